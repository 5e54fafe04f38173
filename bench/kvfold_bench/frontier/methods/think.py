"""think: kvpress's ThinK — drop the key channels with the smallest query-key magnitude.

kvpress scores channel c of KV head g as mean_t q_c² (the group's last 32 prompt queries, averaged over
its query heads) × mean_t k_c² and zeroes the lowest `ratio · head_dim` channels of the cached keys;
values are kept. Here the means come from the text calibration (diagonals of the q and k Grams) instead
of each prompt's own window, so one pruning serves every text, like every other method in the sweep.
Bytes: keys shrink by the pruned fraction, values do not, so the most it can save is half the cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..patches import key_channel_mask
from .base import Candidate

__all__ = ["ThinK", "channel_masks"]


def channel_masks(q_gram: torch.Tensor, k_gram: torch.Tensor, ratio: float) -> torch.Tensor:
    """q_gram [H, d, d], k_gram [H_kv, d, d] -> [H_kv, d] mask, 0 on the int(ratio·d) lowest-score channels."""
    kv_heads, d = k_gram.shape[0], k_gram.shape[-1]
    q_norm = q_gram.diagonal(dim1=-2, dim2=-1).view(kv_heads, -1, d).mean(1)  # [H_kv, d]
    score = q_norm * k_gram.diagonal(dim1=-2, dim2=-1)
    pruned = int(d * ratio)
    mask = torch.ones(kv_heads, d)
    if pruned:
        mask.scatter_(1, score.topk(pruned, dim=-1, largest=False).indices, 0.0)
    return mask


@dataclass(frozen=True)
class ThinK:
    name: str = "think"
    label: str = "ThinK (key channels)"
    knob: str = "key channel pruning ratio"
    origin: str | None = None
    grid: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3)

    def candidates(self, setup) -> Iterator[Candidate]:
        stats = setup.stats("text")
        layers = stats.header.model.num_layers
        for ratio in self.grid:
            masks = [channel_masks(stats.gram(i, "q"), stats.gram(i, "k"), ratio) for i in range(layers)]
            kept = sum(float(m.sum()) for m in masks) / sum(m.numel() for m in masks)
            yield Candidate(ratio, (kept + 1.0) / 2, {i: key_channel_mask(m) for i, m in enumerate(masks)})
