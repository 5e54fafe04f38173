"""The attention masks both attention paths accept, in one place.

`mask` is what transformers hands an attention function:
  None                      — causal, the T queries being the last T of the S key positions;
  bool  [B|1, H|1, T, ≥S]   — True where a query may attend;
  float [B|1, H|1, T, ≥S]   — added to the scores (0 or a large negative number).
"""

from __future__ import annotations

import torch

__all__ = ["additive", "head_mask"]


def head_mask(mask: torch.Tensor | None, head: int, t: int, s: int, device) -> torch.Tensor | None:
    """The mask of one query head as [B|1, T, S] (bool or float), or None when nothing is masked."""
    if mask is None:
        if t == 1:
            return None
        return torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)[None]
    m = mask[:, min(head, mask.shape[1] - 1), :, :s]
    return m


def additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask as 0 / the most negative finite number (as transformers' eager masks): a row with
    nothing to attend to (left padding) stays finite instead of turning into NaN and leaking through
    0 × NaN into the other tokens' outputs."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
