"""A prefill's attention on a CPU by vLLM's own CPU attention kernel, over keys and values kvfold has decoded.

A kvfold layer's cache holds per-head widths (and, bits format, band codes) that vLLM's CPU kernel cannot read,
so a prefill used to run torch's SDPA per KV head on the decoded rows; on a 2-core AVX-512 machine vLLM's kernel
(`cpu_attention_with_kv_cache`, what vLLM runs for the original) took 0.33 s where SDPA took 0.51 s for one
SmolLM2 layer's 4K-token prefill in float32 (0.46 against 0.57 in bfloat16): the original's whole time to first
token is mostly that. So the prefill is dequantize-then-attend with the original's kernel: the request's decoded
keys and values are laid out as a dense vLLM CPU cache [blocks, KV heads, BLOCK, h] (every head zero-padded to
one width h, the narrowest head size vLLM's CPU backend lists: zeros add nothing to q·k, and the padded value
columns are dropped), the queries likewise, and vLLM's kernel runs on them with its own scheduler metadata and ISA
choice. Decoding is O(S), the attention O(S²): the copy is small beside it.

`logit`: one more key per query, of score `logit` and zero value, whose share of the softmax comes back beside the
output; a windowed bits layer's prefill merges its whole rows' attention that way (kernels/window_prefill.py). The
key is the cache's first row, seen by every query (causal, aligned bottom-right), a unit vector in a padded column
of its own; the query carries the score there (over two columns, high and low halves, so a 16-bit query holds it to
float32 precision), and the value is a unit vector in a padded value column, which returns the share.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["prefill_attention"]

BLOCK = 128  # tokens per block of the dense cache: a multiple of 32, as vLLM's vec and AMX kernels need
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _vllm():
    """(vllm._custom_ops, its CPU attention ISA chooser), or None where this vLLM build has no CPU kernel."""
    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa

        torch.ops._C.cpu_attention_with_kv_cache  # noqa: B018 (present in vLLM's CPU builds only)
    except (ImportError, AttributeError, RuntimeError):
        return None
    return ops, _get_attn_isa, sorted(CPUAttentionBackend.get_supported_head_sizes())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int],
                      group: int, *, scaling: float, logit: torch.Tensor | None = None):
    """Causal attention of the last t positions' queries q [t, Σ_g group·d_k(g)] over one request's keys
    k [S, Σd_k] and values v [S, Σd_v] (packed per-head widths, kvfold_runtime.format) -> [t, Σ_g group·d_v(g)];
    None where vLLM's CPU kernel does not run (no such kernel, another dtype, a tensor off the CPU).
    With `logit` [t, heads·group] (scaled scores, query head g·group + j): (output, its key's share [t, heads·group]
    float32), the output normalised over that key too."""
    tools = _vllm()
    if tools is None or q.device.type != "cpu" or q.dtype not in DTYPES or not (q.dtype == k.dtype == v.dtype):
        return None
    ops, isa_of, sizes = tools
    extra = 0 if logit is None else 2  # the logit key's columns (score high and low halves; value and spare)
    t, s, heads = q.shape[0], k.shape[0] + (logit is not None), len(d_k)
    # the narrowest head size the kernel has: time follows the padded width (4K tokens, 9 query heads, bfloat16 on
    # 2 AVX-512 cores: width 65 padded to 80, 140 ms; to 96, 190 ms; 64 unpadded, 135 ms)
    h = next((w for w in sizes if w >= max(*d_k, *d_v) + extra), None)
    if h is None:
        return None
    blocks = -(-s // BLOCK)
    isa = isa_of(q.dtype, BLOCK, h)
    # the cache as vLLM's CPU backend allocates and views it ([blocks, heads, BLOCK, 2h] -> keys and values
    # [blocks, heads, BLOCK, h]), filled by vLLM's own writer: the kernel reads the layout its ISA stores
    cache = q.new_empty(blocks, heads, BLOCK, 2 * h)
    cache[-1].zero_()  # the last block's rows past s: read and masked, never NaN (0 · NaN is NaN)
    key_cache, value_cache = cache.view(blocks, heads, 2 * BLOCK, h).chunk(2, dim=2)
    first = int(logit is not None)  # the extra key's row
    keys, values = _heads(k, d_k, h, first), _heads(v, d_v, h, first)
    query = _heads(q, [w for w in d_k for _ in range(group)], h)  # query head g·group + j at KV head g's width
    if logit is not None:  # the extra key first (row 0), in columns past every head's width
        keys[0, :, h - 2:] = 1.0
        values[0, :, h - 2:] = 1.0
        score = logit.float() / scaling
        query[..., h - 2] = score.to(q.dtype)
        query[..., h - 1] = (score - query[..., h - 2].float()).to(q.dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, torch.arange(s, dtype=torch.int64), isa)
    out = q.new_empty(t, heads * group, h)
    starts = torch.tensor([0, t], dtype=torch.int32)
    lens = torch.tensor([s], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=heads * group, num_kv_heads=heads, head_dim=h, seq_lens=lens, dtype=q.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa, enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lens,
        scale=scaling, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=torch.arange(blocks, dtype=torch.int32)[None], softcap=0.0, scheduler_metadata=meta, s_aux=None)
    if logit is None and all(w == h for w in d_v):  # every head at the padded width: the output is already packed
        return out.view(t, heads * group * h)
    if all(w == d_v[0] for w in d_v):  # one width: the packed output is one strided copy
        packed = out[..., :d_v[0]].reshape(t, -1)
    else:
        packed = torch.cat([out[:, g * group:(g + 1) * group, :w].reshape(t, group * w) for g, w in enumerate(d_v)],
                           -1)
    return packed if logit is None else (packed, out[..., h - 2].float())


def _heads(x: torch.Tensor, widths: list[int], h: int, first: int = 0) -> torch.Tensor:
    """[N, Σ widths] -> [first + N, heads, h]: `first` zero rows, then x's, each head zero-padded to h (x itself,
    reshaped, where every head is h wide and first is 0)."""
    n, heads = x.shape[0], len(widths)
    if first == 0 and all(w == h for w in widths):
        return x.reshape(n, heads, h).contiguous()
    out = x.new_zeros(first + n, heads, h)
    if all(w == widths[0] for w in widths):  # one width: one strided copy
        out[first:, :, :widths[0]] = x.view(n, heads, widths[0])
        return out
    at = 0
    for g, w in enumerate(widths):
        out[first:, g, :w] = x[:, at:at + w]
        at += w
    return out
