"""Exports of the tiny models at chosen per-head ranks, written to disk the way `kvfold export` does."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from kvfold.adapters import HeadLayout, get_adapter
from kvfold.checkpoint.manifest import Calibration, Manifest, SourceModel
from kvfold.checkpoint.writer import write_checkpoint
from kvfold.factors.positions import holds_key_shift
from kvfold.plan.bits import BitPlan, BitRule
from kvfold.plan.export_plan import Baseline, ExportPlan
from kvfold.plan.point import Point
from kvfold.plan.ranks import RankPlan, RankRule
from kvfold.rewrite.bake import bake
from kvfold.sources.models import weights_sha256
from tests.conftest import build_tiny, tiny_tokenizer
from tests.rewrite.test_bake import _factors


def full_ranks(model) -> tuple[list[list[int]], list[list[int]]]:
    layout = HeadLayout.from_config(model.config)
    full = [[layout.head_dim] * layout.num_kv_heads for _ in range(layout.num_layers)]
    return full, [list(r) for r in full]


def uneven_ranks(model) -> tuple[list[list[int]], list[list[int]]]:
    """Every layer and KV head at a different width, d_k ≠ d_v."""
    layout = HeadLayout.from_config(model.config)
    d = layout.head_dim
    d_k = [[d - 4 * ((i + g) % 3) for g in range(layout.num_kv_heads)] for i in range(layout.num_layers)]
    d_v = [[d - 4 * ((i + 2 * g + 1) % 3) - 1 for g in range(layout.num_kv_heads)] for i in range(layout.num_layers)]
    return d_k, d_v


def balanced_ranks(model) -> tuple[list[list[int]], list[list[int]]]:
    """Uneven widths per head that sum the same on each pair of consecutive KV heads (two tensor-parallel ranks
    of a 4-KV-head model hold equal widths), d_k ≠ d_v."""
    d = HeadLayout.from_config(model.config).head_dim
    d_k = [[d, d - 8, d - 4, d - 4], [d - 4, d - 4, d - 8, d]]
    d_v = [[d - 1, d - 9, d - 5, d - 5], [d - 9, d - 1, d - 5, d - 5]]
    return d_k, d_v


RANKS = {"full": full_ranks, "uneven": uneven_ranks, "balanced": balanced_ranks}

# 8 query heads over 4 KV heads (head_dim 16): splits over 1, 2 and 4 tensor-parallel ranks
WIDE = {"hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 4}
WIDE_ARCHS = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]  # Qwen2: q/k/v biases


@dataclass
class TinyExport:
    original: torch.nn.Module  # the tiny source model
    path: Path  # the exported directory
    manifest: Manifest


def band_bits(widths: list[list[int]], low: bool) -> list[list[list[int]]]:
    """Per-dim bit widths for every head: all 16, or (low) a quarter of the dims at 8 bits, a quarter at 4,
    the rest at 2."""
    def head(w: int) -> list[int]:
        return [16] * w if not low else [8] * (w // 4) + [4] * (w // 4) + [2] * (w - 2 * (w // 4))

    return [[head(w) for w in layer] for layer in widths]


def key_shifts(model, arch: str, factors: list, seed: int = 7) -> list:
    """`factors` with a seeded key shift (LayerFactors.k_mean, several times the tiny keys' size) where an export
    can hold one (holds_key_shift)."""
    if not holds_key_shift(model, get_adapter(arch).rope):
        return factors
    gen = torch.Generator().manual_seed(seed)
    return [replace(f, k_mean=3 * torch.randn(len(f.qk_b), f.qk_b[0].shape[0], generator=gen, dtype=torch.float64))
            for f in factors]


def write_export(arch: str, source: Path, out: Path, ranks: str = "full", method: str = "aware",
                 bits: str | None = None, band_scale: str = "log8", overrides: dict | None = None,
                 key_shift: bool = False) -> TinyExport:
    """Bake the tiny `arch` model (saved at `source`, built with config `overrides`) at `ranks` (RANKS) into
    `out`; with `bits` ("16" or "low", band_bits) in the bits format, its bands' scales stored as `band_scale`;
    `key_shift`: with a seeded key shift where the architecture can hold one (key_shifts)."""
    model = build_tiny(arch, **(overrides or {}))
    d_k, d_v = RANKS[ranks](model)
    layout = HeadLayout.from_config(model.config)
    d = layout.head_dim
    factors = _factors(model, arch, method, d_k, d_v)
    if key_shift:
        factors = key_shifts(model, arch, factors)
    rank_plan = RankPlan(d_k, d_v, d)
    rule, bit_plan = RankRule(0.0, 0.0, multiple=1, min_rank=1), None
    if bits is not None:  # every head's widths padded with dropped dims (0 bits) to head_dim, as plan_bits gives them
        k_bits, v_bits = band_bits(d_k, bits == "low"), band_bits(d_v, bits == "low")

        def padded(side):
            return [[head + [0] * (d - len(head)) for head in layer] for layer in side]

        rule, bit_plan = BitRule(0.0, 0.0, scale=band_scale), BitPlan(padded(k_bits), padded(v_bits), d, band_scale)
    point = Point(r_k=0.0, r_v=0.0, compression=rank_plan.compression, top1_ratio=1.0, ppl_ratio=1.0, top1_se=0.0)
    plan = ExportPlan(
        model=model, layout=layout, method=method, metric="top1", target=None, ratio=0.0, allocation="eq6",
        search_dtype="float32", positions=None, scales=None, rule=rule, ranks=rank_plan, bits=bit_plan,
        factors=tuple(factors), chosen=point, curve=(point,),
        baseline=Baseline(eval_text="test", eval_tokens=0, top1=0.0, ppl=0.0), passkey=None)
    baked = bake(plan.model, get_adapter(arch), list(plan.factors))
    manifest = Manifest.from_plan(
        plan, baked, source=SourceModel(spec=str(source), path=str(source), architecture=arch,
                                        weights_sha256=weights_sha256(source)),
        calibration=Calibration(source="random", text=None, tokens=512, seed=0, stats_sha256="test"))
    out.mkdir(parents=True)
    return TinyExport(model, out, write_checkpoint(baked, source, manifest, out))


@pytest.fixture(scope="session")
def tiny_exports(tiny_dirs, tmp_path_factory) -> dict[tuple[str, str], TinyExport]:
    """(architecture, "full" | "uneven") -> a tiny export on disk, built once per test run (with a key shift where
    the architecture can hold one, as `kvfold export` writes them)."""
    root = tmp_path_factory.mktemp("exports")
    return {(arch, ranks): write_export(arch, tiny_dirs[arch], root / f"{arch}-{ranks}", ranks, key_shift=True)
            for arch in tiny_dirs for ranks in ("full", "uneven")}


@pytest.fixture(scope="session")
def tiny_bits_exports(tiny_dirs, tmp_path_factory) -> dict[str, TinyExport]:
    """architecture -> a tiny bits-format export at uneven ranks, every head in 8-, 4- and 2-bit bands
    (band_bits "low"), built once per test run."""
    root = tmp_path_factory.mktemp("bits-exports")
    return {arch: write_export(arch, tiny_dirs[arch], root / arch, "uneven", bits="low", key_shift=True)
            for arch in tiny_dirs}


@pytest.fixture(scope="session")
def wide_exports(tmp_path_factory) -> dict[tuple[str, str], TinyExport]:
    """(architecture, "uneven" | "balanced" | "bits") -> a tiny export of WIDE's shape (4 KV heads) with a seeded
    key shift (each tensor-parallel rank loads its own heads' part), built once per run."""
    root = tmp_path_factory.mktemp("wide")
    out = {}
    for arch in WIDE_ARCHS:
        source = root / f"source-{arch}"
        model = build_tiny(arch, **WIDE)
        model.config.architectures = [arch]
        model.save_pretrained(source)
        tiny_tokenizer().save_pretrained(source)
        for ranks in ("uneven", "balanced"):
            out[arch, ranks] = write_export(arch, source, root / f"{arch}-{ranks}", ranks, overrides=WIDE,
                                            key_shift=True)
        # bits format, every head at full width in 8-, 4- and 2-bit bands: equal bytes on every rank
        out[arch, "bits"] = write_export(arch, source, root / f"{arch}-bits", "full", bits="low", overrides=WIDE,
                                         key_shift=True)
    return out
