"""Band codes written on a GPU in one launch: a bits layer's rows for N tokens (bands.encode_heads' bytes exactly),
where the table-driven torch writer (torch_bits._encode) is ~125 small ops a side, each a launch on a GPU: ~250 a
layer's decode step, more time than the step's attention at small batches.

One program a token and head: each quantized band's absmax, its covering log8
byte (the smallest of the 256 scales ≥ absmax / (2^(b−1) − ½)), the fitted byte (bands.FIT_STEPS bytes below it
tried, each band's squared error summed in float64; the least wins, the covering one on a tie), each dim's code
shifted into its 16-bit window (or its float16 bits), added into the row's bytes (codes never share a bit: adding
is OR). The arithmetic is torch's step for step: x / s rounded (div_rn), the reconstruction's product rounded
before the difference (on CUDA `mul.rn`, which the compiler may not fuse into an FMA), so the bytes are the same.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from kvfold_runtime.bands import FIT_STEPS, Band, log8_scales
from kvfold_runtime.kernels.torch_bits import _writer

__all__ = ["encode_rows_triton"]


@triton.jit
def _mul_rn(a, b):
    """a · b rounded to float32 on its own (never fused with a following add)."""
    if _ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return a * b


@triton.jit
def _per_dim(per_band, of_band):
    """[BLOCK_B] band values -> [BLOCK_D]: each dim its band's (of_band [BLOCK_B, BLOCK_D]: dim d in band b)."""
    return tl.sum(tl.where(of_band, per_band[:, None], 0), 0)


@triton.jit
def _codes(x, s, half, top):
    """Each dim's code at scale s: floor(x / s + 2^(b−1)) within [0, 2^b − 1]."""
    return tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(x, s) + half), 0.0), top)


@triton.jit
def _band_errors(x, quantized, half, top, of_band, member, byte, scales_ptr):
    """[BLOCK_B] float64: each band's squared error with its scale at log8 byte `byte` [BLOCK_B]."""
    s = tl.where(quantized, _per_dim(tl.load(scales_ptr + byte), of_band), 1.0)
    q = _codes(x, s, half, top)
    e = (_mul_rn(q + 0.5 - half, s) - x).to(tl.float64)
    return tl.sum(tl.where(member, (e * e)[None, :], 0.0), 1)


@triton.jit
def _encode_kernel(x_ptr, stride_x, out_ptr, row_bytes, heads_ptr, band_ptr, kind_ptr, half_ptr, top_ptr, shift_ptr,
                   lo_ptr, hi_ptr, levels_ptr, scale_at_ptr, scales_ptr, FIT: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_B: tl.constexpr):
    """Program (t, g): token t's head g (heads [G, 4]: its first dim, width, first band, band count)."""
    t, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    first, width = tl.load(heads_ptr + 4 * g), tl.load(heads_ptr + 4 * g + 1)
    first_band, num_bands = tl.load(heads_ptr + 4 * g + 2), tl.load(heads_ptr + 4 * g + 3)
    live = tl.arange(0, BLOCK_D) < width
    d = first + tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + t * stride_x + d, mask=live, other=0.0).to(tl.float32)
    kind = tl.load(kind_ptr + d, mask=live, other=0)  # 1: a code, 2: float16 bits, 0: nothing stored
    quantized = kind == 1
    half = tl.load(half_ptr + d, mask=live, other=0.0)
    top = tl.load(top_ptr + d, mask=live, other=0.0)
    b = first_band + tl.arange(0, BLOCK_B)
    has = tl.arange(0, BLOCK_B) < num_bands
    of_band = (tl.load(band_ptr + d, mask=live, other=-1)[None, :] == b[:, None]) & has[:, None]
    member = of_band & quantized[None, :]
    amax = tl.max(tl.where(member, tl.abs(x)[None, :], 0.0), 1)
    ideal = tl.maximum(tl.math.div_rn(amax, tl.load(levels_ptr + b, mask=has, other=1.0)), 1e-30)
    scales = tl.load(scales_ptr + tl.arange(0, 256))
    covering = tl.minimum(tl.sum((scales[None, :] < ideal[:, None]).to(tl.int32), 1), 255)  # torch.bucketize's
    byte = covering
    best = _band_errors(x, quantized, half, top, of_band, member, covering, scales_ptr)
    for k in tl.static_range(1, FIT + 1):
        tried = tl.maximum(covering - k, 0)
        err = _band_errors(x, quantized, half, top, of_band, member, tried, scales_ptr)
        byte = tl.where(err < best, tried, byte)
        best = tl.minimum(err, best)
    s = tl.where(quantized, _per_dim(tl.load(scales_ptr + byte), of_band), 1.0)
    code = _codes(x, s, half, top).to(tl.int32) << tl.load(shift_ptr + d, mask=live, other=0)
    bits16 = x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    word = tl.where(quantized, code, tl.where(kind == 2, bits16, 0))
    row = out_ptr + t * row_bytes
    stored = live & (kind != 0)
    tl.atomic_add(row + tl.load(lo_ptr + d, mask=live, other=0), word & 0xFF, mask=stored)
    tl.atomic_add(row + tl.load(hi_ptr + d, mask=live, other=0), word >> 8, mask=stored & (word >> 8 != 0))
    tl.atomic_add(row + tl.load(scale_at_ptr + b, mask=has, other=0), byte, mask=has)


# PTX where Triton compiles for CUDA; its interpreter (decided when the kernel was decorated) multiplies in numpy,
# which never fuses
_ASM = tl.constexpr(isinstance(_encode_kernel, JITFunction) and torch.version.hip is None)


@functools.lru_cache(maxsize=256)
def _tables(widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...], device: str) -> dict | None:
    """torch_bits' writer tables in the kernel's types, or None where that writer has none (float16 scales)."""
    w = _writer(widths, bands, device)
    if w is None:
        return None
    kind = torch.where(w.quantized, 1, torch.where(w.f16, 2, 0))
    heads, dim, band = [], 0, 0  # per head: first dim, width, first quantized band, quantized bands
    for width, head in zip(widths, bands, strict=True):
        scaled = sum(b.scaled for b in head)
        heads.append([dim, width, band, scaled])
        dim, band = dim + width, band + scaled
    return {"heads": torch.tensor(heads, dtype=torch.int32, device=device), "widest": max(widths),
            "most_bands": max(h[3] for h in heads), "band": w.band.int(), "kind": kind.int(), "half": w.half.float(),
            "top": w.top.float(), "shift": w.shift, "lo": w.lo.int(), "hi": w.hi.int(), "levels": w.levels.float(),
            "scale_at": w.scale_at.int(), "scales": log8_scales(device), "row_bytes": w.row_bytes}


def encode_rows_triton(x: torch.Tensor, widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...]) -> torch.Tensor:
    """torch_bits.encode_rows' contract in one kernel launch: x [..., Σ_g widths[g]] -> [..., Σ_g row_bytes] uint8,
    bands.encode_heads' bytes. A layer whose bands keep float16 scales (exports before schema 1.6) goes to
    encode_heads."""
    from kvfold_runtime.bands import encode_heads

    widths, bands = tuple(widths), tuple(tuple(h) for h in bands)
    t = _tables(widths, bands, str(x.device))
    if t is None or x.numel() == 0:
        return encode_heads(x, widths, bands)
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.zeros(flat.shape[0], t["row_bytes"], dtype=torch.int32, device=x.device)
    _encode_kernel[(flat.shape[0], len(widths))](
        flat, flat.stride(0), out, t["row_bytes"], t["heads"], t["band"], t["kind"], t["half"], t["top"], t["shift"],
        t["lo"], t["hi"], t["levels"], t["scale_at"], t["scales"], FIT=FIT_STEPS,
        BLOCK_D=triton.next_power_of_2(t["widest"]), BLOCK_B=triton.next_power_of_2(max(1, t["most_bands"])))
    return out.to(torch.uint8).view(*x.shape[:-1], t["row_bytes"])
