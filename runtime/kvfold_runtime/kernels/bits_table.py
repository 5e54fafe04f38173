"""Where every kept dim of a bits-format cache row lives: the small int32 tables the Triton bits kernels
(triton_bits.py) read to dequantize codes in registers.

The row layout is kvfold_runtime.bands' (`encode_heads`): per KV head its bands' codes (byte-aligned per band,
little-endian bit stream, first dim in the lowest bits), then one scale per quantized band; the heads' rows one
after another. Every code sits inside a 16-bit little-endian window starting at one byte: a band starts
byte-aligned, so a b-bit code (b ≤ 8) begins at bit (i·b) mod 8 ≤ 7 of its byte and ends by bit 15, and a 16-bit
band's value (float16) is byte-aligned. So per kept dim c of head g the table holds two int32 words, packed so
that a kernel keeps few registers alive (it unpacks the fields with shifts and masks where it uses them):

  CODE   byte << 8 | shift << 5 | bits
           byte   offset of the window within the side's (keys' or values') row
           shift  the code's first bit within the window (0 for 16-bit)
           bits   the code's width; 16 = the window is a float16 value; 0 = no band holds the dim (reads as 0)
  SCALE  scale_at << 2 | kind
           scale_at  offset of its band's scale within the row (0 when kind is 0)
           kind      0 none (16-bit), 1 log8 (one byte c, s = 2^((c − 128)/8)), 2 float16 (two bytes, little-endian)

laid out [G, 2, width] with width a power of two ≥ 16 (the kernels' tile, triton_common.tile), dims past a head's
d[g] being 0 (bits 0). Tables are built once per layer and device (cached), so a serving step builds nothing.
"""

from __future__ import annotations

import functools

import torch

from kvfold_runtime.bands import Band
from kvfold_runtime.format import LayerDims
from kvfold_runtime.kernels.triton_common import tile

__all__ = ["CODE", "SCALE", "SCALE_KINDS", "band_table", "layer_tables", "unpack"]

CODE, SCALE = 0, 1  # the two words per dim
SCALE_KINDS = {"log8": 1, "float16": 2}  # the scale kinds' codes (0: no scale)
MAX_ROW = 1 << 23  # bytes a row may have: byte << 8 stays within an int32


def _rows(widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...], width: int) -> list[list[list[int]]]:
    """The table as nested lists [G][2][width] (see the module docstring)."""
    table, at = [], 0  # `at`: the current head's first byte within the row
    for d, head in zip(widths, bands, strict=True):
        code, scale = [0] * width, [0] * width
        code_at = at
        scale_at = at + sum(b.code_bytes for b in head)  # the scales follow all of the head's codes
        for band in head:
            if band.start + band.size > d:
                raise ValueError(f"a band covers dims {band.start}…{band.start + band.size - 1} of a head of width "
                                 f"{d}: the layer's bands do not match its widths; re-export the model")
            for i in range(band.size):
                c, bit = band.start + i, i * band.bits
                code[c] = (code_at + bit // 8) << 8 | (bit % 8) << 5 | band.bits
                if band.scaled:
                    scale[c] = scale_at << 2 | SCALE_KINDS[band.scale]
            code_at += band.code_bytes
            scale_at += band.scale_bytes
        table.append([code, scale])
        at = scale_at
    if at > MAX_ROW:
        raise ValueError(f"a cache row of {at} bytes is more than the bits kernels address ({MAX_ROW})")
    return table


@functools.lru_cache(maxsize=256)
def _band_table(widths: tuple[int, ...], bands: tuple[tuple[Band, ...], ...], width: int,
                device: str) -> torch.Tensor:
    return torch.tensor(_rows(widths, bands, width), dtype=torch.int32, device=device)


def band_table(widths, bands, device, width: int | None = None) -> torch.Tensor:
    """[G, 2, width] int32: where each kept dim of each head's row sits (module docstring), for heads of
    `widths` stored in `bands` (per head, kvfold_runtime.bands). width: default the tile of the widest head."""
    widths = tuple(int(w) for w in widths)
    width = tile(max(widths)) if width is None else int(width)
    return _band_table(widths, tuple(tuple(h) for h in bands), width, str(torch.device(device)))


def layer_tables(dims: LayerDims, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys' and the values' tables of a bits-format layer (cached per layer and device)."""
    if not dims.banded:
        raise ValueError("the bits kernels read bits-format caches; this layer stores its keys as they are "
                         "(use decode_attention / prefill_attention)")
    return band_table(dims.d_k, dims.k_bands, device), band_table(dims.d_v, dims.v_bands, device)


def unpack(table: torch.Tensor) -> dict[str, torch.Tensor]:
    """The fields of a table, each [G, width]: byte, shift, bits, scale_at, kind (as the kernels unpack them)."""
    code, scale = table[:, CODE], table[:, SCALE]
    return {"byte": code >> 8, "shift": (code >> 5) & 7, "bits": code & 31, "scale_at": scale >> 2, "kind": scale & 3}
