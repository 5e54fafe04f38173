"""Attention over a *paged* cache of packed per-head widths (vLLM's block tables), in plain torch.

The paged layout — one layout for the vLLM backend, this torch path and the GPU kernels:
  per layer one tensor  kv [num_blocks, block_size, Σ_g d_k + Σ_g d_v]  (any leading view of it that
  flattens to rows, e.g. vLLM's [num_blocks, 1, block_size, C] with one declared "KV head")
  row of a token         [k'_0 | k'_1 | … | k'_{G-1} | v'_0 | v'_1 | … | v'_{G-1}]
                          every KV head g at its own width d_k[g] (keys) / d_v[g] (values), no padding
  slot of a token         block_table[request, position // block_size] * block_size + position % block_size
So a page holds block_size × (Σd_k + Σd_v) numbers: the KV pool shrinks by exactly 1 − p. The numbers are
the model dtype, or fp8 (vLLM's kv_cache_dtype="fp8": uint8 storage holding float8_e4m3fn / e5m2 codes of
k / k_scale and v / v_scale, saturated at the format's largest value), which halves the bytes again. Queries and
outputs keep the contiguous packed layouts of kvfold_runtime.format ([T, Σ_h d_k(g(h))], [T, Σ_h d_v(g(h))]).

Requests are described as vLLM does: query_start_loc [R + 1] (their query tokens, concatenated), seq_lens [R]
(tokens in the cache after this step, the new ones included: the queries are the *last* tokens of each
sequence), block_table [R, max_blocks]. Decode requests (one query token) are batched into one call per
KV head; prefills and chunked prefills (several query tokens against a cached prefix) go one by one.
"""

from __future__ import annotations

import torch

from kvfold_runtime.kernels.torch_sdpa import sdpa_attention

__all__ = ["paged_attention", "write_paged"]


def _encode(x: torch.Tensor, fp8: torch.dtype | None, scale: float, like: torch.Tensor) -> torch.Tensor:
    if fp8 is None:
        return x.to(like.dtype)
    big = torch.finfo(fp8).max
    return (x.float() / scale).clamp(-big, big).to(fp8).view(like.dtype)


def _decode_rows(rows: torch.Tensor, sk: int, dtype: torch.dtype, fp8: torch.dtype | None, k_scale: float,
                 v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached rows [..., C] -> keys [..., Σd_k], values [..., Σd_v] in the query dtype."""
    if fp8 is None:
        return rows[..., :sk].to(dtype), rows[..., sk:].to(dtype)
    codes = rows.view(fp8)
    return codes[..., :sk].to(dtype) * k_scale, codes[..., sk:].to(dtype) * v_scale


def write_paged(kv: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                fp8: torch.dtype | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store keys k [N, Σd_k] and values v [N, Σd_v] of N tokens at their slots (-1: padding, skipped);
    `fp8`: the float8 format the (uint8) cache holds."""
    rows = kv.view(-1, kv.shape[-1])  # [num_blocks·block_size, Σd_k + Σd_v]
    n = slots.shape[0]
    k, v = k[:n].reshape(n, -1), v[:n].reshape(n, -1)
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    w = k.shape[-1]
    rows[slots, :w] = _encode(k, fp8, k_scale, rows)
    rows[slots, w:] = _encode(v, fp8, v_scale, rows)


def _gather(blocks: torch.Tensor, table_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Rows of positions [start, end) of one sequence: [end - start, C]."""
    bs = blocks.shape[1]
    first, last = start // bs, (end + bs - 1) // bs
    rows = blocks[table_row[first:last]].reshape(-1, blocks.shape[-1])  # [(last-first)·bs, C]
    return rows[start - first * bs:end - first * bs]


def paged_attention(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, d_k: list[int], d_v: list[int], group: int, *, scaling: float,
                    sliding_window: int | None = None, out: torch.Tensor | None = None,
                    fp8: torch.dtype | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """query [T, Σ_h d_k(g(h))] -> [T, Σ_h d_v(g(h))]: causal attention of each request's queries over its
    cached tokens (the paged layout above), at the original model's scaling. `sliding_window` W: a query at
    position i sees keys i − W + 1 … i (Mistral's and transformers' convention). `fp8`, `k_scale`,
    `v_scale`: how an fp8 cache was written (write_paged)."""
    sk = sum(d_k)
    blocks = kv.reshape(kv.shape[0], -1, kv.shape[-1])  # [num_blocks, block_size, C] (vLLM's has a 1 in between)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    n_out = group * sum(d_v)
    if out is None:
        out = query.new_empty(query.shape[0], n_out)
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    other = [i for i, n in enumerate(q_lens) if n > 1]
    if decode:
        codec = (fp8, k_scale, v_scale)
        _decode(query, blocks, block_table, lens, starts, decode, d_k, d_v, group, scaling, sliding_window, sk, out,
                codec)
    for i in other:
        s, t = lens[i], q_lens[i]
        begin = 0 if sliding_window is None else max(0, s - t - sliding_window + 1)
        rows = _gather(blocks, block_table[i], begin, s)  # [S', C]
        q = query[starts[i]:starts[i + 1]]
        mask = None  # no window: sdpa_attention's own causal mask, aligned to the last query
        if sliding_window is not None:
            qpos = torch.arange(s - t, s, device=q.device)[:, None]
            kpos = torch.arange(begin, s, device=q.device)[None, :]
            allowed = kpos <= qpos
            if sliding_window is not None:
                allowed &= qpos - kpos < sliding_window
            mask = allowed[None, None]  # [1, 1, t, S']
        k, v = _decode_rows(rows, sk, q.dtype, fp8, k_scale, v_scale)
        o = sdpa_attention(q[None], k[None], v[None], d_k, d_v, group, scaling=scaling, mask=mask)
        out[starts[i]:starts[i + 1]] = o[0]
    return out


def _decode(query, blocks, block_table, lens, starts, idx, d_k, d_v, group, scaling, window, sk, out, codec) -> None:
    """All one-token requests at once: their contexts gathered (padded to the longest) and masked."""
    dev = query.device
    seq = torch.tensor([lens[i] for i in idx], device=dev)
    begin = torch.zeros_like(seq) if window is None else (seq - window).clamp(min=0)
    span = int((seq - begin).max())
    bs = blocks.shape[1]
    # absolute positions read per request: begin … begin + span - 1 (past the end: masked)
    pos = begin[:, None] + torch.arange(span, device=dev)[None, :]  # [N, span]
    valid = pos < seq[:, None]
    pos = torch.where(valid, pos, 0)
    table = block_table[torch.tensor(idx, device=dev)]
    slots = table.gather(1, pos // bs).long() * bs + pos % bs  # [N, span]
    rows = blocks.reshape(-1, blocks.shape[-1])[slots]  # [N, span, C]
    at = torch.tensor([starts[i] for i in idx], device=dev)  # each request's one query token
    q = query[at][:, None]  # [N, 1, Σ_h d_k]
    k, v = _decode_rows(rows, sk, q.dtype, *codec)
    o = sdpa_attention(q, k, v, d_k, d_v, group, scaling=scaling, mask=valid[:, None, None, :])
    out[at] = o[:, 0]
