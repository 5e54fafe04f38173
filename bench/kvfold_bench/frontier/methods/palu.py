"""palu: Palu's low-rank KV cache — keys and values cached as a per-layer latent taken *before* RoPE
and reconstructed before RoPE is applied (so attention itself sees full-width keys).

Per layer and kind, the k_proj (v_proj) output y [T, H_kv·d] of all KV heads together (Palu's joint
decomposition) is replaced by its projection y U_r U_rᵀ on the top-r principal axes of the calibration
text; the cache would hold y U_r (r numbers per token). r per layer from the removal rate on that
layer's own spectrum (ZACK's Eq. 6, as for kvfold), so layers get different ranks. Full rank is exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvfold.calib.spectrum import rank_for_removal, svd_from_gram
from kvfold.calib.tokens import batches
from kvfold.errors import KVFoldError

from .base import Candidate

__all__ = ["Palu", "prerope_grams"]


def _check(adapter) -> None:
    if adapter.k_proj is None or not adapter.rope:
        raise KVFoldError(f"palu needs RoPE and separate k_proj/v_proj, which {adapter.name} has not; "
                          "leave it out with --method")


def prerope_grams(model, adapter, seqs, batch: int = 8) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, "k"|"v") -> float64 Gram [H_kv·d, H_kv·d] of the k_proj / v_proj outputs over `seqs`."""
    _check(adapter)
    grams: dict[tuple[int, str], torch.Tensor] = {}

    def hook(key):
        def add(_m, _args, out):
            x = out.detach().reshape(-1, out.shape[-1]).to(torch.float64)
            grams[key] = grams[key] + x.T @ x if key in grams else x.T @ x

        return add

    handles = [getattr(attn, proj).register_forward_hook(hook((i, kind)))
               for i, attn in enumerate(adapter.attention_modules(model))
               for kind, proj in (("k", adapter.k_proj), ("v", adapter.v_proj))]
    try:
        with torch.inference_mode():
            for ids in batches(seqs, batch):
                model.base_model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return grams


def _projector(axes: torch.Tensor, rank: int, dtype: torch.dtype):
    p = (axes[:, :rank] @ axes[:, :rank].T).to(dtype)  # [n, n], y ↦ y U_r U_rᵀ
    return lambda y: y @ p


@dataclass(frozen=True)
class Palu:
    name: str = "palu"
    label: str = "Palu (pre-RoPE low rank)"
    knob: str = "removal rate r (per-layer joint spectrum)"
    origin: str | None = None
    grid: tuple[float, ...] = (0.001, 0.003, 0.01, 0.03)

    def check(self, adapter) -> None:
        _check(adapter)

    def candidates(self, setup) -> Iterator[Candidate]:
        grams = setup.once("palu_grams", lambda: prerope_grams(setup.model, setup.adapter, setup.calib_sequences()))
        spectra = {key: svd_from_gram(g) for key, g in grams.items()}
        total = sum(g.shape[0] for g in grams.values())
        for r in self.grid:
            maps, kept = {}, 0
            for key, (s, axes) in spectra.items():
                n = axes.shape[0]
                rank = min(n, math.ceil(rank_for_removal(s, r) / setup.multiple) * setup.multiple)
                kept += rank
                if rank < n:
                    maps[key] = _projector(axes, rank, setup.dtype)
            yield Candidate(r, kept / total, proj_maps=maps)
