"""vLLM attention backend `KVFOLD`: attention over vLLM's paged cache at per-KV-head widths.

Each kvfold layer declares itself to vLLM as *one* KV head of width Σ_g d_k (keys) and Σ_g d_v
(values), `group` query heads of width Σ_g d_k, so the packed vectors pass through vLLM's reshapes. Its page
(block_size rows, no padding) is then:
- rank format: block_size × (Σd_k + Σd_v) × bytes per number — vLLM's own spec of those widths — and the
  layer's tensor [num_blocks, 1, block_size, Σd_k + Σd_v];
- bits format: block_size × row_bytes bytes, row_bytes = Σ LayerDims.row_bytes() (keys' band codes and
  scales, then values'): the layer (kvfold_runtime.vllm.attention.KVFoldAttentionLayer) declares a uint8
  spec with `state_content_bytes=row_bytes`, and the tensor is uint8 [num_blocks, 1, block_size, row_bytes].
vLLM sizes its block pool by those pages: exactly the export's bytes per token. The true per-head attention
(KV head g at its own widths, its `group` query heads) runs on the rows: the layout and the row codecs (how a
row is written and read back) are in kvfold_runtime.kernels.paged, the math is
kvfold_runtime.kernels.dispatch.paged: on CUDA the Triton kernels (kernels/triton_decode.py,
triton_prefill.py; triton_bits.py for bits caches), elsewhere and for fp8 caches the torch path
kernels.paged_attention (any widths, d_k ≠ d_v, prefill, decode and chunked prefill, prefix caching, the
model's original scaling, sliding windows), which decodes only the blocks it reads, a prefill's attention on a
CPU by vLLM's own CPU kernel over the decoded rows (kvfold_runtime.vllm.cpu_prefill); what a step's batch reads
(its StepPlan) is made by the step's first layer and kept in the step's metadata for the others. A step of
decodes only, no sliding window, on a CPU reads vLLM's block table and lengths in C as they are (no plan: vLLM
keeps one metadata per KV cache group, and a bits export's per-layer page sizes make many groups), and a bits
layer's rows are encoded straight into their slots; there a layer's write and attention are one C call, in any
model dtype (kernels.paged.decode_layer_c: separate calls' Python and ctypes cost ~50–90 µs more a layer at batch 1).

The per-head widths and bands reach the implementation through the layer (`kvfold_dims=` extra argument of
vLLM's Attention). A rank layer's cache holds the model dtype, or with vLLM's `kv_cache_dtype="fp8"` (e4m3) /
"fp8_e5m2" one byte per number (the layer's k/v scales, 1.0 unless the checkpoint or vLLM sets them), so
the two savings compose: (1 − p) / 2 of the fp16 bytes. A bits layer's cache holds its band codes as the
export defines them, whatever kv_cache_dtype says ("auto" only: the model class refuses the others). A windowed
bits export's layers also read and write each request's whole sink and recent rows in rings (kvfold_runtime.vllm.ring;
the attention in kernels/paged_window.py, torch on every device).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.forward_context import get_forward_context
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import KVCacheLayout

from kvfold_runtime.format import LayerDims
from kvfold_runtime.kernels import row_codec, write_paged
from kvfold_runtime.kernels.dispatch import StepSplit, kernels_for, paged
from kvfold_runtime.kernels.paged import BandPages, decode_layer_c
from kvfold_runtime.kernels.paged_window import windowed_paged_attention, write_ring
from kvfold_runtime.vllm.cpu_prefill import prefill_attention
from kvfold_runtime.vllm.errors import refuse

__all__ = ["BACKEND_NAME", "KVFoldAttentionBackend"]

BACKEND_NAME = "KVFOLD"
# vLLM's kv_cache_dtype names -> the float8 format the uint8 cache holds
FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass
class KVFoldMetadata:
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [R + 1], on the device (the Triton kernels read it there)
    seq_lens: torch.Tensor  # [R], on the device
    block_table: torch.Tensor  # [R, max_blocks]
    slot_mapping: torch.Tensor  # [num_actual_tokens]
    max_query_len: int  # grid sizes for the kernels, known to vLLM without a host sync
    max_seq_len: int
    # the torch path's StepPlan per (block size, window), made by the step's first layer, read by the others
    plans: dict = field(default_factory=dict)
    split: StepSplit | None = None  # on CUDA: the decodes and prefills (dispatch.paged), None elsewhere


class KVFoldMetadataBuilder(AttentionMetadataBuilder[KVFoldMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # decodes first in every batch (vLLM reorders for builders that ask): on CUDA a step splits into the decode
        # kernel's requests and the prefills' (dispatch.StepSplit) without a host round trip
        self._init_reorder_batch_threshold(1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVFoldMetadata:
        m = common_attn_metadata
        n = m.num_reqs
        return KVFoldMetadata(num_actual_tokens=m.num_actual_tokens,
                              query_start_loc=m.query_start_loc[:n + 1], seq_lens=m.seq_lens[:n],
                              block_table=m.block_table_tensor[:n], slot_mapping=m.slot_mapping[:m.num_actual_tokens],
                              max_query_len=m.max_query_len, max_seq_len=m.max_seq_len, split=self._split(m))

    def _split(self, m: CommonAttentionMetadata) -> StepSplit | None:
        """The step's decodes and prefills from vLLM's host copies (the prefills' lengths are exact there)."""
        if torch.device(self.device).type != "cuda" or m.max_query_len <= 1 or m.seq_lens_cpu_upper_bound is None:
            return None
        decodes, _, decode_tokens, _ = split_decodes_and_prefills(m, decode_threshold=1)
        starts, lens = m.query_start_loc_cpu.tolist(), m.seq_lens_cpu_upper_bound.tolist()
        prefills = tuple((r, starts[r], starts[r + 1] - starts[r], lens[r]) for r in range(decodes, m.num_reqs))
        return StepSplit(decodes, decode_tokens, prefills)


class KVFoldAttentionImpl(AttentionImpl[KVFoldMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                 sliding_window: int | None, kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None,
                 *, kvfold_dims: LayerDims, kvfold_ring: tuple[str, int, int, int] | None = None) -> None:
        if kv_cache_dtype not in FP8_FORMATS and kv_cache_dtype != "auto":
            raise refuse(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the kvfold backend; use 'auto' "
                         f"or one of {', '.join(FP8_FORMATS)}")
        if alibi_slopes is not None or logits_soft_cap or attn_type != AttentionType.DECODER:
            raise refuse("the kvfold backend serves causal decoder attention without ALiBi or soft-capping")
        dims = kvfold_dims
        assert not (dims.banded and kv_cache_dtype != "auto"), "the model class refuses it (vllm/models.py)"
        assert num_kv_heads == 1 and num_heads == dims.group, "kvfold layers declare one packed KV head"
        assert head_size == sum(dims.d_k), "declared key width must be Σ d_k"
        self.dims, self.d_k, self.d_v = dims, list(dims.d_k), list(dims.d_v)
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = FP8_FORMATS.get(kv_cache_dtype)
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self._decode_layer = None  # kernels.paged.decode_layer_c's, made at the first decode step (False: none)
        # a windowed bits export: (ring module name, this layer's slot in it, sinks, window) — vllm/ring.py
        self.ring = kvfold_ring
        self._rings = None  # (the ring module's cache, this layer's view of it): _ring_rows
        if kvfold_ring is not None and sliding_window is not None:
            raise refuse("a windowed bits export of a sliding-window model is not served: re-export without --window")

    def _codec(self, layer, query: torch.Tensor, kv_cache: torch.Tensor):
        """How this layer's rows are stored: its band codes (bits format; in the GPU page layout, a block a page,
        where the Triton kernels read the cache), or its numbers in the model's dtype or fp8 at the layer's k/v
        scales. The same choice at every step: the query's device and the cache's block size do not change."""
        page = kv_cache.shape[-2] if kernels_for(query) == "triton" and self.ring is None else None
        return row_codec(self.dims, self.fp8, layer._k_scale_float, layer._v_scale_float, page=page)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: KVFoldMetadata | None, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """query [T, group, Σd_k] (the packed [T, Σ_h d_k(g(h))] seen through vLLM's reshape), key [T, 1, Σd_k]
        and value [T, 1, Σd_v] in the model's dtype, output [T, group, Σd_v] (likewise the packed
        [T, Σ_h d_v(g(h))]). The step's keys and values are written first (one row per token at its slot), then
        every query attends: one vLLM custom op per layer and step, not two (forward_includes_kv_cache_update)."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvfold: fused output quantization is not supported")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        meta, n = attn_metadata, attn_metadata.num_actual_tokens
        writes = self.kv_sharing_target_layer_name is None and key is not None and value is not None
        codec = self._codec(layer, query, kv_cache)
        if self.ring is not None:
            return self._windowed(query, key, value, kv_cache, meta, output, codec)
        if writes and meta.max_query_len == 1 and self.sliding_window is None and not isinstance(codec, BandPages):
            # decodes: one C call if it runs (C reads rows, not pages)
            if self._decode_in_c(query[:n], key[:n], value[:n], kv_cache, meta, output[:n]):
                return output
        if writes:
            write_paged(kv_cache, meta.slot_mapping, key[:n], value[:n], codec=codec)
        q = query[:n].reshape(n, -1)
        out = output[:n].view(n, -1)
        paged(q, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc, self.d_k, self.d_v, self.dims.group,
              scaling=self.scale, sliding_window=self.sliding_window, out=out, codec=codec,
              max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, plans=meta.plans,
              prefill=prefill_attention, split=meta.split)
        return output

    def _decode_in_c(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                     meta: KVFoldMetadata, output: torch.Tensor, ring=None) -> bool:
        """A step of decodes as one C call (kernels.paged.decode_layer_c's, made at the first one): True once its
        rows are written and attended, False where C does not run it (nothing done)."""
        if self._decode_layer is None:
            self._decode_layer = decode_layer_c(self.dims, kv_cache, self.fp8) or False
        return bool(self._decode_layer) and self._decode_layer(query, key, value, meta.slot_mapping, kv_cache,
                                                              meta.block_table, meta.seq_lens, output, self.scale,
                                                              ring=ring)

    def _windowed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                  meta: KVFoldMetadata, output: torch.Tensor, codec) -> torch.Tensor:
        """A windowed bits layer: the step's codes written, attention with the sinks and window read whole from the
        request's ring (kernels.paged_window), then the step's whole rows written to the ring."""
        name, slot, sinks, window = self.ring
        context = get_forward_context()
        ring = self._ring_rows(context.no_compile_layers[name], slot)
        blocks = context.attn_metadata[name].blocks
        n = meta.num_actual_tokens
        k, v = key[:n].reshape(n, -1), value[:n].reshape(n, -1)
        # decodes: one C call if it runs (codes and ring rows written, then attention)
        if meta.max_query_len == 1 and self._decode_in_c(query[:n], k, v, kv_cache, meta, output[:n],
                                                         ring=(ring, blocks, sinks, window)):
            return output
        write_paged(kv_cache, meta.slot_mapping, k, v, codec=codec)
        windowed_paged_attention(query[:n].reshape(n, -1), k, v, kv_cache, ring, blocks, meta.block_table,
                                 meta.seq_lens, meta.query_start_loc, codec, scaling=self.scale, sinks=sinks,
                                 window=window, out=output[:n].view(n, -1), prefill=prefill_attention,
                                 max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, split=meta.split)
        write_ring(ring, blocks, meta.seq_lens, meta.query_start_loc, k, v, sinks=sinks, window=window,
                   max_query_len=meta.max_query_len)
        return output

    def _ring_rows(self, module, slot: int) -> torch.Tensor:
        """This layer's rings, a view of the ring module's cache made once (vLLM binds the cache once; a step's
        decode of a layer costs ~0.1 ms of Python beside its C call, and a view is a few µs of it)."""
        if self._rings is None or self._rings[0] is not module.kv_cache:
            self._rings = (module.kv_cache, module.rows(slot, sum(self.d_k) + sum(self.d_v)))
        return self._rings[1]


class KVFoldAttentionBackend(AttentionBackend):
    # the step's rows are written in forward (one custom op per layer: ~9 µs of vLLM's dispatch saved a layer on CPU)
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", *FP8_FORMATS]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[KVFoldAttentionImpl]:
        return KVFoldAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[KVFoldMetadataBuilder]:
        return KVFoldMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any width

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        # Layer-compact layouts first: each layer's cache is then one contiguous tensor whose rows are the
        # token slots (the backend declares one KV head, so [L, B, H, N, C] and [L, B, N, H, C] coincide).
        # A windowed export's rings (vllm/ring.py) take the block-outer ones, where each layer's cache is a strided
        # view (kernels.paged writes it by block; C, which wants contiguous rows, then stands aside).
        return (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC, KVCacheLayout.BLHNC)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER
