"""Attention over a bits cache that keeps its sink and recent tokens whole (the windowed bits format, issue 51).

Query i (absolute position) reads cached token j at the model's dtype where j < sinks or i − j < window, and as its
band codes give it back everywhere else: what a decode at position i sees of a cache that keeps the first `sinks`
tokens and the last `window` ones whole and stores the rest in bands. A prefill scores every position as that decode
would, so an export's accuracy (measured the same way, kvfold.hooks.exact_recent_attention) is what is served.

Decoding one token, the whole tokens are the same for every query row: their exact rows replace the decoded ones and
one ordinary attention call runs (kernels.dispatch.attention). For several query rows each row's window differs: per
block of `_ROWS` rows, one attention over just the keys the block reads, each once — the sinks left of its band, the
whole rows of its band [first − window + 1, last], the codes of [sinks, last − window] — with a mask saying which row
reads which (kvfold's export scores its candidates the same way, kvfold.hooks.exact_recent_attention). Forming both
full score matrices per block and choosing entries (the first version) took 2.7× as long at 4K tokens (Qwen2.5-Coder's
shapes in bfloat16 on 2 busy cores; 1.5× at 2K).

Positions are cache slots: in a left-padded batch a row's first slots are padding (masked), so that row keeps fewer
real tokens whole as sinks than a row without padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfold_runtime.kernels.masks import additive, head_mask

__all__ = ["window_attention", "window_reads"]

_ROWS = 256  # query rows per block of the several-row path


def window_attention(q: torch.Tensor, k_exact: torch.Tensor, v_exact: torch.Tensor, k_coded: torch.Tensor,
                     v_coded: torch.Tensor, d_k: list[int], d_v: list[int], group: int, *, scaling: float,
                     sinks: int, window: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """reference_attention's contract (packed layouts: q [B, T, Σ_h d_k(g(h))], keys [B, S, Σ_g d_k], values
    [B, S, Σ_g d_v]; `mask` as transformers gives it, None: causal with the T queries the last T of S positions),
    with two copies of the cache: `k_exact`/`v_exact` hold the whole tokens' rows (other rows are never read) and
    `k_coded`/`v_coded` every row as its band codes give it back. Float32 softmax."""
    b, t, s = q.shape[0], q.shape[1], k_coded.shape[1]
    first = s - t  # the first query's position
    acc = torch.promote_types(q.dtype, torch.float32)
    qs = q.split([group * w for w in d_k], -1)
    k0s, k1s = k_exact.split(d_k, -1), k_coded.split(d_k, -1)
    v0s, v1s = v_exact.split(d_v, -1), v_coded.split(d_v, -1)
    blocks = [window_reads(first + a, first + min(a + _ROWS, t), sinks, window, q.device) for a in range(0, t, _ROWS)]
    floor = torch.finfo(acc).min
    biases = [torch.zeros(r.shape, dtype=acc, device=q.device).masked_fill(~r, floor) for r, _, _ in blocks]
    out = []
    for g, (dk, dv) in enumerate(zip(d_k, d_v, strict=True)):
        qg = qs[g].view(b, t, group, dk).transpose(1, 2).to(acc)  # [B, group, T, dk]
        k0, k1 = k0s[g].to(acc)[:, None], k1s[g].to(acc)[:, None]  # [B, 1, S, dk]
        v0, v1 = v0s[g].to(acc)[:, None], v1s[g].to(acc)[:, None]
        m = None if mask is None else _mask(mask, g * group, group, t, s, q.device, acc)  # [B|1, group|1, T, S]
        rows = []
        for a, (reads, whole, coded), bias in zip(range(0, t, _ROWS), blocks, biases, strict=True):
            k = torch.cat([k0[:, :, whole], k1[:, :, coded]], 2).expand(-1, group, -1, -1)
            v = torch.cat([v0[:, :, whole], v1[:, :, coded]], 2).expand(-1, group, -1, -1)
            if m is not None:  # transformers' mask too (left padding), at the same keys
                given = m[..., a:a + reads.shape[0], :]
                bias = torch.where(reads, torch.cat([given[..., whole], given[..., coded]], -1).to(acc), bias)
            rows.append(F.scaled_dot_product_attention(qg[:, :, a:a + reads.shape[0]], k, v, attn_mask=bias,
                                                       scale=scaling))
        o = torch.cat(rows, 2)  # [B, group, T, dv]
        out.append(o.transpose(1, 2).reshape(b, t, group * dv).to(q.dtype))
    return torch.cat(out, -1)


def window_reads(start: int, end: int, sinks: int, window: int,
                 device=None) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """The keys the queries at positions [start, end) read: `whole`, positions of exact rows (the sinks left of the
    band, then the band [start − window + 1, end)), and `coded`, a slice of the coded rows ([sinks, end − window));
    and `reads` [rows, n]: which of those keys each row reads (its sinks and window whole, older tokens coded, none
    past itself). The one definition of which tokens a windowed cache serves whole: kvfold's export scores its
    candidates by it (kvfold.hooks.exact_recent_attention)."""
    lo, hi = max(0, start - window + 1), max(sinks, end - window)
    below = min(sinks, lo)  # sinks left of the band
    pos = torch.arange(start, end, device=device)[:, None]
    j = torch.arange(lo, end, device=device)[None, :]
    band = ((j < sinks) | (pos - j < window)) & (j <= pos)
    coded = torch.arange(sinks, hi, device=device)[None, :] <= pos - window
    reads = torch.cat([band.new_ones(end - start, below), band, coded], 1)
    whole = torch.cat([torch.arange(below, device=device), torch.arange(lo, end, device=device)])
    return reads, whole, slice(sinks, hi)


def _mask(mask: torch.Tensor | None, first: int, group: int, t: int, s: int, device,
          dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask of query heads [first, first + group) as [B|1, group|1, T, S]."""
    if mask is None or mask.shape[1] == 1:
        m = additive(head_mask(mask, first, t, s, device), dtype)
        return None if m is None else m[:, None]
    return additive(mask[:, first:first + group, :, :s], dtype)
