"""Exports of the tiny models at chosen per-head ranks, written to disk the way `kvfold export` does."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

import kvfold
from kvfold.adapters import HeadLayout, get_adapter
from kvfold.checkpoint.manifest import Calibration, Manifest, Point, SourceModel
from kvfold.checkpoint.writer import write_checkpoint
from kvfold.rewrite.bake import bake
from kvfold.sources.models import weights_sha256
from kvfold_runtime import K_POST, Q_POST
from tests.conftest import build_tiny
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


def write_export(arch: str, source: Path, out: Path, ranks: str = "full", method: str = "aware",
                 bits: str | None = None, band_scale: str = "log8") -> TinyExport:
    """Bake the tiny `arch` model (saved at `source`) at full or uneven ranks into `out`; with `bits`
    ("16" or "low", band_bits) in the bits format, its bands' scales stored as `band_scale`."""
    model = build_tiny(arch)
    d_k, d_v = (full_ranks if ranks == "full" else uneven_ranks)(model)
    k_bits = v_bits = None
    if bits is not None:
        k_bits, v_bits = band_bits(d_k, bits == "low"), band_bits(d_v, bits == "low")
    layout = HeadLayout.from_config(model.config)
    factors = _factors(model, arch, method, d_k, d_v)
    baked = bake(model, get_adapter(arch), factors)
    p = 1 - sum(map(sum, d_k + d_v)) / (2 * layout.head_dim * layout.num_kv_heads * layout.num_layers)
    point = Point(r_k=0.0, r_v=0.0, compression=p, top1_ratio=1.0, ppl_ratio=1.0, top1_se=0.0)
    manifest = Manifest(
        kvfold_version=kvfold.__version__, torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        source=SourceModel(spec=str(source), path=str(source), architecture=arch,
                           weights_sha256=weights_sha256(source)),
        calibration=Calibration(source="random", text=None, tokens=512, seed=0, stats_sha256="test"),
        method=method, metric="top1", target="compression>=0", eval_text="test", eval_tokens=0,
        baseline_top1=0.0, baseline_ppl=0.0, rounding_multiple=1, min_rank=1, head_dim=layout.head_dim,
        num_heads=layout.num_heads, num_kv_heads=layout.num_kv_heads, d_k=d_k, d_v=d_v, k_bits=k_bits,
        v_bits=v_bits, band_scale=band_scale, chosen=point,
        curve=[point], extra_tensors=sorted(n for n, _ in baked.named_parameters() if n.endswith((Q_POST, K_POST))),
    )
    out.mkdir(parents=True)
    return TinyExport(model, out, write_checkpoint(baked, source, manifest, out))


@pytest.fixture(scope="session")
def tiny_exports(tiny_dirs, tmp_path_factory) -> dict[tuple[str, str], TinyExport]:
    """(architecture, "full" | "uneven") -> a tiny export on disk, built once per test run."""
    root = tmp_path_factory.mktemp("exports")
    return {(arch, ranks): write_export(arch, tiny_dirs[arch], root / f"{arch}-{ranks}", ranks)
            for arch in tiny_dirs for ranks in ("full", "uneven")}
