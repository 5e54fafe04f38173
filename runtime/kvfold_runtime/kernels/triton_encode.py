"""A bits layer's step written on a GPU in a few launches: its band codes (bands.encode_heads' bytes exactly) in one
launch (keys and values together for the page layout), where the table-driven torch writer (torch_bits._encode) is
~125 small ops a side, each a launch on a GPU (~250 a layer's decode step, more time than the step's attention at
small batches); and, for the GPU page layout
(kvfold_runtime.pages), those rows scattered into their slots' pages in one more; any other cache's rows (a rank
layer's numbers, a windowed layer's codes) copied to their slots in one. Padding slots (−1) are skipped inside the
kernels: a boolean mask would make the host wait for the GPU at every layer.

The writer, one program a token and head: each quantized band's absmax, its covering log8 byte (the smallest of the
256 scales ≥ absmax / (2^(b−1) − ½)), the fitted byte (bands.FIT_STEPS bytes below it tried, each band's squared
error summed in float64; the least wins, the covering one on a tie), each dim's code shifted into its 16-bit window
(or its float16 bits), added into the row's bytes (codes never share a bit: adding is OR). The arithmetic is
torch's step for step: x / s rounded (div_rn), the reconstruction's product rounded before the difference (on CUDA
`mul.rn`, which the compiler may not fuse into an FMA), so the bytes are the same.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from kvfold_runtime.bands import FIT_STEPS, Band, log8_scales
from kvfold_runtime.format import LayerDims
from kvfold_runtime.kernels.torch_bits import writer_tables
from kvfold_runtime.pages import PageLayout

__all__ = ["copy_rows", "encode_rows_triton", "write_pages"]


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
def _encode_kernel(x_ptr, stride_x, y_ptr, stride_y, split, out_ptr, stride_out, heads_ptr, band_ptr, kind_ptr,
                   half_ptr, top_ptr, shift_ptr, lo_ptr, hi_ptr, levels_ptr, scale_at_ptr, scales_ptr,
                   FIT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr):
    """Program (t, g): token t's head g (heads [G, 4]: its first dim, width, first band, band count). The dims are
    x's columns, then from `split` on y's (a layer's keys and values in one launch)."""
    t, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    first, width = tl.load(heads_ptr + 4 * g), tl.load(heads_ptr + 4 * g + 1)
    first_band, num_bands = tl.load(heads_ptr + 4 * g + 2), tl.load(heads_ptr + 4 * g + 3)
    live = tl.arange(0, BLOCK_D) < width
    d = first + tl.arange(0, BLOCK_D)
    if first >= split:  # a head of y's (a head's dims lie in one of the two)
        x = tl.load(y_ptr + t * stride_y + (d - split), mask=live, other=0.0).to(tl.float32)
    else:
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
    row = out_ptr + t * stride_out
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
    w = writer_tables(widths, bands, device)
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
    out = torch.zeros(flat.shape[0], t["row_bytes"], dtype=torch.int32, device=x.device)
    _encode_into(flat, t, out)
    return out.to(torch.uint8).view(*x.shape[:-1], t["row_bytes"])


def _encode_into(flat: torch.Tensor, t: dict, out: torch.Tensor, then: torch.Tensor | None = None) -> None:
    """Add the codes of rows flat [N, D] (then, where given, of `then` [N, D′]: its columns follow flat's in the
    tables) into out [N, ≥ row bytes] int32 (zeros where they go), in one launch."""
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    if then is None:
        then = flat
    elif then.stride(-1) != 1:
        then = then.contiguous()
    _encode_kernel[(flat.shape[0], t["heads"].shape[0])](
        flat, flat.stride(0), then, then.stride(0), flat.shape[1] if then is not flat else 1 << 30, out,
        out.stride(0), t["heads"], t["band"], t["kind"], t["half"], t["top"], t["shift"], t["lo"], t["hi"],
        t["levels"], t["scale_at"], t["scales"], FIT=FIT_STEPS, BLOCK_D=triton.next_power_of_2(t["widest"]),
        BLOCK_B=triton.next_power_of_2(max(1, t["most_bands"])))


@triton.jit
def _scatter_kernel(rows_ptr, stride_rows, slots_ptr, cache_ptr, src_ptr, dest_ptr, row_bytes, page_bytes,
                    PAGE: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (n, c): token n's page bytes c·BLOCK_C … from its row (int32 bytes): each page byte's 8 bits
    gathered from the row bits `src` [C, 8] names, stored where `dest` [5, C] puts it in the token's page
    (PageLayout.token_maps). A padding slot (−1) writes nothing."""
    n, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    if slot >= 0:
        j = c * BLOCK_C + tl.arange(0, BLOCK_C)
        live = j < row_bytes
        byte = tl.zeros([BLOCK_C], tl.int32)
        for b in tl.static_range(8):
            bit = tl.load(src_ptr + j * 8 + b, mask=live, other=0)
            byte |= ((tl.load(rows_ptr + n * stride_rows + bit // 8, mask=live, other=0) >> (bit % 8)) & 1) << b
        at = slot % PAGE
        tokens = tl.load(dest_ptr + 4 * row_bytes + j, mask=live, other=1)
        place = (tl.load(dest_ptr + j, mask=live, other=0) + (at // tokens) * tl.load(dest_ptr + row_bytes + j,
                 mask=live, other=0) + (at % tokens) * tl.load(dest_ptr + 2 * row_bytes + j, mask=live, other=0)
                 + tl.load(dest_ptr + 3 * row_bytes + j, mask=live, other=0))
        tl.store(cache_ptr + (slot // PAGE) * page_bytes + place, byte.to(tl.uint8), mask=live)


@functools.lru_cache(maxsize=256)
def _layer_tables(dims: LayerDims, device: str) -> dict | None:
    """A layer's writer tables, its value heads after its key heads (a row is the keys' bytes, then the values'),
    keyed by its LayerDims (hashed once per process): a decode step writes every layer."""
    return _tables(tuple(dims.d_k) + tuple(dims.d_v), tuple(dims.k_bands) + tuple(dims.v_bands), device)


def write_pages(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PageLayout) -> None:
    """The GPU page layout's write of a step (kernels.write_paged's contract for BandPages): keys k [N, Σ d_k] and
    values v [N, Σ d_v] encoded (bands.encode_heads' bytes) and scattered into their slots' pages of `cache`
    [num_blocks, …, P · C bytes] — a zeroed buffer and two launches, no read back to the host (a padding slot, −1, is
    skipped inside the kernel)."""
    tables = _layer_tables(layout.dims, str(k.device))
    assert tables is not None and tables["row_bytes"] == layout.row_bytes, "the page layout's bands: log8 scales"
    n = slots.shape[0]
    if n == 0:
        return
    rows = torch.zeros(n, layout.row_bytes, dtype=torch.int32, device=k.device)
    _encode_into(k.reshape(n, -1), tables, rows, then=v.reshape(n, -1))
    src, dest = layout.token_maps(k.device)
    block_c = min(512, triton.next_power_of_2(layout.row_bytes))
    _scatter_kernel[(n, triton.cdiv(layout.row_bytes, block_c))](
        rows, rows.stride(0), slots, cache.view(-1), src, dest, layout.row_bytes, layout.page * layout.row_bytes,
        PAGE=layout.page, BLOCK_C=block_c)


@triton.jit
def _copy_kernel(rows_ptr, slots_ptr, cache_ptr, block_stride, row_bytes, BS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (n, c): bytes c·BLOCK … of token n's row to its slot's row (block slot // BS, row slot mod BS, rows
    of a block contiguous, blocks block_stride bytes apart). A padding slot (−1) writes nothing."""
    n, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    if slot >= 0:
        j = c * BLOCK + tl.arange(0, BLOCK)
        live = j < row_bytes
        at = cache_ptr + (slot // BS) * block_stride + (slot % BS) * row_bytes
        tl.store(at + j, tl.load(rows_ptr + n * row_bytes + j, mask=live), mask=live)


def copy_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """kernels.write_paged's store for a cache of rows (not pages): rows [N, C] in the cache's dtype to `slots` of
    `cache` [num_blocks, …, BS, C] (a block's rows contiguous; blocks may lie further apart, as in vLLM's
    block-outer layouts), in one launch."""
    n = slots.shape[0]
    if n == 0:
        return
    blocks = cache.view(cache.shape[0], -1, cache.shape[-1])  # [num_blocks, BS, C]: a view (a block's rows contiguous)
    assert blocks.stride(-1) == 1 and blocks.stride(1) == blocks.shape[-1] and rows.dtype == cache.dtype
    size = cache.element_size()
    row_bytes = cache.shape[-1] * size
    source = rows.reshape(n, -1).contiguous().view(torch.uint8)
    block = min(1024, triton.next_power_of_2(row_bytes))
    _copy_kernel[(n, triton.cdiv(row_bytes, block))](
        source, slots, blocks.view(torch.uint8), blocks.stride(0) * size, row_bytes, BS=blocks.shape[1], BLOCK=block)
