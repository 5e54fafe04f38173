"""A windowed bits export's whole rows in vLLM: one ring per request beside each layer's band-code pages.

A windowed bits export (issue 51) reads each request's first `sinks` tokens and last `window` tokens whole, at the
model's dtype (kvfold_runtime.kernels.paged_window). Their rows live in rings, declared to vLLM as its own
`CircularBufferSpec` (one block per request, `block_size` = the ring's capacity sinks + window), so vLLM's block
pool pays for them and frees them with the request; the band codes stay in each attention layer's pages as for any
bits export.

Packing. vLLM gives every ring group one pool block per request, a block being block_size × the export's code bytes
per token over all layers; a ring larger than that widens every block. So rings are few and full: each ring module
holds the rings of `slots` consecutive layers (one vLLM "KV head" each, at the widest layer's Σd_k + Σd_v numbers),
as many as fit in one block, and every ring module has the same page (vLLM's grouping wants equal or all-distinct
ring pages). A request then costs ⌈T / block_size⌉ code blocks plus `rings` ring blocks: at 4,096 tokens close to
what `ConfigBlock.bytes_per_token(context=)` counts (the rounding of the rings to whole blocks aside).

Layout. Ring groups need vLLM's block-outer KV cache layouts (BLNHC / BLHNC): under a layer-outer one vLLM pads
every layer's page to the largest, rings included. The ring backend declares only those, the kvfold backend accepts
them too (its layers' caches are then strided views: kernels.paged writes and reads them by block), so vLLM picks a
block-outer layout exactly when an export has rings.

vLLM computes a generic slot mapping for the ring group that is wrong past the ring's capacity; it is not used: the
ring's slots come from each token's position (paged_window.ring_slots), its block from the group's block table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata, MultipleOf
from vllm.v1.kv_cache_interface import CircularBufferSpec, KVCacheLayout

from kvfold_runtime.format import LayerDims

__all__ = ["RING_PREFIX", "KVFoldRing", "RingPlan", "model_ring_plan", "ring_plan"]

RING_PREFIX = "kvfold_rings"  # ring module j is f"{RING_PREFIX}.{j}": one integer in the name, as vLLM wants


@dataclass(frozen=True)
class RingPlan:
    """Where each layer's ring lives: layer i in ring module i // slots, at "KV head" i % slots."""

    sinks: int
    window: int
    width: int  # numbers per ring row: the widest layer's Σd_k + Σd_v
    slots: int  # layers per ring module
    rings: int  # ring modules: pool blocks a request holds beside its code blocks

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    def place(self, layer: int) -> tuple[str, int]:
        """(ring module name, slot) of a layer."""
        return f"{RING_PREFIX}.{layer // self.slots}", layer % self.slots


def ring_plan(dims: list[LayerDims], sinks: int, window: int, element_size: int, block_size: int) -> RingPlan:
    """The rings of a model whose layers (this rank's widths) are `dims`, whole rows at `element_size` bytes per
    number, vLLM's pool blocks of `block_size` tokens: as many layers per ring as fit in one pool block."""
    width = max(sum(d.d_k) + sum(d.d_v) for d in dims)
    block_bytes = block_size * sum(sum(d.row_bytes()) for d in dims)
    per_layer = (sinks + window) * width * element_size
    slots = max(1, min(len(dims), block_bytes // per_layer))
    return RingPlan(sinks, window, width, slots, cdiv(len(dims), slots))


@dataclass(frozen=True, kw_only=True)
class _RingSpec(CircularBufferSpec):
    """vLLM's ring spec with a block table row as long as a full-attention one: vLLM's worker fills the ring group's
    generic slot mapping (unused here) from the row, and a row of one block would have it read past the row."""

    def max_num_blocks_per_req(self, vllm_config, max_len: int) -> int:
        return cdiv(max_len, self.block_size)


@dataclass
class RingMetadata:
    blocks: torch.Tensor  # [R] each request's ring block (0, vLLM's null block: none, in dummy runs)


class _RingMetadataBuilder(AttentionMetadataBuilder[RingMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # one buffer for every step, at one address: a kernel launch captured in a CUDA graph reads it where it was
        self._blocks = torch.zeros(vllm_config.scheduler_config.max_num_seqs, dtype=torch.int32, device=device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RingMetadata:
        m = common_attn_metadata
        # one contiguous int32 copy a step, as the C decode and the ring kernel read it (not one per layer)
        blocks = self._blocks[:m.num_reqs]
        blocks.copy_(m.block_table_tensor[:m.num_reqs, 0])
        return RingMetadata(blocks)


class KVFoldRingBackend(AttentionBackend):
    """The ring group's backend: its metadata only (the attention layers read and write the rings)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "KVFOLD_RING"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("kvfold's rings are read by the kvfold attention layers")

    @staticmethod
    def get_builder_cls() -> type[_RingMetadataBuilder]:
        return _RingMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        return (KVCacheLayout.BLNHC, KVCacheLayout.BLHNC)


class KVFoldRing(nn.Module, AttentionLayerBase):
    """The rings of `plan.slots` layers: vLLM's cache view [blocks, slots, capacity, width] in the model's dtype."""

    def __init__(self, plan: RingPlan, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.plan, self.dtype, self.prefix = plan, dtype, prefix
        self.kv_cache = torch.tensor([])
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name: {prefix}")
        context[prefix] = self

    def get_kv_cache_spec(self, vllm_config) -> _RingSpec:
        return _RingSpec(block_size=self.plan.capacity, num_kv_heads=self.plan.slots, head_size=self.plan.width,
                         head_size_v=0, dtype=self.dtype, dcp_sharded=False)

    def get_attn_backend(self) -> type[AttentionBackend]:
        return KVFoldRingBackend

    def rows(self, slot: int, width: int) -> torch.Tensor:
        """One layer's rings: [blocks, capacity, width] (a view of the cache)."""
        return self.kv_cache[:, slot, :, :width]

    def forward(self) -> None:  # the attention layers use the rings
        raise NotImplementedError


def model_ring_plan(vllm_config) -> RingPlan | None:
    """The rings of the export vLLM is loading (None: not a windowed export): this rank's layer widths, the model's
    dtype, vLLM's block size."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    from kvfold_runtime.format import ConfigBlock, model_dims
    from kvfold_runtime.sharding import shard_layer

    config = vllm_config.model_config.hf_config
    block = ConfigBlock.from_config(config)
    if not block.windowed:
        return None
    rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    dims = [shard_layer(d, rank, size).dims for d in model_dims(config)]
    element_size = torch.empty(0, dtype=vllm_config.model_config.dtype).element_size()
    return ring_plan(dims, block.sinks, block.window, element_size, vllm_config.cache_config.block_size)
