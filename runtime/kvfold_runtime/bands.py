"""The bit-band cache format: a head's rotated dims stored in contiguous bands of one bit width each.

kvfold's rotations order each KV head's dims by importance, and in that basis the dims' variances span
orders of magnitude, so (as in transform coding) dims get bits in proportion to their log-variance and a
dropped dim is simply 0 bits. Bits therefore never increase along the dims, and equal widths form
contiguous bands.

One token row of one KV head (keys and values separately), in dim order, byte-aligned per band:

    band 0 codes | band 1 codes | ...        ceil(n_b · bits_b / 8) bytes each
    band 0 scale | band 1 scale | ...        one scale per band of 2..8 bits (1 byte, or 2 in float16)

- 16-bit band: the values themselves as float16 (no scale).
- 2..8-bit band: symmetric mid-rise uniform codes q = clamp(floor(x/s + 2^(b−1)), 0, 2^b − 1),
  x̂ = (q + ½ − 2^(b−1))·s: every level is used (2 bits = ±½s, ±3/2 s, no wasted zero code). Codes are packed
  little-endian, first dim in the lowest bits.
- 0 bits: not stored (the export drops those dims from its ranks).

Which scale s a writer stores is the writer's choice (a reader only decodes); kvfold's writers (this module's
`quantize`, kernels/torch_bits.py, kernels/cpu_bits.c, byte for byte the same) fit it per band row:
- "log8": of the scale that covers the row (the smallest at or above absmax/(2^(b−1) − ½), so no value is
  clipped and |x − x̂| ≤ s/2) and the FIT_STEPS scales below it, the one whose codes give the least squared
  error Σ(x − x̂)² (summed in float64), the covering one on a tie. A smaller step clips the row's largest values
  but rounds all the others finer: on Gaussian rows of 8–64 dims (a band's DCT-mixed dims are close to it) the
  squared error falls by 10% at 5 bits, 20–25% at 4, 25–32% at 3, 35–40% at 2.
  Measured on SmolLM2's bits plans (2026-11-28, 12,288 wiki:eval+pydoc:eval tokens, docs/notebook.md): mean KL
  0.0239 → 0.0191 at 0.270 of fp16's bytes and 0.0160 → 0.0132 at 0.285, perplexity ratio 1.0208 → 1.0167 and
  1.0178 → 1.0151; six steps instead of three gave the same KL (0.0191, 0.0134).
- "float16" (legacy exports): the covering scale, as they were verified with.

The scale s, stored per band per token, in one of two formats (SCALES; all bands of an export share one,
config.json `kvfold.band_scale`):
- "log8" (exports from kvfold 0.1 schema 1.6 on): one byte c, s = 2^((c − 128)/8); the covering scale is the
  smallest such power at or above the ideal absmax/(2^(b−1) − ½). Steps of 2^(1/8) cost at most 9% of the step (about
  0.06 bits per number on average); the byte it saves is 10% of a row at 4 bits per number. Range 2^−16
  to 2^15.9: a band whose ideal scale is below it gets 2^−16 (its error stays ≤ 2^−17), above it is clamped.
- "float16" (bits exports before schema 1.6): the ideal scale rounded up to float16, two bytes
  little-endian.

A layer's cached row per token is its heads' rows in order (`encode_heads`): keys [..., Σ_g row_bytes(g)]
uint8, the same for values — what the transformers cache stores for a bits-format export, byte for byte.
`row_bytes` is what the cache holds per token and head; `roundtrip` is quantize then dequantize, what
attention reads back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import pairwise

import torch

__all__ = ["DEFAULT_SCALE", "FIT_STEPS", "LEGACY_SCALE", "SCALES", "WIDTHS", "Band", "bands_from_bits", "decode_heads",
           "dequantize", "encode_heads", "log8_scales", "pack_bits", "quantize", "roundtrip", "row_bytes"]

WIDTHS = (0, 2, 3, 4, 5, 6, 8, 16)  # the bit widths a band may have
SCALES = {"log8": 1, "float16": 2}  # a quantized band's per-token scale format -> its bytes
DEFAULT_SCALE = "log8"  # what kvfold writes
LEGACY_SCALE = "float16"  # what an export means when config.json has no band_scale (before schema 1.6)
LOG8_STEPS = 8  # log8 scale levels per octave
LOG8_ZERO = 128  # the log8 byte of scale 1.0
FIT_STEPS = 3  # log8 scales below the covering one a writer tries (module docstring): down to 2^(−3/8) ≈ 0.77×


@dataclass(frozen=True)
class Band:
    start: int  # first dim
    size: int  # dims
    bits: int  # one of WIDTHS, not 0
    scale: str = DEFAULT_SCALE  # its per-token scale's format (SCALES), when bits < 16

    @property
    def code_bytes(self) -> int:
        return -(-self.size * self.bits // 8)

    @property
    def scaled(self) -> bool:
        return self.bits < 16

    @property
    def scale_bytes(self) -> int:
        return SCALES[self.scale] if self.scaled else 0


def bands_from_bits(bits: list[int], scale: str = DEFAULT_SCALE) -> tuple[Band, ...]:
    """Per-dim bit widths (non-increasing, as the allocation gives them) -> the bands of equal width, zero
    widths left out, their scales stored as `scale` (SCALES)."""
    if scale not in SCALES:
        raise ValueError(f"band scale format must be one of {sorted(SCALES)}, got {scale!r}")
    if any(b not in WIDTHS for b in bits):
        raise ValueError(f"bit widths must be among {WIDTHS}, got {sorted(set(bits) - set(WIDTHS))}")
    if any(b2 > b1 for b1, b2 in pairwise(bits)):
        raise ValueError("bit widths must not increase along the dims (dims are ordered by importance)")
    bands, start = [], 0
    while start < len(bits):
        end = start
        while end < len(bits) and bits[end] == bits[start]:
            end += 1
        if bits[start]:
            bands.append(Band(start, end - start, bits[start], scale))
        start = end
    return tuple(bands)


def row_bytes(bands: tuple[Band, ...]) -> int:
    """Bytes per token of one head's row: codes plus one scale per quantized band."""
    return sum(b.code_bytes + b.scale_bytes for b in bands)


def _levels(bits: int) -> float:
    return 2.0 ** (bits - 1) - 0.5  # absmax maps to the outermost level's centre


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] integer codes < 2^bits -> [..., ceil(n·bits/8)] uint8, little-endian bit stream."""
    shifts = torch.arange(bits, device=codes.device)
    stream = ((codes[..., None].to(torch.int32) >> shifts) & 1).flatten(-2)  # [..., n·bits]
    pad = (-stream.shape[-1]) % 8
    stream = torch.nn.functional.pad(stream, (0, pad)).unflatten(-1, (-1, 8))
    return (stream << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    stream = ((packed[..., None].to(torch.int32) >> torch.arange(8, device=packed.device)) & 1).flatten(-2)
    stream = stream[..., : n * bits].unflatten(-1, (n, bits))
    return (stream << torch.arange(bits, device=packed.device)).sum(-1)


def _as_float16(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2n] -> float16 [..., n]. A slice of an odd-width row keeps its odd byte strides through
    `.contiguous()` where the other dims have size 1, which cannot be viewed as float16, so: a fresh copy."""
    return raw.new_empty(raw.shape).copy_(raw).view(torch.float16)


def _encode_scale(ideal: torch.Tensor, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """ideal [..., 1] float32 -> (its stored bytes [..., SCALES[scale]] uint8, the stored scale as float32,
    never below `ideal` unless clamped at the format's top), so absmax never lands outside the outermost level."""
    if scale == "float16":
        s16 = ideal.to(torch.float16)
        s16 = torch.where(s16.float() < ideal, torch.nextafter(s16, torch.full_like(s16, torch.inf)), s16)
        return s16.contiguous().view(torch.uint8), s16.float()
    # the smallest byte whose scale (the one table every reader uses) is ≥ ideal: by search, not by log2, whose
    # round-off differs between eager and compiled code (torch_bits.encode_rows writes the same bytes)
    c = torch.bucketize(ideal, log8_scales(str(ideal.device))).clamp(max=255)
    return c.to(torch.uint8), _decode_log8(c)


@functools.cache
def log8_scales(device: str = "cpu") -> torch.Tensor:
    """The 256 scales a log8 byte stands for, float32: one table, so that every reader (this module, the CPU
    cache reader) gets the same float32 for a byte (exp2 on a vector and on a scalar can differ in the last bit)."""
    return torch.exp2((torch.arange(256, dtype=torch.float32) - LOG8_ZERO) / LOG8_STEPS).to(device)


def _decode_log8(c: torch.Tensor) -> torch.Tensor:
    return log8_scales(str(c.device))[c.long()]


def _decode_scale(raw: torch.Tensor, scale: str) -> torch.Tensor:
    """A band's stored scale bytes [..., SCALES[scale]] -> the scale [..., 1] float32."""
    return _as_float16(raw).float() if scale == "float16" else _decode_log8(raw)


def _codes(x: torch.Tensor, s: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.floor(x / s + 2.0 ** (bits - 1)).clamp(0, 2**bits - 1)


def _values(q: torch.Tensor, s: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes q (float) at scale s -> the level centres they stand for: what a reader gets back."""
    return (q + 0.5 - 2.0 ** (bits - 1)) * s


def _fit_log8(x: torch.Tensor, covering: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] float32, its covering log8 bytes [..., 1] -> (the fitted bytes, their scales): of the covering
    scale and the FIT_STEPS below it, the one with the least squared error (module docstring), the first on a tie."""
    def error(c: torch.Tensor) -> torch.Tensor:
        s = _decode_log8(c)
        return (_values(_codes(x, s, bits), s, bits) - x).double().square().sum(-1, keepdim=True)

    best_c = covering.long()
    best_e = error(best_c)
    for k in range(1, FIT_STEPS + 1):
        c = (covering.long() - k).clamp(min=0)
        e = error(c)
        best_c, best_e = torch.where(e < best_e, c, best_c), torch.minimum(e, best_e)
    return best_c.to(torch.uint8), _decode_log8(best_c)


def quantize(x: torch.Tensor, bands: tuple[Band, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] (one head's rotated row per token) -> (codes [..., Σ code_bytes] uint8, scales
    [..., Σ scale_bytes] uint8: each quantized band's stored scale, in band order)."""
    rows, scales = [], []
    for band in bands:
        part = x[..., band.start : band.start + band.size].float()
        if not band.scaled:
            rows.append(part.to(torch.float16).contiguous().view(torch.uint8))
            continue
        # the codes are computed against the scale as stored
        # divided by a tensor: torch on CUDA multiplies by the reciprocal of a Python number, which can land one
        # float32 step off the quotient and so store another scale than the CPU (175 / 3.5 gave 50.000004 on an H200)
        levels = torch.tensor(_levels(band.bits), device=part.device)
        raw, s = _encode_scale((part.abs().amax(-1, keepdim=True) / levels).clamp_min(1e-30), band.scale)
        if band.scale == "log8":
            raw, s = _fit_log8(part, raw, band.bits)
        rows.append(pack_bits(_codes(part, s, band.bits).to(torch.int32), band.bits))
        scales.append(raw)
    lead = x.shape[:-1]
    codes = torch.cat(rows, -1) if rows else torch.empty(*lead, 0, dtype=torch.uint8, device=x.device)
    sc = torch.cat(scales, -1) if scales else torch.empty(*lead, 0, dtype=torch.uint8, device=x.device)
    return codes, sc


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bands: tuple[Band, ...], d: int,
               dtype: torch.dtype = torch.float32, scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The inverse of `quantize`: [..., d] with zeros in the dims no band holds. scale_dtype: each scale rounded to
    it first (what the GPU page kernels compute in half precision: kernels/triton_pages.py), the level times it
    then rounded once to `dtype`."""
    out = torch.zeros(*codes.shape[:-1], d, dtype=dtype, device=codes.device)
    at, k = 0, 0
    for band in bands:
        chunk = codes[..., at : at + band.code_bytes]
        at += band.code_bytes
        if not band.scaled:
            vals = _as_float16(chunk).float()
        else:
            q = _unpack(chunk, band.bits, band.size).float()
            s = _decode_scale(scales[..., k : k + band.scale_bytes], band.scale)
            if scale_dtype is not None:
                s = s.to(scale_dtype).float()
            vals = _values(q, s, band.bits)
            k += band.scale_bytes
        out[..., band.start : band.start + band.size] = vals.to(dtype)
    return out


def roundtrip(x: torch.Tensor, bands: tuple[Band, ...]) -> torch.Tensor:
    """What attention reads back after x [..., d] is stored in `bands` (same shape and dtype)."""
    codes, scales = quantize(x, bands)
    return dequantize(codes, scales, bands, x.shape[-1], x.dtype)


def encode_heads(x: torch.Tensor, widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...]) -> torch.Tensor:
    """x [..., Σ_g widths[g]] (heads packed at their widths) -> [..., Σ_g row_bytes(bands[g])] uint8:
    per head its codes, then its scales' bytes."""
    rows = []
    for part, head in zip(x.split(list(widths), -1), bands, strict=True):
        rows += list(quantize(part, head))
    return torch.cat(rows, -1)


def decode_heads(rows: torch.Tensor, widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...],
                 dtype: torch.dtype, scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The inverse of `encode_heads`: [..., Σ_g widths[g]] in `dtype` (scale_dtype: see `dequantize`)."""
    out, at = [], 0
    for width, head in zip(widths, bands, strict=True):
        n_codes = sum(b.code_bytes for b in head)
        n_scales = sum(b.scale_bytes for b in head)
        codes, scales = rows[..., at : at + n_codes], rows[..., at + n_codes : at + n_codes + n_scales]
        at += n_codes + n_scales
        out.append(dequantize(codes, scales, head, width, dtype, scale_dtype))
    return torch.cat(out, -1)
