"""`kvfold.json`: everything needed to trust, reproduce and serve an exported checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import transformers
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

import kvfold
from kvfold.calib.artifact import CalibHeader
from kvfold.errors import KVFoldError
from kvfold.plan.bit_plan import KEY_MIN_BITS, fp16_bytes_per_token
from kvfold.plan.criteria import Target
from kvfold.plan.export_plan import Baseline, ExportPlan, PreviousExport
from kvfold.plan.formats import get_format
from kvfold.plan.point import Point
from kvfold.plan.ranks import RankRule
from kvfold.plan.rounding import HeadScales
from kvfold.plan.sensitivity import LayerScales
from kvfold.sources.models import ModelRef
from kvfold_runtime import (
    K_POST,
    K_SHIFT,
    LEGACY_BAND_SCALE,
    MANIFEST,
    Q_POST,
    SCHEMA_VERSION,
    ConfigBlock,
    check_schema,
)

__all__ = ["Calibration", "Manifest", "SourceModel"]

# 1.1: allocation and per-layer rate multipliers. 1.2: perplexity ratio is ppl/ppl₀ (was ppl₀/ppl), points
# carry agreement, KL and every standard error, the target is stored as metric + level + margin. 1.3: a point
# scored on a mixture of texts carries each text's figures (`parts`). 1.4: `positions`, the context the
# query/key statistics were averaged over. 1.5: `search_dtype`, the dtype the model ran in while scored, and
# `passkey`, the long-context check of the chosen point. 1.6: `band_scale`, the bits format's scale format
# (one-byte log8; before, float16). 1.7: `tensor_parallel`, the tensor-parallel size the widths were balanced for.
# 1.8: the keys' shift (`kvfold_k_shift` in extra_tensors; config.json's kvfold block says `key_shift`). 1.9: a bits
# export's sensitivity allocation, per KV head (`head_scale_k/v`, `head_cost_k/v`). 1.10: a windowed bits export's
# whole tokens (`sinks`, `window`; config.json's kvfold block says them too; absent: 0), and the search's windows
# (`search_context` tokens, scored from `score_from` on; absent: 512 and 1). Without a version of its own
# (no runtime reads it, and no rank or bits export writes it): `format`, the cache format (`Manifest.format`); nor
# `key_bits`, the narrowest key band a bits export's search allowed (absent: 4).
# Older files still load: `_upgrade` converts them. A manifest is made from the plan (`Manifest.from_plan`), in
# one place; its points are the plan's own type (plan/point.py). The version and the file name are the runtime's
# (kvfold_runtime.format): kvfold writes what every runtime reads.


def _key_bits(plan: ExportPlan) -> int | None:
    """The manifest's key_bits: a bits plan's narrowest key band where it is not KEY_MIN_BITS (a bits export's
    manifest is then what it was before the option existed)."""
    key_min = getattr(plan.rule, "key_min", KEY_MIN_BITS)
    return None if plan.bits is None or key_min == KEY_MIN_BITS else key_min


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SourceModel(_Frozen):
    spec: str
    path: str
    architecture: str
    weights_sha256: str
    # A Hugging Face Hub model: its id and the commit its snapshot held (verify fetches that commit where `path`
    # is gone); None, and no key in the file, for a local folder or an alias
    hub_id: str | None = None
    revision: str | None = None

    @classmethod
    def of(cls, ref: ModelRef, weights_sha256: str) -> SourceModel:
        hub = dict(hub_id=ref.hub.repo_id, revision=ref.hub.revision) if ref.hub else {}
        return cls(spec=ref.spec, path=str(ref.path.resolve()), architecture=ref.architecture,
                   weights_sha256=weights_sha256, **hub)


class Calibration(_Frozen):
    source: str
    text: str | None
    tokens: int
    seed: int
    stats_sha256: str

    @classmethod
    def of(cls, header: CalibHeader) -> Calibration:
        return cls(source=header.options.source, text=header.options.text, tokens=header.tokens,
                   seed=header.options.seed, stats_sha256=header.stats_sha256)


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
    search_context: int = 512  # the search's windows (tokens) and the position each is scored from (before 1.10:
    score_from: int = 1  # 512 and 1)
    baseline_top1: float
    baseline_ppl: float
    rounding_multiple: int
    min_rank: int
    # the tensor-parallel size the widths were balanced for (export --tp; kvfold_runtime.sharding reads it when
    # it refuses another size); 1: not balanced (and before 1.7)
    tensor_parallel: int = 1
    allocation: str = "eq6"  # how r becomes per-layer rates: eq6 (one r) or sensitivity
    layer_scale_k: list[float] = []  # per-layer multipliers of r_k / r_v (sensitivity allocation)
    layer_scale_v: list[float] = []
    layer_cost_k: list[float] = []  # the measured NLL increase per removed dim behind them
    layer_cost_v: list[float] = []
    # bits format, sensitivity allocation: per layer and KV head, multipliers of θ_k / θ_v and the measured KL per
    # unit of modelled rounding distortion behind them (plan/rounding.py)
    head_scale_k: list[list[float]] = []
    head_scale_v: list[list[float]] = []
    head_cost_k: list[list[float]] = []
    head_cost_v: list[list[float]] = []
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
    # bits format: every layer's first `sinks` and last `window` tokens also kept whole (plan/bits.BitPlan); 0: none
    sinks: int = 0
    window: int = 0
    # bits format: the keys' narrowest width its search allowed (Recipe.key_bits), which a reused curve must share,
    # where it is not 4; None: 4, or a rank export. No runtime reads it (the widths themselves are k_bits).
    key_bits: int | None = None
    # The cache format that planned the export (plan/formats), where its checkpoint layout does not name it: the
    # runtime serves a checkpoint by its layout (rank or bits, `config_block().format`) and reads no format name, so
    # the rank and bits formats write none and their manifests stay as they always were; a format of its own (one
    # more class in plan/formats) writing one of those layouts records its name here. None: the layout's format.
    format: str | None = None
    chosen: Point  # plan/point.py
    curve: list[Point]
    extra_tensors: list[str]  # post-RoPE projections (RoPE models): names in the safetensors files
    files: dict[str, str] = {}  # file name -> sha256, every file of the directory but this one

    @classmethod
    def from_plan(cls, plan: ExportPlan, baked: nn.Module, *, source: SourceModel,
                  calibration: Calibration) -> Manifest:
        """The manifest of `plan` baked into `baked` (rewrite.bake), before write_checkpoint adds the files."""
        bits = plan.bits
        k_bits, v_bits = bits.kept_bits() if bits else (None, None)
        multiple, min_rank = plan.rounding
        return cls(
            kvfold_version=kvfold.__version__, torch_version=torch.__version__,
            transformers_version=transformers.__version__, source=source, calibration=calibration,
            method=plan.method, metric=plan.metric, **_target_fields(plan.target, plan.ratio),
            eval_text=plan.baseline.eval_text, eval_tokens=plan.baseline.eval_tokens,
            search_context=plan.baseline.context, score_from=plan.baseline.score_from,
            baseline_top1=plan.baseline.top1, baseline_ppl=plan.baseline.ppl,
            rounding_multiple=multiple, min_rank=min_rank, allocation=plan.allocation,
            tensor_parallel=plan.rule.tp if isinstance(plan.rule, RankRule) else 1,
            **_layer_fields(plan.scales), positions=plan.positions, search_dtype=plan.search_dtype,
            passkey=plan.passkey, head_dim=plan.layout.head_dim, num_heads=plan.layout.num_heads,
            num_kv_heads=plan.layout.num_kv_heads, d_k=plan.ranks.d_k, d_v=plan.ranks.d_v, k_bits=k_bits,
            v_bits=v_bits, band_scale=bits.scale if bits else LEGACY_BAND_SCALE, sinks=bits.sinks if bits else 0,
            window=bits.window if bits else 0, key_bits=_key_bits(plan), chosen=plan.chosen,
            curve=list(plan.curve), format=get_format(plan.format).manifest_name if plan.format else None,
            extra_tensors=sorted(n for n, _ in baked.named_parameters() if n.endswith((Q_POST, K_POST, K_SHIFT))),
        )

    def previous_export(self, path: Path) -> PreviousExport:
        """This export as a later one reuses its curve (--reuse-curve, plan/reuse.py); `path`: its folder."""
        bits = self.k_bits is not None
        return PreviousExport(
            path=Path(path), weights_sha256=self.source.weights_sha256, stats_sha256=self.calibration.stats_sha256,
            method=self.method, rounding=(self.rounding_multiple, self.min_rank),
            tensor_parallel=self.tensor_parallel, allocation=self.allocation,
            format=self.format or self.config_block().format, band_scale=self.band_scale if bits else None,
            search_dtype=self.search_dtype, positions=self.positions, scales=self.layer_scales(),
            curve=tuple(self.curve), passkey=self.passkey,
            baseline=Baseline(self.eval_text, self.eval_tokens, self.baseline_top1, self.baseline_ppl,
                              self.search_context, self.score_from),
            window=(self.sinks, self.window), key_bits=(self.key_bits or KEY_MIN_BITS) if bits else None)

    def layer_scales(self) -> LayerScales | HeadScales | None:
        """The multipliers and the costs behind them (sensitivity allocation): per layer (rank format) or per KV
        head (bits format); None: eq6."""
        if self.head_scale_k:
            return HeadScales(*(tuple(map(tuple, x)) for x in (self.head_scale_k, self.head_scale_v,
                                                                self.head_cost_k, self.head_cost_v)))
        if not self.layer_scale_k:
            return None
        return LayerScales(tuple(self.layer_scale_k), tuple(self.layer_scale_v), tuple(self.layer_cost_k),
                            tuple(self.layer_cost_v))

    def config_block(self) -> ConfigBlock:
        """The `kvfold` block of config.json: what the runtime needs to build the model and its cache."""
        return ConfigBlock(self.d_k, self.d_v, bool(self.extra_tensors), self.k_bits, self.v_bits, self.band_scale,
                           self.schema_version, key_shift=any(n.endswith(K_SHIFT) for n in self.extra_tensors),
                           sinks=self.sinks, window=self.window)

    def kv_fraction(self, context: int) -> float:
        """The cache's bytes a token at `context` tokens as a fraction of float16's, by the runtime's accounting (a
        windowed export's whole tokens at 2 bytes a number, a fixed count: its fraction falls with the context)."""
        fp16 = fp16_bytes_per_token(self.head_dim, self.num_kv_heads * len(self.d_k))
        return self.config_block().bytes_per_token(context=context) / fp16

    def accuracy_target(self) -> Target | None:
        """The target the search met (None when the export was made for a compression)."""
        return None if self.target_level is None else Target(self.metric, self.target_level, self.margin)

    def to_json(self) -> str:
        # no `format` key where the layout names the format, no hub keys for a local source: those files are byte
        # for byte what they always were
        exclude: dict = {k: True for k in ("format", "key_bits") if getattr(self, k) is None}
        if self.source.hub_id is None:
            exclude["source"] = {"hub_id", "revision"}
        return json.dumps(self.model_dump(exclude=exclude or None), indent=2, sort_keys=True)

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


def _target_fields(target: Target | None, ratio: float | None) -> dict:
    """What the user asked for: an accuracy target (its words, level and margin), or a compression."""
    if target is None:
        return dict(target=f"compression>={ratio}", target_level=None, margin=0.0)
    return dict(target=target.describe(), target_level=target.level, margin=target.margin)


def _layer_fields(scales: LayerScales | HeadScales | None) -> dict:
    """The per-layer (or per-head) lists of `scales` (Manifest.layer_scales reads them back); none for eq6."""
    if scales is None:
        return {}
    if isinstance(scales, HeadScales):
        return dict(head_scale_k=list(map(list, scales.k)), head_scale_v=list(map(list, scales.v)),
                    head_cost_k=list(map(list, scales.cost_k)), head_cost_v=list(map(list, scales.cost_v)))
    return dict(layer_scale_k=list(scales.k), layer_scale_v=list(scales.v), layer_cost_k=list(scales.cost_k),
                layer_cost_v=list(scales.cost_v))
