/* Band codes on a CPU: kvfold_runtime.bands.decode_heads' values, band by band, every bit width a loop of its
 * own with the width a constant (vector loops where the CPU has AVX2 + BMI2); encode_heads' bytes; and decode
 * attention read from a paged cache's codes; and a vLLM decode step's write and attention of one layer in one call
 * (kvfold_decode_layer). kernels/cpu_bits.py builds this once per machine and calls it through ctypes.
 *
 * A row holds, per head, its bands' codes (byte-aligned per band, little-endian bit stream, first dim in the
 * lowest bits) and then one scale per quantized band (kvfold_runtime/bands.py). The caller describes the row
 * once per layer as segments of six int32s:
 *     out_at  first output number          n      numbers
 *     bits    0 (zeros), 2..8, 16 (float16 values), 32 (float32 values)
 *     code_at its band's first code byte  scale_at its scale's byte     scale_kind 1 log8, 2 float16
 * (scale_kind 3 with bits 16: bfloat16 values.) The plain-number segments let decode attention also read a
 * rank-format layer's rows, its numbers in the model's dtype (one segment per head's keys, one per its values).
 * A b-bit code is x = (q + 1/2 - 2^(b-1)) * s in float32, computed as torch does (an add, then a multiply:
 * built with -ffp-contract=off, so no fused multiply-add changes a rounding).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The vector path needs AVX2 and BMI2 (-march=native turns them on where the CPU has them); KVFOLD_SCALAR
 * forces the scalar loops (the tests build both). */
#if defined(__AVX2__) && defined(__BMI2__) && !defined(KVFOLD_SCALAR)
#include <immintrin.h>
#define KVFOLD_SIMD 1
#else
#define KVFOLD_SIMD 0
#endif

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do { e++; man <<= 1; } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint64_t load_le(const uint8_t *p, int n) { /* n <= 8 bytes, little-endian */
    uint64_t w = 0;
    for (int k = 0; k < n; k++) w |= (uint64_t)p[k] << (8 * k);
    return w;
}

/* The n ≤ 8 bytes at p in the low bytes of a word, read as one 8-byte load where `room` (the bytes from p to the
 * end of the row) allows: byte by byte, a 6-bit band's eight codes cost six loads, shifts and ors. The bytes past
 * n that come with it (the next band's codes, a scale) are dropped by the caller's pdep, which takes the low
 * 8 · bits bits only, or land in lanes its masked store drops. */
static inline uint64_t load_codes(const uint8_t *p, int n, int64_t room) {
    if (room < 8) return load_le(p, n);
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

#if KVFOLD_SIMD
/* Eight codes of `bits` bits (the low 8 · bits bits of w) as eight int32 lanes: two variable shifts of w broadcast
 * (the even codes, then the odd ones, each in a 64-bit lane), the odd ones moved to the high halves, masked. Not
 * BMI2's pdep: AMD before Zen 3 runs pdep in microcode, and a SmolLM2 layer's decode at 4K took 6.4 ms there
 * against 0.86 ms for the scalar loop (EPYC, family 0x17). */
static inline __attribute__((always_inline)) __m256i spread8(uint64_t w, const int bits) {
    __m256i all = _mm256_set1_epi64x((long long)w);
    __m256i even = _mm256_srlv_epi64(all, _mm256_setr_epi64x(0, 2 * bits, 4 * bits, 6 * bits));
    __m256i odd = _mm256_srlv_epi64(all, _mm256_setr_epi64x(bits, 3 * bits, 5 * bits, 7 * bits));
    __m256i both = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    return _mm256_and_si256(both, _mm256_set1_epi32((1 << bits) - 1));
}
#endif

/* n codes of `bits` bits from `codes` into floats. With AVX2 (x86 since 2013), eight codes fill `bits` bytes
 * exactly: spread8 puts them in eight lanes, converted and scaled as one vector (a partial last group read from
 * its own bytes only, stored under a mask); where AVX-512 holds sixteen, BMI2's pdep spreads them into bytes (fast
 * on every CPU with AVX-512: Intel's, AMD's from Zen 4). Without them,
 * a scalar loop over groups of G codes that fill GB bytes (G * bits == 8 * GB). Either way the same float32
 * operations per code, so the same values. A code goes to float through int32: converting an unsigned 64-bit
 * integer is a slow multi-instruction sequence on x86. */
static inline __attribute__((always_inline)) void band(const uint8_t *codes, int64_t room, int n, float *out, float s,
                                                       const int bits, const int G, const int GB) {
    const uint64_t mask = (1u << bits) - 1u;
    const float offset = 0.5f - (float)(1 << (bits - 1));
    int i = 0;
#if KVFOLD_SIMD
    (void)G, (void)GB, (void)mask;
    const __m256 vo = _mm256_set1_ps(offset), vs = _mm256_set1_ps(s);
#ifdef __AVX512F__
    const uint64_t spread = 0x0101010101010101ull * mask; /* the low `bits` bits of each byte */
    const __m512 vo16 = _mm512_set1_ps(offset), vs16 = _mm512_set1_ps(s);
    for (; i + 16 <= n; i += 16, codes += 2 * bits, room -= 2 * bits) { /* sixteen at a time, where vectors hold them */
        uint64_t lo = load_codes(codes, bits, room), hi = load_codes(codes + bits, bits, room - bits);
        if (bits != 8) lo = _pdep_u64(lo, spread), hi = _pdep_u64(hi, spread);
        __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_set_epi64x((long long)hi, (long long)lo)));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_add_ps(v, vo16), vs16));
    }
#endif
    for (; i + 8 <= n; i += 8, codes += bits, room -= bits) {
        __m256 v = _mm256_cvtepi32_ps(spread8(load_codes(codes, bits, room), bits));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_add_ps(v, vo), vs));
    }
    if (i < n) {
        int rest = n - i;
        __m256 v = _mm256_cvtepi32_ps(spread8(load_codes(codes, (rest * bits + 7) / 8, room), bits));
        __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(rest), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        _mm256_maskstore_ps(out + i, keep, _mm256_mul_ps(_mm256_add_ps(v, vo), vs));
    }
#else
    (void)room;
    for (; i + G <= n; i += G, codes += GB) {
        uint64_t w = load_le(codes, GB);
        for (int k = 0; k < G; k++) out[i + k] = ((float)(int32_t)((w >> (k * bits)) & mask) + offset) * s;
    }
    if (i < n) { /* a last, partial group: only its own bytes are read */
        int rest = n - i;
        uint64_t w = load_le(codes, (rest * bits + 7) / 8);
        for (int k = 0; k < rest; k++) out[i + k] = ((float)(int32_t)((w >> (k * bits)) & mask) + offset) * s;
    }
#endif
}

/* Numbers in the model's dtype — a decode step's q, k, v, out and a ring's rows, a rank row's plain numbers: 0 float32,
 * 1 bfloat16, 2 float16 (cpu_bits.STEP_FORMATS). A step's 16-bit ones are widened to float32 once per step, and out
 * narrowed at the end. */
static inline size_t number_size(int32_t fmt) { return fmt ? 2 : 4; }

static inline void to_floats(const void *src, int32_t fmt, int64_t n, float *dst) {
    const uint16_t *h = src;
    if (fmt == 0) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    } else if (fmt == 1) { /* bfloat16: the top half of a float32 (a loop the vectoriser takes) */
        for (int64_t i = 0; i < n; i++) {
            uint32_t w = (uint32_t)h[i] << 16;
            memcpy(dst + i, &w, 4);
        }
    } else {
        for (int64_t i = 0; i < n; i++) dst[i] = half_to_float(h[i]);
    }
}

/* n_rows rows' segments [first, last) into out (row r at rows + r * row_stride, its numbers at
 * out + r * out_stride; see the header for a segment's six numbers). Segment by segment, each over all the
 * rows: the segment is read and its width dispatched once per run of rows, not once per row. */
static inline void decode_segments(const uint8_t *rows, int64_t row_stride, int64_t row_len, int64_t n_rows,
                                   const int32_t *segments, int32_t first, int32_t last, const float *log8,
                                   float *out, int64_t out_stride) {
    for (int32_t j = first; j < last; j++) {
        const int32_t *sg = segments + 6 * j;
        int out_at = sg[0], n = sg[1], bits = sg[2], code_at = sg[3], scale_at = sg[4], kind = sg[5];
#define ROWS(body)                                                                                            \
    for (int64_t r = 0; r < n_rows; r++) {                                                                    \
        const uint8_t *row = rows + r * row_stride, *src = row + code_at;                                     \
        float *dst = out + r * out_stride + out_at;                                                           \
        float s = kind == 1 ? log8[row[scale_at]]                                                             \
                            : kind == 2 ? half_to_float((uint16_t)(row[scale_at] | (row[scale_at + 1] << 8))) \
                                        : 0.0f;                                                               \
        (void)s, (void)src;                                                                                   \
        body;                                                                                                 \
    }
        switch (bits) { /* constant widths: each case compiles to its own unrolled loop */
        case 16: ROWS(to_floats(src, kind == 3 ? 1 : 2, n, dst)); break; /* bfloat16 (kind 3) or float16 */
        case 32: ROWS(to_floats(src, 0, n, dst)); break;
        case 2: ROWS(band(src, row_len - code_at, n, dst, s, 2, 4, 1)); break;
        case 3: ROWS(band(src, row_len - code_at, n, dst, s, 3, 8, 3)); break;
        case 4: ROWS(band(src, row_len - code_at, n, dst, s, 4, 2, 1)); break;
        case 5: ROWS(band(src, row_len - code_at, n, dst, s, 5, 8, 5)); break;
        case 6: ROWS(band(src, row_len - code_at, n, dst, s, 6, 4, 3)); break;
        case 8: ROWS(band(src, row_len - code_at, n, dst, s, 8, 1, 1)); break;
        default: ROWS(memset(dst, 0, sizeof(float) * (size_t)n)); /* 0: dims no band holds */
        }
#undef ROWS
    }
}

/* float32 -> float16 bits, rounded to the nearest even as torch's .to(float16) (Maratyszcza's FP16 library's
 * fp16_ieee_from_fp32_value, which torch's own CPU conversion uses). */
static inline uint16_t float_to_half(float f) {
    uint32_t w, shl1, sign, bias, bits;
    memcpy(&w, &f, 4);
    shl1 = w + w, sign = w & 0x80000000u, bias = shl1 & 0xff000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f, b;
    uint32_t bias_bits = (bias >> 1) + 0x07800000u;
    memcpy(&b, &bias_bits, 4);
    base = b + base;
    memcpy(&bits, &base, 4);
    uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    return (uint16_t)((sign >> 16) | (shl1 > 0xff000000u ? 0x7e00u : nonsign));
}

/* float32 -> bfloat16 bits, rounded to the nearest even as torch's .to(bfloat16) (c10's round_to_nearest_even;
 * a NaN becomes its quiet NaN 0x7fc0). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t w;
    memcpy(&w, &f, 4);
    if ((w & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (uint16_t)((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
}

static void from_floats(const float *src, int32_t fmt, int64_t n, void *dst) {
    uint16_t *h = dst;
    if (fmt == 0) memcpy(dst, src, sizeof(float) * (size_t)n);
    else if (fmt == 1) for (int64_t i = 0; i < n; i++) h[i] = float_to_bf16(src[i]);
    else for (int64_t i = 0; i < n; i++) h[i] = float_to_half(src[i]);
}

/* The encoder's loops (a band's |x| max, its squared errors, its codes): with AVX-512 sixteen dims at a time under
 * a mask, no scalar remainder — a band is 8 to 40 dims, where the vectoriser's loops ran mostly their remainders
 * (one SmolLM2 layer's 2,048 prefill rows on one core: 4.4 ms with those, 2.6 ms with these). Either way the same
 * float32 operations dim by dim, so the same codes and scales. */
#if KVFOLD_SIMD && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVFOLD_ENCODE512 1
/* The first min(count, 16) lanes. */
static inline __mmask16 lanes_below(int count) {
    return count >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << count) - 1u);
}

/* min(max(floor(x / s + half), 0), top), as the scalar loops compute it */
static inline __m512 codes512(__m512 x, __m512 s, __m512 half, __m512 top) {
    __m512 c = _mm512_add_ps(_mm512_div_ps(x, s), half);
    c = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    return _mm512_min_ps(_mm512_max_ps(c, _mm512_setzero_ps()), top);
}
#else
#define KVFOLD_ENCODE512 0
#endif

/* |x| max of n floats as integers (a non-negative float orders as its bits; floats' ?: max is not a vector loop);
 * a NaN counts as 0, as the float compare ignored it. */
static inline float abs_max(const float *v, int n) {
    uint32_t top_bits = 0;
#if KVFOLD_ENCODE512
    __m512i top = _mm512_setzero_si512();
    for (int i = 0; i < n; i += 16) {
        __m512i w = _mm512_maskz_loadu_epi32(lanes_below(n - i), v + i);
        w = _mm512_and_si512(w, _mm512_set1_epi32(0x7fffffff));
        w = _mm512_maskz_mov_epi32(_mm512_cmple_epu32_mask(w, _mm512_set1_epi32(0x7f800000)), w);
        top = _mm512_max_epu32(top, w);
    }
    top_bits = _mm512_reduce_max_epu32(top);
#else
    for (int i = 0; i < n; i++) {
        uint32_t w;
        memcpy(&w, v + i, 4);
        w &= 0x7fffffffu;
        w = w > 0x7f800000u ? 0u : w;
        top_bits = w > top_bits ? w : top_bits;
    }
#endif
    float amax;
    memcpy(&amax, &top_bits, 4);
    return amax;
}

/* A band's squared error with its codes against scale s (bands._fit_log8), summed in float64 (d² of a float32 is
 * exact there). Scalar: the errors first (a loop without a carried dependency, for the vectoriser), then four
 * running sums: one chain of dependent float64 adds was most of the fit's time. (torch sums in its own order: the
 * last bits of two nearly equal candidates may differ.) */
static double band_error(const float *v, int n, float scale, float half, float top) {
#if KVFOLD_ENCODE512
    const __m512 s = _mm512_set1_ps(scale), h = _mm512_set1_ps(half), t = _mm512_set1_ps(top);
    const __m512 off = _mm512_set1_ps(0.5f - half);
    __m512d e0 = _mm512_setzero_pd(), e1 = _mm512_setzero_pd();
    for (int i = 0; i < n; i += 16) {
        __mmask16 k = lanes_below(n - i);
        __m512 x = _mm512_maskz_loadu_ps(k, v + i);
        __m512 d = _mm512_maskz_sub_ps(k, _mm512_mul_ps(_mm512_add_ps(codes512(x, s, h, t), off), s), x);
        __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(d));
        __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(d), 1)));
        e0 = _mm512_fmadd_pd(lo, lo, e0), e1 = _mm512_fmadd_pd(hi, hi, e1);
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(e0, e1));
#else
    float d[256];
    double e[4] = {0.0, 0.0, 0.0, 0.0};
    for (int at = 0; at < n; at += 256) { /* 256 dims at a time: any head_dim */
        int m = n - at < 256 ? n - at : 256;
        for (int i = 0; i < m; i++) {
            float q = floorf(v[at + i] / scale + half);
            q = q < 0.0f ? 0.0f : (q > top ? top : q);
            d[i] = (q + (0.5f - half)) * scale - v[at + i];
        }
        int i = 0;
        for (; i + 4 <= m; i += 4)
            for (int j = 0; j < 4; j++) e[j] += (double)d[i + j] * (double)d[i + j];
        for (; i < m; i++) e[0] += (double)d[i] * (double)d[i];
    }
    return (e[0] + e[1]) + (e[2] + e[3]);
#endif
}

/* The codes floor(x / s + half) clamped to [0, top] of m ≤ 256 dims into q. */
static inline void band_codes(const float *v, int m, float scale, float half, float top, uint8_t *q) {
#if KVFOLD_ENCODE512
    const __m512 s = _mm512_set1_ps(scale), h = _mm512_set1_ps(half), t = _mm512_set1_ps(top);
    for (int i = 0; i < m; i += 16) {
        __mmask16 k = lanes_below(m - i);
        __m512i c = _mm512_cvttps_epi32(codes512(_mm512_maskz_loadu_ps(k, v + i), s, h, t));
        _mm_mask_storeu_epi8(q + i, k, _mm512_cvtepi32_epi8(c));
    }
#else
    for (int i = 0; i < m; i++) {
        float c = floorf(v[i] / scale + half);
        q[i] = (uint8_t)(c < 0.0f ? 0.0f : (c > top ? top : c));
    }
#endif
}

/* m codes of `bits` bits each, packed as a little-endian bit stream from dst on; returns where its next byte goes.
 * Whole bytes at a time where the width allows (8 bits: a byte a code; 4 and 2 bits: two and four codes a byte),
 * else through a 64-bit accumulator, four bytes out at once; a partial last byte's high bits are zero. A band of
 * over 256 dims is packed 256 codes a call: 256 codes of any width fill whole bytes. */
static uint8_t *pack_codes(const uint8_t *q, int m, int bits, uint8_t *dst) {
    if (bits == 8) {
        memcpy(dst, q, (size_t)m);
        return dst + m;
    }
    if (bits == 4) {
        int i = 0;
        for (; i + 2 <= m; i += 2) *dst++ = (uint8_t)(q[i] | q[i + 1] << 4);
        if (i < m) *dst++ = q[i];
        return dst;
    }
    if (bits == 2) {
        int i = 0;
        for (; i + 4 <= m; i += 4) *dst++ = (uint8_t)(q[i] | q[i + 1] << 2 | q[i + 2] << 4 | q[i + 3] << 6);
        if (i < m) {
            uint8_t b = 0;
            for (int j = 0; i + j < m; j++) b |= (uint8_t)(q[i + j] << 2 * j);
            *dst++ = b;
        }
        return dst;
    }
    uint64_t acc = 0;
    int filled = 0;
    for (int i = 0; i < m; i++) {
        acc |= (uint64_t)q[i] << filled;
        filled += bits;
        if (filled >= 32) { /* four whole bytes out at once */
            for (int j = 0; j < 4; j++) *dst++ = (uint8_t)(acc >> 8 * j);
            acc >>= 32, filled -= 32;
        }
    }
    for (; filled > 0; filled -= 8, acc >>= 8) *dst++ = (uint8_t)acc; /* the last byte's high bits zero */
    return dst;
}

/* The first of the 256 log8 table scales ≥ ideal (torch.bucketize), at most the last. The table holds 2^((c −
 * 128)/8), exactly 2^e at c = 128 + 8e, so an ideal in [2^e, 2^(e+1)) lies among the 8 scales from there: its
 * index is that c plus how many of them are below it (8 compares, no unpredictable branch). Ideals outside the
 * table's octaves take the binary search. */
static inline int first_scale_at_least(const float *log8, float ideal) {
    uint32_t w;
    memcpy(&w, &ideal, 4);
    int c = 128 + 8 * ((int)((w >> 23) & 0xff) - 127);
    if (c >= 0 && c + 8 <= 255) {
        int below = 0;
        for (int k = 0; k < 8; k++) below += log8[c + k] < ideal;
        return c + below;
    }
    int lo = 0, hi = 256;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (log8[mid] < ideal) lo = mid + 1; else hi = mid;
    }
    return lo > 255 ? 255 : lo;
}

/* One row's segments into its bytes: bands.quantize's bytes exactly. A quantized band's covering scale is the
 * smallest stored scale ≥ absmax / (2^(b−1) − ½) (a log8 byte: the first of the 256 table scales not below it; a
 * float16: rounded, then one step up if below); a log8 band then takes, of it and the fit_steps bytes below it,
 * the one with the least squared error (the first on a tie); its codes floor(x / s + 2^(b−1)) clamped to
 * [0, 2^b − 1], packed as a little-endian bit stream. Here a segment's out_at is the dim it starts at in x. */
static void encode_segments(const float *x, const int32_t *segments, int32_t n_segments, const float *log8,
                            int32_t fit_steps, uint8_t *row) {
    for (int32_t j = 0; j < n_segments; j++) {
        const int32_t *sg = segments + 6 * j;
        int at = sg[0], n = sg[1], bits = sg[2], code_at = sg[3], scale_at = sg[4], kind = sg[5];
        const float *v = x + at;
        uint8_t *dst = row + code_at;
        if (bits == 0) continue; /* dims no band holds */
        if (bits == 16) {
            for (int i = 0; i < n; i++) {
                uint16_t h = float_to_half(v[i]);
                dst[2 * i] = (uint8_t)h, dst[2 * i + 1] = (uint8_t)(h >> 8);
            }
            continue;
        }
        float amax = abs_max(v, n);
        float ideal = amax / ((float)(1 << (bits - 1)) - 0.5f), scale;
        ideal = ideal < 1e-30f ? 1e-30f : ideal;
        const float half = (float)(1 << (bits - 1)), top = (float)((1 << bits) - 1);
        if (kind == 1) {
            int lo = first_scale_at_least(log8, ideal);
            double best = band_error(v, n, log8[lo], half, top);
            int fitted = lo;
            for (int c = lo - 1; c >= 0 && c >= lo - fit_steps; c--) {
                double e = band_error(v, n, log8[c], half, top);
                if (e < best) best = e, fitted = c;
            }
            row[scale_at] = (uint8_t)fitted;
            scale = log8[fitted];
        } else {
            uint16_t h = float_to_half(ideal);
            if (half_to_float(h) < ideal) h++; /* positive and finite here: the next float16 up */
            row[scale_at] = (uint8_t)h, row[scale_at + 1] = (uint8_t)(h >> 8);
            scale = half_to_float(h);
        }
        for (int at = 0; at < n; at += 256) { /* the codes first (a vector loop), then packed: any head_dim */
            int m = n - at < 256 ? n - at : 256;
            uint8_t q[256];
            band_codes(v + at, m, scale, half, top, q);
            dst = pack_codes(q, m, bits, dst);
        }
    }
}

/* x [n_rows, x_stride] float32 -> row r's bytes at cache + slots[r] * row_bytes + at, or with slots NULL at
 * cache + r * row_bytes + at (row_bytes: the rows' stride). A slot -1 is padding, skipped. With slots, a side (keys
 * at 0, values after the keys' bytes) of vLLM's paged rows is written in place, without the rows first written
 * aside and scattered by torch (three ops and a copy per layer and step). */
void kvfold_encode_slots(const float *x, int64_t n_rows, int64_t x_stride, const int32_t *segments,
                         int32_t n_segments, const float *log8, int32_t fit_steps, uint8_t *cache, int64_t row_bytes,
                         int64_t at, const int64_t *slots) {
#pragma omp parallel for schedule(static) if (n_rows >= 256)
    for (int64_t r = 0; r < n_rows; r++)
        if (!slots || slots[r] >= 0)
            encode_segments(x + r * x_stride, segments, n_segments, log8, fit_steps,
                            cache + (slots ? slots[r] : r) * row_bytes + at);
}

/* Where slot `slot` of a paged cache lies: blocks of block_size rows, `block_stride` bytes apart (a block-outer
 * cache holds every layer's block of a request together, so a layer's blocks are further apart than its rows). */
static inline int64_t slot_offset(int64_t slot, int64_t block_size, int64_t block_stride, int64_t row_bytes) {
    return slot / block_size * block_stride + slot % block_size * row_bytes;
}

/* The rows src [n_rows, src_stride bytes], n_bytes each -> cache + slots[r] * row_bytes + at (slot -1: padding,
 * skipped): a rank layer's numbers, already in the cache's dtype, copied into vLLM's paged rows in place. */
void kvfold_copy_slots(const uint8_t *src, int64_t n_rows, int64_t src_stride, int64_t n_bytes, uint8_t *cache,
                       int64_t row_bytes, int64_t at, const int64_t *slots) {
    for (int64_t r = 0; r < n_rows; r++)
        if (slots[r] >= 0) memcpy(cache + slots[r] * row_bytes + at, src + r * src_stride, (size_t)n_bytes);
}

/* 1 where this build decodes with its vector loops, 0 where with the scalar ones (a test checks which). */
int kvfold_vector_loops(void) { return KVFOLD_SIMD; }

static void segment_span(const int32_t *segments, int32_t first, int32_t last, int64_t *span);

void kvfold_decode_rows(const uint8_t *rows, int64_t n_rows, int64_t row_stride, const int32_t *segments,
                        int32_t n_segments, const float *log8, float *out, int64_t out_width) {
    int64_t span[2]; /* the row's own bytes end where its last segment's do: no load reads past them */
    segment_span(segments, 0, n_segments, span);
    int64_t runs = (n_rows + 15) / 16; /* sixteen rows at a time: a run's output stays in the L1 cache */
#pragma omp parallel for schedule(static) if (n_rows >= 512)
    for (int64_t run = 0; run < runs; run++) {
        int64_t r0 = run * 16, n = n_rows - r0 < 16 ? n_rows - r0 : 16;
        decode_segments(rows + r0 * row_stride, row_stride, span[1], n, segments, 0, n_segments, log8,
                        out + r0 * out_width, out_width);
    }
}

/* The attention's arithmetic runs on the CPU's own vector width, VW floats: 16 with AVX-512, 8 with AVX, else 4.
 * A 64-byte vector type on an AVX2 CPU is split into halves that GCC passes through the stack and general
 * registers: one SmolLM2 rank layer's attention at 4K tokens took 4.7 ms on one thread of an AVX2-only EPYC,
 * 1.1 ms at its own width. Widths are padded to 16, a multiple of each. Loads and stores go through memcpy,
 * which compiles to one unaligned move. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));
typedef uint8_t vu8 __attribute__((vector_size(VW)));
static inline vf loadv(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void storev(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* e^x of VW x ≤ 0 at once (Cephes' expf: e^x = 2^n · e^r, |r| ≤ ln2/2, a degree-6 polynomial, ~2 ulp;
 * below −87 the result is ~1e-38 instead of smaller: a weight nothing adds up to). glibc's expf one at a
 * time was a sixth of the decode attention's time. */
static inline vf expv(vf x) {
    vi low = x < -87.0f;
    x = (vf)((low & (vi)(x * 0.0f - 87.0f)) | (~low & (vi)x));
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round(x / ln 2): add and take 2^23·1.5 */
    vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    vf p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    vi two_n = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)two_n;
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

/* The sum of a vector's lanes, as a tree (halves added, in registers). */
static inline float sumv(vf v) {
#if VW == 16
    f32x8 e = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#elif VW == 8
    f32x8 e = v;
#endif
#if VW >= 8
    f32x4 l4 = __builtin_shufflevector(e, e, 0, 1, 2, 3) + __builtin_shufflevector(e, e, 4, 5, 6, 7);
#else
    f32x4 l4 = v;
#endif
    return (l4[0] + l4[2]) + (l4[1] + l4[3]);
}

/* A block's columns [0, full) of `width` at `cols` floats a row apart, as whole vectors — and, where width is not a
 * multiple of VW, the last VW columns [width − VW, width) as one more vector (`tail`): it overlaps the whole ones,
 * so its query lanes (or its sums' lanes) below `full` are zero (dropped). Rows decoded into a buffer are read at
 * full = the padded width and no tail; float32 rows straight from the cache, where reading past a head's width
 * would read the next head's numbers (NaN in an unwritten row), with the tail. */
typedef struct {
    const float *cols;
    int64_t stride; /* floats from one row to the next */
    int32_t full;   /* columns read as whole vectors */
    int32_t tail;   /* 1: one more vector at width − VW */
    int32_t width;
} rows_view;

static inline void prefetch_row(const uint8_t *row, const int64_t *span) {
    for (int side = 0; side < 2; side++) {
        uintptr_t at = (uintptr_t)(row + span[2 * side]) & ~(uintptr_t)63, end = (uintptr_t)(row + span[2 * side + 1]);
        for (; at < end; at += 64) __builtin_prefetch((const void *)at, 0, 1);
    }
}

/* w_j[r] = q_j · row r for NJ (1 to 4) of the group's queries (q_j at q + j · q_stride, `full` floats: decoded
 * rows, padded to whole vectors, have no tail; w_j at w + j · w_stride), over every row of the
 * block (a row not seen too: whatever it gives is masked later); m[j] raised to the largest over the seen rows.
 * Two rows a step: a row's vector is loaded once for the NJ queries, and 2 · NJ independent sums hide the adds'
 * latency (one sum per row, query by query, left the CPU waiting on each add and each row's first load). While
 * scoring, the next block's lines of this head's rows are fetched into the outer caches (`next`, with the row
 * bytes `span` of keys and values; NULL: none). Used for rows decoded into a buffer (attend says why). */
static inline __attribute__((always_inline)) void score_rows_nj(const float *q, int64_t q_stride, rows_view k,
                                                                int64_t block_size, const uint8_t *seen, float *w,
                                                                int64_t w_stride, float *m, const uint8_t *next,
                                                                int64_t row_bytes, const int64_t *span, const int NJ) {
    int64_t r = 0;
    for (; r + 2 <= block_size; r += 2) {
        if (next) prefetch_row(next + r * row_bytes, span), prefetch_row(next + (r + 1) * row_bytes, span);
        const float *k0 = k.cols + r * k.stride, *k1 = k0 + k.stride;
        vf p0[4], p1[4];
        for (int j = 0; j < NJ; j++) p0[j] = p1[j] = (vf){0};
        for (int32_t c = 0; c < k.full; c += VW) {
            vf x0 = loadv(k0 + c), x1 = loadv(k1 + c);
            for (int j = 0; j < NJ; j++) {
                vf qc = loadv(q + j * q_stride + c);
                p0[j] += qc * x0, p1[j] += qc * x1;
            }
        }
        for (int j = 0; j < NJ; j++) {
            float d0 = sumv(p0[j]), d1 = sumv(p1[j]);
            w[j * w_stride + r] = d0, w[j * w_stride + r + 1] = d1;
            m[j] = seen[r] && d0 > m[j] ? d0 : m[j];
            m[j] = seen[r + 1] && d1 > m[j] ? d1 : m[j];
        }
    }
    for (; r < block_size; r++) {
        if (next) prefetch_row(next + r * row_bytes, span);
        const float *kr = k.cols + r * k.stride;
        for (int j = 0; j < NJ; j++) {
            vf part = {0};
            for (int32_t c = 0; c < k.full; c += VW) part += loadv(q + j * q_stride + c) * loadv(kr + c);
            float d = sumv(part);
            w[j * w_stride + r] = d;
            m[j] = seen[r] && d > m[j] ? d : m[j];
        }
    }
}

/* w[r] = q · row r for one query over the block's rows (rows not seen too: whatever they give is masked later);
 * returns the largest over the seen rows and m. q holds full + (tail ? VW : 0) floats: the whole vectors' lanes,
 * then the tail's. Four rows at a time, four independent sums: one row's chain of dependent adds (4 cycles each)
 * and its lane sum left the CPU waiting. Used for rows read in place (attend says why). */
static inline float score_rows_one(const float *q, rows_view k, int64_t block_size, const uint8_t *seen, float *w,
                                   float m) {
    int64_t r = 0;
    for (; r + 4 <= block_size; r += 4) {
        const float *k0 = k.cols + r * k.stride, *k1 = k0 + k.stride, *k2 = k1 + k.stride, *k3 = k2 + k.stride;
        vf p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0};
        for (int32_t c = 0; c < k.full; c += VW) {
            vf qc = loadv(q + c);
            p0 += qc * loadv(k0 + c), p1 += qc * loadv(k1 + c), p2 += qc * loadv(k2 + c), p3 += qc * loadv(k3 + c);
        }
        if (k.tail) {
            vf qc = loadv(q + k.full);
            int32_t c = k.width - VW;
            p0 += qc * loadv(k0 + c), p1 += qc * loadv(k1 + c), p2 += qc * loadv(k2 + c), p3 += qc * loadv(k3 + c);
        }
        float d[4] = {sumv(p0), sumv(p1), sumv(p2), sumv(p3)};
        for (int i = 0; i < 4; i++) {
            w[r + i] = d[i];
            m = seen[r + i] && d[i] > m ? d[i] : m;
        }
    }
    for (; r < block_size; r++) {
        if (!seen[r]) continue;
        const float *kr = k.cols + r * k.stride;
        vf part = {0};
        for (int32_t c = 0; c < k.full; c += VW) part += loadv(q + c) * loadv(kr + c);
        if (k.tail) part += loadv(q + k.full) * loadv(kr + k.width - VW);
        float dot = sumv(part);
        w[r] = dot;
        m = dot > m ? dot : m;
    }
    return m;
}

#if VW == 16
/* Lane i: the sum of p[i]'s lanes — sixteen rows' dot products as one vector, by a tree of two-vector shuffles and
 * adds (45 operations, where summing each row's lanes alone takes 8 a row). */
static inline vf sums16(const vf *p) {
    vf r[8], s[4], t[2];
    for (int i = 0; i < 8; i++) /* lanes 0–7: p[2i]'s halves added; 8–15: p[2i + 1]'s */
        r[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                       31);
    for (int i = 0; i < 4; i++) /* four lanes a row */
        s[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(r[2 * i], r[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                       31);
    for (int i = 0; i < 2; i++) /* two lanes a row */
        t[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(s[2 * i], s[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                       31);
    return __builtin_shufflevector(t[0], t[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(t[0], t[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* w[i] = q · row i for sixteen decoded rows (whole vectors, no tail); returns m raised to the largest over the seen
 * ones. Sixteen running sums, one a row, summed together at the end (sums16). */
static inline float score16(const float *q, rows_view k, const uint8_t *seen, float *w, float m) {
    vf p[16];
    for (int i = 0; i < 16; i++) p[i] = (vf){0};
    for (int32_t c = 0; c < k.full; c += VW) {
        vf qc = loadv(q + c);
        for (int i = 0; i < 16; i++) p[i] += qc * loadv(k.cols + i * k.stride + c);
    }
    vf d = sums16(p);
    storev(w, d);
    for (int i = 0; i < 16; i++) m = seen[i] && d[i] > m ? d[i] : m;
    return m;
}
#endif

/* The group's scores over a block of decoded rows: sixteen rows at a time per query where vectors hold sixteen
 * (score16; the next block's rows fetched meanwhile), the rest by score_rows_nj, four queries at a time. */
static inline void score_rows(const float *q, int64_t q_stride, rows_view k, int64_t block_size,
                              const uint8_t *seen, float *w, float *m, int32_t group, const uint8_t *next,
                              int64_t row_bytes, const int64_t *span) {
    int64_t done = 0;
#if VW == 16
    for (; done + 16 <= block_size; done += 16) {
        if (next)
            for (int64_t r = done; r < done + 16; r++) prefetch_row(next + r * row_bytes, span);
        rows_view rows = k;
        rows.cols = k.cols + done * k.stride;
        for (int32_t j = 0; j < group; j++)
            m[j] = score16(q + j * q_stride, rows, seen + done, w + j * block_size + done, m[j]);
    }
#endif
    if (done == block_size) return;
    k.cols += done * k.stride, seen += done, w += done, next = next ? next + done * row_bytes : NULL;
    const int64_t rest = block_size - done;
    for (int32_t j = 0; j < group; j += 4) {
        const float *qj = q + j * q_stride;
        float *wj = w + j * block_size, *mj = m + j;
        const uint8_t *nx = j ? NULL : next;
        switch (group - j < 4 ? group - j : 4) { /* a constant count of queries: their sums stay in registers */
        case 1: score_rows_nj(qj, q_stride, k, rest, seen, wj, block_size, mj, nx, row_bytes, span, 1); break;
        case 2: score_rows_nj(qj, q_stride, k, rest, seen, wj, block_size, mj, nx, row_bytes, span, 2); break;
        case 3: score_rows_nj(qj, q_stride, k, rest, seen, wj, block_size, mj, nx, row_bytes, span, 3); break;
        default: score_rows_nj(qj, q_stride, k, rest, seen, wj, block_size, mj, nx, row_bytes, span, 4);
        }
    }
}

/* acc += Σ_r w[r] · row r over the block's seen rows (all: every row seen). acc holds full + (tail ? VW : 0)
 * floats as score_rows' q. VW columns of the sum at a time, in vector registers that stay in place for the whole
 * block; a block every row of which is seen takes four rows at a time into four sums (one sum's chain of dependent
 * adds, 4 cycles each, was 38% of a rank layer's attention). An unwritten row may hold NaN bytes: never
 * multiplied. */
static inline void add_rows(float *acc, rows_view v, int64_t block_size, const uint8_t *seen, int all,
                            const float *w) {
    for (int32_t c = 0; c < v.full + (v.tail ? VW : 0); c += VW) {
        const float *col = v.cols + (c < v.full ? c : v.width - VW);
        vf part = loadv(acc + c), p1 = {0}, p2 = {0}, p3 = {0};
        int64_t r = 0;
        if (all)
            for (; r + 4 <= block_size; r += 4) {
                const float *vr = col + r * v.stride;
                part += w[r] * loadv(vr);
                p1 += w[r + 1] * loadv(vr + v.stride);
                p2 += w[r + 2] * loadv(vr + 2 * v.stride);
                p3 += w[r + 3] * loadv(vr + 3 * v.stride);
            }
        for (; r < block_size; r++)
            if (seen[r]) part += w[r] * loadv(col + r * v.stride);
        storev(acc + c, (part + p1) + (p2 + p3));
    }
}

/* The bytes of a row that a head's segments read (codes, numbers, scales): [span[0], span[1]). */
static void segment_span(const int32_t *segments, int32_t first, int32_t last, int64_t *span) {
    int64_t lo = INT64_MAX, hi = 0;
    for (int32_t j = first; j < last; j++) {
        const int32_t *sg = segments + 6 * j;
        int64_t n = sg[1], bits = sg[2], code_at = sg[3], scale_at = sg[4], kind = sg[5];
        if (bits == 0) continue; /* dims no band holds: no bytes */
        int64_t end = code_at + (bits == 32 ? 4 * n : bits == 16 ? 2 * n : (n * bits + 7) / 8);
        lo = code_at < lo ? code_at : lo, hi = end > hi ? end : hi;
        if (kind == 1 || kind == 2) { /* a log8 (one byte) or float16 (two) scale */
            lo = scale_at < lo ? scale_at : lo;
            hi = scale_at + kind > hi ? scale_at + kind : hi;
        }
    }
    span[0] = lo == INT64_MAX ? 0 : lo, span[1] = hi;
}

/* A head's one float32 segment covering [0, width), at least VW wide: read where it lies in the cache. */
static inline int direct_segment(const int32_t *segments, int32_t first, int32_t last, int32_t width) {
    const int32_t *sg = segments + 6 * first;
    return VW >= 8 && last - first == 1 && sg[0] == 0 && sg[1] == width && sg[2] == 32 && width >= VW &&
           sg[3] % 4 == 0;
}

/* Where one request's blocks lie and which of their rows it sees. Either a StepPlan's (ids64 [B], valid [B ·
 * block_size]: any window), or vLLM's own block table row (ids32) and the request's length `seq`: every row before
 * it seen, the only case of a decode step without a sliding window, which then needs no plan from Python (one per
 * KV cache group and step: with per-layer page sizes, vLLM makes a group of each size, 17 on SmolLM2's 0.99
 * export). `ones` and `partial` [block_size]: a full block's and the last block's rows seen. */
typedef struct {
    const int64_t *ids64;
    const uint8_t *valid;
    const int32_t *ids32;
    int64_t lo, seq; /* table path: rows [lo, seq) are read from codes (lo > 0: a windowed layer's sinks skipped) */
    const uint8_t *ones;
    uint8_t *edge; /* a block only partly inside [lo, seq): its mask, written by block_seen */
} request_blocks;

static inline int64_t block_id(const request_blocks *rq, int64_t b) { return rq->ids64 ? rq->ids64[b] : rq->ids32[b]; }

static inline const uint8_t *block_seen(const request_blocks *rq, int64_t b, int64_t block_size) {
    if (rq->valid) return rq->valid + b * block_size;
    int64_t start = b * block_size;
    if (start >= rq->lo && start + block_size <= rq->seq) return rq->ones;
    for (int64_t r = 0; r < block_size; r++) rq->edge[r] = start + r >= rq->lo && start + r < rq->seq;
    return rq->edge;
}

/* Decode attention read straight from the paged cache's codes: for each request n and KV head g, the group's
 * query heads attend over the request's S = B * block_size rows (block b of
 * request n is blocks[block_ids[n, b]], a block holds block_size rows of row_bytes; valid [N, S]) without writing
 * a decoded cache or gathering the blocks. One pass, block by block (flash attention's online softmax): a
 * block's keys are scored against the group's queries, the sums so far rescaled if the largest score grew, then
 * the block's values added with their weights — the block's bytes read once, while the next block's are fetched.
 * Band codes and 16-bit numbers are decoded into a buffer first; float32 numbers (a rank layer of a float32
 * model) are read where they lie: copying them first cost a memcpy call per row and head, 2 x 128 per block.
 * Segments per head: k_first[g] .. k_first[g + 1] of k_segments (out_at relative to the head's first dim,
 * bytes relative to the row), likewise for values. q [N, Σ_h d_k(g(h))], out [N, Σ_h d_v(g(h))] float32, heads
 * packed in order, a KV head's `group` query heads next to each other. A query with no valid row gives 0. */
static void attend(const uint8_t *blocks, const request_blocks *rq, int64_t first_block, int64_t last_block,
                   int64_t block_size, int64_t block_bytes, int64_t row_bytes, const float *qg, int32_t group,
                   int32_t d_k, int32_t d_v, const int32_t *k_segments, int32_t k_first, int32_t k_last,
                   const int32_t *v_segments, int32_t v_first, int32_t v_last, const float *log8, float scaling,
                   float *kbuf, float *vbuf, int64_t padded, float *qpad, float *w, float *accpad, float *acc,
                   float *top, float *total) {
    /* One KV head of one request over its blocks [first_block, last_block): the group's unnormalised sums acc
     * [group, d_v], their largest score top [group] and the sum of exp(score - top) total [group]. A decoded
     * block's keys (values) go to kbuf (vbuf) [block_size, padded]; w [group, block_size].
     * Every product runs over whole vectors (rows_view): decoded rows at their widths rounded up to 16 (kp, vp; a
     * multiple of VW), the queries' copy qpad [group, kp] and kbuf's columns [d_k, kp) zero (a decode writes
     * [0, d_k) only; a wider head may have left numbers there, NaN from an unwritten row among them, and 0 · NaN
     * is NaN), the sums kept at the padded width in accpad [group, vp] (its columns past d_v, whatever vbuf held
     * there, are dropped). An export's widths are uneven (58, 47, 31, ...): a scalar tail per row cost more than
     * the vectors before it. block_bytes: from one block to the next (block_size · row_bytes unless block-outer). */
    const int32_t kp = (d_k + 15) / 16 * 16, vp = (d_v + 15) / 16 * 16;
    float best[64]; /* a block's largest score per query (group <= 64: decode_attention_c's contract) */
    int64_t span[4];
    segment_span(k_segments, k_first, k_last, span);
    segment_span(v_segments, v_first, v_last, span + 2);
    const int k_direct = direct_segment(k_segments, k_first, k_last, d_k);
    const int v_direct = direct_segment(v_segments, v_first, v_last, d_v);
    /* The views' columns relative to a block's start (direct) or kbuf/vbuf. kp ≥ full + VW wherever there is a
     * tail (kp is a multiple of VW above d_k > full), so the tail's lanes fit in qpad's and accpad's rows. */
    rows_view kv = {kbuf, padded, kp, 0, d_k}, vv = {vbuf, padded, vp, 0, d_v};
    if (k_direct) kv = (rows_view){NULL, row_bytes / 4, d_k / VW * VW, d_k % VW != 0, d_k};
    if (v_direct) vv = (rows_view){NULL, row_bytes / 4, d_v / VW * VW, d_v % VW != 0, d_v};
    for (int32_t j = 0; j < group; j++) {
        top[j] = -INFINITY, total[j] = 0.0f;
        float *qj = qpad + j * kp;
        for (int32_t c = 0; c < kp; c++) qj[c] = c < d_k && c < kv.full ? qg[j * d_k + c] * scaling : 0.0f;
        if (kv.tail) /* the tail's lanes: columns d_k − VW + i, zero where a whole vector already holds them */
            for (int32_t i = 0; i < VW; i++) {
                int32_t c = d_k - VW + i;
                qj[kv.full + i] = c >= kv.full ? qg[j * d_k + c] * scaling : 0.0f;
            }
        for (int32_t c = 0; c < vp; c++) accpad[j * vp + c] = 0.0f;
    }
    if (!k_direct && kp > d_k)
        for (int64_t r = 0; r < block_size; r++)
            memset(kbuf + r * padded + d_k, 0, sizeof(float) * (size_t)(kp - d_k));
    for (int64_t b = first_block; b < last_block; b++) {
        const uint8_t *block = blocks + block_id(rq, b) * block_bytes, *seen = block_seen(rq, b, block_size);
        const uint8_t *next = b + 1 < last_block ? blocks + block_id(rq, b + 1) * block_bytes : NULL;
        int any = 0, all = 1;
        for (int64_t r = 0; r < block_size; r++) any |= seen[r], all &= seen[r] != 0;
        if (!any) continue;
        if (k_direct)
            kv.cols = (const float *)(block + k_segments[6 * k_first + 3]);
        else
            decode_segments(block, row_bytes, row_bytes, block_size, k_segments, k_first, k_last, log8, kbuf, padded);
        for (int32_t j = 0; j < group; j++) best[j] = top[j];
        /* Rows read in place (float32) and rows decoded into a buffer are scored and fetched differently: each way
         * measured the faster for its own rows on SmolLM2's 30 layers at 4K tokens (kvfold-bench kernels on CPU
         * does not time this; the figures are in docs/notebook.md). In place: the next block's lines of this head's
         * rows fetched in one burst before the block, then query by query, four rows at a time. Decoded: from the
         * buffer by score_rows (sixteen rows a query with AVX-512, else four queries at a time), the next block
         * fetched meanwhile. */
        if (k_direct) {
            if (next)
                for (int64_t r = 0; r < block_size; r++) prefetch_row(next + r * row_bytes, span);
            for (int32_t j = 0; j < group; j++)
                best[j] = score_rows_one(qpad + j * kp, kv, block_size, seen, w + j * block_size, top[j]);
        } else {
            score_rows(qpad, kp, kv, block_size, seen, w, best, group, next, row_bytes, span);
        }
        for (int32_t j = 0; j < group; j++) {
            float m = best[j];
            if (m > top[j]) { /* a larger score: the sums so far rescaled to it */
                float shrink = expf(top[j] - m); /* 0 before the first row */
                total[j] *= shrink;
                for (int32_t c = 0; c < vp; c += VW) storev(accpad + j * vp + c, loadv(accpad + j * vp + c) * shrink);
                top[j] = m;
            }
            int64_t r = 0;
            for (; r + VW <= block_size; r += VW) { /* VW rows' weights at once; rows not seen weigh 0 */
                vu8 seen_v;
                memcpy(&seen_v, seen + r, sizeof seen_v);
                vi keep = __builtin_convertvector(seen_v, vi) != 0;
                vf e = (vf)((vi)expv(loadv(w + j * block_size + r) - m) & keep);
                storev(w + j * block_size + r, e);
                total[j] += sumv(e);
            }
            for (; r < block_size; r++) {
                float e = seen[r] ? expf(w[j * block_size + r] - m) : 0.0f;
                w[j * block_size + r] = e;
                total[j] += e;
            }
        }
        if (v_direct)
            vv.cols = (const float *)(block + v_segments[6 * v_first + 3]);
        else
            decode_segments(block, row_bytes, row_bytes, block_size, v_segments, v_first, v_last, log8, vbuf, padded);
        for (int32_t j = 0; j < group; j++) add_rows(accpad + j * vp, vv, block_size, seen, all, w + j * block_size);
    }
    for (int32_t j = 0; j < group; j++) /* a tail's lane i holds column d_v − VW + i */
        for (int32_t c = 0; c < d_v; c++)
            acc[j * d_v + c] = c < vv.full ? accpad[j * vp + c] : accpad[j * vp + vv.full + c - (d_v - VW)];
}

/* A windowed layer's request of seq tokens reads positions [lo, hi) from codes (kvfold_decode_attention); without
 * a ring, all of them. */
static inline void code_rows(int64_t seq, int64_t sinks, int64_t window, int windowed, int64_t *lo, int64_t *hi) {
    *lo = windowed ? (sinks < seq ? sinks : seq) : 0;
    *hi = !windowed || seq - window > *lo ? seq - window * windowed : *lo;
}

/* The ring row of position p (kernels/paged_window.ring_slots). */
static inline int64_t ring_slot(int64_t p, int64_t sinks, int64_t window) {
    return p < sinks || window == 0 ? p : sinks + (p - sinks) % window;
}

/* Where KV head g's queries start in a row of q (packed query heads). */
static inline int32_t q_at_of(const int32_t *d_k, int32_t g, int32_t group) {
    int32_t at = 0;
    for (int32_t h = 0; h < g; h++) at += group * d_k[h];
    return at;
}

/* Every (request, KV head) over the OpenMP threads; where there are fewer of them than 16 per thread (a short
 * batch of long contexts), each one's blocks are split in parts that are summed afterwards, flash-decoding's
 * way (the parts' sums rescaled to the largest score). Request n reads either a plan's blocks, block_ids [N,
 * n_blocks] and valid [N, n_blocks · block_size] (table NULL), or (block_ids and valid NULL) its row of vLLM's
 * block table, table [N, ≥ n_blocks] (row stride table_stride) int32, and sees its first seq_lens[n] rows (at most
 * n_blocks blocks). block_bytes: from one block to the next (0: block_size · row_bytes, the blocks contiguous).
 * `ring` (table path only; NULL: none): a windowed bits layer (kernels/paged_window.py), int64s
 *   0 rows*  1 numbers from one ring to the next  2 numbers from one ring row to the next  3 ring_ids* (int32 [N])
 *   4 sinks  5 window  6 the rows' numbers (number_size's formats: the model's dtype)
 * (*: addresses): request n reads positions [lo, hi) from codes, lo = min(sinks, seq), hi = max(lo, seq − window),
 * and the others from its ring of rows [k | v] (packed widths), the query's own row already written there
 * (kvfold_decode_layer); merged with the codes' parts where those are summed. Returns 0, or -1 when out of memory. */
int kvfold_decode_attention(const uint8_t *blocks, const int64_t *block_ids, const int32_t *table, int64_t table_stride,
                            const int32_t *seq_lens, int64_t n_blocks, int64_t block_size, int64_t block_bytes,
                            const uint8_t *valid, int64_t row_bytes, const float *q, float *out, int64_t n_req,
                            int32_t n_kv, int32_t group, const int32_t *d_k, const int32_t *d_v,
                            const int32_t *k_segments, const int32_t *k_first, const int32_t *v_segments,
                            const int32_t *v_first, const float *log8, float scaling, const int64_t *ring) {
    int32_t widest = 1, q_width = 0, o_width = 0, k_width = 0, failed = 0;
    for (int32_t g = 0; g < n_kv; g++) {
        widest = d_k[g] > widest ? d_k[g] : widest;
        widest = d_v[g] > widest ? d_v[g] : widest;
        q_width += group * d_k[g];
        o_width += group * d_v[g];
        k_width += d_k[g];
    }
    if (!block_bytes) block_bytes = block_size * row_bytes;
    const int64_t sinks = ring ? ring[4] : 0, window = ring ? ring[5] : 0;
    if (table) { /* the blocks the longest request reads */
        int64_t longest = 0;
        for (int64_t n = 0; n < n_req; n++) longest = seq_lens[n] > longest ? seq_lens[n] : longest;
        longest = (longest + block_size - 1) / block_size;
        n_blocks = longest < n_blocks ? longest : n_blocks;
    }
    int64_t heads = n_req * n_kv, want = 16 * (int64_t)omp_get_max_threads();
    int64_t parts = heads >= want ? 1 : (want + heads - 1) / heads;
    parts = parts > n_blocks ? n_blocks : parts;
    parts = parts < 1 ? 1 : parts; /* no block to read (every request empty): one empty part each */
    int64_t per_part = (n_blocks + parts - 1) / parts, stride = (int64_t)group * (widest + 2);
    float *partial = malloc(sizeof(float) * (size_t)(heads * parts * stride));
    if (!partial) return -1;
    /* torch's own OpenMP threads (the same libgomp.so.1 is loaded once per process), one buffer set each */
#pragma omp parallel reduction(| : failed)
    {
        /* the decoded block's rows: 64-byte aligned, each `padded` floats (the widest head rounded up to 16) */
        int64_t padded = (widest + 15) / 16 * 16, buf_floats = block_size * padded;
        float *kbuf = aligned_alloc(64, sizeof(float) * (size_t)(2 * buf_floats + 2 * group * padded));
        float *vbuf = kbuf ? kbuf + buf_floats : NULL, *qpad = vbuf ? vbuf + buf_floats : NULL;
        float *accpad = qpad ? qpad + group * padded : NULL;
        float *scores = malloc(sizeof(float) * (size_t)(block_size * group));
        uint8_t *seen = malloc((size_t)(2 * block_size)); /* request_blocks' ones and edge */
        if (!kbuf || !scores || !seen) {
            failed = 1;
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < heads * parts; item++) {
                int64_t n = item / (n_kv * parts), part = item % parts;
                int32_t g = (int32_t)(item / parts % n_kv), q_at = q_at_of(d_k, g, group);
                int64_t b0 = part * per_part, b1 = b0 + per_part > n_blocks ? n_blocks : b0 + per_part;
                float *acc = partial + item * stride, *top = acc + group * widest, *total = top + group;
                request_blocks rq = {NULL, NULL, NULL, 0, 0, seen, seen + block_size};
                if (table) {
                    rq.ids32 = table + n * table_stride;
                    code_rows(seq_lens[n], sinks, window, ring != NULL, &rq.lo, &rq.seq);
                    int64_t count = (rq.seq + block_size - 1) / block_size, first = rq.lo / block_size;
                    b0 = b0 > first ? b0 : first;
                    b1 = b1 < count ? b1 : count;
                    memset(seen, 1, (size_t)block_size);
                } else {
                    rq.ids64 = block_ids + n * n_blocks, rq.valid = valid + n * n_blocks * block_size;
                }
                if (b0 >= b1) {
                    for (int32_t j = 0; j < group; j++) top[j] = -INFINITY, total[j] = 0.0f;
                    continue;
                }
                attend(blocks, &rq, b0, b1, block_size, block_bytes, row_bytes, q + n * q_width + q_at, group, d_k[g], d_v[g],
                       k_segments, k_first[g], k_first[g + 1], v_segments, v_first[g], v_first[g + 1], log8, scaling,
                       kbuf, vbuf, padded, qpad, scores, accpad, acc, top, total);
            }
        }
        free(kbuf);
        free(scores);
        free(seen);
    }
    /* the parts of each (request, KV head) summed: out = Σ acc·e^(top - m) / Σ total·e^(top - m); a few heads'
     * sums (batch 1: SmolLM2's 3) cost less than waking the threads for a second parallel region */
    if (!failed) {
#pragma omp parallel for schedule(static) reduction(| : failed) if (heads * parts >= 64)
        for (int64_t head = 0; head < heads; head++) {
            int64_t n = head / n_kv;
            int32_t g = (int32_t)(head % n_kv), o_at = 0;
            for (int32_t h = 0; h < g; h++) o_at += group * d_v[h];
            float *og = out + n * o_width + o_at;
            /* a windowed layer's whole rows: positions [0, lo) and [hi, seq), from the request's ring */
            int64_t lo = 0, hi = 0, n_whole = 0, k_at = 0, v_at = k_width;
            for (int32_t h = 0; h < g; h++) k_at += d_k[h], v_at += d_v[h];
            if (ring) {
                code_rows(seq_lens[n], sinks, window, 1, &lo, &hi);
                n_whole = lo + seq_lens[n] - hi;
            }
            /* whole row i's keys at kr[i], values at vr[i]: float32 rows read in place, 16-bit ones widened once
             * here into `wide` (each is read once per query of the group) */
            const float *kr[n_whole + 1], *vr[n_whole + 1];
            float *wide = n_whole && ring[6] ? malloc(sizeof(float) * (size_t)(n_whole * (d_k[g] + d_v[g]))) : NULL;
            if (n_whole && ring[6] && !wide) {
                failed = 1;
                continue;
            }
            for (int64_t i = 0; i < n_whole; i++) {
                const uint8_t *row = (const uint8_t *)ring[0] + number_size((int32_t)ring[6]) *
                    (((const int32_t *)ring[3])[n] * ring[1] + ring_slot(i < lo ? i : hi + i - lo, sinks, window) *
                     ring[2]);
                if (!wide) {
                    kr[i] = (const float *)row + k_at, vr[i] = (const float *)row + v_at;
                    continue;
                }
                float *w = wide + i * (d_k[g] + d_v[g]);
                to_floats(row + 2 * k_at, (int32_t)ring[6], d_k[g], w);
                to_floats(row + 2 * v_at, (int32_t)ring[6], d_v[g], w + d_k[g]);
                kr[i] = w, vr[i] = w + d_k[g];
            }
            const float *qg = q + n * q_width + q_at_of(d_k, g, group);
            float whole[n_whole + 1]; /* scores of one query over them (at most sinks + window) */
            for (int32_t j = 0; j < group; j++) {
                float m = -INFINITY, sum = 0.0f, *oj = og + j * d_v[g];
                const float *qj = qg + j * d_k[g];
                for (int64_t part = 0; part < parts; part++) {
                    float t = partial[(head * parts + part) * stride + group * widest + j];
                    m = t > m ? t : m;
                }
                for (int64_t i = 0; i < n_whole; i++) { /* a vector at a time: a scalar sum waits on each add */
                    const float *row = kr[i];
                    int32_t c = 0;
                    vf acc = {0};
                    for (; c + VW <= d_k[g]; c += VW) acc = acc + loadv(qj + c) * loadv(row + c);
                    float dot = sumv(acc);
                    for (; c < d_k[g]; c++) dot += qj[c] * row[c];
                    whole[i] = dot * scaling;
                    m = whole[i] > m ? whole[i] : m;
                }
                for (int32_t c = 0; c < d_v[g]; c++) oj[c] = 0.0f;
                if (m == -INFINITY) continue; /* no row seen: 0 */
                for (int64_t part = 0; part < parts; part++) {
                    const float *acc = partial + (head * parts + part) * stride, *top = acc + group * widest;
                    if (top[j] == -INFINITY) continue; /* a part with no row seen (its sums were never written) */
                    float w = expf(top[j] - m);
                    sum += w * top[group + j];
                    for (int32_t c = 0; c < d_v[g]; c++) oj[c] += w * acc[j * d_v[g] + c];
                }
                for (int64_t i = 0; i < n_whole; i++) {
                    const float *row = vr[i];
                    float w = expf(whole[i] - m);
                    sum += w;
                    int32_t c = 0;
                    for (; c + VW <= d_v[g]; c += VW) storev(oj + c, loadv(oj + c) + w * loadv(row + c));
                    for (; c < d_v[g]; c++) oj[c] += w * row[c];
                }
                for (int32_t c = 0; c < d_v[g]; c++) oj[c] /= sum;
            }
            free(wide);
        }
    }
    free(partial);
    return failed ? -1 : 0;
}

/* One layer's decode step in one call: this step's keys k [n_req, k_stride] and values v [n_req, v_stride] written
 * into their slots (slot −1: padding, skipped) — a bits layer's encoded into band codes, a rank layer's numbers
 * copied (its cache holds them in the step's dtype) —, then kvfold_decode_attention of q over vLLM's block table and
 * lengths into out. q, k, v, out and a ring's rows hold numbers of format `fmt` (number_size's: the model's dtype;
 * strides count numbers): 16-bit ones are widened to float32 here and out narrowed at the end. What does not change
 * from step to step is `layer`, int64s that cpu_step.DecodeLayer packs once per layer:
 *   0 banded  1 row_bytes  2 block_size  3 key_bytes  4 n_kv  5 group  6 d_k*  7 d_v*  8 k_rows*  9 n_k_rows
 *   10 v_rows*  11 n_v_rows  12 k_segments*  13 k_first*  14 v_segments*  15 v_first*  16 log8*  17 fit_steps
 * (*: addresses). At batch 1 a layer's Python, three ctypes calls and their ~50 arguments cost more than its
 * attention over a short context; this is one call of eighteen. Returns kvfold_decode_attention's. */
int kvfold_decode_layer(const int64_t *layer, const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                        const int64_t *slots, uint8_t *cache, int64_t block_bytes, const int32_t *table,
                        int64_t table_stride, const int32_t *seq_lens, int64_t n_blocks, const void *q, void *out,
                        int64_t n_req, float scaling, const int64_t *ring, int32_t fmt) {
    const int64_t row_bytes = layer[1], block_size = layer[2], key_bytes = layer[3];
    const int32_t n_kv = (int32_t)layer[4], group = (int32_t)layer[5];
    const int32_t *d_k = (const int32_t *)layer[6], *d_v = (const int32_t *)layer[7];
    const float *log8 = (const float *)layer[16];
    const size_t size = number_size(fmt);
    int32_t k_width = 0, v_width = 0;
    for (int32_t g = 0; g < n_kv; g++) k_width += d_k[g], v_width += d_v[g];
    if (!block_bytes) block_bytes = block_size * row_bytes;
    if (layer[0]) {
#pragma omp parallel for schedule(static) if (n_req >= 128)
        for (int64_t r = 0; r < n_req; r++) {
            if (slots[r] < 0) continue; /* padding */
            uint8_t *row = cache + slot_offset(slots[r], block_size, block_bytes, row_bytes);
            const float *kf = (const float *)((const uint8_t *)k + r * k_stride * size);
            const float *vf = (const float *)((const uint8_t *)v + r * v_stride * size);
            float wide[fmt ? k_width + v_width : 1]; /* the encoder reads float32: one token's row */
            if (fmt) {
                to_floats(kf, fmt, k_width, wide), to_floats(vf, fmt, v_width, wide + k_width);
                kf = wide, vf = wide + k_width;
            }
            encode_segments(kf, (const int32_t *)layer[8], (int32_t)layer[9], log8, (int32_t)layer[17], row);
            encode_segments(vf, (const int32_t *)layer[10], (int32_t)layer[11], log8, (int32_t)layer[17],
                            row + key_bytes);
        }
    } else {
        for (int64_t r = 0; r < n_req; r++) {
            if (slots[r] < 0) continue;
            uint8_t *row = cache + slot_offset(slots[r], block_size, block_bytes, row_bytes);
            memcpy(row, (const uint8_t *)k + r * k_stride * size, (size_t)key_bytes);
            memcpy(row + key_bytes, (const uint8_t *)v + r * v_stride * size, (size_t)(row_bytes - key_bytes));
        }
    }
    if (ring) { /* a windowed layer: the step's whole row into its ring too (its slot held position seq − 1 − window,
                 * which this query reads from codes), so that the attention reads every whole row from the ring */
        for (int64_t r = 0; r < n_req; r++) {
            int64_t p = seq_lens[r] - 1;
            if (p < 0 || (p >= ring[4] && ring[5] == 0)) continue; /* past the sinks, no window: codes only */
            uint8_t *row = (uint8_t *)ring[0] + size * (((const int32_t *)ring[3])[r] * ring[1] +
                                                        ring_slot(p, ring[4], ring[5]) * ring[2]);
            memcpy(row, (const uint8_t *)k + r * k_stride * size, size * (size_t)k_width);
            memcpy(row + size * k_width, (const uint8_t *)v + r * v_stride * size, size * (size_t)v_width);
        }
    }
    const float *qf = q;
    float *of = out;
    int64_t q_numbers = n_req * group * k_width, o_numbers = n_req * group * v_width;
    if (fmt) { /* the attention reads and writes float32 */
        float *buf = malloc(sizeof(float) * (size_t)(q_numbers + o_numbers));
        if (!buf) return -1;
        to_floats(q, fmt, q_numbers, buf);
        qf = buf, of = buf + q_numbers;
    }
    int failed = kvfold_decode_attention(cache, NULL, table, table_stride, seq_lens, n_blocks, block_size, block_bytes,
                                         NULL, row_bytes, qf, of, n_req, n_kv, group, d_k, d_v,
                                         (const int32_t *)layer[12], (const int32_t *)layer[13],
                                         (const int32_t *)layer[14], (const int32_t *)layer[15], log8, scaling, ring);
    if (fmt) {
        if (!failed) from_floats(of, fmt, o_numbers, out);
        free((void *)qf);
    }
    return failed;
}

typedef struct {
    const float *k, *v;
    int64_t k_stride, v_stride, sink_end, window_row; /* row r ≥ sink_end is k[window_row + r − sink_end] */
} window_rows;

static inline __attribute__((always_inline)) const float *window_row(const window_rows *w, const float *base,
                                                                     int64_t stride, int64_t r) {
    return base + (r < w->sink_end ? r : w->window_row + r - w->sink_end) * stride;
}

/* Query i's whole rows: the sink rows below it, then the window positions from max(sinks, i − window + 1) to i (held
 * rows: n_sinks sink rows, then positions [lo, s)) -> w's sink_end and window_row, and their count. */
static inline int64_t window_span(int64_t i, int64_t sinks, int64_t window, int64_t n_sinks, int64_t lo,
                                  window_rows *w) {
    int64_t first = i - window + 1;
    first = first > sinks ? first : sinks;
    w->sink_end = i + 1 < n_sinks ? i + 1 : n_sinks;
    w->window_row = n_sinks + first - lo;
    return w->sink_end + (i + 1 > first ? i + 1 - first : 0);
}

/* score[r] = e^(score[r] − m) for r < n, whole vectors (the lanes up to the next multiple of VW set to m first, so
 * they read e^0), and the sum of the n. score holds n rounded up to whole vectors. */
static inline float exp_sum(float *score, int64_t n, float m) {
    for (int64_t r = n; r < (n + VW - 1) / VW * VW; r++) score[r] = m;
    vf total = {0};
    for (int64_t r = 0; r < n; r += VW) {
        vf e = expv(loadv(score + r) - m);
        storev(score + r, e);
        total += r + VW <= n ? e : (vf){0}; /* the padded lanes past n are e^0 */
    }
    float sum = sumv(total);
    for (int64_t r = n / VW * VW; r < n; r++) sum += score[r]; /* the last partial vector's own lanes */
    return sum;
}

/* One query's attention over its n whole rows (window_rows w), any widths: out normalised, the log-sum-exp returned.
 * `score` holds n rounded up to whole vectors. Heads of one width in whole vectors take window_queries below. */
static float window_query(const float *qj, const window_rows *w, int64_t n, int32_t dk, int32_t dv, float scaling,
                          float *score, float *oj) {
    float m = -INFINITY;
    for (int64_t r = 0; r < n; r++) {
        const float *kr = window_row(w, w->k, w->k_stride, r);
        int32_t c = 0;
        vf dot = {0};
        for (; c + VW <= dk; c += VW) dot = dot + loadv(qj + c) * loadv(kr + c);
        float d = sumv(dot);
        for (; c < dk; c++) d += qj[c] * kr[c];
        score[r] = d * scaling;
        m = score[r] > m ? score[r] : m;
    }
    const float sum = exp_sum(score, n, m);
    for (int32_t c = 0; c < dv; c++) oj[c] = 0.0f;
    for (int64_t r = 0; r < n; r++) {
        const float *vr = window_row(w, w->v, w->v_stride, r);
        int32_t c = 0;
        for (; c + VW <= dv; c += VW) storev(oj + c, loadv(oj + c) + score[r] * loadv(vr + c));
        for (; c < dv; c++) oj[c] += score[r] * vr[c];
    }
    for (int32_t c = 0; c < dv; c++) oj[c] /= sum;
    return m + logf(sum);
}

/* a · b + c, fused where the CPU has FMA (the library builds with -ffp-contract=off, so the encoder's rounding is
 * torch's: the attention's sums may fuse, as the attention is compared within a tolerance) */
static inline vf fmav(vf a, vf b, vf c) {
#if KVFOLD_SIMD && VW == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif KVFOLD_SIMD && VW == 8 && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

/* x in every lane: one broadcast (`(vf){0} + x` adds first; a loop over the lanes builds it lane by lane) */
static inline vf splat(float x) {
#if KVFOLD_SIMD && VW == 16
    return (vf)_mm512_set1_ps(x);
#elif KVFOLD_SIMD && VW == 8
    return (vf)_mm256_set1_ps(x);
#else
    return (vf){0} + x;
#endif
}

/* CALL(NQ, NV) with compile-time counts for nq queries (≤ 4; ≤ 2 where nv is 8) and nv vectors a head (2, 4 or 8),
 * so a kernel's sums stay in registers. */
#define WITH_COUNTS(nq, nv, CALL)                                                                                      \
    switch ((nq) * 16 + (nv)) {                                                                                        \
    case 0x12: CALL(1, 2); break;                                                                                      \
    case 0x22: CALL(2, 2); break;                                                                                      \
    case 0x32: CALL(3, 2); break;                                                                                      \
    case 0x42: CALL(4, 2); break;                                                                                      \
    case 0x14: CALL(1, 4); break;                                                                                      \
    case 0x24: CALL(2, 4); break;                                                                                      \
    case 0x34: CALL(3, 4); break;                                                                                      \
    case 0x44: CALL(4, 4); break;                                                                                      \
    case 0x18: CALL(1, 8); break;                                                                                      \
    case 0x28: CALL(2, 8); break;                                                                                      \
    default: __builtin_unreachable();                                                                                  \
    }

/* The scores of NQ queries qs[j] (dk floats each) over `count` held rows from `from` on, scaled, into
 * score[j · stride + r]: up to 4 vectors of rows at a time from the transposed keys kt [dk][cols], dim by dim, each
 * query's dim broadcast once and each key vector loaded once for the NQ queries (no sum across lanes). Writes whole
 * vectors: up to VW − 1 past `count`. */
static inline __attribute__((always_inline)) void window_scores(const float *kt, int64_t cols, int32_t dk,
                                                                const float *const *qs, int64_t from, int64_t count,
                                                                float scaling, float *score, int64_t stride,
                                                                const int NQ) {
    for (int64_t r = 0; r < count; r += 4 * VW) {
        const int64_t nb = (count - r + VW - 1) / VW; /* vectors left: this pass takes up to 4 */
        vf acc[4][4] = {{{0}}};
        for (int32_t c = 0; c < dk; c++) {
            const float *kc = kt + c * cols + from + r;
            vf qc[4];
            for (int j = 0; j < NQ; j++) qc[j] = splat(qs[j][c]);
            for (int b = 0; b < 4; b++) {
                if (b >= nb) break;
                const vf key = loadv(kc + b * VW);
                for (int j = 0; j < NQ; j++) acc[j][b] = fmav(qc[j], key, acc[j][b]);
            }
        }
        for (int j = 0; j < NQ; j++)
            for (int b = 0; b < 4 && b < nb; b++) storev(score + j * stride + r + b * VW, acc[j][b] * scaling);
    }
}

/* NQ queries of one KV head (key and value widths both NV vectors) over their n whole rows (window_rows w; held
 * row r's keys at column r of kt, see kvfold_window_part): outputs oj[j] normalised, log-sum-exps into lse[j].
 * Each value row is loaded once for the NQ queries. `score`: NQ rows of `stride` ≥ n rounded up to whole vectors
 * plus one. */
static inline __attribute__((always_inline)) void window_queries(const float *kt, int64_t cols, const float *const *qs,
                                                                 const window_rows *w, int64_t n, int64_t window_from,
                                                                 float scaling, float *score, int64_t stride,
                                                                 float *const *oj, float *lse, const int NQ,
                                                                 const int NV) {
    const int32_t dk = NV * VW;
    window_scores(kt, cols, dk, qs, 0, w->sink_end, scaling, score, stride, NQ);
    window_scores(kt, cols, dk, qs, window_from, n - w->sink_end, scaling, score + w->sink_end, stride, NQ);
    float sum[4];
    for (int j = 0; j < NQ; j++) {
        float *sj = score + j * stride, m = -INFINITY;
        for (int64_t r = 0; r < n; r++) m = sj[r] > m ? sj[r] : m;
        sum[j] = exp_sum(sj, n, m);
        lse[j] = m + logf(sum[j]);
    }
    vf acc[4][NV];
    for (int j = 0; j < NQ; j++)
        for (int c = 0; c < NV; c++) acc[j][c] = (vf){0};
    for (int64_t r = 0; r < n; r++) {
        const float *vr = window_row(w, w->v, w->v_stride, r);
        for (int c = 0; c < NV; c++) {
            const vf value = loadv(vr + c * VW);
            for (int j = 0; j < NQ; j++) acc[j][c] = fmav(splat(score[j * stride + r]), value, acc[j][c]);
        }
    }
    for (int j = 0; j < NQ; j++)
        for (int c = 0; c < NV; c++) storev(oj[j] + c * VW, acc[j][c] / sum[j]);
}

/* The whole part of a windowed layer's prefill (kernels/window_prefill.py, its torch twin `_whole`): each of the t
 * queries q [t, q_width] (packed widths) at positions [s − t, s) over its whole rows only — the sinks below it and
 * the window rows past the sinks, i − window < j ≤ i — normalised into out [t, n_kv, group, widest] and the
 * log-sum-exp of its scaled scores into lse [t, n_kv, group]. Rows k [n_held, k_stride] and v [n_held, v_stride]
 * (float32, packed widths, unit stride) are whole_positions' order: the sink rows, then positions [lo, s).
 * One (query, KV head) a task. Heads whose key and value widths are the same whole number of vectors (64, 128)
 * score from the keys transposed once per call (kt: a vector holds VW rows' dim c, so a score needs no sum across
 * lanes) and take their group's queries a few at a time, each key and value vector loaded once for them: one
 * SmolLM2 layer at 4K tokens on one AVX-512 core, 21 ms one query and one key at a time, 19 ms so. Other widths
 * (and where the transposed keys cannot be allocated): one query at a time (window_query). */
void kvfold_window_part(const float *q, int64_t t, int64_t q_width, const float *k, int64_t n_held, int64_t k_stride,
                        const float *v, int64_t v_stride, const int32_t *d_k, const int32_t *d_v, int32_t n_kv, int32_t group,
                        int64_t s, int64_t sinks, int64_t window, float scaling, float *out, int64_t widest,
                        float *lse) {
    const int64_t n_sinks = sinks < s ? sinks : s, lo = s - (n_held - n_sinks); /* the held window rows: [lo, s) */
    const int64_t cols = (n_held + VW - 1) / VW * VW + VW; /* kt's columns: a vector load from any row stays inside */
    int64_t width = 0;
    for (int32_t g = 0; g < n_kv; g++) width += d_k[g];
    float *kt = calloc((size_t)(width * cols), sizeof(float)); /* [Σ d_k][cols]: column r is held row r's keys */
    if (kt != NULL) {
#pragma omp parallel for schedule(static) if (n_held * width >= 65536)
        for (int64_t r0 = 0; r0 < n_held; r0 += VW) /* VW rows at a time: each row read once, whole lines written */
            for (int64_t c = 0; c < width; c++)
                for (int64_t r = r0; r < r0 + VW && r < n_held; r++) kt[c * cols + r] = k[r * k_stride + c];
    }
#pragma omp parallel for schedule(static) if (t * n_kv >= 64)
    for (int64_t task = 0; task < t * n_kv; task++) {
        const int64_t row = task / n_kv, i = s - t + row;
        const int32_t g = (int32_t)(task % n_kv), dk = d_k[g], dv = d_v[g];
        int64_t k_at = 0, v_at = 0;
        for (int32_t h = 0; h < g; h++) k_at += d_k[h], v_at += d_v[h];
        window_rows w = {k + k_at, v + v_at, k_stride, v_stride, 0, 0};
        const int64_t n = window_span(i, sinks, window, n_sinks, lo, &w), stride = (n + VW - 1) / VW * VW + VW;
        float score[4 * stride];
        const float *qg = q + row * q_width + q_at_of(d_k, g, group);
        float *og = out + (row * n_kv + g) * group * widest, *lg = lse + (row * n_kv + g) * group;
        const int nv = dk == dv && dk % VW == 0 && (dk / VW == 2 || dk / VW == 4 || dk / VW == 8) && kt != NULL && n > 0
                           ? dk / VW : 0;
        const int per = nv <= 4 ? 4 : 2; /* queries at once: their sums (per · nv vectors) stay in registers */
        for (int32_t j = 0; j < group && nv > 0; j += per) {
            const int nq = group - j < per ? group - j : per;
            const float *qs[4];
            float *os[4];
            for (int e = 0; e < nq; e++) qs[e] = qg + (j + e) * dk, os[e] = og + (j + e) * widest;
            const float *ktg = kt + k_at * cols;
#define WINDOW_QUERIES(NQ, NV) window_queries(ktg, cols, qs, &w, n, w.window_row, scaling, score, stride, os, lg + j, NQ, NV)
            WITH_COUNTS(nq, nv, WINDOW_QUERIES);
#undef WINDOW_QUERIES
        }
        for (int32_t j = 0; j < group && nv == 0; j++)
            lg[j] = window_query(qg + j * dk, &w, n, dk, dv, scaling, score, og + j * widest);
    }
    free(kt);
}

#if KVFOLD_SIMD && VW == 16 && defined(__AVX512BF16__)
/* kvfold_window_part for bfloat16 rows and queries (the model's dtype; products of two bfloat16 are exact in
 * float32), on CPUs with AVX512-BF16: one instruction takes a pair of numbers a lane (vdpbf16ps), so a score or an
 * output costs half the float32 kernel's instructions. Keys: pairs of dims transposed (kp[pair][row]: a 32-bit word
 * holds a row's dims 2c and 2c + 1, one vector 16 rows); values: pairs of rows (vp[row / 2][dim]: a word holds a
 * dim of rows 2r and 2r + 1), dotted with the probabilities as bfloat16 pairs (rounded from float32: ≤ 2^−9 of
 * each weight, the output's own precision). Every head's key and value widths equal and a multiple of 32 (the
 * caller checks): 1 when done, 0 when a buffer could not be allocated (nothing written). */
static inline __m512 dp_pairs(__m512 acc, uint32_t pair, const uint32_t *words) {
    __m512i w;
    memcpy(&w, words, sizeof w);
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)pair), (__m512bh)w);
}

/* the scores of NQ queries (their dim pairs qs[j]) over `count` held rows from `from` on, as window_scores */
static inline __attribute__((always_inline)) void window_scores_bf16(const uint32_t *kp, int64_t cols, int32_t pairs,
                                                                     const uint32_t *const *qs, int64_t from,
                                                                     int64_t count, float scaling, float *score,
                                                                     int64_t stride, const int NQ) {
    for (int64_t r = 0; r < count; r += 4 * VW) {
        const int64_t nb = (count - r + VW - 1) / VW;
        __m512 acc[4][4];
        for (int j = 0; j < NQ; j++)
            for (int b = 0; b < 4; b++) acc[j][b] = _mm512_setzero_ps();
        for (int32_t c = 0; c < pairs; c++) {
            const uint32_t *kc = kp + c * cols + from + r;
            for (int b = 0; b < 4; b++) {
                if (b >= nb) break;
                for (int j = 0; j < NQ; j++) acc[j][b] = dp_pairs(acc[j][b], qs[j][c], kc + b * VW);
            }
        }
        for (int j = 0; j < NQ; j++)
            for (int b = 0; b < 4 && b < nb; b++)
                _mm512_storeu_ps(score + j * stride + r + b * VW, _mm512_mul_ps(acc[j][b], _mm512_set1_ps(scaling)));
    }
}

/* held rows [from, from + count) of NQ queries' probabilities (prob[j · stride + x] for row from + x) into the
 * outputs acc[j][NV]: row pairs from the even row at or below `from`, a row outside the range weighted 0 */
static inline __attribute__((always_inline)) void window_values_bf16(const uint32_t *vp, int64_t vp_width,
                                                                     const float *prob, int64_t stride, int64_t from,
                                                                     int64_t count, uint16_t *pbuf, __m512 acc[4][8],
                                                                     const int NQ, const int NV) {
    if (count <= 0) return;
    const int64_t base = from & ~(int64_t)1, pairs = (from + count - base + 1) / 2;
    for (int j = 0; j < NQ; j++) { /* the range's probabilities as bfloat16 from `base` on, zero around them */
        uint16_t *pj = pbuf + j * (stride + 2 * VW);
        pj[0] = 0;
        for (int64_t x = 0; x < count + 1; x += VW) { /* lanes past `count` load as 0 */
            const __mmask16 in = x + VW <= count ? 0xffff : (__mmask16)((1u << (count > x ? count - x : 0)) - 1);
            __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(in, prob + j * stride + x));
            memcpy(pj + (from - base) + x, &h, sizeof h);
        }
    }
    for (int64_t p = 0; p < pairs; p++) {
        const uint32_t *vr = vp + (base / 2 + p) * vp_width;
        for (int c = 0; c < NV; c++)
            for (int j = 0; j < NQ; j++) {
                uint32_t pair;
                memcpy(&pair, pbuf + j * (stride + 2 * VW) + 2 * p, 4);
                acc[j][c] = dp_pairs(acc[j][c], pair, vr + c * VW);
            }
    }
}

static inline __attribute__((always_inline)) void window_queries_bf16(
    const uint32_t *kp, int64_t cols, const uint32_t *vp, int64_t vp_width, const uint32_t *const *qs, int64_t sink_end,
    int64_t window_from, int64_t n, float scaling, float *score, int64_t stride, uint16_t *pbuf, float *const *oj,
    float *lse, const int NQ, const int NV) {
    const int32_t pairs = NV * VW / 2;
    window_scores_bf16(kp, cols, pairs, qs, 0, sink_end, scaling, score, stride, NQ);
    window_scores_bf16(kp, cols, pairs, qs, window_from, n - sink_end, scaling, score + sink_end, stride, NQ);
    float sum[4];
    for (int j = 0; j < NQ; j++) { /* softmax in float32, as window_queries */
        float *sj = score + j * stride, m;
        __m512 top = _mm512_set1_ps(-INFINITY);
        for (int64_t r = 0; r < n; r += VW) /* lanes past n (other scores' writes) load as −inf */
            top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY),
                                                          r + VW <= n ? 0xffff : (__mmask16)((1u << (n - r)) - 1), sj + r));
        m = _mm512_reduce_max_ps(top);
        sum[j] = exp_sum(sj, n, m);
        lse[j] = m + logf(sum[j]);
    }
    __m512 acc[4][8];
    for (int j = 0; j < NQ; j++)
        for (int c = 0; c < NV; c++) acc[j][c] = _mm512_setzero_ps();
    window_values_bf16(vp, vp_width, score, stride, 0, sink_end, pbuf, acc, NQ, NV);
    window_values_bf16(vp, vp_width, score + sink_end, stride, window_from, n - sink_end, pbuf, acc, NQ, NV);
    for (int j = 0; j < NQ; j++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(oj[j] + c * VW, _mm512_div_ps(acc[j][c], _mm512_set1_ps(sum[j])));
}

int kvfold_window_part_bf16(const uint16_t *q, int64_t t, int64_t q_width, const uint16_t *k, int64_t n_held,
                            int64_t k_stride, const uint16_t *v, int64_t v_stride, const int32_t *d_k,
                            const int32_t *d_v, int32_t n_kv, int32_t group, int64_t s, int64_t sinks, int64_t window,
                            float scaling, float *out, int64_t widest, float *lse) {
    (void)d_v; /* each head's, equal to d_k (the caller checks) */
    const int64_t n_sinks = sinks < s ? sinks : s, lo = s - (n_held - n_sinks);
    const int64_t cols = (n_held + VW - 1) / VW * VW + 4 * VW, row_pairs = (n_held + 1) / 2 + 1;
    int64_t width = 0;
    for (int32_t g = 0; g < n_kv; g++) width += d_k[g];
    uint32_t *kp = calloc((size_t)(width / 2 * cols), 4), *vp = calloc((size_t)(row_pairs * width), 4);
    if (kp == NULL || vp == NULL) {
        free(kp), free(vp);
        return 0;
    }
#pragma omp parallel for schedule(static) if (n_held * width >= 65536)
    for (int64_t r0 = 0; r0 < n_held; r0 += VW) /* VW rows at a time: each row read once */
        for (int64_t c = 0; c < width / 2; c++)
            for (int64_t r = r0; r < r0 + VW && r < n_held; r++) memcpy(kp + c * cols + r, k + r * k_stride + 2 * c, 4);
#pragma omp parallel for schedule(static) if (n_held * width >= 65536)
    for (int64_t r = 0; r < n_held; r++)
        for (int64_t c = 0; c < width; c++) ((uint16_t *)(vp + r / 2 * width + c))[r % 2] = v[r * v_stride + c];
#pragma omp parallel for schedule(static) if (t * n_kv >= 64)
    for (int64_t task = 0; task < t * n_kv; task++) {
        const int64_t row = task / n_kv, i = s - t + row;
        const int32_t g = (int32_t)(task % n_kv), dk = d_k[g];
        int64_t at = 0;
        for (int32_t h = 0; h < g; h++) at += d_k[h];
        window_rows w = {0}; /* its sink_end and window_row: the rows' addresses are kp's and vp's here */
        const int64_t n = window_span(i, sinks, window, n_sinks, lo, &w), stride = (n + VW - 1) / VW * VW + VW;
        float score[4 * stride];
        uint16_t pbuf[4 * (stride + 2 * VW)];
        const uint16_t *qg = q + row * q_width + q_at_of(d_k, g, group);
        float *og = out + (row * n_kv + g) * group * widest, *lg = lse + (row * n_kv + g) * group;
        const int nv = dk / VW, per = nv <= 4 ? 4 : 2;
        for (int32_t j = 0; j < group; j += per) {
            const int nq = group - j < per ? group - j : per;
            const uint32_t *qs[4];
            float *os[4];
            for (int e = 0; e < nq; e++) qs[e] = (const uint32_t *)(qg + (j + e) * dk), os[e] = og + (j + e) * widest;
#define WINDOW_QUERIES(NQ, NV)                                                                                         \
    window_queries_bf16(kp + at / 2 * cols, cols, vp + at, width, qs, w.sink_end, w.window_row, n, scaling, score,     \
                        stride, pbuf, os, lg + j, NQ, NV)
            WITH_COUNTS(nq, nv, WINDOW_QUERIES);
#undef WINDOW_QUERIES
        }
    }
    free(kp), free(vp);
    return 1;
}
#endif
