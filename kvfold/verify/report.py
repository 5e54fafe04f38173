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
    metric: str = "joint"
    target: str | None = None  # the export's target, in words
    # per evaluation text: eval_text, tokens, baseline_top1/ppl, top1_ratio, ppl_ratio (ppl/ppl₀), agreement, kl,
    # kl_p99 and their paired standard errors (*_se)
    texts: list[dict] = field(default_factory=list)
    kv_bytes_per_token: dict[str, float] = field(default_factory=dict)  # original / exported, from live caches
    kv_bytes_ratio: float | None = None
    expected_kv_bytes_ratio: float | None = None  # from the manifest's ranks and the tokens each layer holds
    # a windowed export's bytes a token as a fraction of float16's, by context length (serving._at_length)
    kv_fraction_at: dict[str, float] = field(default_factory=dict)
    # runs: per prompt the two greedy continuations and the first differing position (None: identical);
    # forced_agreement: the export's next token = the original's, reading the original's continuations
    generation: dict[str, object] = field(default_factory=dict)
    # original / exported: passkey keys retrieved, in all and by depth (measure/passkey.py); or skipped: why
    passkey: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def to_dict(self) -> dict:
        return {"ok": self.ok, **asdict(self)}
