"""vLLM 0.32's per-token-head KV-cache dtypes (`--kv-cache-dtype int8_per_token_head` etc.), quantized bit for bit
as vLLM's Triton attention backend stores them, the only backend that takes them, and its plain fp8 cache (the last
item below). Each (token, KV head) row of keys (post-RoPE) and values gets its own float32 scale, computed when the
token is written; every cached token, the current ones included, is read back quantized. File names below are
under vllm/ of vLLM 0.32.0 (csrc/: its repository's C++ and CUDA sources, which the wheel does not hold).

- int8_per_token_head: int8 codes, s = max(amax/127, 1e-6), code = x·(1/s) ± 0.5 clamped to [-128, 127] and
  truncated by the int8 store (round half away from zero). Read: code · s (the kernel casts the code to q's dtype
  and folds s into the score, and into P before P·V). Write: v1/attention/ops/triton_reshape_and_cache_flash.py
  (_reshape_cache_per_token_head, _PER_TOKEN_HEAD_QUANT_PARAMS); read: v1/attention/ops/triton_unified_attention.py
  (kernel_unified_attention, KV_QUANT_MODE 2).
- fp8_per_token_head: float8 e4m3fn codes, s = max(amax/448, 1e-6), code = x·(1/s) clamped to ±448 and rounded
  to nearest even by the store; read as code · s. Same files (KV_QUANT_MODE 3). The 448 is CUDA's e4m3fn; ROCm's
  e4m3fnuz (±224, model_executor/layers/quantization/utils/quant_utils.py get_fp8_min_max) is not modelled.
- int4_per_token_head (v1/attention/ops/int4_per_token_head.py): the row is first rotated by a randomized
  Hadamard transform, y = H_b·(D·x) on blocks of b = the largest power-of-two divisor of d (single_rht; D = ±1
  from torch.bernoulli seeded 0x9E3779B9, _get_rht_signs; H unnormalized, so the norm grows by √b), computed in
  float32 and rounded to the model's dtype (reshape_and_cache_int4). Then asymmetric 4 bits
  (_reshape_cache_int4_kernel): s = max((max − min)/15, 1e-6), zero point z = round(−min/s) clamped to [0, 15],
  code = round(y·(1/s) + z) clamped to [0, 15] (rounding half away from zero), two codes a byte (even dim in the
  low nibble). z hides in the 4 low mantissa bits of the float32 scale: stored bits = (bits(s) & ~15) | z. The
  read kernel (_attn_packed) takes z = bits & 15 and s' = bits & ~15, so it dequantizes (code − z)·s' with a scale
  up to 15 ulp below the one it quantized with (a relative −2e-6 at most: the one mismatch between write and read).
  vLLM keeps K and V in the rotated basis and rotates q instead (score scale ÷ b), inverse-rotating the output
  (÷ b); the roundtrip here inverse-rotates the dequantized K and V, which is the same attention up to round-off.
  Rows whose rotated range does not contain 0 clip (z is clamped), as they do in vLLM.
- fp8 (`--kv-cache-dtype fp8`, KVQuantMode.FP8_PER_TENSOR): one float32 scale per layer for keys and one for
  values, fixed when the model loads. A checkpoint without calibrated k/v scales (SmolLM2, most) keeps vLLM's
  default 1.0: model_executor/layers/attention/attention.py set_default_quant_scales (from _init_kv_cache_quant);
  with a quantization config and no scales in the checkpoint, model_executor/layers/quantization/kv_cache.py
  BaseKVCacheMethod.process_weights_after_loading sets 1.0 too; 0.32 has no run-time scale calculation. Write:
  code = e4m3fn(float32(x) / scale), rounded to nearest even and saturated to ±448. On CUDA the FlashAttention and
  FlashInfer backends write with the C++ reshape_and_cache_flash (csrc/cache_kernels.cu → fp8::scaled_convert,
  csrc/quantization/w8a8/fp8/nvidia/quant_utils.cuh: __nv_cvt_float_to_fp8(float(x) / scale, __NV_SATFINITE,
  __NV_E4M3)); the Triton backend (v1/attention/backends/triton_attn.py do_kv_cache_update) with
  reshape_and_cache_kernel_flash (v1/attention/ops/triton_reshape_and_cache_flash.py), which divides by the loaded
  scale in float32 and lets tl.store cast (on SM89+, which it requires, a round-to-nearest-even, saturating
  convert). Read: code · scale in the query's dtype (v1/attention/ops/triton_unified_attention.py _cast_kv_tile,
  KV_QUANT_MODE 1). Every e4m3 value is exact in float16, bfloat16 and float32, so at scale 1.0 the roundtrip is
  the code itself in x's dtype. One byte a number and no scales in the cache: 0.500 of float16's bytes.
  Not modelled: on CUDA the Triton and FlashAttention backends also quantize the query to e4m3 at q_scale 1.0
  (attention.py Attention.__init__ query_quant, where impl.supports_quant_query_input: triton_attn.py
  TritonAttentionImpl is_cuda(), backends/flash_attn.py all but SM90 FA4), and the Triton kernel then rounds P·256
  to e4m3 before P·V (triton_unified_attention.py, p_scale). vLLM's CPU path, and FlashInfer below SM100, keep q
  and P in the model's dtype: what this roundtrip gives.

Layout and bytes (v1/attention/backends/triton_attn.py TritonAttentionBackend.customize_spec, _ensure_scale_caches;
v1/kv_cache_interface.py AttentionSpec.page_size_bytes; code dtypes in utils/torch_utils.py): per KV head and token,
[K codes | K scale | V codes | V scale], the scales float32 inline, so 2·d + 8 bytes (int8, fp8) or d + 8 (int4),
no further padding. Against float16's 4·d: d = 64 → 136/256 = 0.531 and 72/256 = 0.281; d = 128 → 264/512 =
0.516 and 136/512 = 0.266.

Where this is not vLLM on a GPU: the RHT here is vLLM's CPU butterfly (fast_hadamard_transform, tier 3) in
float32; on CUDA vLLM runs it through hadacore or a Triton matmul in bfloat16, float32 inputs cast down first (for q
and the output too), which moves values by bf16 round-off (2^-9) and so flips an occasional int4 code by one. A GPU
may also contract the kernels' multiply-adds into FMAs, which matters only within a float32 ulp of a rounding boundary.
tests/bench/test_vllm_kv_dtypes.py runs vLLM's own write and read kernels (Triton interpreter) against these
functions: it is the alarm for a vLLM upgrade that changes any of the above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

import torch

from kvfold.adapters import HeadLayout
from kvfold.errors import KVFoldError

from ..patches import FP8_MAX, quantized_kv
from .base import Candidate

__all__ = [
    "DEFAULT_KV_SCALE",
    "DTYPES",
    "VllmPerTokenHead",
    "fp8_per_tensor_encode",
    "fp8_per_tensor_roundtrip",
    "fp8_per_token_head_encode",
    "fp8_per_token_head_roundtrip",
    "int4_per_token_head_decode",
    "int4_per_token_head_encode",
    "int4_per_token_head_roundtrip",
    "int8_per_token_head_encode",
    "int8_per_token_head_roundtrip",
    "per_token_head_decode",
    "rht",
    "rht_signs",
    "vllm_bytes_per_token",
]

MIN_SCALE = 1e-6  # every kernel's floor on the scale
RHT_SEED = 0x9E3779B9


# ---- randomized Hadamard transform (int4) -----------------------------------------------------------------------


@cache
def rht_signs(b: int) -> torch.Tensor:
    """vLLM's D: b deterministic ±1 signs (_get_rht_signs, round 0). Shared: do not modify."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((b,), 0.5), generator=gen) - 1.0


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized H_b·x over the last dim (b a power of two), vLLM's butterfly in its order of additions."""
    b = x.shape[-1]
    h = 1
    while h < b:
        xv = x.view(*x.shape[:-1], b // (2 * h), 2, h)
        x = torch.stack([xv[..., 0, :] + xv[..., 1, :], xv[..., 0, :] - xv[..., 1, :]], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """single_rht: H_b·(D·x) block-diagonally over the last dim; inverse = D·(H_b·x), so rht(rht(x), True) = b·x.
    x float32."""
    d = x.shape[-1]
    b = d & -d  # largest power-of-two divisor
    xb, signs = x.reshape(*x.shape[:-1], d // b, b), rht_signs(b).to(x.device)
    y = _hadamard(xb.contiguous()) * signs if inverse else _hadamard(xb * signs)
    return y.reshape(x.shape)


# ---- int4_per_token_head -----------------------------------------------------------------------------------------


def _round_half_away(t: torch.Tensor) -> torch.Tensor:
    """The kernels' where(t >= 0, t + 0.5, t - 0.5).to(int32), back in float32."""
    return torch.where(t >= 0, t + 0.5, t - 0.5).to(torch.int32).float()


def int4_per_token_head_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] (d even) → (codes uint8 [..., d/2], scales float32 [...]) as vLLM writes them to the cache:
    nibble pairs of the rotated row, the zero point in the scale's low mantissa bits."""
    if x.shape[-1] % 2:
        raise KVFoldError(f"int4_per_token_head needs an even head dim, got {x.shape[-1]}")
    y = rht(x.float()).to(x.dtype).float()  # as reshape_and_cache_int4 hands it to the kernel
    lo, hi = y.amin(-1), y.amax(-1)
    scale = ((hi - lo) / 15.0).clamp_min(MIN_SCALE)
    zero = _round_half_away(-lo / scale).clamp(0.0, 15.0)
    q = _round_half_away(y * (1.0 / scale)[..., None] + zero[..., None]).clamp(0.0, 15.0).to(torch.uint8)
    codes = q[..., 0::2] | (q[..., 1::2] << 4)
    packed = (scale.view(torch.int32) & -16) | zero.to(torch.int32)
    return codes, packed.view(torch.float32)


def int4_per_token_head_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(codes, scales) as stored → float32 [..., d] in the ROTATED basis, by the read kernel's arithmetic."""
    bits = scales.view(torch.int32)
    zero = (bits & 15).float()[..., None]
    scale = (bits & -16).view(torch.float32)[..., None]
    q = torch.stack([codes & 15, codes >> 4], dim=-1).flatten(-2).float()  # even dims from the low nibbles
    return (q - zero) * scale


def int4_per_token_head_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x [B, H_kv, T, d] → what vLLM's int4 cache gives back, inverse-rotated to x's basis, in x's dtype."""
    y = int4_per_token_head_decode(*int4_per_token_head_encode(x))
    b = x.shape[-1] & -x.shape[-1]
    return (rht(y, inverse=True) / b).to(x.dtype)


# ---- int8_per_token_head, fp8_per_token_head ---------------------------------------------------------------------


def _absmax_scaled(x: torch.Tensor, qmax: float, qmin: float, integer: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """_reshape_cache_per_token_head up to the store: (float32 values handed to the store, scales)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / qmax).clamp_min(MIN_SCALE)
    q = xf * (1.0 / scale)[..., None]
    if integer:
        q = torch.where(q >= 0, q + 0.5, q - 0.5)  # the int8 store then truncates
    return q.clamp(qmin, qmax), scale


def int8_per_token_head_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] → (codes int8 [..., d], scales float32 [...])."""
    q, scale = _absmax_scaled(x, 127.0, -128.0, integer=True)
    return q.to(torch.int8), scale


def fp8_per_token_head_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] → (codes float8_e4m3fn [..., d], scales float32 [...])."""
    q, scale = _absmax_scaled(x, FP8_MAX, -FP8_MAX, integer=False)
    return q.to(torch.float8_e4m3fn), scale


def per_token_head_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 or fp8 (codes, scales) → float32 code · scale, which is what the read kernel multiplies q and P by."""
    return codes.float() * scales[..., None]


def int8_per_token_head_roundtrip(x: torch.Tensor) -> torch.Tensor:
    return per_token_head_decode(*int8_per_token_head_encode(x)).to(x.dtype)


def fp8_per_token_head_roundtrip(x: torch.Tensor) -> torch.Tensor:
    return per_token_head_decode(*fp8_per_token_head_encode(x)).to(x.dtype)


# ---- fp8: one scale per layer, vLLM's default 1.0 ----------------------------------------------------------------

DEFAULT_KV_SCALE = 1.0  # set_default_quant_scales: _k_scale = _v_scale = 1.0 unless the checkpoint has scales


def fp8_per_tensor_encode(x: torch.Tensor, scale: float = DEFAULT_KV_SCALE) -> torch.Tensor:
    """x [...] in the model's dtype → float8_e4m3fn codes [...] as vLLM writes them: float32(x) / scale, rounded to
    nearest even, saturated to ±448 (__NV_SATFINITE). torch's cast rounds the same but would make |x| ≥ 464 NaN:
    hence the clamp first."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def fp8_per_tensor_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x [B, H_kv, T, d] → what vLLM's fp8 cache at its default scale gives back: code · 1.0, in x's dtype."""
    return (fp8_per_tensor_encode(x).float() * DEFAULT_KV_SCALE).to(x.dtype)


# ---- bytes and the frontier methods ------------------------------------------------------------------------------

ROUNDTRIPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "int4_per_token_head": int4_per_token_head_roundtrip,
    "int8_per_token_head": int8_per_token_head_roundtrip,
    "fp8_per_token_head": fp8_per_token_head_roundtrip,
}
DTYPES = tuple(ROUNDTRIPS)
_LABELS = {
    "int4_per_token_head": "vLLM int4_per_token_head (Hadamard, asym. int4)",
    "int8_per_token_head": "vLLM int8_per_token_head",
    "fp8_per_token_head": "vLLM fp8_per_token_head (e4m3)",
}


def vllm_bytes_per_token(dtype: str, num_kv_heads: int, head_dim: int) -> int:
    """KV-cache bytes vLLM allocates per token (page_size_bytes / block_size): per KV head, K and V codes (one
    byte each, two int4 codes a byte) plus one float32 scale each, inline (TritonAttentionBackend.customize_spec)."""
    if dtype not in ROUNDTRIPS:
        raise KVFoldError(f"unknown vLLM per-token-head dtype {dtype!r}; choose from: {', '.join(DTYPES)}")
    code_bytes = head_dim // 2 if dtype == "int4_per_token_head" else head_dim  # uint8 / int8 / fp8 as uint8
    return num_kv_heads * (2 * code_bytes + 2 * 4)


@dataclass(frozen=True)
class VllmPerTokenHead:
    dtype: str  # one of DTYPES, vLLM's kv_cache_dtype string
    origin: str | None = None
    knob: str = "none"

    @property
    def name(self) -> str:
        return self.dtype

    @property
    def label(self) -> str:
        return _LABELS[self.dtype]

    def candidates(self, setup) -> Iterator[Candidate]:
        layout = HeadLayout.from_config(setup.model.config)
        fp16 = 2 * 2 * layout.num_kv_heads * layout.head_dim
        fraction = vllm_bytes_per_token(self.dtype, layout.num_kv_heads, layout.head_dim) / fp16
        layers = len(setup.adapter.attention_modules(setup.model))
        yield Candidate(0.0, fraction, {i: quantized_kv(ROUNDTRIPS[self.dtype]) for i in range(layers)})
