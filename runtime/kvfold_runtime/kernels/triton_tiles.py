"""The page kernel's tiles (triton_pages, heads over 64 dims) made in the registers where the warpgroup MMA reads its
first operand: the keys' never pass through shared memory, the values' (their product takes them transposed) once,
in matrix stores.

An H200 profile of the page decode found its L1 the busiest unit (89%, DRAM 14%): both unpacked [BLOCK_N, head_dim]
tiles were stored to shared memory and loaded again for the tensor cores, 4.31 bytes a number (kvfold-bench kernels
--aot sm_90: shared bytes a number) where 4-bit codes are 0.5; and 2- and 3-bit value chunks, whose fields Triton
re-laid through shared memory 16 bits at a time, cost ~12 instructions a number. The MMA's first operand, in
registers, gives a thread of warp w the rows 16w + t and 16w + 8 + t (t = lane // 4) and, of every 8 columns, the
pair 2g, 2g + 1 (g = lane mod 4). Here every tensor carries those axes as [2 (row + 8), BLOCK_N/16 (warp), 8 (t),
4 (g), J] (J = CH/8 column octets of a chunk): pair k = 4j + g of a chunk is what lane g unpacks, from the word of
its token's plane entry that holds it (the four lanes of a row load the same bytes, which the L1 serves once), so
the layout Triton propagates back from the dot is the loads' own and no conversion is emitted. The values are
triton_unpack's (the same fields, magic numbers and scales): the tiles equal the staged path's number for number.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvfold_runtime.kernels.triton_unpack import field

__all__ = ["mma_tile", "tile_rows"]


@triton.jit
def tile_rows(cache_ptr, table_ptr, r, stride_table, page_bytes, start, hi, PAGE: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """The block [start, start + BLOCK_N)'s rows in the MMA's axes: (each row's page, uint8 pointer
    [1, BLOCK_N/16, 1, 1, 1]; its place in the page [2, BLOCK_N/16, 8, 1, 1]; whether the request has it). Rows
    16a … 16a + 15 lie in one page (pages hold a multiple of 16 tokens); a page past the request's end reads as
    page 0 (any page will do: its rows are masked)."""
    group = start // 16 + tl.arange(0, BLOCK_N // 16)  # each 16 rows' group of 16 tokens
    first = group * 16
    page = tl.load(table_ptr + r.to(tl.int64) * stride_table + first // PAGE, mask=first < hi, other=0)
    at = (cache_ptr + page.to(tl.int64) * page_bytes)[None, :, None, None, None]
    row = (tl.arange(0, 2) * 8)[:, None, None, None, None] + tl.arange(0, 8)[None, None, :, None, None]
    # the place in the page as a multiple of 16 plus the row (0..15), so that the compiler sees a token's word of
    # shared entries and its byte in it (tok // 4, tok % 4) as the row's, constants after unrolling
    tok = ((group % (PAGE // 16)) * 16)[None, :, None, None, None] + row
    return at, tok, (first[None, :, None, None, None] + row) < hi


@triton.jit
def _words(at, tok, g, j, P: tl.constexpr, CH: tl.constexpr):
    """The word of each token's P-bit plane entry (at: the plane's first byte in the row's page; pages.py's lanes)
    that holds pair k = 4j + g (g [1, 1, 1, 4, 1], j [1, 1, 1, 1, J]), or, where tokens share a word (entries under 4
    bytes), that word shifted so that the token's fields lie at bits P·k of each lane (triton_unpack.plane_words):
    [2, A, 8, 4, J or 1] int32. Every load carries the lane axis g (the four lanes of a row load the same bytes) and
    the octet axis j only where the words differ along it, as a contiguous pair, so that the compiler lays the load
    out as the MMA's registers: a load that varied along j by a stride would get lanes along j, and a conversion."""
    E: tl.constexpr = CH * P // 8
    if E >= 8 and P == 4:  # two words a 16-dim entry, pair k in word k // 4 = j: one 64-bit load a row
        return tl.load((at + tok * E).to(tl.pointer_type(tl.int32), bitcast=True) + j + 0 * g)
    elif P == 8:  # pair k in word k // 2 = 2j + g // 2 (16 dims) or g // 2 (8): words 2j, 2j + 1 as one 64-bit load
        w = tl.load((at + tok * E).to(tl.pointer_type(tl.int64), bitcast=True) + j + 0 * g)
        return (w >> (32 * (g // 2))).to(tl.int32)
    elif E >= 4:  # one word a token holds every pair
        return tl.load((at + tok * E).to(tl.pointer_type(tl.int32), bitcast=True) + 0 * g)
    else:
        SHARE: tl.constexpr = 4 // E
        x = tl.load((at + (tok // SHARE) * 4).to(tl.pointer_type(tl.int32), bitcast=True) + 0 * g)
        x = x >> ((tok % SHARE) * 8)
        if E == 1:  # one byte a token: lane 0's bits in its low nibble, lane 1's in its high one
            x = (x & 0xF) | ((x & 0xF0) << 12)
        return x


@triton.jit
def _chunk(at, tok, valid, WIDTH: tl.constexpr, PLANE: tl.constexpr, SCALE: tl.constexpr, CH: tl.constexpr,
           PAGE: tl.constexpr, MASKED: tl.constexpr, OUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, CH]: a chunk's numbers (triton_pages._chunk's contract) in the MMA's registers."""
    J: tl.constexpr = CH // 8
    g = tl.arange(0, 4)[None, None, None, :, None]
    j = tl.arange(0, J)[None, None, None, None, :]
    k = 4 * j + g  # the pair lane g unpacks: dims 2k and 2k + 1
    if WIDTH == 0:  # (an if/else: Triton's compiler goes on past a return inside a compile-time if)
        return tl.zeros([BLOCK_N, CH], OUT)
    else:
        if WIDTH == 16:  # float16 values, pair k in word k
            w = tl.load((at + PLANE * PAGE + tok * (2 * CH)).to(tl.pointer_type(tl.int32), bitcast=True) + k)
            x = tl.join((w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True),
                        (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)).to(OUT)
            if MASKED:  # an unwritten row may hold NaN
                x = tl.where(tl.expand_dims(valid, -1), x, 0.0)
        else:
            # [2, A, 8, 4, 1]: a row's band scale byte, from the word of the scale region holding it (whole words, as
            # the code words: read as bytes, the load would take another layout and a conversion through shared memory)
            word = tl.load((at + SCALE * PAGE + (tok // 4) * 4).to(tl.pointer_type(tl.int32), bitcast=True) + 0 * g)
            byte = (word >> ((tok % 4) * 8)) & 255
            if MASKED:  # an unwritten row's scale could overflow a float16 value: 1 instead
                byte = tl.where(valid, byte, 128)
            s = tl.exp2((byte.to(tl.float32) - 128.0) * 0.125)
            HALF: tl.constexpr = (1 << (WIDTH - 1)) - 0.5
            P1: tl.constexpr = 8 if WIDTH == 8 else (4 if WIDTH >= 4 else 2)  # pages.PLANES
            P2: tl.constexpr = WIDTH - P1
            F: tl.constexpr = 16 // P1 if CH * P1 >= 32 else CH // 2  # fields a lane: of a word, or of a shared word
            words = _words(at + PLANE * PAGE, tok, g, j, P1, CH)
            hi_words = words
            if P2 > 0:
                hi_words = _words(at + PLANE * PAGE + PAGE * CH * P1 // 8, tok, g, j, P2, CH)
            x = field(words, hi_words, s, k % F, k, HALF, WIDTH, P1, P2, OUT)  # [2, A, 8, 4, J, 2]
        # row 16a + 8·(row + 8) + t, column 8j + 2g + lane: the chunk's dims in order
        return tl.reshape(tl.permute(x, (1, 0, 2, 4, 3, 5)), [BLOCK_N, CH])


@triton.jit
def mma_tile(at, tok, valid, KIND: tl.constexpr, FIRST: tl.constexpr, COUNT: tl.constexpr, NC: tl.constexpr,
             CH: tl.constexpr, PAGE: tl.constexpr, MASKED: tl.constexpr, OUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Chunks of a head of kind KIND (triton_pages._flat) side by side, the COUNT whose entries start at FIRST of the
    kind (keys: chunk c at c, values at 3·NC + c): [BLOCK_N, CH·COUNT], in the head's dim order (triton_pages._tile's
    contract)."""
    if COUNT == 1:
        return _chunk(at, tok, valid, KIND[FIRST], KIND[FIRST + NC], KIND[FIRST + 2 * NC], CH, PAGE, MASKED, OUT,
                      BLOCK_N)
    else:
        a = mma_tile(at, tok, valid, KIND, FIRST, COUNT // 2, NC, CH, PAGE, MASKED, OUT, BLOCK_N)
        b = mma_tile(at, tok, valid, KIND, FIRST + COUNT // 2, COUNT // 2, NC, CH, PAGE, MASKED, OUT, BLOCK_N)
        return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [BLOCK_N, CH * COUNT])
