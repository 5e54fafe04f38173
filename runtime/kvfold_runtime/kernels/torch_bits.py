"""Band codes read back in plain torch, every dim of a layer's row at once: the CPU path's decoder of a bits-format
cache (kernels.paged.BandRows), giving exactly kvfold_runtime.bands.decode_heads' values.

decode_heads walks band by band and unpacks each band's bit stream bit by bit (eight int32 numbers per byte): the
format's plain statement, and on a CPU most of a serving step. Here the per-dim table of kernels/bits_table.py (the
Triton bits kernels' table: each code sits in the 16-bit little-endian window at its byte, at its shift) drives a
few whole-row tensor ops: read each dim's two bytes, shift and mask, look its band's scale byte up in a 256-entry
table (log8) or read it as float16, then x̂ = (q + ½ − 2^(b−1))·s; 16-bit dims are the window read as float16.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from kvfold_runtime.bands import Band, log8_scales
from kvfold_runtime.kernels.bits_table import SCALE_KINDS, band_table, unpack

__all__ = ["decode_rows"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Plan:
    """Per kept dim (heads packed at their widths), as index tensors over the row's bytes."""

    lo: torch.Tensor  # [D] the byte its window starts at
    hi: torch.Tensor  # [D] the next byte (clamped into the row; only read where the code needs it)
    shift: torch.Tensor  # [D] int32
    mask: torch.Tensor  # [D] int32: 2^bits − 1 (0 for 16-bit and for no-band dims)
    offset: torch.Tensor  # [D] float32: ½ − 2^(bits−1)
    scale_lo: torch.Tensor  # [D] its band's scale byte (0 where none)
    half_scale: bool  # some band stores its scale as float16 (legacy exports)
    log8: torch.Tensor  # [D] bool: its scale is one log8 byte
    f16: torch.Tensor  # [D] bool: a 16-bit dim (the window is its float16 value)
    unused: torch.Tensor  # [D] bool: no band holds it (reads 0)


@functools.lru_cache(maxsize=256)
def _plan(widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...], row_bytes: int, device: str) -> _Plan:
    f = unpack(band_table(widths, bands, "cpu"))
    keep = torch.arange(f["byte"].shape[1])[None, :] < torch.tensor(widths)[:, None]  # [G, width]: dims < d[g]
    byte, shift, bits, scale_at, kind = (f[k][keep].long() for k in ("byte", "shift", "bits", "scale_at", "kind"))
    quantized = (bits > 0) & (bits < 16)
    mask = torch.where(quantized, (1 << bits.clamp(max=15)) - 1, 0)
    offset = torch.where(quantized, 0.5 - 2.0 ** (bits.clamp(min=1) - 1).float(), 0.0)
    t = {"lo": byte, "hi": (byte + 1).clamp(max=row_bytes - 1), "shift": shift.int(), "mask": mask.int(),
         "offset": offset, "scale_lo": scale_at, "log8": kind == SCALE_KINDS["log8"], "f16": bits == 16,
         "unused": bits == 0}
    return _Plan(**{k: v.to(device) for k, v in t.items()}, half_scale=bool((kind == SCALE_KINDS["float16"]).any()))


def _as_float16(word: torch.Tensor) -> torch.Tensor:
    """int32 words < 2^16 -> the float16 values of those bits, as float32."""
    signed = word - ((word >> 15) << 16)  # into int16's range, so the narrowing keeps the bits
    return signed.to(torch.int16).view(torch.float16).float()


def _decode(rows, lo, hi, shift, mask, offset, scale_lo, log8, f16, unused, scales, half_scale: bool):
    word = rows.index_select(-1, lo).int() | (rows.index_select(-1, hi).int() << 8)  # [..., D]
    code = ((word >> shift) & mask).float()
    scale_byte = rows.index_select(-1, scale_lo)
    scale = scales[scale_byte.long()]
    if half_scale:  # float16 scales: two bytes little-endian
        high = rows.index_select(-1, (scale_lo + 1).clamp(max=rows.shape[-1] - 1)).int()
        scale = torch.where(log8, scale, _as_float16(scale_byte.int() | (high << 8)))
    values = torch.where(f16, _as_float16(word), (code + offset) * scale)
    return values.masked_fill(unused, 0.0)


# On a CPU, _decode compiled by inductor is one fused loop over the rows instead of a dozen passes: 4× faster
# (SmolLM2 bits layer, 16 × 320 tokens: 1.1 ms against 4.6 ms), the same values; compiled once per process (~3 s,
# dynamic shapes: any batch, context or layer). Where compiling fails (no C++ compiler), the eager ops run.
_compiled = {"fn": None, "failed": False}


def _run(*args, cpu: bool):
    if not cpu or _compiled["failed"]:
        return _decode(*args)
    if _compiled["fn"] is None:
        _compiled["fn"] = torch.compile(_decode, dynamic=True)
    try:
        return _compiled["fn"](*args)
    except Exception as e:  # a compiler missing or refusing: the eager ops give the same values
        _log.warning("kvfold: compiling the bits-cache decoder failed (%s); decoding eagerly (slower)", e)
        _compiled["failed"] = True
        return _decode(*args)


def decode_rows(rows: torch.Tensor, widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...],
                dtype: torch.dtype) -> torch.Tensor:
    """rows [..., Σ_g row_bytes(bands[g])] uint8 (encode_heads) -> [..., Σ_g widths[g]] in `dtype`: the values
    decode_heads gives."""
    p = _plan(tuple(widths), tuple(tuple(h) for h in bands), rows.shape[-1], str(rows.device))
    values = _run(rows, p.lo, p.hi, p.shift, p.mask, p.offset, p.scale_lo, p.log8, p.f16, p.unused,
                  log8_scales(str(rows.device)), p.half_scale, cpu=rows.device.type == "cpu")
    return values.to(dtype)
