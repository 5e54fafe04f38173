"""A windowed bits layer's prefill at the cost of one causal attention (issue 51): the history through the fast causal
kernel, the sinks and window beside it, merged exactly by one more key.

Query i (absolute position) reads token j whole where j < sinks or i − j < window, and from its codes elsewhere: from
codes exactly the positions sinks ≤ j ≤ i − window. Those form a causal pattern of their own: the queries at positions
≥ sinks + window over the codes of positions [sinks, s − window), aligned bottom-right (query i sees code j ≤ i −
window), so the fast causal kernels run them (vLLM's CPU kernel, SDPA). The whole part is small (sinks + window keys a
query) and is computed beside it (in C on a CPU: kernels/cpu_window.py), with its log-sum-exp b_i. The two are merged
inside the causal call by one more key that every query sees, of score b_i and zero value (the causal attention's
`logit`): the call returns the codes' weighted values over Z_codes + Z_whole and the extra key's share
Z_whole / (Z_codes + Z_whole), by which the whole part's normalised output is added. Exact, one causal call. Where the
fast kernel does not run, SDPA runs the same merge with the extra key as a first row in a column of its own
(_sdpa_with_logit), in float32.

Forming both score matrices per block of rows, or one plus a rescored band (paged_window's first versions), costs
full [rows, s] score matrices in torch per KV head, where the causal kernels never form one.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvfold_runtime.kernels.cpu_window import window_part_c
from kvfold_runtime.kernels.torch_sdpa import sdpa_attention

__all__ = ["LogitAttention", "whole_positions", "windowed_prefill"]

_ROWS = 32  # queries per block of the whole part: each reads sinks + rows + window − 1 keys (its band: window)


class LogitAttention(Protocol):
    """Causal attention of a request's last t positions (q [t, Σ group·d_k], k [S, Σd_k], v [S, Σd_v]) with one
    more key per query head, seen by every query, of scaled score logit [t, heads·group] and zero value ->
    (output [t, Σ group·d_v] normalised over that key too, its share [t, heads·group]), or None where it does not
    run (kvfold_runtime.vllm.cpu_prefill.prefill_attention)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int],
                 group: int, *, scaling: float, logit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None: ...


def whole_positions(s: int, t: int, sinks: int, window: int) -> torch.Tensor:
    """The positions whose whole rows the last t queries of s tokens read: the sinks, then [lo, s) (every position
    some query reads inside its window; none where the sinks cover all)."""
    lo = min(s, max(sinks, s - t - window + 1)) if window else s
    return torch.cat([torch.arange(min(sinks, s)), torch.arange(lo, s)])


def windowed_prefill(q: torch.Tensor, k_coded: torch.Tensor, v_coded: torch.Tensor, k_whole: torch.Tensor,
                     v_whole: torch.Tensor, d_k: list[int], d_v: list[int], group: int, *, scaling: float,
                     sinks: int, window: int, causal: LogitAttention | None = None) -> torch.Tensor:
    """One request's queries q [t, Σ_g group·d_k(g)] at positions [s − t, s) over its s cached tokens: k_coded
    [s, Σd_k] and v_coded [s, Σd_v] every position as its codes give it back, k_whole and v_whole the whole rows of
    whole_positions(s, t, sinks, window), in that order -> [t, Σ_g group·d_v(g)] in q's dtype. `causal`: a faster
    causal attention with the extra key (cpu_prefill.prefill_attention), SDPA where None or it gives None."""
    t, s = q.shape[0], k_coded.shape[0]
    f32 = torch.float32
    whole = (d_k, d_v, group, scaling, sinks, window, s)
    o_whole, lse = window_part_c(q, k_whole, v_whole, *whole) or _whole(q.to(f32), k_whole.to(f32), v_whole.to(f32),
                                                                        *whole)
    first = max(0, sinks + window - (s - t))  # the step's first query that reads some codes
    if first >= t:
        return _packed(o_whole, d_v, t).to(q.dtype)
    n, history = t - first, slice(sinks, s - window)  # its queries, and the positions they read from codes
    args = (q[first:], k_coded[history], v_coded[history], d_k, d_v, group)
    logit = lse[first:].reshape(n, -1)  # [n, heads·group]
    got = None if causal is None else causal(*args, scaling=scaling, logit=logit)
    o, share = _sdpa_with_logit(*args, scaling=scaling, logit=logit) if got is None else got
    if all(w == d_v[0] for w in d_v):  # one width: packed rows are [heads · group, width], merged in one pass
        heads, w = len(d_v) * group, d_v[0]
        merged = o.view(n, heads, w).float().add_(share.view(n, heads, 1) * o_whole[first:].view(n, heads, w))
        packed = q.new_empty(t, heads * w)
        packed[:first] = o_whole[:first].view(first, heads * w)
        packed[first:] = merged.view(n, -1)
        return packed
    share = share.view(n, len(d_k), group, 1)
    out, at = o_whole, 0
    for g, dv in enumerate(d_v):
        og = o[:, at:at + group * dv].to(f32).view(n, group, dv)
        at += group * dv
        out[first:, g, :, :dv] = og + share[:, g] * o_whole[first:, g, :, :dv]
    return _packed(out, d_v, t).to(q.dtype)


def _sdpa_with_logit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int], group: int,
                     *, scaling: float, logit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LogitAttention by SDPA in float32: the extra key a first row, a unit vector in a column of its own where the
    query holds logit / scaling; its value a unit vector in a value column of its own, which returns the share."""
    n, f32 = q.shape[0], torch.float32
    qs, ks, vs = q.to(f32).split([group * w for w in d_k], -1), k.to(f32).split(d_k, -1), v.to(f32).split(d_v, -1)
    logit = logit.to(f32).view(n, len(d_k), group) / scaling
    q_aug = [torch.cat([qs[g].view(n, group, w), logit[:, g, :, None]], -1).view(n, -1) for g, w in enumerate(d_k)]
    o = sdpa_attention(torch.cat(q_aug, -1)[None], torch.cat([_with_probe(x) for x in ks], -1)[None],
                       torch.cat([_with_probe(x) for x in vs], -1)[None], [w + 1 for w in d_k],
                       [w + 1 for w in d_v], group, scaling=scaling)[0]
    outs, shares, at = [], [], 0
    for dv in d_v:
        og = o[:, at:at + group * (dv + 1)].view(n, group, dv + 1)
        at += group * (dv + 1)
        outs.append(og[..., :dv].reshape(n, -1))
        shares.append(og[..., dv])
    return torch.cat(outs, -1), torch.cat(shares, -1)


def _with_probe(x: torch.Tensor) -> torch.Tensor:
    """Rows x [L, d] -> [L + 1, d + 1]: a first row that is a unit vector in a new last column, then x beside zeros."""
    out = x.new_zeros(x.shape[0] + 1, x.shape[1] + 1)
    out[0, -1] = 1.0
    out[1:, :-1] = x
    return out


def _whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int], group: int,
           scaling: float, sinks: int, window: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's attention over its whole rows alone (its sinks up to itself and its window past the sinks; k and
    v the rows of whole_positions) -> normalised outputs [t, KV heads, group, max d_v] and log-sum-exps of the scaled
    scores [t, KV heads, group].
    The queries in blocks of _ROWS, every block at once per KV head: block b reads the sinks and the span of window
    rows its queries reach, [first_b, first_b + _ROWS + window − 1) (clamped, masked to each query's band), so a
    head is a few batched products, not a loop over blocks (a loop's per-op cost was most of its time)."""
    t = q.shape[0]
    n_sinks, rows = min(sinks, s), min(_ROWS, t)
    blocks = -(-t // rows)
    dev = q.device
    position = (s - t + torch.arange(blocks * rows, device=dev)).view(blocks, rows)  # padded past t: masked below
    first = position[:, :1] - window + 1  # [blocks, 1]: the block's first query's window start
    j = first + torch.arange(rows + window - 1, device=dev)  # [blocks, span]: the window rows any query reaches
    band = (j[:, None, :] <= position[..., None]) & (position[..., None] - j[:, None, :] < window)
    band &= (j >= sinks)[:, None, :]  # rows below the sinks' end are read as sinks
    sink = torch.arange(n_sinks, device=dev) <= position[..., None]  # [blocks, rows, sinks]
    seen = torch.cat([sink, band], -1)[:, :, None, :]  # [blocks, rows, 1, sinks + span]
    lo = s - (k.shape[0] - n_sinks)  # the held window rows are [lo, s) (whole_positions): every j read is ≥ lo
    rows_at = (n_sinks + j - lo).clamp(0, k.shape[0] - 1)
    at = torch.cat([torch.arange(n_sinks, device=dev).expand(blocks, -1), rows_at], -1)  # [blocks, keys]: k's rows
    out = q.new_zeros(blocks * rows, len(d_k), group, max(d_v))
    lse = q.new_empty(blocks * rows, len(d_k), group)
    qs, ks, vs = q.split([group * w for w in d_k], -1), k.split(d_k, -1), v.split(d_v, -1)
    for g, (dk, dv) in enumerate(zip(d_k, d_v, strict=True)):
        qg = torch.nn.functional.pad(qs[g], (0, 0, 0, blocks * rows - t)).view(blocks, rows * group, dk)
        scores = (qg @ ks[g][at].transpose(1, 2) * scaling).view(blocks, rows, group, -1)
        scores.masked_fill_(~seen, float("-inf"))
        top = scores.amax(-1, keepdim=True).clamp_min_(torch.finfo(q.dtype).min)  # padded queries see nothing
        weights = scores.sub_(top).exp_()
        total = weights.sum(-1, keepdim=True)
        lse[:, g] = (top + total.log()).view(-1, group)
        o = weights.view(blocks, rows * group, -1) @ vs[g][at] / total.view(blocks, rows * group, 1)
        out[:, g, :, :dv] = o.view(-1, group, dv)
    return out[:t], lse[:t]


def _packed(out: torch.Tensor, d_v: list[int], t: int) -> torch.Tensor:
    """[t, KV heads, group, max d_v] -> the packed [t, Σ_g group·d_v(g)]."""
    return torch.cat([out[:, g, :, :dv].reshape(t, -1) for g, dv in enumerate(d_v)], -1)
