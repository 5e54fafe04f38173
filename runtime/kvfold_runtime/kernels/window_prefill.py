"""A windowed bits layer's prefill at the cost of one causal attention (issue 51): the history through the fast causal
kernel, the sinks and window beside it, merged exactly by a probe key.

Query i (absolute position) reads token j whole where j < sinks or i − j < window, and from its codes elsewhere: from
codes exactly the positions sinks ≤ j ≤ i − window. Those form a causal pattern of their own: the queries at positions
≥ sinks + window over the codes of positions [sinks, s − window), aligned bottom-right (query i sees code j ≤ i −
window), so the fast causal kernels run them (vLLM's CPU kernel, SDPA). The whole part is small (sinks + window keys a
query) and is computed here, with its log-sum-exp b_i. The two are merged inside the causal call by one more key, put
first: every query sees it (bottom-right alignment, one more key than codes), its key is a unit vector in a column of
its own and the query's entry there is b_i / scaling, so its score is b_i; its value is a unit vector in a value column
of its own. The call then returns, per query, the codes' weighted values over Z_codes + Z_whole and, in that column,
Z_whole / (Z_codes + Z_whole): the whole part's share, by which its normalised output is added. Exact, one causal call.
The merge runs in float32: b_i / scaling in bfloat16 would move the whole part's weight by up to a few percent.

Forming both score matrices per block of rows, or one plus a rescored band (paged_window's first versions), costs
full [rows, s] score matrices in torch per KV head, where the causal kernels never form one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvfold_runtime.kernels.torch_sdpa import sdpa_attention

__all__ = ["windowed_prefill"]

_ROWS = 128  # queries per block of the whole part: [rows, group, sinks + rows + window] scores at a time

Causal = Callable[..., torch.Tensor | None]  # prefill_attention's contract (kvfold_runtime.vllm.cpu_prefill)


def windowed_prefill(q: torch.Tensor, k_coded: torch.Tensor, v_coded: torch.Tensor, k_whole: torch.Tensor,
                     v_whole: torch.Tensor, d_k: list[int], d_v: list[int], group: int, *, scaling: float,
                     sinks: int, window: int, causal: Causal | None = None) -> torch.Tensor:
    """One request's queries q [t, Σ_g group·d_k(g)] at positions [s − t, s) over its s cached tokens: k_coded
    [s, Σd_k] and v_coded [s, Σd_v] every position as its codes give it back, k_whole and v_whole [s, ·] the whole
    rows (read only at positions < sinks and ≥ s − t − window + 1) -> [t, Σ_g group·d_v(g)] in q's dtype.
    `causal`: a faster causal attention of packed rows, aligned bottom-right (cpu_prefill.prefill_attention), SDPA
    where None or it gives None."""
    t, s = q.shape[0], k_coded.shape[0]
    f32 = torch.float32
    o_whole, lse = _whole(q.to(f32), k_whole.to(f32), v_whole.to(f32), d_k, d_v, group, scaling, sinks, window, s)
    first = max(0, sinks + window - (s - t))  # the step's first query that reads some codes
    if first >= t:
        return _packed(o_whole, d_v, t).to(q.dtype)
    n, history = t - first, slice(sinks, s - window)  # its queries, and the positions they read from codes
    qs = q[first:].to(f32).split([group * w for w in d_k], -1)
    ks, vs = k_coded[history].to(f32).split(d_k, -1), v_coded[history].to(f32).split(d_v, -1)
    q_aug, k_aug, v_aug = [], [], []
    for g, dk in enumerate(d_k):
        b = lse[first:, g] / scaling  # [n, group]: the probe's score b_i once the kernel scales it
        q_aug.append(torch.cat([qs[g].view(n, group, dk), b[..., None]], -1).view(n, group * (dk + 1)))
        k_aug.append(_with_probe(ks[g]))
        v_aug.append(_with_probe(vs[g]))
    d_k1, d_v1 = [w + 1 for w in d_k], [w + 1 for w in d_v]
    q_aug, k_aug, v_aug = torch.cat(q_aug, -1), torch.cat(k_aug, -1), torch.cat(v_aug, -1)
    o = None if causal is None else causal(q_aug, k_aug, v_aug, d_k1, d_v1, group, scaling=scaling)
    if o is None:
        o = sdpa_attention(q_aug[None], k_aug[None], v_aug[None], d_k1, d_v1, group, scaling=scaling)[0]
    out, at = o_whole.clone(), 0
    for g, dv in enumerate(d_v):
        og = o[:, at:at + group * (dv + 1)].to(f32).view(n, group, dv + 1)
        at += group * (dv + 1)
        out[first:, g, :, :dv] = og[..., :dv] + og[..., dv:] * o_whole[first:, g, :, :dv]
    return _packed(out, d_v, t).to(q.dtype)


def _with_probe(x: torch.Tensor) -> torch.Tensor:
    """Rows x [L, d] -> [L + 1, d + 1]: a first row that is a unit vector in a new last column, then x beside zeros."""
    out = x.new_zeros(x.shape[0] + 1, x.shape[1] + 1)
    out[0, -1] = 1.0
    out[1:, :-1] = x
    return out


def _whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int], group: int,
           scaling: float, sinks: int, window: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's attention over its whole rows alone (its sinks up to itself and its window past the sinks) ->
    normalised outputs [t, KV heads, group, max d_v] and log-sum-exps of the scaled scores [t, KV heads, group].
    Per block of _ROWS queries, dense products with the sinks and with the block's span of window rows (masked to
    each query's band): no gather of a window per query."""
    t = q.shape[0]
    heads, n_sinks = len(d_k), min(sinks, s)
    out = q.new_zeros(t, heads, group, max(d_v))
    lse = q.new_empty(t, heads, group)
    qs, ks, vs = q.split([group * w for w in d_k], -1), k.split(d_k, -1), v.split(d_v, -1)
    for lo in range(0, t, _ROWS):
        hi = min(t, lo + _ROWS)
        position = torch.arange(s - t + lo, s - t + hi, device=q.device)[:, None]  # the block's queries
        end = s - t + hi  # past the block's last query
        first = min(end, max(sinks, s - t + lo - window + 1))  # the block's window rows [first, end): none below
        j = torch.arange(first, end, device=q.device)[None, :]
        band = (j <= position) & (position - j < window)  # [rows, span]
        sink = torch.arange(n_sinks, device=q.device)[None, :] <= position  # [rows, sinks]
        seen = torch.cat([sink, band], 1)[:, None, :]  # [rows, 1, sinks + span]
        for g, (dk, dv) in enumerate(zip(d_k, d_v, strict=True)):
            qg = qs[g][lo:hi].view(-1, group, dk)
            keys = torch.cat([ks[g][:n_sinks], ks[g][first:end]])  # [sinks + span, dk]
            scores = (qg @ keys.T * scaling).masked_fill_(~seen, float("-inf"))  # [rows, group, sinks + span]
            top = scores.amax(-1, keepdim=True)  # every query sees a whole row: finite
            weights = scores.sub_(top).exp_()
            total = weights.sum(-1, keepdim=True)
            lse[lo:hi, g] = (top + total.log()).squeeze(-1)
            out[lo:hi, g, :, :dv] = weights @ torch.cat([vs[g][:n_sinks], vs[g][first:end]]) / total
    return out, lse


def _packed(out: torch.Tensor, d_v: list[int], t: int) -> torch.Tensor:
    """[t, KV heads, group, max d_v] -> the packed [t, Σ_g group·d_v(g)]."""
    return torch.cat([out[:, g, :, :dv].reshape(t, -1) for g, dv in enumerate(d_v)], -1)
