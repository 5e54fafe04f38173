/* Band codes read back on a CPU: kvfold_runtime.bands.decode_heads' values, band by band, every bit width a
 * loop of its own with the width a constant, so the compiler unrolls the shifts of a group of codes and
 * vectorises the conversions (kernels/cpu_bits.py builds this once per machine and calls it through ctypes).
 *
 * A row holds, per head, its bands' codes (byte-aligned per band, little-endian bit stream, first dim in the
 * lowest bits) and then one scale per quantized band (kvfold_runtime/bands.py). The caller describes the row
 * once per layer as segments of six int32s:
 *     out_at  first output number          n      numbers
 *     bits    0 (zeros), 2..8, or 16 (float16 values)
 *     code_at its band's first code byte  scale_at its scale's byte     scale_kind 1 log8, 2 float16
 * A b-bit code is x = (q + 1/2 - 2^(b-1)) * s in float32, computed as torch does (an add, then a multiply:
 * built with -ffp-contract=off, so no fused multiply-add changes a rounding).
 */
#include <stdint.h>
#include <string.h>

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

/* n codes of `bits` bits from `codes`; G codes fill GB bytes exactly (G * bits == 8 * GB). A code goes to float
 * through int32: converting an unsigned 64-bit integer is a slow multi-instruction sequence on x86. */
static inline __attribute__((always_inline)) void band(const uint8_t *codes, int n, float *out, float s,
                                                       const int bits, const int G, const int GB) {
    const uint64_t mask = (1u << bits) - 1u;
    const float offset = 0.5f - (float)(1 << (bits - 1));
    int i = 0;
    for (; i + G <= n; i += G, codes += GB) {
        uint64_t w = load_le(codes, GB);
        for (int k = 0; k < G; k++) out[i + k] = ((float)(int32_t)((w >> (k * bits)) & mask) + offset) * s;
    }
    if (i < n) { /* a last, partial group: only its own bytes are read */
        int rest = n - i;
        uint64_t w = load_le(codes, (rest * bits + 7) / 8);
        for (int k = 0; k < rest; k++) out[i + k] = ((float)(int32_t)((w >> (k * bits)) & mask) + offset) * s;
    }
}

void kvfold_decode_rows(const uint8_t *rows, int64_t n_rows, int64_t row_stride, const int32_t *segments,
                        int32_t n_segments, const float *log8, float *out, int64_t out_width) {
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = rows + r * row_stride;
        float *o = out + r * out_width;
        for (int32_t j = 0; j < n_segments; j++) {
            const int32_t *sg = segments + 6 * j;
            int out_at = sg[0], n = sg[1], bits = sg[2], code_at = sg[3], scale_at = sg[4], kind = sg[5];
            float *dst = o + out_at;
            const uint8_t *src = row + code_at;
            if (bits == 0) {
                memset(dst, 0, sizeof(float) * (size_t)n);
                continue;
            }
            if (bits == 16) {
                for (int i = 0; i < n; i++) dst[i] = half_to_float((uint16_t)(src[2 * i] | (src[2 * i + 1] << 8)));
                continue;
            }
            float s = kind == 1 ? log8[row[scale_at]]
                                : half_to_float((uint16_t)(row[scale_at] | (row[scale_at + 1] << 8)));
            switch (bits) { /* constant widths: each case compiles to its own unrolled loop */
            case 2: band(src, n, dst, s, 2, 4, 1); break;
            case 3: band(src, n, dst, s, 3, 8, 3); break;
            case 4: band(src, n, dst, s, 4, 2, 1); break;
            case 5: band(src, n, dst, s, 5, 8, 5); break;
            case 6: band(src, n, dst, s, 6, 4, 3); break;
            case 8: band(src, n, dst, s, 8, 1, 1); break;
            default: memset(dst, 0, sizeof(float) * (size_t)n); /* not a width bands.py writes */
            }
        }
    }
}
