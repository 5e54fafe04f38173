"""The result of `kvfold verify` as plain data (the CLI renders it as a table or JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Check", "VerifyReport"]


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class VerifyReport:
    export: str
    checks: list[Check] = field(default_factory=list)
    against: str | None = None
    metric: str = "top1"
    eval_text: str | None = None
    eval_tokens: int | None = None
    metric_ratio: float | None = None  # exported / original on the evaluation text
    metric_ratio_se: float | None = None
    ppl_ratio: float | None = None
    recorded_ratio: float | None = None  # the point chosen at export, on its own evaluation text
    tolerance: float | None = None
    kv_bytes_per_token: dict[str, float] = field(default_factory=dict)  # original / exported, from live caches
    kv_bytes_ratio: float | None = None
    expected_kv_bytes_ratio: float | None = None  # 1 − p from the manifest
    generation: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def to_dict(self) -> dict:
        return {"ok": self.ok, **asdict(self)}
