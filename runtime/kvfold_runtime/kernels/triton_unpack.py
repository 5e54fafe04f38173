"""Codes to values for the page layout's Triton kernels (kvfold_runtime.pages, triton_pages): a plane's words read for
a block of tokens, and a chunk's values made from them in the query dtype.

- A p-bit plane (p = 2, 4, 8) is p/2 words a token (where tokens share a word: 1- and 2-byte entries, the token's
  field shifted into place), dims 2k and 2k + 1 in the two 16-bit lanes of one word; 3, 5 and 6 bits OR in the
  second plane's bits (1 bit: a word that two tokens share; 2 bits: a word a token).
- Half precision, codes below 2^7 (bfloat16) or 2^10 (float16): a word's two lanes are one pair of values in one
  register: mask and OR the magic number 0x4300 (0x6400) in, giving the 16-bit floats 2^7 + q (2^10 + q); a paired
  multiply-add by 1 subtracts the integer 2^7 + 2^(b−1) (exact), a paired multiply-add by the scale s adds s/2
  (rounded once): (q − 2^(b−1) + ½)·s, three instructions for two numbers, no integer-to-float conversion. On CUDA
  this is PTX (Triton lowers 16-bit arithmetic one number at a time and re-packs the pairs); in Triton's
  interpreter and on other GPUs, the same arithmetic written in Triton.
- 8-bit codes under bfloat16 queries (bfloat16's 8 bits cannot hold 2^7 + q) and every code under float32 ones go
  through float32 (_bytes_bf16, and 2^23 + q): exact before the one rounding to the query dtype.
Values come out [BLOCK_N, CH] with column j holding dim j of the chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

__all__ = ["chunk_values", "field", "plane_words", "scale_bytes"]


@triton.jit
def plane_words(base, first, AT: tl.constexpr, P: tl.constexpr, CH: tl.constexpr, SEG: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A p-bit plane's words for a block of BLOCK_N tokens of CH-dim chunks: [BLOCK_N, W] int32, each token's
    W = CH·p/32 words, or where tokens share a word (CH·p/8 < 4 bytes: pages.lane_bits < 16) [BLOCK_N, 1] their
    word shifted so that the token's fields lie at bits p·k of each lane (bits above them belong to other tokens:
    callers mask).

    The block is BLOCK_N/SEG segments of SEG consecutive tokens of one page each. base [BLOCK_N/SEG]: each
    segment's page at the head's first plane (a uint8 pointer, 16-byte aligned); first: the segment's first token's
    place in its page (int32, a multiple of 16, or 0); AT: the plane's offset from the head's first plane (a
    compile-time multiple of 16, so every load of a head shares one address). A segment's entries are SEG·E
    contiguous bytes of the page (the plane is token-major): one row of whole words, never masked, since every page
    the block table names is memory of the cache, and codes past a request's end are finite values the softmax
    weighs by zero."""
    E: tl.constexpr = CH * P // 8  # a token's bytes in the plane
    N: tl.constexpr = SEG * E // 4  # the segment's words
    row = (base + (AT + first * E)).to(tl.pointer_type(tl.int32), bitcast=True)
    cols = tl.arange(0, N)
    if E == 8 and P == 4:
        # a 4-bit plane of 16 dims (two words a token) read a word a thread, not both: with both, a thread holds 16
        # dims whose registers Triton then stores to shared memory one number at a time (sm_90, 128-token blocks:
        # 5.26 instructions per number at 4 bits, 4.25 this way); the other planes do best as they are
        cols = tl.max_contiguous(cols, 1)
    words = tl.load(row[:, None] + cols[None, :])  # [BLOCK_N/SEG, N]
    if E >= 4:
        return tl.reshape(words, [BLOCK_N, E // 4])
    else:
        SHARE: tl.constexpr = 4 // E  # token t of a word: its bytes at byte t mod SHARE (of each lane, E = 2)
        x = words[:, :, None] >> (tl.arange(0, SHARE) * 8)[None, None, :]
        if E == 1:  # one byte a token: lane 0's bits in its low nibble, lane 1's in its high one
            x = (x & 0xF) | ((x & 0xF0) << 12)
        return tl.reshape(x, [BLOCK_N, 1])


@triton.jit
def scale_bytes(base, first, AT: tl.constexpr, SEG: tl.constexpr, BLOCK_N: tl.constexpr):
    """A band's log8 scale bytes for the block (plane_words' segments): [BLOCK_N] int32, token t's byte of the
    region AT bytes after base ([P tokens × 1 byte] in each page), read as SEG/4 whole words a segment."""
    row = (base + (AT + first)).to(tl.pointer_type(tl.int32), bitcast=True)
    words = tl.load(row[:, None] + tl.arange(0, SEG // 4)[None, :])  # [BLOCK_N/SEG, SEG/4]
    return tl.reshape((words[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 255, [BLOCK_N])


# one word's two lanes, by width: mask the codes and OR the magic number in (one LOP3), subtract its integer (a
# multiply-add by 1: exact), multiply-add the scale; the 32-bit result is the two 16-bit values (PTX, sm_80+)
_PAIR = ("{{ .reg .b32 t; lop3.b32 t, $2, {mask}, {magic}, 0xEA; fma.rn.{op} t, t, $3, $4; fma.rn.{op} t, t, $5, $6; "
         "mov.b32 {{$0, $1}}, t; }}")
_PAIR_BF16 = tl.constexpr(tuple(_PAIR.format(mask=((1 << b) - 1) * 0x00010001, magic=0x43004300, op="bf16x2")
                                for b in range(8)))
_PAIR_F16 = tl.constexpr(tuple(_PAIR.format(mask=((1 << b) - 1) * 0x00010001, magic=0x64006400, op="f16x2")
                               for b in range(11)))


@triton.jit
def _pairs(v, s, HALF: tl.constexpr, WIDTH: tl.constexpr, OUT: tl.constexpr):
    """Pairs of codes v [BLOCK_N, W] (int32, lane h = bits 16h …) -> their values (q − 2^(b−1) + ½)·s in OUT, the
    query dtype, [BLOCK_N, W, 2] (lane last: a pair is one 32-bit register, the word itself; any rank, s of v's).
    In half precision with codes below 2^7 (bfloat16) or 2^10 (float16), a lane OR-ed into a magic number is the
    16-bit float 2^7 + q (2^10 + q): the integer 2^7 + 2^(b−1) (2^10 + …) subtracted (exact) and a multiply-add
    (·s + s/2, rounded once) make the values, with no integer-to-float conversion; otherwise in float32 (8-bit codes
    under bfloat16 queries on CUDA take _bytes_bf16, from field). HALF = 2^(b−1) − ½."""
    # the magic number's integer plus the code's offset: an integer, so subtracting it is exact
    BASE: tl.constexpr = (128.0 if OUT == tl.bfloat16 else 1024.0) + HALF + 0.5
    if _packed(WIDTH, OUT):  # the pair in one register, by PTX
        args = [v, _twice(tl.full(v.shape, 1.0, tl.float32), OUT), _twice(tl.full(v.shape, -BASE, tl.float32), OUT),
                _twice(s, OUT), _twice(s * 0.5, OUT)]
        if OUT == tl.bfloat16:
            lo, hi = tl.inline_asm_elementwise(_PAIR_BF16[WIDTH], "=h,=h,r,r,r,r,r", args,
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(_PAIR_F16[WIDTH], "=h,=h,r,r,r,r,r", args,
                                               dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        return tl.join(lo, hi)
    elif (OUT == tl.bfloat16 and WIDTH < 8) or OUT == tl.float16:  # the same in Triton (the interpreter's path)
        MAGIC: tl.constexpr = 0x43004300 if OUT == tl.bfloat16 else 0x64006400  # two lanes of 2^7 or 2^10
        m = v | MAGIC
        pair = tl.join(m.to(tl.int16), (m >> 16).to(tl.int16)).to(OUT, bitcast=True)
        return (pair - BASE) * tl.expand_dims(s.to(OUT), -1) + tl.expand_dims((s * 0.5).to(OUT), -1)
    else:  # the same trick in float32 (2^23 + q, then q exactly; no integer-to-float conversion, a slow one on
        # GPUs), then q·s − HALF·s in one multiply-add: exact for a half-precision scale (HALF·s has ≤ 16 bits)
        s32 = s.to(OUT).to(tl.float32)  # the scale in the query dtype, as the half-precision path rounds it
        offset = -HALF * s32
        lo = ((v & 0xFFFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        hi = ((v >> 16) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return tl.join(lo * s32 + offset, hi * s32 + offset).to(OUT)


@triton.constexpr_function  # a compile-time answer in every Triton (3.6 makes a @triton.jit function's a run-time one)
def _packed(width: int, out) -> bool:
    """Whether width-bit codes become `out` values a pair at a time by _PAIR (codes below 2^7 in bfloat16, 2^10 in
    float16) on a CUDA GPU."""
    return _ASM.value and ((out == tl.bfloat16 and width < 8) or out == tl.float16)


@triton.jit
def _twice(x, OUT: tl.constexpr):
    """x rounded to OUT (16 bits) in both halves of an int32: a packed pair's operand."""
    b = x.to(OUT).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _byte_into(v, one, k):
    """Byte k of each word in bits 8-15 of the float32 1.0 (0x3F80kk00): one PRMT (bytes 4-7 are `one`'s); k a
    constant or, lane by lane, a tensor (PRMT takes its selector from a register)."""
    return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [v, one, 0x7604 + 16 * k],
                                     dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _bytes_bf16(v, s, HALF: tl.constexpr, f):
    """8-bit codes (v: lane h's code in byte 2h + f) under bfloat16 queries: each code moved to bits 8-15 of the
    float32 1.0 (x = 1 + q·2^-15: one PRMT, no integer-to-float conversion), then one multiply-add
    x·2^15·s − (2^15 + HALF)·s = (q − HALF)·s, and one rounding of two numbers to a bfloat16 pair. Exact before
    that rounding: s is the bfloat16-rounded scale (at most 8 significant bits), so (2^15 + HALF)·s
    (2·(2^15 + HALF) < 2^17 and odd) has at most 24 and is a float32, and the fused multiply-add rounds
    (q − HALF)·s (17 bits) not at all. CUDA only (inline PTX): the interpreter computes bfloat16 in float32."""
    sh = s.to(tl.bfloat16).to(tl.float32)
    big = sh * 32768.0
    offset = -(32768.0 + HALF) * sh
    one = tl.full(v.shape, 0x3F800000, tl.int32)
    lo = _byte_into(v, one, f).to(tl.float32, bitcast=True)
    hi = _byte_into(v, one, 2 + f).to(tl.float32, bitcast=True)
    return tl.join(lo * big + offset, hi * big + offset).to(tl.bfloat16)


@triton.jit
def _field(words, hi_words, s, f: tl.constexpr, F: tl.constexpr, HALF: tl.constexpr, WIDTH: tl.constexpr,
           P1: tl.constexpr, P2: tl.constexpr, OUT: tl.constexpr):
    """Field f of every first-plane word [BLOCK_N, W] (pair k = w·F + f): values [BLOCK_N, W, 2]."""
    k = tl.arange(0, words.shape[1])[None, :] * F + f
    return field(words, hi_words, s, f, k, HALF, WIDTH, P1, P2, OUT)


@triton.jit
def field(words, hi_words, s, f, k, HALF: tl.constexpr, WIDTH: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
          OUT: tl.constexpr):
    """Field f (a constant, or a tensor: each lane its own) of first-plane words holding pair k (dims 2k and 2k + 1),
    with its second-plane bits (p₂ = 1 or 2, at bit p₂·k of the token's one word) above the first plane's p₁: the
    pair's two values [..., 2]."""
    if P1 == 8 and OUT == tl.bfloat16 and _ASM:  # the PRMT picks bytes f and 2 + f itself: no shift, no mask
        return _bytes_bf16(words, s, HALF, f)
    v = words >> (P1 * f)
    LOW: tl.constexpr = ((1 << P1) - 1) * 0x00010001  # the first plane's bits of each lane
    if P2 > 0:
        # the second plane's field of pair k moved to bit p₁ of each lane by one rotation (a right shift by
        # p₂·k − p₁ that may be negative; what wraps around lands below p₁ or past the width), then one select (a
        # LOP3) takes the low p₁ bits from v and the rest from it; bits past the width are garbage the unpacking masks
        hi = _rotate(hi_words, (P2 * k - P1) & 31)
        v = (v & LOW) | (hi & ~LOW)
        if not _packed(WIDTH, OUT):  # (_PAIR masks its own)
            v = v & (((1 << WIDTH) - 1) * 0x00010001)
    elif not _packed(WIDTH, OUT):
        v = v & LOW
    return _pairs(v, s, HALF, WIDTH, OUT)


@triton.jit
def _rotate(x, r):
    """x rotated right by r bits (0 ≤ r < 32): one funnel shift on CUDA, the same arithmetic in Triton elsewhere."""
    if _ASM:
        return tl.inline_asm_elementwise("shf.r.wrap.b32 $0, $1, $1, $2;", "=r,r,r", [x, r + 0 * x], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        u = x.to(tl.uint32, bitcast=True)
        return ((u >> r) | ((u << 1) << (31 - r))).to(tl.int32, bitcast=True)


@triton.jit
def chunk_values(words, hi_words, s, HALF: tl.constexpr, WIDTH: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
                 CH: tl.constexpr, OUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N, CH] values of a chunk from its first plane's words [BLOCK_N, W] (and its second plane's, P2 > 0):
    F = CH/2W fields a lane. Pair w·F + f's two dims go to columns 2(w·F + f) and + 1 (dim order): the fields
    are joined (the join's new index is the fastest), then the lane, first in each pair, is moved last."""
    F: tl.constexpr = CH // 2 // words.shape[1]
    if F == 2:
        x = tl.join(_field(words, hi_words, s, 0, F, HALF, WIDTH, P1, P2, OUT),
                    _field(words, hi_words, s, 1, F, HALF, WIDTH, P1, P2, OUT))
        x = tl.permute(x, (0, 1, 3, 2))
    elif F == 4:
        p0 = _field(words, hi_words, s, 0, F, HALF, WIDTH, P1, P2, OUT)
        p1 = _field(words, hi_words, s, 1, F, HALF, WIDTH, P1, P2, OUT)
        p2 = _field(words, hi_words, s, 2, F, HALF, WIDTH, P1, P2, OUT)
        p3 = _field(words, hi_words, s, 3, F, HALF, WIDTH, P1, P2, OUT)
        x = tl.permute(tl.join(tl.join(p0, p2), tl.join(p1, p3)), (0, 1, 3, 4, 2))
    else:
        tl.static_assert(F == 8)
        p0 = _field(words, hi_words, s, 0, F, HALF, WIDTH, P1, P2, OUT)
        p1 = _field(words, hi_words, s, 1, F, HALF, WIDTH, P1, P2, OUT)
        p2 = _field(words, hi_words, s, 2, F, HALF, WIDTH, P1, P2, OUT)
        p3 = _field(words, hi_words, s, 3, F, HALF, WIDTH, P1, P2, OUT)
        p4 = _field(words, hi_words, s, 4, F, HALF, WIDTH, P1, P2, OUT)
        p5 = _field(words, hi_words, s, 5, F, HALF, WIDTH, P1, P2, OUT)
        p6 = _field(words, hi_words, s, 6, F, HALF, WIDTH, P1, P2, OUT)
        p7 = _field(words, hi_words, s, 7, F, HALF, WIDTH, P1, P2, OUT)
        x = tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))
        x = tl.permute(x, (0, 1, 3, 4, 5, 2))
    return tl.reshape(x, [BLOCK_N, CH])


# PTX for the unpacking on CUDA GPUs; Triton's interpreter (decided when the kernels were decorated, as
# triton_common.dot_options) and other GPUs take the same arithmetic written in Triton
_ASM = tl.constexpr(isinstance(_pairs, JITFunction) and torch.version.hip is None)
