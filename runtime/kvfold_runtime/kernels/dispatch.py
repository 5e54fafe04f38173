"""Which attention implementation runs: the Triton kernels on CUDA, the torch path everywhere else.

`KVFOLD_KERNELS` chooses: `auto` (default: Triton for CUDA tensors when triton imports), `torch`, or
`triton` (also on CPU, where Triton needs TRITON_INTERPRET=1 set before it is first imported — the tests
run the runtime that way). Cases the kernels do not cover fall back to the torch path in every mode:
soft-capped scores (Gemma 2), masks the kernels do not take (triton_common.mask_problem: other dtypes, shapes,
devices), fp8 caches, float64. A paged bits-format (band) cache takes the Triton bits kernels where the others
would take Triton: in the GPU page layout (BandPages, chosen where they run) triton_pages.paged_pages_attention,
else triton_bits.paged_bits_attention (codes dequantized in registers from the rows). The
masks transformers passes (bool [B, 1, T, S], causal, left-padded or banded for sliding windows) go to the
kernels. The torch path is kvfold_runtime.kernels.torch_sdpa / .paged; the layouts are paged.py's.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from kvfold_runtime.kernels.paged import (
    BandPages,
    BandRows,
    NumberRows,
    PrefillAttention,
    RowCodec,
    StepPlan,
    decode_step_c,
    paged_attention,
    plan_step,
)
from kvfold_runtime.kernels.torch_sdpa import sdpa_attention

__all__ = ["StepSplit", "attention", "kernels_for", "paged", "paged_kernels_for"]

_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _triton():
    """The kernel modules, or None where triton does not import (a CPU-only install)."""
    try:
        from kvfold_runtime.kernels import triton_decode, triton_prefill
    except ImportError:
        return None
    return triton_decode, triton_prefill


@functools.cache
def _triton_bits():
    from kvfold_runtime.kernels import triton_bits  # imported only where _triton() imported

    return triton_bits


def kernels_for(x: torch.Tensor) -> str:
    """'triton' or 'torch' for a query tensor, by KVFOLD_KERNELS (see the module docstring)."""
    mode = os.environ.get("KVFOLD_KERNELS", "auto")
    if mode not in ("auto", "torch", "triton"):
        raise ValueError(f"KVFOLD_KERNELS={mode!r}: use auto, torch or triton")
    if mode == "torch" or x.dtype not in _TRITON_DTYPES:
        return "torch"
    if mode == "triton" or x.is_cuda:
        if _triton() is None:
            if mode == "triton":
                raise ValueError("KVFOLD_KERNELS=triton but triton does not import; pip install triton")
            return "torch"
        return "triton"
    return "torch"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_k: list[int], d_v: list[int], group: int, *,
              scaling: float, mask: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """The contiguous layouts (transformers' cache): reference_attention's contract. Triton decode for one
    query token, Triton prefill for more: with no mask plain causal, aligned to the last query; with one (bool,
    or float added to the scores, [B|1, H|1, T, ≥S]) the mask alone decides. A query row with no key to attend
    to (left padding) gives 0 on both paths (torch's SDPA does the same)."""
    if softcap is not None or kernels_for(q) == "torch":
        return sdpa_attention(q, k, v, d_k, d_v, group, scaling=scaling, mask=mask, softcap=softcap)
    decode, prefill = _triton()
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    if mask is not None:
        from kvfold_runtime.kernels.triton_common import supports_mask  # imported with the kernels

        if not supports_mask(mask, b, group * len(d_k), t, s, q.device):
            return sdpa_attention(q, k, v, d_k, d_v, group, scaling=scaling, mask=mask)
        mask = mask[..., :s]
    if t == 1:
        return decode.decode_attention(q, k, v, d_k, d_v, group, scaling=scaling, mask=mask)
    return prefill.prefill_attention(q, k, v, d_k, d_v, group, scaling=scaling, mask=mask)


def paged_kernels_for(x: torch.Tensor, codec: RowCodec | None) -> str:
    """'triton' or 'torch' for a query over a paged cache whose rows `codec` wrote (None: the numbers in the
    cache's dtype): kernels_for(x) where the Triton kernels read the rows, the torch path elsewhere."""
    if codec is None or isinstance(codec, BandRows) or (isinstance(codec, NumberRows) and codec.fp8 is None):
        return kernels_for(x)
    return "torch"  # fp8 codes: the torch path decodes them


def _plan(plans: dict | None, block_table, seq_lens, query_start_loc, block_size: int,
          window: int | None) -> StepPlan:
    """The step's StepPlan: made once and kept in `plans` (when given) for the step's other layers."""
    def make() -> StepPlan:
        return plan_step(block_table, seq_lens.cpu(), query_start_loc.cpu(), block_size, window)

    if plans is None:
        return make()
    key = (block_size, window)
    if key not in plans:
        plans[key] = make()
    return plans[key]


def paged(query: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
          query_start_loc: torch.Tensor, d_k: list[int], d_v: list[int], group: int, *, scaling: float,
          sliding_window: int | None = None, out: torch.Tensor | None = None, codec: RowCodec | None = None,
          max_query_len: int | None = None, max_seq_len: int | None = None,
          plans: dict | None = None, prefill: PrefillAttention | None = None,
          split: StepSplit | None = None) -> torch.Tensor:
    """vLLM's paged cache: paged_attention's contract. On the Triton path `seq_lens` and `query_start_loc`
    should live on the query's device and `max_query_len` / `max_seq_len` be given (vLLM knows them), so
    a step needs no host round trip; a batch of one-token requests takes the decode kernel. `plans`: a dict
    that lives as long as the step (vLLM's attention metadata keeps one), where the torch path keeps the
    step's StepPlan per (block size, window) for the next layers; `prefill`: its prefills' attention over the
    decoded rows (paged_attention's). `split`: the batch's decodes and prefills as vLLM ordered them (decodes
    first), known on the host: over the GPU page layout the decodes then take the page kernel and each prefill
    its pages decoded once and SDPA (flash attention on CUDA), dequantize-then-attend."""
    if isinstance(codec, BandPages):
        if paged_kernels_for(query, codec) == "triton":
            from kvfold_runtime.kernels import triton_pages  # imported only where _triton() imported

            if split is not None and split.prefills:
                return _pages_split(query, kv, block_table, seq_lens, query_start_loc, d_k, d_v, group,
                                    scaling=scaling, sliding_window=sliding_window, out=out, codec=codec,
                                    max_seq_len=max_seq_len, split=split)
            return triton_pages.paged_pages_attention(
                query, kv, block_table, seq_lens.to(query.device), query_start_loc.to(query.device), codec.dims,
                scaling=scaling, sliding_window=sliding_window, out=out, max_query_len=max_query_len,
                max_seq_len=max_seq_len)
        kv, codec = codec.as_rows(kv), BandRows(codec.dims)  # the torch path reads rows (a copy of the cache)
    if paged_kernels_for(query, codec) == "torch":
        if max_query_len == 1 and sliding_window is None:  # a decode step: C reads vLLM's table where it can
            done = decode_step_c(query, kv, block_table, seq_lens, codec, scaling=scaling, out=out)
            if done is not None:
                return done
        plan = _plan(plans, block_table, seq_lens, query_start_loc, kv.shape[-2], sliding_window)
        return paged_attention(query, kv, block_table, seq_lens, query_start_loc, d_k, d_v, group,
                               scaling=scaling, sliding_window=sliding_window, out=out, codec=codec, plan=plan,
                               prefill=prefill)
    dev = query.device
    seq_lens, query_start_loc = seq_lens.to(dev), query_start_loc.to(dev)
    if isinstance(codec, BandRows):  # codes read and dequantized in registers, never a dequantized copy
        return _triton_bits().paged_bits_attention(query, kv, block_table, seq_lens, query_start_loc, codec.dims,
                                                   scaling=scaling, sliding_window=sliding_window, out=out,
                                                   max_query_len=max_query_len, max_seq_len=max_seq_len)
    decode, prefill = _triton()
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len == 1:
        return decode.paged_decode_attention(query, kv, block_table, seq_lens, d_k, d_v, group, scaling=scaling,
                                             sliding_window=sliding_window, max_seq_len=max_seq_len, out=out)
    return prefill.paged_prefill_attention(query, kv, block_table, seq_lens, query_start_loc, d_k, d_v, group,
                                           scaling=scaling, sliding_window=sliding_window,
                                           max_query_len=max_query_len, out=out)


@dataclass(frozen=True)
class StepSplit:
    """A step's batch as vLLM orders it when its builder reorders (decodes first): the first `decodes` requests
    decode one token each (query rows [0, decode_tokens)), then per prefill or chunked prefill (request, first
    query row, query rows, tokens in the cache after the step), host integers."""

    decodes: int
    decode_tokens: int
    prefills: tuple[tuple[int, int, int, int], ...]


def _pages_split(query, kv, block_table, seq_lens, query_start_loc, d_k, d_v, group, *, scaling, sliding_window,
                 out, codec: BandPages, max_seq_len, split: StepSplit) -> torch.Tensor:
    """dispatch.paged over the GPU page layout with the batch split (StepSplit): the decodes by the page kernel,
    each prefill by its own pages turned back into rows and decoded once to the query's dtype, then SDPA
    (paged_attention's prefill): a prefill is compute-bound, and flash attention on dense keys beats
    re-dequantizing them for every block of queries. The dense rows are the prefill's own: its memory is bounded
    by the prefill requests, not by the longest sequence in the batch."""
    from kvfold_runtime.kernels import triton_pages

    if out is None:
        out = query.new_empty(query.shape[0], group * sum(d_v))
    dev, n, t0 = query.device, split.decodes, split.decode_tokens
    if n:
        triton_pages.paged_pages_attention(
            query[:t0], kv, block_table[:n], seq_lens[:n].to(dev), query_start_loc[:n + 1].to(dev), codec.dims,
            scaling=scaling, sliding_window=sliding_window, out=out[:t0], max_query_len=1, max_seq_len=max_seq_len)
    rows_codec = BandRows(codec.dims)
    for r, first, t, s in split.prefills:
        rows = codec.request_rows(kv, block_table[r], s)  # [blocks, P, C]
        paged_attention(query[first:first + t], rows, torch.arange(rows.shape[0], device=dev)[None], torch.tensor([s]),
                        torch.tensor([0, t]), d_k, d_v, group, scaling=scaling, sliding_window=sliding_window,
                        out=out[first:first + t], codec=rows_codec)
    return out
