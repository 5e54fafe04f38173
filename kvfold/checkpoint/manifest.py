"""`kvfold.json`: everything needed to trust, reproduce and serve an exported checkpoint."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from kvfold.errors import KVFoldError
from kvfold.plan.criteria import Target
from kvfold_runtime import LEGACY_BAND_SCALE, MANIFEST, SCHEMA_VERSION, ConfigBlock, check_schema

__all__ = ["Manifest"]

# 1.1: allocation and per-layer rate multipliers. 1.2: perplexity ratio is ppl/ppl₀ (was ppl₀/ppl), points
# carry agreement, KL and every standard error, the target is stored as metric + level + margin. 1.3: a point
# scored on a mixture of texts carries each text's figures (`parts`). 1.4: `positions`, the context the
# query/key statistics were averaged over. 1.5: `search_dtype`, the dtype the model ran in while scored, and
# `passkey`, the long-context check of the chosen point. 1.6: `band_scale`, the bits format's scale format
# (one-byte log8; before, float16).
# Older files still load: `_upgrade` converts them. The version and the file name are the runtime's
# (kvfold_runtime.format): kvfold writes what every runtime reads.


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
    """A scored candidate (plan/search.py: CurvePoint); NaN where a figure was not measured."""
    r_k: float
    r_v: float
    compression: float
    top1_ratio: float
    ppl_ratio: float  # ppl / ppl₀ (1.0 = the original; higher is worse)
    top1_se: float  # standard errors, paired over the evaluation windows
    ppl_se: float = math.nan
    agreement: float = math.nan  # top-1 agreement with the original
    agreement_se: float = math.nan
    kl: float = math.nan  # mean KL(original ‖ compressed) per token, nats
    kl_se: float = math.nan
    kl_p99: float = math.nan
    parts: list[Point] = []  # on a mixture of texts: the same figures per text (1.3; none before)


def _upgrade(raw: dict) -> dict:
    """A 1.0/1.1 manifest in 1.2 terms: ppl ratios inverted, the target string parsed into its parts."""
    if raw.get("schema_version") not in ("1.0", "1.1"):
        return raw
    raw = dict(raw)

    def point(p):
        return {**p, "ppl_ratio": 1 / p["ppl_ratio"]} if isinstance(p, dict) and p.get("ppl_ratio") else p

    raw["chosen"] = point(raw.get("chosen"))
    raw["curve"] = [point(p) for p in raw.get("curve", [])]
    found = re.fullmatch(r"(\w+)(?: - ([\d.]+)\*se)?>=([\d.]+)", str(raw.get("target", "")))
    if found and found[1] != "compression":
        raw["target_level"], raw["margin"] = float(found[3]), float(found[2] or 0.0)
    return raw


class Manifest(_Frozen):
    schema_version: str = SCHEMA_VERSION
    kvfold_version: str
    torch_version: str
    transformers_version: str
    source: SourceModel
    calibration: Calibration
    method: str
    metric: str
    target: str  # what the user asked for, in words, e.g. "top-1 ratio ≥ 0.99 and perplexity ratio ≤ 1.0101 (1 se)"
    target_level: float | None = None  # the accuracy A (the largest mean KL for metric kl); None: compression
    margin: float = 0.0  # standard errors every bound was checked at
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
    # RoPE models: the query/key statistics were averaged over positions [0, positions) before fitting
    # (factors/positions.py); None: fitted as calibrated (no RoPE, --context 0, or before 1.4)
    positions: int | None = None
    # the dtype the model ran in while the curve was measured (export --dtype); before 1.5 always float32
    search_dtype: str = "float32"
    # the chosen point's pass-key check (plan/longrange.py): context, prompts, original and retrieved key counts,
    # and the more compressed points rejected on the way; None: not checked (--passkey 0, a ratio target,
    # --reuse-curve, or before 1.5); {"skipped": why} where the model's context has no room for it
    passkey: dict | None = None
    head_dim: int
    num_heads: int
    num_kv_heads: int
    d_k: list[list[int]]  # [layer][kv head]
    d_v: list[list[int]]
    # bits format (issue 13): [layer][kv head][kept dim] bit width of each kept dim, non-increasing; None: the
    # cache stores k', v' in the model's dtype (rank format)
    k_bits: list[list[list[int]]] | None = None
    v_bits: list[list[list[int]]] | None = None
    # bits format: each band's per-token scale format (kvfold_runtime.bands.SCALES); before 1.6 always float16
    band_scale: str = LEGACY_BAND_SCALE
    chosen: Point
    curve: list[Point]
    extra_tensors: list[str]  # post-RoPE projections (RoPE models): names in the safetensors files
    files: dict[str, str] = {}  # file name -> sha256, every file of the directory but this one

    def config_block(self) -> ConfigBlock:
        """The `kvfold` block of config.json: what the runtime needs to build the model and its cache."""
        return ConfigBlock(self.d_k, self.d_v, bool(self.extra_tensors), self.k_bits, self.v_bits, self.band_scale,
                           self.schema_version)

    def accuracy_target(self) -> Target | None:
        """The target the search met (None when the export was made for a compression)."""
        return None if self.target_level is None else Target(self.metric, self.target_level, self.margin)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST) -> Manifest:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise KVFoldError(f"{where} is not valid JSON ({e}); re-export the model") from None
        try:
            check_schema(raw.get("schema_version") if isinstance(raw, dict) else None, f"{where}: ")
        except ValueError as e:
            raise KVFoldError(str(e)) from None
        try:
            return cls.model_validate(_upgrade(raw))
        except ValidationError as e:
            raise KVFoldError(f"{where} is invalid ({e.error_count()} errors); re-export the model") from None

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise KVFoldError(f"'{directory}' is not a kvfold export (no {MANIFEST})")
        return cls.from_json(path.read_text(), str(path))
