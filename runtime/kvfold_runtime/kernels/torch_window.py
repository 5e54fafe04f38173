"""Attention over a bits cache that keeps its sink and recent tokens whole (the windowed bits format, issue 51).

Query i (absolute position) reads cached token j at the model's dtype where j < sinks or i − j < window, and as its
band codes give it back everywhere else: what a decode at position i sees of a cache that keeps the first `sinks`
tokens and the last `window` ones whole and stores the rest in bands. A prefill scores every position as that decode
would, so an export's accuracy (measured the same way, kvfold.hooks.exact_recent_attention) is what is served.

Decoding one token, the whole tokens are the same for every query row: their exact rows replace the decoded ones and
one ordinary attention call runs (kernels.dispatch.attention). For several query rows each row's window differs, so
both score matrices are formed per block of rows and each entry taken from one of them (plain torch, `_ROWS` rows at a
time: two [B, group, rows, S] blocks per KV head).

Positions are cache slots: in a left-padded batch a row's first slots are padding (masked), so that row keeps fewer
real tokens whole as sinks than a row without padding.
"""

from __future__ import annotations

import torch

from kvfold_runtime.kernels.masks import additive, head_mask

__all__ = ["whole_mask", "window_attention"]

_ROWS = 256  # query rows per block of the several-row path


def whole_mask(positions: torch.Tensor, s: int, sinks: int, window: int) -> torch.Tensor:
    """[T, S] bool: where query row t (at absolute position positions[t]) reads key j whole."""
    j = torch.arange(s, device=positions.device)
    return (j[None, :] < sinks) | (positions[:, None] - j[None, :] < window)


def window_attention(q: torch.Tensor, k_exact: torch.Tensor, v_exact: torch.Tensor, k_coded: torch.Tensor,
                     v_coded: torch.Tensor, d_k: list[int], d_v: list[int], group: int, *, scaling: float,
                     sinks: int, window: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """reference_attention's contract (packed layouts: q [B, T, Σ_h d_k(g(h))], keys [B, S, Σ_g d_k], values
    [B, S, Σ_g d_v]; `mask` as transformers gives it, None: causal with the T queries the last T of S positions),
    with two copies of the cache: `k_exact`/`v_exact` hold the whole tokens' rows (other rows are never read) and
    `k_coded`/`v_coded` every row as its band codes give it back. Float32 softmax."""
    b, t, s = q.shape[0], q.shape[1], k_coded.shape[1]
    positions = torch.arange(s - t, s, device=q.device)
    whole = whole_mask(positions, s, sinks, window)  # [T, S]
    acc = torch.promote_types(q.dtype, torch.float32)
    qs = q.split([group * w for w in d_k], -1)
    k0s, k1s = k_exact.split(d_k, -1), k_coded.split(d_k, -1)
    v0s, v1s = v_exact.split(d_v, -1), v_coded.split(d_v, -1)
    out = []
    for g, (dk, dv) in enumerate(zip(d_k, d_v, strict=True)):
        qg = qs[g].view(b, t, group, dk).transpose(1, 2).to(acc) * scaling  # [B, group, T, dk]
        k0, k1 = k0s[g].to(acc)[:, None], k1s[g].to(acc)[:, None]  # [B, 1, S, dk]
        v0, v1 = v0s[g].to(acc)[:, None], v1s[g].to(acc)[:, None]
        rows = []
        for at in range(0, t, _ROWS):
            near = whole[at:at + _ROWS]  # [rows, S]
            qr = qg[:, :, at:at + _ROWS]
            scores = torch.where(near, qr @ k0.transpose(-1, -2), qr @ k1.transpose(-1, -2))
            m = _mask(mask, g * group, group, t, s, q.device, acc)
            if m is not None:
                scores = scores + m[..., at:at + _ROWS, :]
            p = scores.softmax(-1)
            rows.append(torch.where(near, p, 0.0) @ v0 + torch.where(near, 0.0, p) @ v1)
        o = torch.cat(rows, 2)  # [B, group, T, dv]
        out.append(o.transpose(1, 2).reshape(b, t, group * dv).to(q.dtype))
    return torch.cat(out, -1)


def _mask(mask: torch.Tensor | None, first: int, group: int, t: int, s: int, device,
          dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask of query heads [first, first + group) as [B|1, group|1, T, S]."""
    if mask is None or mask.shape[1] == 1:
        m = additive(head_mask(mask, first, t, s, device), dtype)
        return None if m is None else m[:, None]
    return additive(mask[:, first:first + group, :, :s], dtype)
