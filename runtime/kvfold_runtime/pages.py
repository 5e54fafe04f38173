"""The GPU page layout of a bits-format cache: a page of P tokens holds exactly the bytes of their P rows
(kvfold_runtime.bands' `encode_heads` rows, keys then values), rearranged so that a GPU reads each band's codes
with wide contiguous loads and unpacks them with shifts and masks.

It applies to a layer whose bands are *aligned*: every band of 2..8 or 16 bits starts and ends on a multiple of a
chunk of n = 16 or 8 dims (the layer's `chunk`: 16 where every band allows it), its scale is log8 (one byte), and
so every head's width is a multiple of n too. The dims of a head then fall into chunks of n dims of one width b
each, and a b-bit chunk is stored as one or two *planes* (PLANES): the low p₁ bits of its n codes, then (3, 5 and 6
bits) their high p₂ bits. Dims pair up: dims 2k and 2k + 1 sit in the two 16-bit lanes of a 32-bit word, so one
32-bit operation works on two numbers, and a lane holds L = n/2 · p bits of a token's plane entry (n·p/8 bytes):
  - L ≥ 16: the token's entry is L/16 words, pair k in word k // (16/p) at bits 16h + p·(k mod 16/p) of lane h
    (a 4-bit plane of 16 dims: two words of 8 codes each);
  - L = 8 or 4 (1-bit planes of 16 dims, 2- and 1-bit planes of 8 dims): 16/L tokens share a word, token t's
    bytes at byte t mod (16/L) of each lane (L = 8: its lane-h byte at byte 2h + t mod 2) or, L = 4, its one byte
    at byte t mod 4, lane 0's bits in its low nibble and lane 1's in its high one; pair k at bit p·k of the lane.
A 16-bit chunk's plane holds its n float16 values, dim 2w + h in lane h of word w.

A page, per side (keys, then values), per KV head in order:

    chunk 0's planes | chunk 1's planes | …          each plane [P tokens × n·p/8 bytes], token-major
    band 0's scales | band 1's scales | …            each [P tokens × 1 byte]; 16-bit bands have none

Every region starts at a multiple of 16 bytes when P is a multiple of 16 (PAGE_MULTIPLE), so its loads can be
16-byte aligned. The codes, scales and bytes per token are those of the rows, so a page is P × row_bytes bytes and
vLLM's block accounting is unchanged; only the order of the bits differs. `PageLayout` owns the mapping: the byte
map between P rows and a page (every page byte holds bits of one token only: plane entries are whole bytes), the
per-chunk table and the kinds of head (each chunk's width and offsets, compile-time constants) the Triton kernels
read (kernels/triton_pages.py), and torch conversions both ways.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvfold_runtime.bands import Band
from kvfold_runtime.format import LayerDims

__all__ = ["CHUNKS", "PAGE_MULTIPLE", "PLANES", "PageLayout", "aligned", "chunk_of", "page_layout"]

# dims per chunk, the widest that a layer's bands allow first: 16-dim chunks make fewer, wider loads; 8-dim ones let
# a head_dim-64 head's allocation place its bands at half the granularity (issue 50: the 16-dim alignment cost
# SmolLM2 1.22x the mean KL of bands anywhere at 0.281 of fp16's bytes)
CHUNKS = (16, 8)
PAGE_MULTIPLE = 16  # tokens per page must be a multiple of it (16-byte aligned regions)
PLANES = {2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 8: (8,), 16: (16,)}  # a width's planes, low bits first
TABLE_FIELDS = 3  # per (side, head, chunk): width (0: no dims), first plane's offset, its band's scale offset


def chunk_of(dims: LayerDims) -> int | None:
    """The layer's chunk (module docstring): the widest of CHUNKS its bands are aligned to, None if none fits (or
    the layer is not banded, or a band's scale is not log8)."""
    if not dims.banded:
        return None
    bands = [b for head in (*dims.k_bands, *dims.v_bands) for b in head]
    if not all(b.bits == 16 or b.scale == "log8" for b in bands):
        return None
    return next((n for n in CHUNKS if all(b.start % n == 0 and b.size % n == 0 for b in bands)), None)


def aligned(dims: LayerDims) -> bool:
    """Whether a layer's bands fit the page layout (module docstring)."""
    return chunk_of(dims) is not None


def lane_bits(n: int, p: int) -> int:
    """L: the bits of a token's p-bit plane entry in each 16-bit lane, for chunks of n dims."""
    return n // 2 * p


def _entry_bit(n: int, p: int, bit: int) -> tuple[int, int]:
    """(dim of the chunk, bit of its code's p-bit field) that bit `bit` of one token's p-bit plane entry holds, for
    chunks of n dims (module docstring: dim 2k + h in lane h; L ≥ 16: pair k in word k // (16/p) at bits
    16h + p·(k mod 16/p); L < 16: the entry's first L bits are lane 0's, the next L lane 1's, pair k at bit p·k)."""
    lane = lane_bits(n, p)
    if lane < 16:
        h, at = divmod(bit, lane)
        k, field_bit = divmod(at, p)
        return 2 * k + h, field_bit
    word, lane_bit = divmod(bit, 32)
    h, at = divmod(lane_bit, 16)
    f, field_bit = divmod(at, p)
    return 2 * (word * (16 // p) + f) + h, field_bit


def _entry_bytes(n: int, p: int, page_at: int) -> list[tuple[int, int, int, int, int]]:
    """Where byte j of token t's p-bit plane entry lies, per j: (region, group, one, within, tokens) for the byte
    region + (t // tokens)·group + (t mod tokens)·one + within (module docstring)."""
    lane, size = lane_bits(n, p), n * p // 8
    if lane >= 16:
        return [(page_at, size, 0, j, 1) for j in range(size)]
    share = 16 // lane  # tokens per word: the lane-h byte of token t at byte share·h + t mod share (L = 8), or t mod 4
    return [(page_at, 4, 1, share * j, share) for j in range(size)]


def _head_chunks(bands: tuple[Band, ...], n: int) -> list[tuple[int, int]]:
    """(width, band index among the head's scaled bands, or −1) per chunk of n dims, in dim order."""
    out, scaled = [], 0
    for band in bands:
        out += [(band.bits, scaled if band.scaled else -1)] * (band.size // n)
        scaled += band.scaled
    return out


@dataclass(frozen=True)
class PageLayout:
    """Where each byte of P token rows goes in a page (module docstring), for one aligned layer."""

    dims: LayerDims
    page: int  # tokens per page (vLLM's block size)

    def __post_init__(self):
        if not aligned(self.dims):
            raise ValueError("the page layout needs bands aligned to 8 or 16 dims with log8 scales; this export's are "
                             "not: re-export with kvfold's aligned allocation (the default), or use the row kernels")
        if self.page % PAGE_MULTIPLE:
            raise ValueError(f"a page of {self.page} tokens: the bits page layout needs a multiple of {PAGE_MULTIPLE}")

    @functools.cached_property
    def row_bytes(self) -> int:
        return sum(self.dims.row_bytes())

    @functools.cached_property  # read on every kernel launch: computed once
    def chunk(self) -> int:
        """Dims per chunk (chunk_of)."""
        return chunk_of(self.dims)

    @functools.cached_property  # read on every kernel launch: computed once
    def chunks(self) -> int:
        """Chunks per head in the kernels' tables: the widest head's."""
        return max(max(self.dims.d_k), max(self.dims.d_v)) // self.chunk

    @functools.cached_property  # read on every kernel launch: computed once
    def tile_chunks(self) -> int:
        """Chunks per head in the kernels' tiles: a power of two."""
        return 1 << (self.chunks - 1).bit_length()

    def kinds(self) -> tuple[tuple, tuple[int, ...]]:
        """The layer's kinds of head, the kernels' constexprs, and each KV head's kind. A kind is, for keys then
        values, three tuples over the tile's chunks: each chunk's width (0 past the head's dims), where its first
        plane lies and where its band's scale bytes lie (0 where it has none), both in units of P bytes from the
        head's first plane (`table`'s chunk-0 offset): a head's regions follow one another in an order its widths
        fix, so the kernels address every region but the head's first at a compile-time offset."""
        return self._kinds

    @functools.cached_property  # read on every kernel launch (~0.8 ms a call to build here): built once
    def _kinds(self) -> tuple[tuple, tuple[int, ...]]:
        def side(bands):
            chunks = _head_chunks(bands, self.chunk)
            planes = [0]
            for width, _ in chunks:
                planes.append(planes[-1] + self.chunk * width // 8)  # a chunk's planes: P · n·b/8 bytes
            scales = [planes[-1] + band if band >= 0 else 0 for _, band in chunks]
            pad = [0] * (self.tile_chunks - len(chunks))
            return tuple([w for w, _ in chunks] + pad), tuple(planes[:-1] + pad), tuple(scales + pad)

        per_head = [side(k) + side(v) for k, v in zip(self.dims.k_bands, self.dims.v_bands, strict=True)]
        kinds = tuple(dict.fromkeys(per_head))
        return kinds, tuple(kinds.index(h) for h in per_head)

    def head_kinds(self, device) -> torch.Tensor:
        """int32 [G]: each KV head's kind (`kinds`)."""
        return _head_kinds(self, str(torch.device(device)))

    @functools.cached_property
    def _maps(self) -> tuple[list[list[int]], list[tuple[int, int, int, int]], list[list[list[int]]]]:
        """(source bits of each page byte of a token [C][8] as row bit indices; where each page byte of token t lies,
        (region, group, one, within, tokens) per page byte [C] (_entry_bytes); the kernels' table
        [2][G][TABLE_FIELDS * chunks])."""
        n = self.chunk
        src, dest, table = [], [], []
        row_at = page_at = 0  # the side's first byte in a row; the region being laid out in the page
        for side_bands in (self.dims.k_bands, self.dims.v_bands):
            side_table = []
            for head in side_bands:
                code_bytes = sum(b.code_bytes for b in head)
                chunk_row_at = row_at  # a chunk's codes: n·b/8 contiguous bytes of the row (aligned bands)
                fields = [0] * (TABLE_FIELDS * self.chunks)
                for c, (bits, _) in enumerate(_head_chunks(head, n)):
                    fields[c], fields[self.chunks + c] = bits, page_at
                    low = 0  # the code's bits this plane holds start here
                    for p in PLANES[bits]:
                        for byte in range(n * p // 8):  # one token's entry in this plane
                            src.append([chunk_row_at * 8 + dim * bits + low + bit
                                        for dim, bit in (_entry_bit(n, p, byte * 8 + k) for k in range(8))])
                        dest += _entry_bytes(n, p, page_at)
                        page_at += self.page * n * p // 8
                        low += p
                    chunk_row_at += n * bits // 8
                scale_row_at = row_at + code_bytes
                scale_regions = []
                for j in range(sum(b.scaled for b in head)):
                    src.append([(scale_row_at + j) * 8 + k for k in range(8)])
                    dest.append((page_at, 1, 0, 0, 1))
                    scale_regions.append(page_at)
                    page_at += self.page
                for band, region in enumerate(scale_regions):
                    fields[2 * self.chunks + band] = region
                side_table.append(fields)
                row_at = scale_row_at + len(scale_regions)
            table.append(side_table)
        assert row_at == self.row_bytes and page_at == self.page * self.row_bytes
        return src, dest, table

    def table(self, device) -> torch.Tensor:
        """int32 [2, G, TABLE_FIELDS, tile_chunks]: per side (keys, values) and KV head, each chunk's width (0: the
        head has no such chunk), each chunk's first plane's byte offset in the page (a second plane follows at
        + P·n·p₁/8), and each scaled band's scale region's offset. Every offset is a multiple of 16 bytes. The
        Triton kernels read a head's chunk-0 offset (its first plane) and take the rest from `kinds`, whose
        offsets are this table's (tests/runtime/test_triton_pages.py checks both)."""
        return _table(self, str(torch.device(device)))

    def to_page(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., P, C] uint8 (P token rows) -> [..., P · C] uint8: their page."""
        src_bits, page_byte = _torch_maps(self, str(rows.device))[:2]
        bits = _bits(rows).flatten(-3)[..., src_bits]  # [..., P, C, 8]: each page byte's bits, token by token
        out = rows.new_zeros(*rows.shape[:-2], self.page * self.row_bytes)
        out[..., page_byte] = _pack(bits).flatten(-2)
        return out

    def to_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """The inverse of `to_page`: [..., P · C] -> [..., P, C]."""
        _, page_byte, inverse = _torch_maps(self, str(pages.device))[:3]
        bits = _bits(pages[..., page_byte]).flatten(-2)[..., inverse]  # the rows' bits in row order
        return _pack(bits.unflatten(-1, (self.page, self.row_bytes, 8)))

    def slot_bytes(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [N] (block · P + position in block) -> [N, C] int64: the byte of the paged cache (flattened) that
        each of a token's C page bytes goes to, in the order `row_page_bytes` gives them."""
        region, group, one, within, tokens = _torch_maps(self, str(slots.device))[3]
        block, at = slots.long().div(self.page, rounding_mode="floor"), slots.long()[:, None] % self.page
        return (block[:, None] * (self.page * self.row_bytes) + region + (at // tokens) * group + (at % tokens) * one
                + within)

    def row_page_bytes(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [N, C] -> [N, C]: each token's bytes as its page holds them (scattered to `slot_bytes`)."""
        one_token = _torch_maps(self, str(rows.device))[0][0]  # [C, 8] the row bits of a token's page bytes
        return _pack(_bits(rows).flatten(-2)[..., one_token])

    def token_maps(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """What a kernel writing one token's page bytes reads: (int32 [C, 8], the bit of the token's row that each
        bit of its page byte j holds; int32 [5, C], where page byte j lies, as `slot_bytes` places it: region, group,
        one, within, tokens)."""
        return _token_maps(self, str(torch.device(device)))

    def write(self, cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store token rows [N, C] at `slots` (block · P + place in the block, as vLLM's slot mapping) of a paged cache
        [num_blocks, …, P · C bytes] (any view that flattens)."""
        cache.view(-1)[self.slot_bytes(slots).flatten()] = self.row_page_bytes(rows).flatten()


@functools.lru_cache(maxsize=256)
def page_layout(dims: LayerDims, page: int) -> PageLayout:
    """The (cached) layout of one layer's pages of `page` tokens."""
    return PageLayout(dims, page)


@functools.lru_cache(maxsize=256)
def _table(layout: PageLayout, device: str) -> torch.Tensor:
    table = torch.tensor(layout._maps[2], dtype=torch.int32)  # [2, G, TABLE_FIELDS * chunks]
    table = table.unflatten(-1, (TABLE_FIELDS, layout.chunks))
    return torch.nn.functional.pad(table, (0, layout.tile_chunks - layout.chunks)).contiguous().to(device)


@functools.lru_cache(maxsize=256)
def _head_kinds(layout: PageLayout, device: str) -> torch.Tensor:
    return torch.tensor(layout.kinds()[1], dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=256)
def _token_maps(layout: PageLayout, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    src_bits, _, _, where = _torch_maps(layout, device)
    return src_bits[0].int().contiguous(), torch.stack(where).int().contiguous()


def _bits(x: torch.Tensor) -> torch.Tensor:
    """uint8 [...] -> [..., 8] its bits, least significant first."""
    return (x[..., None] >> torch.arange(8, device=x.device, dtype=torch.uint8)) & 1


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """[..., 8] bits -> uint8 [...]."""
    return (bits << torch.arange(8, device=bits.device, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


@functools.lru_cache(maxsize=256)
def _torch_maps(layout: PageLayout, device: str):
    """`_maps` as index tensors on `device`: (src_bits [P, C, 8], the bit of the flattened P rows that each bit of
    token t's page byte j holds; page_byte [P·C], the page offset of (t, j); inverse [P·C·8], where each row bit
    lands among the (t, j, bit) page bits; (region, group, one, within, tokens) [C] of a token's page bytes)."""
    src, dest, _ = layout._maps
    p, c = layout.page, layout.row_bytes
    first = torch.tensor(src, dtype=torch.long)  # [C, 8]
    where = [torch.tensor(col, dtype=torch.long) for col in zip(*dest, strict=True)]
    region, group, one, within, share = where
    t = torch.arange(p)[:, None]
    page_byte = (region + (t // share) * group + (t % share) * one + within).flatten()
    src_bits = torch.arange(p)[:, None, None] * c * 8 + first[None]
    inverse = torch.empty(p * c * 8, dtype=torch.long)
    inverse[src_bits.flatten()] = torch.arange(p * c * 8)
    return (*(x.to(device) for x in (src_bits, page_byte, inverse)), tuple(x.to(device) for x in where))
