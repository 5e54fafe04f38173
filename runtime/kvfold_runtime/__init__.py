"""kvfold-runtime: serve checkpoints written by `kvfold export`.

`import kvfold_runtime` registers the KVFold<Arch> classes with transformers' Auto classes, so
`AutoModelForCausalLM.from_pretrained(EXPORTED_DIR)` returns a model whose cache stores the
compressed keys and values. Public API: `register`, `runtime_class`, `kv_cache_bytes`, `check_export`,
`tensor_shapes` (an export's tensor shapes from its safetensors headers),
`reference_attention`, `sdpa_attention`, `paged_attention`, `write_paged` (with the row codecs of a paged
cache, `row_codec`, `NumberRows` / `BandRows`: a layer's numbers, or its band codes), `attention` (the
dispatch: Triton on CUDA, torch elsewhere; KVFOLD_KERNELS), `kernels_for`, and the Triton kernels
`decode_attention`, `paged_decode_attention`, `prefill_attention`, `paged_prefill_attention`, and over a
bits-format cache `bits_attention`, `paged_bits_attention` (codes dequantized in registers; vLLM's on CUDA)
(imported on first use: triton is needed only where they run), and `window_reads` (the keys a block of
queries reads in a cache that keeps its sink and recent tokens whole, and which query reads which).

The checkpoint contract (kvfold_runtime.format, the one definition kvfold writes and every runtime reads):
`MANIFEST` (the manifest's file name), `SCHEMA_VERSION` and `check_schema`, `Q_POST` / `K_POST` (tensor names
of the post-RoPE projections), `runtime_class_name`, `head_dim`, `ConfigBlock` (config.json's `kvfold`
block), `LayerDims` (a layer's widths, offsets and bytes per cached token, both formats) and `model_dims`.
The architectures served, as data: `FAMILIES` / `Family`.

The bit-band cache format of `--format bits` exports (a head's rotated dims in contiguous bands of one
bit width, a one-byte scale per band per token; layout in `kvfold_runtime.bands`): `Band`,
`BAND_SCALES` (scale formats → bytes), `bands_from_bits` (a head's per-dim widths → its bands),
`band_row_bytes` (bytes per token of a head's row: codes and scales), `band_roundtrip` (quantize then
dequantize, what the cache's reader sees), `encode_band_rows` (heads at their widths → their cached rows of codes
and scales, as the runtimes write them) and `pack_bits` (b-bit codes as a little-endian bit stream).

`kvfold_runtime.vllm` is vLLM's plugin (entry point `vllm.general_plugins`): with this package installed,
`vllm serve EXPORTED_DIR` and `vllm.LLM(model=EXPORTED_DIR)` serve exports from a paged cache that holds
the compressed widths. It is imported by vLLM, never here (vLLM is optional).
"""

from kvfold_runtime.bands import DEFAULT_SCALE as DEFAULT_BAND_SCALE
from kvfold_runtime.bands import LEGACY_SCALE as LEGACY_BAND_SCALE
from kvfold_runtime.bands import SCALES as BAND_SCALES
from kvfold_runtime.bands import WIDTHS as BAND_WIDTHS
from kvfold_runtime.bands import Band, bands_from_bits, pack_bits
from kvfold_runtime.bands import encode_heads as encode_band_rows
from kvfold_runtime.bands import roundtrip as band_roundtrip
from kvfold_runtime.bands import row_bytes as band_row_bytes
from kvfold_runtime.cache import kv_cache_bytes
from kvfold_runtime.export import check_export, tensor_shapes
from kvfold_runtime.families import FAMILIES, Family
from kvfold_runtime.format import (
    K_POST,
    K_SHIFT,
    MANIFEST,
    Q_POST,
    SCHEMA_VERSION,
    ConfigBlock,
    LayerDims,
    check_schema,
    head_dim,
    model_dims,
    runtime_class_name,
)
from kvfold_runtime.hf import register, runtime_class
from kvfold_runtime.kernels import (
    BandRows,
    NumberRows,
    attention,
    kernels_for,
    paged_attention,
    reference_attention,
    row_codec,
    sdpa_attention,
    write_paged,
)
from kvfold_runtime.kernels.torch_window import window_reads

__version__ = "0.1.0"
__all__ = ["BAND_SCALES", "BAND_WIDTHS", "DEFAULT_BAND_SCALE", "FAMILIES", "K_POST", "K_SHIFT", "LEGACY_BAND_SCALE",
           "MANIFEST", "Q_POST", "SCHEMA_VERSION", "Band", "BandRows", "ConfigBlock", "Family", "LayerDims",
           "NumberRows", "attention", "band_roundtrip", "band_row_bytes", "bands_from_bits", "bits_attention",
           "check_export", "check_schema", "decode_attention", "encode_band_rows", "head_dim", "kernels_for",
           "kv_cache_bytes", "model_dims", "pack_bits", "paged_attention", "paged_bits_attention",
           "paged_decode_attention", "paged_prefill_attention", "prefill_attention", "reference_attention", "register",
           "row_codec", "runtime_class", "runtime_class_name", "sdpa_attention", "tensor_shapes", "window_reads",
           "write_paged"]

_TRITON = {"decode_attention": "triton_decode", "paged_decode_attention": "triton_decode",
           "prefill_attention": "triton_prefill", "paged_prefill_attention": "triton_prefill",
           "bits_attention": "triton_bits", "paged_bits_attention": "triton_bits"}


def __getattr__(name: str):
    """The Triton kernels, imported when first asked for (PEP 562)."""
    if name in _TRITON:
        import importlib

        return getattr(importlib.import_module(f"kvfold_runtime.kernels.{_TRITON[name]}"), name)
    raise AttributeError(f"module 'kvfold_runtime' has no attribute {name!r}")

register()
