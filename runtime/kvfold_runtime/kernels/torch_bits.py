"""Band codes written and read back in plain torch, every dim of a layer's row at once: the CPU path's encoder and
decoder of a bits-format cache (kernels.paged.BandRows), giving exactly kvfold_runtime.bands.encode_heads' bytes
and decode_heads' values.

decode_heads walks band by band and unpacks each band's bit stream bit by bit (eight int32 numbers per byte): the
format's plain statement, and on a CPU most of a serving step. Here the per-dim table of kernels/bits_table.py (the
Triton bits kernels' table: each code sits in the 16-bit little-endian window at its byte, at its shift) drives a
few whole-row tensor ops: read each dim's two bytes, shift and mask, look its band's scale byte up in a 256-entry
table (log8) or read it as float16, then x̂ = (q + ½ − 2^(b−1))·s; 16-bit dims are the window read as float16.
Writing is the same table backwards: each band's absmax over a padded [bands, widest band] gather, its covering log8
byte by bucketing into the 256 scales, the fitted byte (bands.FIT_STEPS tries, each band's squared error summed over
the same gather), each dim's code shifted into its window and added into its two bytes (codes of
one band never share a bit, so adding is OR). encode_heads quantizes band by band in ~10 small ops each: 0.32 ms
a SmolLM2 layer call at batch 1 on this CPU, against 0.05 ms for encode_rows compiled (before the fitted scales,
which cost the compiled writer 1.5× at 1 row and 3× at 2,048: docs/notebook.md, 2026-11-28).

On a CPU with a C compiler, decode_rows hands the rows to kernels/cpu_bits.c (a loop per band width), 4× faster
than these ops compiled (SmolLM2 bits layer, 12,800 rows: 0.61 / 0.51 ms for keys / values against 2.7 / 2.7 ms).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from kvfold_runtime.bands import FIT_STEPS, Band, encode_heads, log8_scales, row_bytes
from kvfold_runtime.kernels import cpu_bits
from kvfold_runtime.kernels.bits_table import SCALE_KINDS, band_table, unpack

__all__ = ["WriterTables", "decode_rows", "encode_rows", "writer_tables"]

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


# On a CPU, _decode (and _encode) compiled by inductor is one fused loop over the rows instead of a dozen passes:
# 4× faster (SmolLM2 bits layer, 16 × 320 tokens: 1.1 ms against 4.6 ms), the same values; compiled once per
# process (~3 s each, dynamic shapes: any batch, context or layer). Where compiling fails (no C++ compiler), the
# eager ops run.
_compiled: dict = {"failed": False}


def _run(fn, *args, cpu: bool):
    if not cpu or _compiled["failed"]:
        return fn(*args)
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    try:
        return _compiled[fn](*args)
    except Exception as e:  # a compiler missing or refusing: the eager ops give the same values
        _log.warning("kvfold: compiling the bits-cache codec failed (%s); running it eagerly (slower)", e)
        _compiled["failed"] = True
        return fn(*args)


def decode_rows(rows: torch.Tensor, widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...],
                dtype: torch.dtype) -> torch.Tensor:
    """rows [..., Σ_g row_bytes(bands[g])] uint8 (encode_heads) -> [..., Σ_g widths[g]] in `dtype`: the values
    decode_heads gives."""
    widths, bands = tuple(widths), tuple(tuple(h) for h in bands)
    if rows.device.type == "cpu" and cpu_bits.library() is not None:  # the C decoder (module docstring)
        return cpu_bits.decode_rows_c(rows, widths, bands).to(dtype)
    p = _plan(widths, bands, rows.shape[-1], str(rows.device))
    values = _run(_decode, rows, p.lo, p.hi, p.shift, p.mask, p.offset, p.scale_lo, p.log8, p.f16, p.unused,
                  log8_scales(str(rows.device)), p.half_scale, cpu=rows.device.type == "cpu")
    return values.to(dtype)


@dataclass(frozen=True)
class WriterTables:
    """Per kept dim and per quantized band of a layer's row, as index tensors (bands.encode_heads' layout)."""

    band_dims: torch.Tensor  # [B, M] the dims of each quantized band, padded with D (a column of zeros)
    levels: torch.Tensor  # [B] float32: 2^(bits−1) − ½, the outermost level's centre in steps
    scale_at: torch.Tensor  # [B] the byte of each band's scale
    band: torch.Tensor  # [D] its quantized band (0 where none: its code is masked off)
    half: torch.Tensor  # [D] float32: 2^(bits−1) (0 where not quantized)
    top: torch.Tensor  # [D] float32: 2^bits − 1, the largest code
    shift: torch.Tensor  # [D] int32
    lo: torch.Tensor  # [D] its window's first byte
    hi: torch.Tensor  # [D] the next byte (clamped into the row; only a nonzero part lands there)
    quantized: torch.Tensor  # [D] bool
    f16: torch.Tensor  # [D] bool
    row_bytes: int


@functools.lru_cache(maxsize=256)
def writer_tables(widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...], device: str) -> WriterTables | None:
    """The layer's writer tables, or None when a band keeps its scale as float16 (exports before schema 1.6:
    bands.encode_heads writes those)."""
    if any(b.scaled and b.scale != "log8" for head in bands for b in head):
        return None
    f = unpack(band_table(widths, bands, "cpu"))
    keep = torch.arange(f["byte"].shape[1])[None, :] < torch.tensor(widths)[:, None]
    byte, shift, bits, scale_at = (f[k][keep].long() for k in ("byte", "shift", "bits", "scale_at"))
    total = sum(row_bytes(h) for h in bands)
    band_dims, levels, scales, band = [], [], [], torch.zeros(len(byte), dtype=torch.long)
    first = 0  # the head's first dim in the packed row
    for width, head in zip(widths, bands, strict=True):
        for b in (b for b in head if b.scaled):
            dims = list(range(first + b.start, first + b.start + b.size))
            band[dims] = len(band_dims)
            band_dims.append(dims)
            levels.append(2.0 ** (b.bits - 1) - 0.5)
            scales.append(int(scale_at[dims[0]]))
        first += width
    widest = max((len(d) for d in band_dims), default=1)
    padded = [d + [len(byte)] * (widest - len(d)) for d in band_dims] or [[len(byte)]]
    quantized = (bits > 0) & (bits < 16)
    t = {"band_dims": torch.tensor(padded), "levels": torch.tensor(levels or [1.0]),
         "scale_at": torch.tensor(scales or [0]), "band": band,
         "half": torch.where(quantized, 2.0 ** (bits.clamp(min=1) - 1).float(), 0.0),
         "top": torch.where(quantized, 2.0 ** bits.float() - 1, 0.0), "shift": shift.int(), "lo": byte,
         "hi": (byte + 1).clamp(max=total - 1), "quantized": quantized, "f16": bits == 16}
    return WriterTables(**{k: v.to(device) for k, v in t.items()}, row_bytes=total)


def _encode(x, band_dims, levels, scale_at, band, half, top, shift, lo, hi, quantized, f16, scales, n_bytes: int):
    x = x.float()
    padded = torch.cat([x.abs(), x.new_zeros(x.shape[0], 1)], -1)  # dim D reads 0: the bands' padding
    ideal = (padded[:, band_dims].amax(-1) / levels).clamp_min(1e-30)  # [N, B], as bands.quantize
    covering = torch.bucketize(ideal, scales).clamp(max=255)  # the smallest log8 byte whose scale is ≥ ideal

    def error(c):  # [N, B] log8 bytes -> [N, B]: each band's squared error at them (bands._fit_log8)
        s = scales[c][:, band]  # [N, D]
        q = torch.floor(x / s + half).clamp(min=0.0).minimum(top)
        err = ((q + 0.5 - half) * s - x).double().square()  # [N, D]; each band sums its own dims below
        return torch.cat([err, err.new_zeros(err.shape[0], 1)], -1)[:, band_dims].sum(-1)

    c, best = covering, error(covering)
    for k in range(1, FIT_STEPS + 1):  # the fitted scale, as bands.quantize: the least squared error, first on a tie
        tried = (covering - k).clamp(min=0)
        err = error(tried)
        c, best = torch.where(err < best, tried, c), torch.minimum(err, best)
    s = scales[c][:, band]  # [N, D]
    q = torch.floor(x / s + half).clamp(min=0.0).minimum(top)
    half_bits = x.to(torch.float16).view(torch.int16).int() & 0xFFFF
    word = torch.where(quantized, q.int() << shift, torch.where(f16, half_bits, 0))
    out = x.new_zeros(x.shape[0], n_bytes, dtype=torch.int32)
    out.index_add_(1, lo, word & 0xFF).index_add_(1, hi, word >> 8)
    out.index_add_(1, scale_at, c.int())
    return out.to(torch.uint8)


def encode_rows(x: torch.Tensor, widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...]) -> torch.Tensor:
    """x [..., Σ_g widths[g]] (heads packed at their widths) -> [..., Σ_g row_bytes(bands[g])] uint8: exactly
    bands.encode_heads' bytes."""
    widths, bands = tuple(widths), tuple(tuple(h) for h in bands)
    if x.device.type == "cpu" and x.numel() and cpu_bits.library() is not None:  # the C encoder (cpu_bits.c)
        return cpu_bits.encode_rows_c(x, widths, bands)
    if x.device.type == "cuda":  # one Triton launch, not the ~125 small ops below (on a GPU each a launch)
        from kvfold_runtime.kernels import triton_encode

        return triton_encode.encode_rows_triton(x, widths, bands)
    w = writer_tables(tuple(widths), tuple(tuple(h) for h in bands), str(x.device))
    if w is None or x.numel() == 0:
        return encode_heads(x, widths, bands)
    flat = x.reshape(-1, x.shape[-1])
    rows = _run(_encode, flat, w.band_dims, w.levels, w.scale_at, w.band, w.half, w.top, w.shift, w.lo, w.hi,
                w.quantized, w.f16, log8_scales(str(x.device)), w.row_bytes, cpu=x.device.type == "cpu")
    return rows.view(*x.shape[:-1], w.row_bytes)
