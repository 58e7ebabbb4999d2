/* Quantized prefill: every expert's SwiGLU FFN of a CPU call (T > 16 rows) in one kernel call, on
 * weights of a quantized format (called by kernels/cpu/qgemm.py's run, the prefill half of
 * kernels/cpu/quant.py's dispatch; the decode half is qdecode.c).
 *
 * Shapes:   T tokens, H hidden, F expert FFN width; slots sorted by expert, expert e owning rows
 *           [bounds[e], bounds[e+1]) of tok [S'] (each slot's token) and scale [S'] (its routing
 *           weight).  FC1 W1 [2F, H] (gate rows then up rows), FC2 W2 [H, F], y = x W^T.
 * Formats:  integer GEMM (activations quantized per token to int8, int32 accumulation):
 *             a8w8-int  int8 weights, fp32 scale per output channel
 *             a8w4-int  4-bit weights u = q + 8, fp32 scale per output channel
 *           y = acc * s_x * s_w; FC2's input (the SwiGLU output, fp32) re-quantized per row.
 *           Group-wise a8w4-int / a8w8-int (activations int8 per token and block of 32, fp16 group
 *           scales: quant/a8w4_int.py, quant/a8w8_int.py) run their own integer semantics on
 *           w4-int's / w8-int's panels (their bytes are theirs): the block tiles of blocktiles.h,
 *           exact int32 sums a block, y = sum_b (acc_b s_x) s_w (ACT_INT; a8w8-int with AVX-512
 *           VNNI only).  Elsewhere, and on request, they run as those formats' float panels on
 *           activations quantized per block and dequantized (x by the host, FC2's input here:
 *           fake_quantize_blocks), so y equals its reference up to fp32 rounding: sum_k (q_x s_x)
 *           (q_w s_w) instead (ACT_FLOAT).
 *           Float GEMM on fp32 activations, one weight panel dequantized at a time into a
 *           [K][16] fp32 buffer of the thread (never a dequantized copy of a whole weight):
 *             w4-int (nibble - 8) * fp16 group scale, mxfp4 e2m1 * 2^(e8m0 - 127),
 *             w8-int q * fp16 group scale, mxfp8 e4m3 * 2^(e8m0 - 127), w16 bf16 / fp16.
 * Panels:   16 output rows each (qgemm.py packs them once):
 *             int8 (a8w8)   [K/4][16][4] bytes: byte (k, j) at (k/4)*64 + 4j + k%4
 *             4-bit (a8w4)  [K/8][16][4] bytes: (k, j) in byte (k/8)*64 + 4j + k%4, low nibble
 *                           for k%8 < 4, high nibble else
 *             float formats, 8- and 4-bit codes [K'/4][16][4] bytes (K' bytes a row, the
 *                           canonical packing): lane j of vector c = row j's bytes 4c .. 4c + 3
 *                           (8-bit: k = 4c + i in byte i; 4-bit: k = 8c + i at bits 4i), the
 *                           layout qdecode.c's rows16 loops read for dense T = 1 too; w16 [K][16]
 *                           elements; scales [K/G][16] in the format's own dtype
 *           so one 32-bit lane of a vector holds 4 (or 8) k of one column: what vpdpbusd /
 *           vpmaddubsw reduce.
 * Tiles:    integer: MR rows x two V-column blocks of int32 accumulators over the whole K.
 *             AVX-512 VNNI 8 x (16 + 16): vpdpbusd (u8 x s8, exact int32).  a8w8: activations
 *               offset to u8 (q + 128), so acc = sum (q + 128) w, less 128 * colsum(w) (pack
 *               time); a8w4: the nibbles u are the unsigned operand, acc = sum u q_x, less
 *               8 * sum(q_x) (per row).
 *             AVX2 4 x (8 + 8): vpmaddubsw + vpmaddwd.  a8w8 with the sign trick
 *               (|a| x sign(w, a): pairs stay <= 2 * 127 * 127 < 2^15, no saturation); a8w4 with
 *               the nibbles unsigned as above (pairs <= 2 * 15 * 127).
 *           float: fp32 FMA tiles, AVX-512 8 x (16 + 16) reading A's rows in place, AVX2 6 x (8 + 8)
 *           reading A tile-packed (x's rows packed per chunk by the team, FC1 writing its output so);
 *           with AVX-512 BF16 (the call's bf16 field, every float format but w16) bf16 tiles 8 x
 *           (16 + 16), vdpbf16ps on x, FC2's input and the dequantized panels rounded to bf16.
 *           FC1's two blocks are gate and up of the same features, FC2's consecutive columns of y.
 * Threads:  as experts.c: each GEMM splits its column units evenly over the OpenMP team (every
 *           weight read once, each column of y one writer); per chunk of an expert's rows one
 *           barrier after FC1 (and one after the re-quantization for integer formats).
 *
 * Built by moe_compile/kernels/cpu/cc.py with `cc -O3 -mavx2 -mfma -fopenmp` on first use; the
 * AVX-512 tiles are compiled for their target alone and run only where the CPU has it.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PANEL 16
#define MR_512 8   /* rows per tile, AVX-512 (integer and float) */
#define MR_I256 4  /* integer AVX2: 8 accumulators + weights + sign temporaries fill the 16 ymm */
#define MR_F256 6  /* float AVX2 */
#define MR_MAX 8
#define V_MAX 16

#include "tiles.h" /* after PANEL: the tiles step PANEL floats per k */
#include "blocktiles.h"

enum { FMT_A8W8 = 1, FMT_A8W4 = 2, FMT_W8 = 3, FMT_W4 = 4, FMT_MXFP4 = 5, FMT_BF16 = 6, FMT_F16 = 7, FMT_MXFP8 = 8 };

static int is_int(int fmt) { return fmt == FMT_A8W8 || fmt == FMT_A8W4; }
static int is_mx(int fmt) { return fmt == FMT_MXFP4 || fmt == FMT_MXFP8; } /* e8m0 group scales, one byte each */

static inline int32_t load32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- integer tiles: c [mr][2V] int32 = A rows (int8, K) . [b0 | b1] ----
 * b0 / b1 point at a V-column block of a panel (its first column's 4 bytes) and step 64 bytes per
 * 4 k (int8) or per 8 k (4-bit). */

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma"), always_inline)) static inline
#define ROWS8(T)                                                                                       \
    const T *a0 = (const T *)a[0], *a1 = (const T *)a[mr > 1 ? 1 : 0], *a2 = (const T *)a[mr > 2 ? 2 : 0], \
            *a3 = (const T *)a[mr > 3 ? 3 : 0], *a4 = (const T *)a[mr > 4 ? 4 : 0],                        \
            *a5 = (const T *)a[mr > 5 ? 5 : 0], *a6 = (const T *)a[mr > 6 ? 6 : 0],                        \
            *a7 = (const T *)a[mr > 7 ? 7 : 0]
#define ACC512 \
    __m512i c00 = _mm512_setzero_si512(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, \
            c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00
#define ISTORE512(R)                                                   \
    if (mr > R) {                                                      \
        _mm512_storeu_si512((void *)(c + R * 32), c##R##0);            \
        _mm512_storeu_si512((void *)(c + R * 32 + 16), c##R##1);       \
    }

/* a8w8: a are u8 (q + 128), the weights s8. */
#define DP8(R)                                                         \
    if (mr > R) {                                                      \
        __m512i av = _mm512_set1_epi32(load32(a##R + k));              \
        c##R##0 = _mm512_dpbusd_epi32(c##R##0, av, v0);                \
        c##R##1 = _mm512_dpbusd_epi32(c##R##1, av, v1);                \
    }
VNNI void itile512_w8(const int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K,
                      int32_t *c) {
    ROWS8(uint8_t);
    ACC512;
    for (int64_t k = 0; k < K; k += 4) {
        __m512i v0 = _mm512_loadu_si512((const void *)(b0 + k * 16)), v1 = _mm512_loadu_si512((const void *)(b1 + k * 16));
        TILE_EACH8(DP8)
    }
    TILE_EACH8(ISTORE512)
}

/* a8w4: the weights' nibbles u8, a s8. */
#define DP4(R)                                                         \
    if (mr > R) {                                                      \
        __m512i al = _mm512_set1_epi32(load32(a##R + k));              \
        __m512i ah = _mm512_set1_epi32(load32(a##R + k + 4));          \
        c##R##0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c##R##0, l0, al), h0, ah); \
        c##R##1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c##R##1, l1, al), h1, ah); \
    }
VNNI void itile512_w4(const int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K,
                      int32_t *c) {
    ROWS8(int8_t);
    ACC512;
    const __m512i m = _mm512_set1_epi8(0x0F);
    for (int64_t k = 0; k < K; k += 8) {
        __m512i r0 = _mm512_loadu_si512((const void *)(b0 + k * 8)), r1 = _mm512_loadu_si512((const void *)(b1 + k * 8));
        __m512i l0 = _mm512_and_si512(r0, m), h0 = _mm512_and_si512(_mm512_srli_epi16(r0, 4), m);
        __m512i l1 = _mm512_and_si512(r1, m), h1 = _mm512_and_si512(_mm512_srli_epi16(r1, 4), m);
        TILE_EACH8(DP4)
    }
    TILE_EACH8(ISTORE512)
}

#define ROWS4(T)                                                                                       \
    const T *a0 = (const T *)a[0], *a1 = (const T *)a[mr > 1 ? 1 : 0], *a2 = (const T *)a[mr > 2 ? 2 : 0], \
            *a3 = (const T *)a[mr > 3 ? 3 : 0]
#define ACC256 \
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00
#define EACH4(M) M(0) M(1) M(2) M(3)
#define ISTORE256(R)                                                   \
    if (mr > R) {                                                      \
        _mm256_storeu_si256((__m256i *)(c + R * 16), c##R##0);         \
        _mm256_storeu_si256((__m256i *)(c + R * 16 + 8), c##R##1);     \
    }
#define AVX2 __attribute__((always_inline)) static inline

/* a8w8, sign trick: |a| (u8) x sign(w, a) (s8) = a w, pairs summed into int16, then int32. */
#define MADD8(R)                                                                                       \
    if (mr > R) {                                                                                      \
        __m256i av = _mm256_set1_epi32(load32(a##R + k)), ab = _mm256_abs_epi8(av);                    \
        c##R##0 = _mm256_add_epi32(c##R##0, _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(v0, av)), one)); \
        c##R##1 = _mm256_add_epi32(c##R##1, _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(v1, av)), one)); \
    }
AVX2 void itile256_w8(const int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K,
                      int32_t *c) {
    ROWS4(int8_t);
    ACC256;
    const __m256i one = _mm256_set1_epi16(1);
    for (int64_t k = 0; k < K; k += 4) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(b0 + k * 16)), v1 = _mm256_loadu_si256((const __m256i *)(b1 + k * 16));
        EACH4(MADD8)
    }
    EACH4(ISTORE256)
}

/* a8w4: nibbles u (u8) x a (s8); the two halves' int16 pairs (<= 2 * 2 * 15 * 127) added first. */
#define MADD4(R)                                                                                       \
    if (mr > R) {                                                                                      \
        __m256i al = _mm256_set1_epi32(load32(a##R + k)), ah = _mm256_set1_epi32(load32(a##R + k + 4)); \
        c##R##0 = _mm256_add_epi32(c##R##0, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l0, al), \
                                                                                _mm256_maddubs_epi16(h0, ah)), one)); \
        c##R##1 = _mm256_add_epi32(c##R##1, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l1, al), \
                                                                                _mm256_maddubs_epi16(h1, ah)), one)); \
    }
AVX2 void itile256_w4(const int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K,
                      int32_t *c) {
    ROWS4(int8_t);
    ACC256;
    const __m256i one = _mm256_set1_epi16(1), m = _mm256_set1_epi8(0x0F);
    for (int64_t k = 0; k < K; k += 8) {
        __m256i r0 = _mm256_loadu_si256((const __m256i *)(b0 + k * 8)), r1 = _mm256_loadu_si256((const __m256i *)(b1 + k * 8));
        __m256i l0 = _mm256_and_si256(r0, m), h0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), m);
        __m256i l1 = _mm256_and_si256(r1, m), h1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), m);
        EACH4(MADD4)
    }
    EACH4(ISTORE256)
}

/* One function per (tile, format) with mr dispatched to a constant (the row branches fold). */
#define DISPATCH8(NAME, ATTR) TILE512_ANY(NAME##_any, NAME, void, uint8_t, int32_t, ATTR)
#define DISPATCH4(NAME)                                                                                \
    static void NAME##_any(int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K, int32_t *c) { \
        switch (mr) {                                                                                  \
        case 4: NAME(4, a, b0, b1, K, c); break;                                                       \
        case 3: NAME(3, a, b0, b1, K, c); break;                                                       \
        case 2: NAME(2, a, b0, b1, K, c); break;                                                       \
        default: NAME(1, a, b0, b1, K, c); break;                                                      \
        }                                                                                              \
    }
#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))
DISPATCH8(itile512_w8, VNNI_FN)
DISPATCH8(itile512_w4, VNNI_FN)
DISPATCH4(itile256_w8)
DISPATCH4(itile256_w4)

/* ---- float tiles (tiles.h): AVX-512 reads A's rows in place, AVX2 reads A tile-packed (element k
 * of row r at a[r][k * MR_F256]: one memory stream for all rows, as experts.c's AVX2 tile, 3-6%
 * faster there); c rows 32 floats apart, the b1 half at +16 in both ---- */

/* the AVX2 float path packs x's rows and writes FC1's output tile-packed */
F32_TILE256_ANY(ftile256_any, MR_F256, 32, 16)

/* ---- panel dequantization (float formats): out [K][16] fp32 of one panel ---- */

#pragma GCC push_options
#pragma GCC target("f16c") /* fp16 scales and weights: every AVX2 CPU has F16C */

/* 2^(e - 127) on 8 lanes of e8m0 codes (e = 0: 2^-127, a subnormal; e = 255: NaN, OCP MX). */
static inline __m256 e8m0_8(__m256i e) {
    __m256i bits = _mm256_slli_epi32(e, 23);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7fc00000), _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
    return _mm256_castsi256_ps(bits);
}

/* e2m1 codes (low 4 bits of each lane) -> fp32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 sign. */
static inline __m256 e2m1_8(__m256i code) {
    const __m256 mag = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    __m256 v = _mm256_permutevar8x32_ps(mag, code);  /* uses the low 3 bits */
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
    return _mm256_xor_ps(v, _mm256_castsi256_ps(sign));
}

/* 8 scales of columns 8h .. 8h + 7 of group g. */
static inline __m256 scales8(int fmt, const void *scales, int64_t g, int h) {
    if (is_mx(fmt))
        return e8m0_8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((const uint8_t *)scales + g * 16 + 8 * h))));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)scales + g * 16 + 8 * h)));
}

/* e4m3fn codes (one per lane, 0..255) -> fp32: the 7 magnitude bits placed under an fp32's
 * exponent and mantissa (2^-120 off, subnormals included), the sign moved to bit 31; S.1111.111 NaN. */
static inline __m256 e4m3_8(__m256i code) {
    const __m256i mag_mask = _mm256_set1_epi32(0x7F);
    __m256i mag = _mm256_and_si256(code, mag_mask);
    __m256i bits = _mm256_or_si256(_mm256_slli_epi32(mag, 20),
                                   _mm256_and_si256(_mm256_slli_epi32(code, 24), _mm256_set1_epi32((int)0x80000000u)));
    __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
    return _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_nanf("")), _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, mag_mask)));
}

/* 4-bit values (low nibbles of 8 lanes) -> fp32 before the scale. */
static inline __m256 nibble8(int fmt, __m256i u) {
    return fmt == FMT_MXFP4 ? e2m1_8(u) : _mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(8)));
}

/* Codes of 4- and 8-bit panels ([K'/4][16][4] bytes, qgemm.py's _code_panels): the 4 bytes at
 * lane j of vector c are row j's bytes 4c .. 4c + 3, so element k of every row sits in the same
 * bits of each lane: 4-bit k = 8c + i at bits 4i .. 4i + 3, 8-bit k = 4c + i in byte i. */
__attribute__((noinline)) static void dequant_panel(int fmt, const uint8_t *codes, const void *scales, int64_t K,
                                                   int64_t G, float *out) {
    const __m256i m = _mm256_set1_epi32(0x0F);
    if (fmt == FMT_W4 || fmt == FMT_MXFP4) {
        for (int64_t g = 0; g < K / G; ++g)
            for (int h = 0; h < 2; ++h) {  /* rows 8h .. 8h + 7: the vector's half h */
                __m256 s = scales8(fmt, scales, g, h);
                for (int64_t k = g * G; k < (g + 1) * G; k += 8) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(codes + (k / 8) * 64 + 32 * h));
                    for (int i = 0; i < 8; ++i)
                        _mm256_storeu_ps(out + (k + i) * 16 + 8 * h,
                                         _mm256_mul_ps(nibble8(fmt, _mm256_and_si256(_mm256_srli_epi32(v, 4 * i), m)), s));
                }
            }
    } else if (fmt == FMT_W8 || fmt == FMT_MXFP8) {  /* one byte per element: int8, or e4m3 codes */
        for (int64_t g = 0; g < K / G; ++g)
            for (int h = 0; h < 2; ++h) {
                __m256 s = scales8(fmt, scales, g, h);
                for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
                    __m256i v = _mm256_loadu_si256((const __m256i *)(codes + (k / 4) * 64 + 32 * h));
                    for (int i = 0; i < 4; ++i) {
                        __m256 f = fmt == FMT_W8 ? _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * i), 24))
                                                 : e4m3_8(_mm256_and_si256(_mm256_srli_epi32(v, 8 * i), _mm256_set1_epi32(0xFF)));
                        _mm256_storeu_ps(out + (k + i) * 16 + 8 * h, _mm256_mul_ps(f, s));
                    }
                }
            }
    } else {  /* 16-bit weights */
        const uint16_t *w = (const uint16_t *)codes;
        for (int64_t i = 0; i < K * 16; i += 8) {
            __m128i v = _mm_loadu_si128((const __m128i *)(w + i));
            __m256 f = fmt == FMT_F16 ? _mm256_cvtph_ps(v)
                                      : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
            _mm256_storeu_ps(out + i, f);
        }
    }
}

/* The same on 16 lanes: one vpermps of a 16-entry table turns a nibble into its value. */
#define DQ512 __attribute__((target("avx512f,avx2,fma,f16c"), noinline)) static

__attribute__((target("avx512f,avx2,fma,f16c"))) static inline __m512 scales16(int fmt, const void *scales, int64_t g) {
    if (!is_mx(fmt)) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)scales + g * 16)));
    __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((const uint8_t *)scales + g * 16)));
    __m512i bits = _mm512_slli_epi32(e, 23);  /* 2^(e - 127); e = 0: 2^-127 (subnormal), 255: NaN */
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7fc00000));
    return _mm512_castsi512_ps(bits);
}

DQ512 void dequant_panel512(int fmt, const uint8_t *codes, const void *scales, int64_t K, int64_t G, float *out) {
    if (fmt == FMT_W4 || fmt == FMT_MXFP4) {
        const __m512 lut = fmt == FMT_MXFP4
                               ? _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f)
                               : _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
        const __m512i m = _mm512_set1_epi32(0x0F);
        for (int64_t g = 0; g < K / G; ++g) {
            __m512 s = scales16(fmt, scales, g);
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) {  /* lane j: row j's 8 nibbles k .. k + 7 */
                __m512i v = _mm512_loadu_si512(codes + (k / 8) * 64);
                for (int i = 0; i < 8; ++i)
                    _mm512_storeu_ps(out + (k + i) * 16,
                                     _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4 * i), m), lut), s));
            }
        }
    } else if (fmt == FMT_W8) {
        for (int64_t g = 0; g < K / G; ++g) {
            __m512 s = scales16(fmt, scales, g);
            for (int64_t k = g * G; k < (g + 1) * G; k += 4) {  /* lane j: row j's bytes k .. k + 3 */
                __m512i v = _mm512_loadu_si512(codes + (k / 4) * 64);
                for (int i = 0; i < 4; ++i) {
                    __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * i), 24);
                    _mm512_storeu_ps(out + (k + i) * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(q), s));
                }
            }
        }
    } else if (fmt == FMT_MXFP8) { /* e4m3 as in e4m3_8, 16 lanes */
        const __m512i mag_mask = _mm512_set1_epi32(0x7F);
        for (int64_t g = 0; g < K / G; ++g) {
            __m512 s = scales16(fmt, scales, g);
            for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
                __m512i v = _mm512_loadu_si512(codes + (k / 4) * 64);
                for (int i = 0; i < 4; ++i) {
                    __m512i c = _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(0xFF));
                    __m512i mag = _mm512_and_si512(c, mag_mask);
                    __m512i bits = _mm512_or_si512(_mm512_slli_epi32(mag, 20),
                                                   _mm512_and_si512(_mm512_slli_epi32(c, 24), _mm512_set1_epi32((int)0x80000000u)));
                    __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
                    f = _mm512_mask_mov_ps(f, _mm512_cmpeq_epi32_mask(mag, mag_mask), _mm512_set1_ps(__builtin_nanf("")));
                    _mm512_storeu_ps(out + (k + i) * 16, _mm512_mul_ps(f, s));
                }
            }
        }
    } else {
        const uint16_t *w = (const uint16_t *)codes;
        for (int64_t i = 0; i < K * 16; i += 16) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(w + i));
            __m512 f = fmt == FMT_F16 ? _mm512_cvtph_ps(v)
                                      : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
            _mm512_storeu_ps(out + i, f);
        }
    }
}

#pragma GCC pop_options

/* ---- bf16 float tiles (AVX-512 BF16) ----
 * Where the CPU multiplies bf16 natively, the float formats' tiles (not w16's: its 16-bit weights
 * hold more than bf16 keeps) run vdpbf16ps: 2 products a lane and instruction, twice the fp32
 * FMA's, on operands rounded to bf16 (nearest even): the dequantized panel (q * s rounded once)
 * and the activations, the sums in fp32.  kernels/cpu/dense.py's prefill GEMMs do the same
 * (prefill_dtype); the error is ~2^-9 of a product, far under the formats' own.
 * Operands in k-pairs: a bf16 panel is [K/2][16][2] (lane j of pair step kp holds column j's
 * elements 2kp, 2kp + 1), a bf16 row is the row itself (element pairs are 32-bit words). */
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")))

/* fp32 panel [K][16] (K even) -> bf16 k-pairs [K/2][16][2]. */
BF16_TARGET static void panel_to_pairs(const float *src, int64_t K, uint16_t *dst) {
    for (int64_t k = 0; k < K; k += 2) {
        __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k * 16)));
        __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + (k + 1) * 16)));
        _mm512_storeu_si512(dst + k * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

/* dst [n, K] bf16 = src's rows (ld apart), K a multiple of 16: this thread's share of the rows
 * (the caller then waits for the team). */
BF16_TARGET static void rows_to_bf16(const float *src, int64_t ld, int64_t n, int64_t K, uint16_t *dst) {
    int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
    for (int64_t r = n * t / parts; r < n * (t + 1) / parts; ++r) {
        const float *row = src + r * ld;
        for (int64_t k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(dst + r * K + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
    }
}

#define BTILE_ROW(R)                                                                  \
    if (mr > R) {                                                                     \
        __m512bh av = (__m512bh)_mm512_set1_epi32(a##R[kp]);                          \
        c##R##0 = _mm512_dpbf16_ps(c##R##0, av, v0);                                  \
        c##R##1 = _mm512_dpbf16_ps(c##R##1, av, v1);                                  \
    }

/* c [mr][32] = A rows . [b0 | b1] over K (even): A's rows as k-pairs read in place, b0 / b1 bf16
 * panels in k-pairs; mr <= 8 rows x (16 + 16) columns, as f32_tile512. */
BF16_TARGET __attribute__((always_inline)) static inline void bf16_tile512(const int mr, const int32_t *const *a,
                                                                          const uint16_t *b0, const uint16_t *b1,
                                                                          int64_t K, float *c) {
    const int32_t *a0 = a[0], *a1 = a[mr > 1 ? 1 : 0], *a2 = a[mr > 2 ? 2 : 0], *a3 = a[mr > 3 ? 3 : 0],
                  *a4 = a[mr > 4 ? 4 : 0], *a5 = a[mr > 5 ? 5 : 0], *a6 = a[mr > 6 ? 6 : 0], *a7 = a[mr > 7 ? 7 : 0];
    __m512 z = _mm512_setzero_ps();
    __m512 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z;
    __m512 c40 = z, c41 = z, c50 = z, c51 = z, c60 = z, c61 = z, c70 = z, c71 = z;
    for (int64_t kp = 0; kp < K / 2; ++kp) {
        __m512bh v0 = (__m512bh)_mm512_loadu_si512(b0 + kp * 32), v1 = (__m512bh)_mm512_loadu_si512(b1 + kp * 32);
        TILE_EACH8(BTILE_ROW)
    }
    TILE_EACH8(TILE_STORE512)
}

/* bf16_tile512 at a run-time row count mr (1..8). */
TILE512_ANY(bf16_tile512_any, bf16_tile512, int32_t, uint16_t, float, BF16_TARGET)

/* ---- per-token int8 quantization (quant/common.py: quantize_per_token_int8) ---- */

/* q = clamp(round_half_even(x / s), -127, 127), s = max|x| / 127 (1 for a zero row), of one row of
 * K floats; q offset to u8 (q + 128) when `offset`; sum = sum of q (a8w4's correction).  Division,
 * not a multiply by 1/s, and round-half-even: bit for bit torch's x / s and torch.round. */
static void quantize_row(const float *x, int64_t K, int8_t *q, float *s_out, int32_t *sum_out, int offset) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 m8 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) m8 = _mm256_max_ps(m8, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    float lanes[8], amax = 0.f;
    _mm256_storeu_ps(lanes, m8);
    for (int i = 0; i < 8; ++i) amax = lanes[i] > amax ? lanes[i] : amax;
    for (; k < K; ++k) amax = __builtin_fabsf(x[k]) > amax ? __builtin_fabsf(x[k]) : amax;
    float s = amax / 127.f;
    if (!(s > 0.f)) s = 1.f;
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), flip = _mm256_set1_epi8((char)0x80);
    __m256i sum8 = _mm256_setzero_si256();
    k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i i4[4];
        for (int j = 0; j < 4; ++j) {
            __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k + 8 * j), vs),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            i4[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
            sum8 = _mm256_add_epi32(sum8, i4[j]);
        }
        __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i4[0], i4[1]), _mm256_packs_epi32(i4[2], i4[3]));
        b = _mm256_permutevar8x32_epi32(b, order);
        if (offset) b = _mm256_xor_si256(b, flip);
        _mm256_storeu_si256((__m256i *)(q + k), b);
    }
    int32_t sums[8], sum = 0;
    _mm256_storeu_si256((__m256i *)sums, sum8);
    for (int i = 0; i < 8; ++i) sum += sums[i];
    for (; k < K; ++k) {
        float r = __builtin_nearbyintf(x[k] / s);  /* the default rounding mode: half to even */
        int v = (int)(r < -127.f ? -127.f : (r > 127.f ? 127.f : r));
        sum += v;
        q[k] = (int8_t)(offset ? (uint8_t)(v + 128) : v);
    }
    *s_out = s;
    if (sum_out) *sum_out = sum;
}

/* ---- the call ---- */

/* The ISA's tile shape for a format: rows MR, block width V, and whether its A operands are
 * tile-packed ([n, K] held MR rows at a time, each tile [K][MR], the tile of rows r0.. at r0 * K:
 * the float AVX2 tile). */
typedef struct {
    int isa, fmt, mr, v, packed;
} Shape;

static Shape shape_of(int isa, int fmt) {
    Shape s = {isa, fmt, MR_512, 16, 0};
    if (isa == ISA_AVX2) s.mr = is_int(fmt) ? MR_I256 : MR_F256, s.v = 8, s.packed = !is_int(fmt);
    return s;
}

/* Row pointers of the tile of rows r0 .. r0 + mr - 1 of an A operand [n, K] in the shape's layout. */
static void frows(Shape s, const float *base, int64_t r0, int mr, int64_t K, const float **rows) {
    for (int i = 0; i < mr; ++i) rows[i] = s.packed ? base + r0 * K + i : base + (r0 + i) * K;
}

/* Where element (r, k) of an A operand [n, K] lies in the shape's layout. */
static int64_t element_at(Shape s, int64_t r, int64_t k, int64_t K) {
    return s.packed ? (r - r % s.mr) * K + k * s.mr + r % s.mr : r * K + k;
}

static int rows_at(Shape s, int64_t n, int64_t r0) { return n - r0 < s.mr ? (int)(n - r0) : s.mr; }

static void my_units(int64_t units, int64_t *u0, int64_t *u1) {
    int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
    *u0 = units * t / parts, *u1 = units * (t + 1) / parts;
}

typedef struct {
    const float *x;
    int64_t ldx;
    float *y;
    int64_t ldy;
    const int64_t *tok;
    const float *scale;
    int64_t H, F, G1, G2;  /* G: the float formats' groups along K of FC1 (H) and FC2 (F) */
    float limit;
    int between;           /* routing weight between the SwiGLU and FC2 (else on FC2's output) */
    int8_t *qx;            /* integer formats: x quantized [T, H], its scales and row sums */
    float *sx;
    int32_t *sumx;
    int8_t *qa;            /* FC2's input quantized [chunk, F], its scales and row sums */
    float *sa;
    int32_t *suma;
    int act_blocks;        /* grouped a8w4-int / a8w8-int: ACT_FLOAT, FC2's input quantized per block of 32 and
                            * dequantized (fake_quantize_blocks) for the float panels; ACT_INT, the integer
                            * block tiles (blocktiles.h) on x and FC2's input quantized per block */
    int bf16;              /* float formats on AVX-512 BF16: the bf16 tiles, on xb / ab */
    uint16_t *xb, *ab;     /* bf16 tiles: x [T, H] and FC2's input [chunk + MR_MAX, F] as bf16 */
    int vnni;              /* ACT_INT: the AVX-512 VNNI block tile (else the AVX2 one) */
    int bits8;             /* ACT_INT on 8-bit panels (group-wise a8w8-int, VNNI only), else 4-bit (a8w4-int) */
    int32_t *xq, *xo, *aq, *ao; /* ACT_INT: x [T] and FC2's input [chunk + MR_MAX] rows as BlockRow's */
    float *xs, *as;             /* quads (K/4 each), offsets and scales (K/32 each) */
} Call;

enum { ACT_NONE = 0, ACT_FLOAT = 1, ACT_INT = 2 };

/* One expert's packed weights: codes, scales (fp32 per channel for integer formats, the format's
 * own group scales in panel order else) and int32 column sums (a8w8) of FC1 and FC2. */
typedef struct {
    const uint8_t *w1, *w2;
    const void *s1, *s2;
    const int32_t *cs1, *cs2;
} Expert;

/* Bytes of one panel with K inputs. */
static int64_t panel_bytes(int fmt, int64_t K) {
    if (fmt == FMT_A8W4 || fmt == FMT_W4 || fmt == FMT_MXFP4) return K * 8;
    if (fmt == FMT_BF16 || fmt == FMT_F16) return K * 32;
    return K * 16;
}

/* Integer formats: column `col` of a packed weight, its block's first byte. */
static const uint8_t *icolumn(int fmt, const uint8_t *w, int64_t col, int64_t K) {
    return w + (col / PANEL) * panel_bytes(fmt, K) + (col % PANEL) * 4;
}

static void itile(Shape s, int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K, int32_t *c) {
    if (s.isa == ISA_AVX512)
        (s.fmt == FMT_A8W8 ? itile512_w8_any : itile512_w4_any)(mr, a, b0, b1, K, c);
    else
        (s.fmt == FMT_A8W8 ? itile256_w8_any : itile256_w4_any)(mr, a, b0, b1, K, c);
}

/* What the tile's sums carry beyond q_a . w: the VNNI a8w8 offset, 128 * colsum(w) per column
 * (colsum, NULL when none), or the a8w4 nibble offset, 8 * sum(q_a) per row (row_offset). */
typedef struct {
    const int32_t *colsum;
    int32_t row_offset;
} Offsets;

static const int32_t ZEROS[2 * V_MAX];

/* out[j] = (float)(acc[j] - offsets) * s_row * s_col[j] for j < w: the exact int32 sum scaled as
 * quant/a8w8_int.py's matmul does it, (acc * s_x) * s_w. */
static void scale_sums(const int32_t *acc, Offsets o, int64_t col0, float s_row, const float *s_col, int64_t w,
                       float *out) {
    const int32_t *cs = o.colsum ? o.colsum + col0 : ZEROS;
    int32_t m = o.colsum ? 128 : 0;
    for (int64_t j = 0; j < w; ++j) out[j] = (float)(acc[j] - o.row_offset - m * cs[j]) * s_row * s_col[col0 + j];
}

static Offsets offsets(Shape s, const int32_t *colsum, const int32_t *rowsums, int64_t r) {
    Offsets o = {NULL, 0};
    if (s.fmt == FMT_A8W4) o.row_offset = 8 * rowsums[r];
    else if (s.isa == ISA_AVX512) o.colsum = colsum;
    return o;
}

static float route(const Call *cl, int64_t slot) { return cl->scale[slot]; }

/* Integer FC1 + SwiGLU of slots [lo, lo + n): this thread's features of a [n, F] (fp32). */
static void ifc1(const Call *cl, Shape s, int64_t lo, int64_t n, const Expert *ex, float *a) {
    int32_t c[MR_MAX * 2 * V_MAX];
    float gate[V_MAX], up[V_MAX];
    const void *rows[MR_MAX];
    const float *s1 = (const float *)ex->s1;
    int64_t u0, u1, H = cl->H, F = cl->F;
    my_units(F / s.v, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
        int64_t f0 = u * s.v;
        const uint8_t *b0 = icolumn(s.fmt, ex->w1, f0, H), *b1 = icolumn(s.fmt, ex->w1, F + f0, H);
        for (int64_t r0 = 0; r0 < n; r0 += s.mr) {
            int mr = rows_at(s, n, r0);
            for (int i = 0; i < mr; ++i) rows[i] = cl->qx + cl->tok[lo + r0 + i] * H;
            itile(s, mr, rows, b0, b1, H, c);
            for (int i = 0; i < mr; ++i) {
                int64_t t = cl->tok[lo + r0 + i];
                Offsets o = offsets(s, ex->cs1, cl->sumx, t);
                scale_sums(c + i * 2 * s.v, o, f0, cl->sx[t], s1, s.v, gate);
                scale_sums(c + i * 2 * s.v + s.v, o, F + f0, cl->sx[t], s1, s.v, up);
                float k = cl->between ? route(cl, lo + r0 + i) : 1.f;
                swiglu_span(a + (r0 + i) * F + f0, gate, up, 0, s.v, cl->limit, k);
            }
        }
    }
}

/* Integer FC2 + weighted combine of slots [lo, lo + n) on qa (a re-quantized): this thread's
 * columns of y. */
static void ifc2(const Call *cl, Shape s, int64_t lo, int64_t n, const Expert *ex) {
    int32_t c[MR_MAX * 2 * V_MAX];
    float out[2 * V_MAX];
    const void *rows[MR_MAX];
    const float *s2 = (const float *)ex->s2;
    int64_t u0, u1, F = cl->F, w = 2 * s.v;
    my_units(cl->H / w, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
        int64_t c0 = u * w;
        const uint8_t *b0 = icolumn(s.fmt, ex->w2, c0, F), *b1 = icolumn(s.fmt, ex->w2, c0 + s.v, F);
        for (int64_t r0 = 0; r0 < n; r0 += s.mr) {
            int mr = rows_at(s, n, r0);
            for (int i = 0; i < mr; ++i) rows[i] = cl->qa + (r0 + i) * F;
            itile(s, mr, rows, b0, b1, F, c);
            for (int i = 0; i < mr; ++i) {
                int64_t slot = lo + r0 + i;
                float k = cl->between ? 1.f : route(cl, slot), *dst = cl->y + cl->tok[slot] * cl->ldy + c0;
                scale_sums(c + i * w, offsets(s, ex->cs2, cl->suma, r0 + i), c0, cl->sa[r0 + i], s2, w, out);
                for (int64_t j = 0; j < w; ++j) dst[j] += k * out[j];
            }
        }
    }
}

static void ftile(Shape s, int mr, const float *const *a, const float *b0, const float *b1, int64_t K, float *c) {
    if (s.isa == ISA_AVX512)
        f32_tile512_any(mr, a, b0, b1, K, c);
    else
        ftile256_any(mr, a, b0, b1, K, c);
}

/* Group scales of panel p of a float-format weight with K inputs, group G. */
static const void *panel_scales(int fmt, const void *scales, int64_t p, int64_t K, int64_t G) {
    int64_t bytes = is_mx(fmt) ? 1 : 2;
    return (const uint8_t *)scales + p * (K / G) * 16 * bytes;
}

static void dequant(Shape s, const uint8_t *w, const void *scales, int64_t p, int64_t K, int64_t G, float *out) {
    const uint8_t *codes = w + p * panel_bytes(s.fmt, K);
    const void *sc = scales ? panel_scales(s.fmt, scales, p, K, G) : NULL;
    if (s.isa == ISA_AVX512)
        dequant_panel512(s.fmt, codes, sc, K, G, out);
    else
        dequant_panel(s.fmt, codes, sc, K, G, out);
}

/* The float tile over a chunk's rows for the 16 columns of panels b0 and b1 each: c [mr][32], b0's
 * columns then b1's; AVX-512 in one go, AVX2 in two halves of 8 columns (its tile stores a row's
 * two 8-wide blocks 16 floats apart, so both halves land in this layout). */
static void fpanel(Shape s, int mr, const float *const *rows, const float *b0, const float *b1, int64_t K, float *c) {
    ftile(s, mr, rows, b0, b1, K, c);
    if (s.isa == ISA_AVX2) ftile(s, mr, rows, b0 + 8, b1 + 8, K, c + 8);
}

/* Tile-packed x rows of slots [lo, lo + n) into xp, this thread's share of the tiles (the caller
 * then waits for the team). */
static void pack_x(const Call *cl, Shape s, int64_t lo, int64_t n, float *xp) {
    int64_t t0, t1;
    my_units((n + s.mr - 1) / s.mr, &t0, &t1);
    for (int64_t r0 = t0 * s.mr; r0 < n && r0 < t1 * s.mr; r0 += s.mr) {
        int mr = rows_at(s, n, r0);
        float *dst = xp + r0 * cl->H;
        const float *src[MR_MAX];
        for (int i = 0; i < mr; ++i) src[i] = cl->x + cl->tok[lo + r0 + i] * cl->ldx;
        for (int64_t k = 0; k < cl->H; ++k)  /* written in order, mr read streams */
            for (int i = 0; i < mr; ++i) dst[k * s.mr + i] = src[i][k];
    }
}

/* Panel p of a float-format weight for the call's tile: fp32 [K][16] into out, or for the bf16
 * tiles its k-pairs into out (half its size) by way of tmp [K][16]. */
static const void *tile_panel(const Call *cl, Shape s, const uint8_t *w, const void *scales, int64_t p, int64_t K,
                              int64_t G, float *out, float *tmp) {
    if (!cl->bf16) {
        dequant(s, w, scales, p, K, G, out);
        return out;
    }
    dequant(s, w, scales, p, K, G, tmp);
    panel_to_pairs(tmp, K, (uint16_t *)out);
    return out;
}

/* The call's float tile (fp32, or bf16 on rows and panels in k-pairs) over mr rows. */
static void tile_rows(const Call *cl, Shape s, int mr, const void *const *rows, const void *b0, const void *b1,
                      int64_t K, float *c) {
    if (cl->bf16)
        bf16_tile512_any(mr, (const int32_t *const *)rows, b0, b1, K, c);
    else
        fpanel(s, mr, (const float *const *)rows, b0, b1, K, c);
}

/* Float FC1 + SwiGLU: this thread's 16-feature units, gate and up panels dequantized into buf;
 * a [n, F] in the shape's layout; xp: x's rows tile-packed where the shape reads them so; tmp:
 * the bf16 tiles' fp32 panel. */
static void ffc1(const Call *cl, Shape s, int64_t lo, int64_t n, const Expert *ex, const float *xp, float *a,
                 float *buf, float *tmp) {
    float c[MR_MAX * 32], act[16];
    const void *rows[MR_MAX];
    int64_t u0, u1, H = cl->H, F = cl->F;
    my_units(F / 16, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
        const void *bg = tile_panel(cl, s, ex->w1, ex->s1, u, H, cl->G1, buf, tmp);
        const void *bu = tile_panel(cl, s, ex->w1, ex->s1, F / 16 + u, H, cl->G1, buf + H * 16, tmp);
        for (int64_t r0 = 0; r0 < n; r0 += s.mr) {
            int mr = rows_at(s, n, r0);
            if (s.packed)
                frows(s, xp, r0, mr, H, (const float **)rows);
            else if (cl->bf16)
                for (int i = 0; i < mr; ++i) rows[i] = cl->xb + cl->tok[lo + r0 + i] * H;
            else
                for (int i = 0; i < mr; ++i) rows[i] = cl->x + cl->tok[lo + r0 + i] * cl->ldx;
            tile_rows(cl, s, mr, rows, bg, bu, H, c);
            for (int i = 0; i < mr; ++i) {
                float k = cl->between ? route(cl, lo + r0 + i) : 1.f;
                if (!s.packed) {  /* the row's 16 features are contiguous in a */
                    swiglu_span(a + (r0 + i) * F + u * 16, c + i * 32, c + i * 32 + 16, 0, 16, cl->limit, k);
                    continue;
                }
                swiglu_span(act, c + i * 32, c + i * 32 + 16, 0, 16, cl->limit, k);
                for (int j = 0; j < 16; ++j) a[element_at(s, r0 + i, u * 16 + j, F)] = act[j];
            }
        }
    }
}

/* Float FC2 + weighted combine: this thread's 32-column units of y (the bf16 tiles read FC2's
 * input from cl->ab). */
static void ffc2(const Call *cl, Shape s, int64_t lo, int64_t n, const Expert *ex, const float *a, float *buf,
                 float *tmp) {
    float c[MR_MAX * 32];
    const void *rows[MR_MAX];
    int64_t u0, u1, F = cl->F;
    my_units(cl->H / 32, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
        const void *b0 = tile_panel(cl, s, ex->w2, ex->s2, 2 * u, F, cl->G2, buf, tmp);
        const void *b1 = tile_panel(cl, s, ex->w2, ex->s2, 2 * u + 1, F, cl->G2, buf + F * 16, tmp);
        for (int64_t r0 = 0; r0 < n; r0 += s.mr) {
            int mr = rows_at(s, n, r0);
            if (cl->bf16)
                for (int i = 0; i < mr; ++i) rows[i] = cl->ab + (r0 + i) * F;
            else
                frows(s, a, r0, mr, F, (const float **)rows);
            tile_rows(cl, s, mr, rows, b0, b1, F, c);
            for (int i = 0; i < mr; ++i) {
                int64_t slot = lo + r0 + i;
                float k = cl->between ? 1.f : route(cl, slot), *dst = cl->y + cl->tok[slot] * cl->ldy + u * 32;
                for (int j = 0; j < 32; ++j) dst[j] += k * c[i * 32 + j];
            }
        }
    }
}

/* ---- group-wise a8w4-int / a8w8-int on the integer block tiles (ACT_INT, blocktiles.h) ---- */

/* Row r of a [n, K] quantized set (x: K = H, FC2's input: K = F) as the block tiles read it. */
static BlockRow block_row(const int32_t *q, const float *sc, const int32_t *off, int64_t r, int64_t K) {
    BlockRow row = {q + r * (K / 4), sc + r * (K / BLOCK), off + r * (K / BLOCK)};
    return row;
}

/* This thread's share of the rows of src [n, K] (ld apart) quantized per block into q / sc / off. */
static void block_quantize_rows(const Call *cl, const float *src, int64_t ld, int64_t n, int64_t K, int32_t *q,
                                float *sc, int32_t *off) {
    int64_t r0, r1;
    my_units(n, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r)
        block_quantize_row(src + r * ld, K, cl->bits8, q + r * (K / 4), sc + r * (K / BLOCK), off + r * (K / BLOCK));
}

/* Panel p of the call's w4 / w8 weight with K inputs and group G on the block tile: c [mr][32]
 * columns 16 h .. 16 h + 15. */
static void block_of(const Call *cl, const uint8_t *w, const void *s, int64_t p, int64_t K, int64_t G,
                     const BlockRow *rows, int mr, float *c) {
    int fmt = cl->bits8 ? FMT_W8 : FMT_W4;
    block_panel(cl->vnni, cl->bits8, w + p * panel_bytes(fmt, K), (const uint16_t *)panel_scales(fmt, s, p, K, G), K,
                G, rows, mr, c, 32);
}

/* Block-tile FC1 + SwiGLU: this thread's 16-feature units (gate panel u, up panel F/16 + u) over
 * the rows of slots [lo, lo + n); a [n, F] row-major. */
static void bfc1(const Call *cl, int mr_max, int64_t lo, int64_t n, const Expert *ex, float *a) {
    float c[MR_MAX * 32];
    BlockRow rows[MR_MAX];
    int64_t u0, u1, H = cl->H, F = cl->F, G = cl->G1;
    my_units(F / 16, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u)
        for (int64_t r0 = 0; r0 < n; r0 += mr_max) {
            int mr = n - r0 < mr_max ? (int)(n - r0) : mr_max;
            for (int i = 0; i < mr; ++i) rows[i] = block_row(cl->xq, cl->xs, cl->xo, cl->tok[lo + r0 + i], H);
            block_of(cl, ex->w1, ex->s1, u, H, G, rows, mr, c);
            block_of(cl, ex->w1, ex->s1, F / 16 + u, H, G, rows, mr, c + 16);
            for (int i = 0; i < mr; ++i) {
                float k = cl->between ? route(cl, lo + r0 + i) : 1.f;
                swiglu_span(a + (r0 + i) * F + u * 16, c + i * 32, c + i * 32 + 16, 0, 16, cl->limit, k);
            }
        }
}

/* Block-tile FC2 + weighted combine: this thread's 32-column units of y over FC2's input rows,
 * quantized into cl->aq / as / ao. */
static void bfc2(const Call *cl, int mr_max, int64_t lo, int64_t n, const Expert *ex) {
    float c[MR_MAX * 32];
    BlockRow rows[MR_MAX];
    int64_t u0, u1, F = cl->F, G = cl->G2;
    my_units(cl->H / 32, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u)
        for (int64_t r0 = 0; r0 < n; r0 += mr_max) {
            int mr = n - r0 < mr_max ? (int)(n - r0) : mr_max;
            for (int i = 0; i < mr; ++i) rows[i] = block_row(cl->aq, cl->as, cl->ao, r0 + i, F);
            for (int h = 0; h < 2; ++h) block_of(cl, ex->w2, ex->s2, 2 * u + h, F, G, rows, mr, c + 16 * h);
            for (int i = 0; i < mr; ++i) {
                int64_t slot = lo + r0 + i;
                float k = cl->between ? 1.f : route(cl, slot), *dst = cl->y + cl->tok[slot] * cl->ldy + u * 32;
                for (int j = 0; j < 32; ++j) dst[j] += k * c[i * 32 + j];
            }
        }
}

/* One chunk of an expert's rows on the block tiles: FC1, FC2's input quantized, FC2 (the team's
 * barriers between). */
static void block_chunk(const Call *cl, int64_t lo, int64_t n, const Expert *ex, float *a) {
    int mr_max = cl->vnni ? BLOCK_MR_512 : BLOCK_MR_256;
    bfc1(cl, mr_max, lo, n, ex, a);
#pragma omp barrier
    block_quantize_rows(cl, a, cl->F, n, cl->F, cl->aq, cl->as, cl->ao);
#pragma omp barrier
    bfc2(cl, mr_max, lo, n, ex);
}

/* Grouped a8w4-int / a8w8-int on float panels: this thread's share of FC2's input rows a [n, F] (in the shape's
 * layout) quantized per block of 32 and dequantized in place, q * s, as quant/common.py's
 * quantize_per_block_int8: s = max|a| / 127 (1 where that is 0; non-finite stays so), q = round
 * half to even(a / s) in [-127, 127], 0 where a / s is NaN. */
static void fake_quantize_blocks(Shape s, float *a, int64_t n, int64_t F) {
    int64_t r0, r1;
    my_units(n, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t b = 0; b < F; b += 32) {
            float big = 0.f;
            for (int64_t j = b; j < b + 32; ++j) {
                float v = a[element_at(s, r, j, F)], m = v < 0 ? -v : v;
                big = m > big || m != m ? m : big; /* a NaN wins and stays */
            }
            float sc = big / 127.f;
            sc = sc == 0.f ? 1.f : sc;
            for (int64_t j = b; j < b + 32; ++j) {
                float *p = a + element_at(s, r, j, F);
                int v = _mm_cvtss_si32(_mm_set_ss(*p / sc)); /* MXCSR's round half to even; NaN -> INT_MIN */
                v = v == (int)0x80000000 ? 0 : v > 127 ? 127 : v < -127 ? -127 : v;
                *p = (float)v * sc;
            }
        }
}

/* This thread's share of the rows of src [n, K] quantized per row into q / s / sum. */
static void quantize_rows(const float *src, int64_t n, int64_t K, int8_t *q, float *s, int32_t *sum, int offset) {
    int64_t r0, r1;
    my_units(n, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) quantize_row(src + r * K, K, q + r * K, s + r, sum ? sum + r : NULL, offset);
}

/* ---- entry points ---- */

/* Bit 0: AVX-512F (float tiles), bit 1: AVX-512 VNNI + BW (integer tiles), bit 2: AVX-512 BF16 + BW
 * (the float formats' bf16 tiles). */
int64_t moe_qgemm_cpu_features(void) {
    __builtin_cpu_init();
    int64_t f = 0;
    if (__builtin_cpu_supports("avx512f")) f |= 1;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
        f |= 2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16"))
        f |= 4;
    return f;
}

static int isa_ok(int isa, int fmt) {
    if (isa == ISA_AVX2) return 1;
    int64_t need = is_int(fmt) ? 2 : 1;
    return isa == ISA_AVX512 && (moe_qgemm_cpu_features() & need) == need;
}

/* Call fields, int64 each (pointers as integers):
 *   x, ldx, y, ldy, tok, scale, H, F, G1, G2, chunk, scratch, isa, fmt, between, qx, sx, sumx, qa, sa, suma,
 *   act_blocks (grouped a8w4-int / a8w8-int on FMT_W4 / FMT_W8 panels, F % 32 == 0: ACT_FLOAT, x already
 *   quantized per block and dequantized by the host, the float tiles; ACT_INT, the integer block tiles
 *   (a8w4-int on FMT_W4, a8w8-int on FMT_W8 with AVX-512 VNNI; groups multiples of 32, no bf16), x
 *   as it is, quantized here),
 *   bf16 (1: the float formats' bf16 tiles, AVX-512 BF16 only; not w16)
 * experts: E rows of (w1, w2, s1, s2, cs1, cs2) pointers; bounds: E + 1 slot offsets.  scratch:
 * FC1's output of two chunks, 2 * (chunk + MR_MAX) * F floats; qx [T, H] bytes, sx / sumx [T];
 * qa [chunk + MR_MAX, F] bytes, sa / suma [chunk + MR_MAX] (integer formats; sumx / suma used by
 * a8w4 alone, may be 0 otherwise).  Returns 0; -1 for an ISA this CPU lacks or sizes the tiles do
 * not divide; -2 when the dequantization buffers cannot be allocated. */
enum { C_X, C_LDX, C_Y, C_LDY, C_TOK, C_SCALE, C_H, C_F, C_G1, C_G2, C_CHUNK, C_SCRATCH, C_ISA, C_FMT, C_BETWEEN,
       C_QX, C_SX, C_SUMX, C_QA, C_SA, C_SUMA, C_ACT_BLOCKS, C_BF16, C_FIELDS };
#define PTR(type, f, i) ((type *)(intptr_t)(f)[i])

/* Rows of x already quantized by the host (plain int8 q [n, K] in place of the kernel's own
 * quantize_rows): this thread's share moved to the tiles' form — q + 128 for vpdpbusd's unsigned
 * operand when `offset`, the row sums a8w4 needs into sum. */
static void adopt_rows(int8_t *q, int64_t n, int64_t K, int32_t *sum, int offset) {
    int64_t r0, r1;
    my_units(n, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
        int8_t *row = q + r * K;
        int32_t total = 0;
        for (int64_t k = 0; k < K; ++k) {
            total += row[k];
            if (offset) row[k] = (int8_t)((uint8_t)row[k] ^ 0x80);
        }
        if (sum) sum[r] = total;
    }
}

static int64_t run_call(const int64_t *f, const int64_t *experts, const int64_t *bounds, int64_t num_experts,
                        int64_t num_tokens, float limit, int64_t nthreads, int prequantized);

int64_t moe_qgemm_run(const int64_t *f, const int64_t *experts, const int64_t *bounds, int64_t num_experts,
                      int64_t num_tokens, float limit, int64_t nthreads) {
    return run_call(f, experts, bounds, num_experts, num_tokens, limit, nthreads, 0);
}

/* moe_qgemm_run on rows the host quantized (integer formats only): qx holds q [num_tokens, H] as
 * plain int8 and sx its per-row scales (quant/common.py's quantize_per_token_int8, e.g. rows that
 * arrived quantized over the expert-parallel exchange); x is not read.  qx is rewritten in place
 * (the tiles' form).  Otherwise the same call, the same results as quantizing x here. */
int64_t moe_qgemm_run_quantized(const int64_t *f, const int64_t *experts, const int64_t *bounds, int64_t num_experts,
                                int64_t num_tokens, float limit, int64_t nthreads) {
    if (!is_int((int)f[C_FMT])) return -1;
    return run_call(f, experts, bounds, num_experts, num_tokens, limit, nthreads, 1);
}

static int64_t run_call(const int64_t *f, const int64_t *experts, const int64_t *bounds, int64_t num_experts,
                        int64_t num_tokens, float limit, int64_t nthreads, int prequantized) {
    int fmt = (int)f[C_FMT];
    Shape s = shape_of((int)f[C_ISA], fmt);
    if (!isa_ok(s.isa, fmt) || f[C_F] % PANEL || f[C_H] % 32 || f[C_CHUNK] < 1) return -1;
    if (!is_int(fmt) && (f[C_G1] < 1 || f[C_G2] < 1 || f[C_H] % f[C_G1] || f[C_F] % f[C_G2])) return -1;
    if (f[C_ACT_BLOCKS] && ((fmt != FMT_W4 && fmt != FMT_W8) || f[C_F] % 32)) return -1;
    if (f[C_ACT_BLOCKS] < ACT_NONE || f[C_ACT_BLOCKS] > ACT_INT) return -1;
    /* the block tiles: a8w4-int on w4 panels, a8w8-int on w8 panels (AVX-512 VNNI), whole blocks a group */
    int block_int = f[C_ACT_BLOCKS] == ACT_INT, vnni = s.isa == ISA_AVX512 && (moe_qgemm_cpu_features() & 2);
    if (block_int && ((fmt != FMT_W4 && !(fmt == FMT_W8 && vnni)) || f[C_G1] % BLOCK || f[C_G2] % BLOCK || f[C_BF16]))
        return -1;
    Call cl = {PTR(const float, f, C_X), f[C_LDX], PTR(float, f, C_Y), f[C_LDY], PTR(const int64_t, f, C_TOK),
               PTR(const float, f, C_SCALE), f[C_H], f[C_F], f[C_G1], f[C_G2], limit, (int)f[C_BETWEEN],
               PTR(int8_t, f, C_QX), PTR(float, f, C_SX), PTR(int32_t, f, C_SUMX), PTR(int8_t, f, C_QA),
               PTR(float, f, C_SA), PTR(int32_t, f, C_SUMA)};
    cl.act_blocks = (int)f[C_ACT_BLOCKS];
    cl.bf16 = (int)f[C_BF16];
    if (cl.bf16 && (is_int(fmt) || fmt == FMT_BF16 || fmt == FMT_F16 || s.isa != ISA_AVX512 ||
                    !(moe_qgemm_cpu_features() & 4)))
        return -1;
    int64_t chunk = f[C_CHUNK], kmax = cl.H > cl.F ? cl.H : cl.F;
    int offset = fmt == FMT_A8W8 && s.isa == ISA_AVX512;  /* vpdpbusd's unsigned operand */
    float *scratch[2] = {PTR(float, f, C_SCRATCH), PTR(float, f, C_SCRATCH) + (chunk + MR_MAX) * cl.F};
    /* per thread: two panels [kmax][16] fp32 (the bf16 tiles: their k-pairs), and the bf16 tiles' fp32 panel */
    const int64_t per_thread = (cl.bf16 ? 3 : 2) * kmax * 16;
    int panels = !is_int(fmt) && !block_int, packed = s.packed && !block_int; /* the float tiles' buffers */
    float *bufs = panels ? malloc(sizeof(float) * nthreads * per_thread) : NULL;
    float *xp = packed ? malloc(sizeof(float) * (chunk + MR_MAX) * cl.H) : NULL;
    uint16_t *bf = cl.bf16 ? malloc(sizeof(uint16_t) * (num_tokens * cl.H + (chunk + MR_MAX) * cl.F)) : NULL;
    /* the block tiles' rows: x [T, H] and FC2's input [chunk + MR_MAX, F], a quad, a scale and an
     * offset per 4 / 32 / 32 elements: 4 + 4 / 32 * 8 bytes a 4 elements */
    const int64_t xn = num_tokens * cl.H, an = (chunk + MR_MAX) * cl.F;
    int32_t *blk = block_int ? malloc((size_t)(xn + an) / 4 * 4 + (size_t)(xn + an) / BLOCK * 8 + 64) : NULL;
    if ((panels && bufs == NULL) || (packed && xp == NULL) || (cl.bf16 && bf == NULL) || (block_int && blk == NULL))
        return free(bufs), free(xp), free(bf), free(blk), -2;
    cl.xb = bf, cl.ab = bf ? bf + num_tokens * cl.H : NULL;
    if (block_int) {
        cl.vnni = vnni, cl.bits8 = fmt == FMT_W8;
        cl.xq = blk, cl.aq = cl.xq + xn / 4;
        cl.xo = cl.aq + an / 4, cl.ao = cl.xo + xn / BLOCK;
        cl.xs = (float *)(cl.ao + an / BLOCK), cl.as = cl.xs + xn / BLOCK;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int64_t step = 0;
        float *buf = bufs ? bufs + omp_get_thread_num() * per_thread : NULL, *tmp = buf ? buf + 2 * kmax * 16 : NULL;
        if (cl.bf16) {
            rows_to_bf16(cl.x, cl.ldx, num_tokens, cl.H, cl.xb);
#pragma omp barrier
        }
        if (block_int) {
            block_quantize_rows(&cl, cl.x, cl.ldx, num_tokens, cl.H, cl.xq, cl.xs, cl.xo);
#pragma omp barrier
        }
        if (is_int(fmt)) {
            if (prequantized)
                adopt_rows(cl.qx, num_tokens, cl.H, cl.sumx, offset);
            else
                quantize_rows(cl.x, num_tokens, cl.H, cl.qx, cl.sx, cl.sumx, offset);  /* ldx == H: the host's copy */
#pragma omp barrier
        }
        for (int64_t e = 0; e < num_experts; ++e) {
            const int64_t *p = experts + 6 * e;
            Expert ex = {PTR(const uint8_t, p, 0), PTR(const uint8_t, p, 1), PTR(const void, p, 2),
                         PTR(const void, p, 3), PTR(const int32_t, p, 4), PTR(const int32_t, p, 5)};
            for (int64_t lo = bounds[e]; lo < bounds[e + 1]; lo += chunk) {
                int64_t n = bounds[e + 1] - lo < chunk ? bounds[e + 1] - lo : chunk;
                float *a = scratch[step++ & 1];
                if (block_int) {
                    block_chunk(&cl, lo, n, &ex, a);
                } else if (is_int(fmt)) {
                    ifc1(&cl, s, lo, n, &ex, a);
#pragma omp barrier
                    quantize_rows(a, n, cl.F, cl.qa, cl.sa, cl.suma, offset);
#pragma omp barrier
                    ifc2(&cl, s, lo, n, &ex);
                } else {
                    if (s.packed) {  /* xp is free: every thread is past the last FC1 */
                        pack_x(&cl, s, lo, n, xp);
#pragma omp barrier
                    }
                    ffc1(&cl, s, lo, n, &ex, xp, a, buf, tmp);
#pragma omp barrier
                    if (cl.act_blocks) {
                        fake_quantize_blocks(s, a, n, cl.F);
#pragma omp barrier
                    }
                    if (cl.bf16) { /* FC2's input as bf16: every thread's FC2 of the last chunk is done */
                        rows_to_bf16(a, cl.F, n, cl.F, cl.ab);
#pragma omp barrier
                    }
                    ffc2(&cl, s, lo, n, &ex, a, buf, tmp);
                }
            }
        }
    }
    free(bufs), free(xp), free(bf), free(blk);
    return 0;
}

/* Test entries.  The exact int32 product acc [M, N] = q_a [M, K] . W^T of an integer-format weight
 * (its panels, N / 16 of them; colsum [N] for a8w8) on one thread, through the run's tiles. */
int64_t moe_qgemm_int_matmul(int64_t isa, int64_t fmt, const int8_t *qa, int64_t M, int64_t K, const uint8_t *w,
                             const int32_t *colsum, int64_t N, int32_t *out) {
    Shape s = shape_of((int)isa, (int)fmt);
    if (!is_int((int)fmt) || !isa_ok(s.isa, (int)fmt) || N % (2 * s.v) || K % 8) return -1;
    int offset = fmt == FMT_A8W8 && s.isa == ISA_AVX512;
    int8_t *a = malloc(M * K);
    int32_t *rowsum = malloc(sizeof(int32_t) * (M + 1));
    if (!a || !rowsum) return free(a), free(rowsum), -2;
    for (int64_t r = 0; r < M; ++r) {
        rowsum[r] = 0;
        for (int64_t k = 0; k < K; ++k) rowsum[r] += qa[r * K + k], a[r * K + k] = offset ? (int8_t)(qa[r * K + k] ^ 0x80) : qa[r * K + k];
    }
    int32_t c[MR_MAX * 2 * V_MAX];
    const void *rows[MR_MAX];
    for (int64_t c0 = 0; c0 < N; c0 += 2 * s.v)
        for (int64_t r0 = 0; r0 < M; r0 += s.mr) {
            int mr = rows_at(s, M, r0);
            for (int i = 0; i < mr; ++i) rows[i] = a + (r0 + i) * K;
            itile(s, mr, rows, icolumn(s.fmt, w, c0, K), icolumn(s.fmt, w, c0 + s.v, K), K, c);
            for (int i = 0; i < mr; ++i) {
                Offsets o = offsets(s, colsum, rowsum, r0 + i);
                for (int j = 0; j < 2 * s.v; ++j)
                    out[(r0 + i) * N + c0 + j] = c[i * 2 * s.v + j] - o.row_offset - (o.colsum ? 128 * o.colsum[c0 + j] : 0);
            }
        }
    free(a), free(rowsum);
    return 0;
}

/* Panel p of a float-format weight dequantized: out [K][16]. */
int64_t moe_qgemm_dequant_panel(int64_t isa, int64_t fmt, const uint8_t *w, const void *scales, int64_t p, int64_t K,
                                int64_t G, float *out) {
    Shape s = shape_of((int)isa, (int)fmt);
    if (!isa_ok(s.isa, s.fmt)) return -1;
    dequant(s, w, scales, p, K, G, out);
    return 0;
}

/* Rows of x [n, K] quantized per token (quant/common.py's quantize_per_token_int8): q, s, sum. */
void moe_qgemm_quantize(const float *x, int64_t n, int64_t K, int8_t *q, float *s, int32_t *sum) {
#pragma omp parallel num_threads(1)
    quantize_rows(x, n, K, q, s, sum, 0);
}

/* Rows of x [n, K] (K a multiple of 32) as the block tiles read them (block_quantize_row, for
 * 4-bit or 8-bit weights): quads xq [n, K/4], scales sx and offsets off [n, K/32]. */
void moe_qgemm_block_quantize(const float *x, int64_t n, int64_t K, int64_t bits8, int32_t *xq, float *sx,
                              int32_t *off) {
    for (int64_t r = 0; r < n; ++r)
        block_quantize_row(x + r * K, K, (int)bits8, xq + r * (K / 4), sx + r * (K / BLOCK), off + r * (K / BLOCK));
}

/* moe_qgemm_dequant_kn's step along k: whole groups, DQ_KC elements where the group divides it */
enum { DQ_KC = 256 };
static int64_t dequant_kn_step(int64_t G) { return G > 0 && G < DQ_KC ? DQ_KC / G * G : G > 0 ? G : DQ_KC; }

/* 16 fp32 values as bf16, rounded to nearest even: (bits + 0x7FFF + lsb) >> 16 a lane, the rule
 * torch's fp32 -> bf16 conversion follows for finite values (the packs' values are finite). */
static inline __m256i bf16x16(const float *src) {
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    __m256i h[2];
    for (int i = 0; i < 2; ++i) {
        const __m256i bits = _mm256_load_si256((const __m256i *)(src + 8 * i));
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
        h[i] = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias, lsb)), 16);
    }
    /* packus interleaves the 128-bit lanes (a0-3 b0-3 a4-7 b4-7): the permute puts them in order */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xD8);
}

/* Panels [p, p + np) (np 1 or 2) of a float-format weight dequantized into their columns of
 * out [K][N]: `step` elements of k at a time (dequant_kn_step) into the thread's buffer
 * buf [2][step][16] (32 KiB at step 256, in L1 / L2), then each k's 64 bytes (fp32: one panel;
 * bf16: two) stored to memory as one line, non-temporally where the lines are whole and aligned
 * (`stream`: then N is a multiple of 32 and np is 2). */
static void dequant_kn_panels(Shape s, const uint8_t *w, const void *scales, int64_t p, int np, int64_t N, int64_t K,
                              int64_t G, int64_t step, void *out, int bf16, int stream, float *buf) {
    const int64_t code_bytes = panel_bytes(s.fmt, K) / K, scale_bytes = is_mx(s.fmt) ? 1 : 2; /* a k, a group */
    for (int64_t k0 = 0; k0 < K; k0 += step) {
        const int64_t kc = K - k0 < step ? K - k0 : step;
        for (int i = 0; i < np; ++i) {
            const uint8_t *codes = w + (p + i) * panel_bytes(s.fmt, K) + k0 * code_bytes;
            const void *sk = scales ? (const uint8_t *)panel_scales(s.fmt, scales, p + i, K, G) + (k0 / G) * PANEL * scale_bytes
                                    : NULL;
            if (s.isa == ISA_AVX512)
                dequant_panel512(s.fmt, codes, sk, kc, G, buf + i * step * PANEL); /* [kc][16] */
            else
                dequant_panel(s.fmt, codes, sk, kc, G, buf + i * step * PANEL);
        }
        for (int64_t k = 0; k < kc; k++) {
            const float *b0 = buf + k * PANEL, *b1 = b0 + step * PANEL;
            if (!bf16) {
                float *o = (float *)out + (k0 + k) * N + p * PANEL;
                for (int i = 0; i < np; ++i, o += PANEL, b0 = b1)
                    if (stream)
                        _mm256_stream_ps(o, _mm256_load_ps(b0)), _mm256_stream_ps(o + 8, _mm256_load_ps(b0 + 8));
                    else
                        _mm256_storeu_ps(o, _mm256_load_ps(b0)), _mm256_storeu_ps(o + 8, _mm256_load_ps(b0 + 8));
            } else {
                __m256i *o = (__m256i *)((uint16_t *)out + (k0 + k) * N + p * PANEL);
                if (stream && np == 2)
                    _mm256_stream_si256(o, bf16x16(b0)), _mm256_stream_si256(o + 1, bf16x16(b1));
                else
                    for (int i = 0; i < np; ++i) _mm256_storeu_si256(o + i, bf16x16(i ? b1 : b0));
            }
        }
    }
}

/* A float-format weight [N, K] (panel layout, N a multiple of 16) dequantized into its transpose:
 * out [K][N], fp32 (bf16 = 0) or bf16 rounded to nearest even (bf16 = 1).  A dense linear's prefill
 * GEMM operand (kernels/cpu/dense.py): x [T, K] @ out, the layout torch's GEMM takes as its second
 * operand as it is.  Why so: a panel dequantizes into [K][16], so each k is 16 columns' values side
 * by side, one 64-byte line of fp32 (two panels' of bf16), stored whole and non-temporally (no
 * read of the line before it is written).  Written as rows [N][K] the same values were a strided
 * scalar gather: a [4096, 2048] a8w4-int weight took 3.5 ms against its bf16 GEMM's 4.8 at 512 rows
 * (2-core Xeon with AMX).  Panel pairs split over the threads.  0, or -1 when the ISA is not on
 * this CPU, -2 out of memory. */
int64_t moe_qgemm_dequant_kn(int64_t isa, int64_t fmt, const uint8_t *w, const void *scales, int64_t N, int64_t K,
                             int64_t G, void *out, int64_t bf16, int64_t threads) {
    Shape s = shape_of((int)isa, (int)fmt);
    if (!isa_ok(s.isa, s.fmt)) return -1;
    const int64_t row_bytes = N * (bf16 ? 2 : 4);
    const int stream = (uintptr_t)out % 64 == 0 && row_bytes % 64 == 0;
    const int64_t pairs = (N / PANEL + 1) / 2, step = dequant_kn_step(G);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buf = aligned_alloc(64, sizeof(float) * 2 * step * PANEL);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t q = 0; q < pairs; q++) {
                const int np = 2 * q + 1 < N / PANEL ? 2 : 1;
                dequant_kn_panels(s, w, scales, 2 * q, np, N, K, G, step, out, (int)bf16, stream, buf);
            }
            _mm_sfence(); /* the streamed lines visible before the GEMM reads them */
            free(buf);
        }
    }
    return failed ? -2 : 0;
}
