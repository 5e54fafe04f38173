"""`kvfold.json`: everything needed to trust, reproduce and serve an exported checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from kvfold.errors import KVFoldError

__all__ = ["MANIFEST_FILE", "SCHEMA_VERSION", "Manifest"]

SCHEMA_VERSION = "1.1"  # 1.1: allocation and per-layer rate multipliers (1.0 files still load)
MANIFEST_FILE = "kvfold.json"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SourceModel(_Frozen):
    spec: str
    path: str
    architecture: str
    weights_sha256: str


class Calibration(_Frozen):
    source: str
    text: str | None
    tokens: int
    seed: int
    stats_sha256: str


class Point(_Frozen):
    r_k: float
    r_v: float
    compression: float
    top1_ratio: float
    ppl_ratio: float
    top1_se: float  # standard error of top1_ratio, paired over the evaluation windows


class Manifest(_Frozen):
    schema_version: str = SCHEMA_VERSION
    kvfold_version: str
    torch_version: str
    transformers_version: str
    source: SourceModel
    calibration: Calibration
    method: str
    metric: str
    target: str  # what the user asked for, e.g. "accuracy>=0.99" or "compression>=0.1"
    eval_text: str
    eval_tokens: int
    baseline_top1: float
    baseline_ppl: float
    rounding_multiple: int
    min_rank: int
    allocation: str = "eq6"  # how r becomes per-layer rates: eq6 (one r) or sensitivity
    layer_scale_k: list[float] = []  # per-layer multipliers of r_k / r_v (sensitivity allocation)
    layer_scale_v: list[float] = []
    layer_cost_k: list[float] = []  # the measured NLL increase per removed dim behind them
    layer_cost_v: list[float] = []
    head_dim: int
    num_heads: int
    num_kv_heads: int
    d_k: list[list[int]]  # [layer][kv head]
    d_v: list[list[int]]
    chosen: Point
    curve: list[Point]
    extra_tensors: list[str]  # post-RoPE projections (RoPE models): names in the safetensors files
    files: dict[str, str] = {}  # file name -> sha256, every file of the directory but this one

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = "kvfold.json") -> Manifest:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise KVFoldError(f"{where} is not valid JSON ({e}); re-export the model") from None
        major = str(raw.get("schema_version", "")).split(".")[0] if isinstance(raw, dict) else ""
        if major != SCHEMA_VERSION.split(".")[0]:
            version = raw.get("schema_version") if isinstance(raw, dict) else None
            raise KVFoldError(f"{where} has schema version {version!r}; this kvfold reads "
                              f"{SCHEMA_VERSION.split('.')[0]}.x — upgrade kvfold or re-export")
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise KVFoldError(f"{where} is invalid ({e.error_count()} errors); re-export the model") from None

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST_FILE
        if not path.is_file():
            raise KVFoldError(f"'{directory}' is not a kvfold export (no {MANIFEST_FILE})")
        return cls.from_json(path.read_text(), str(path))
