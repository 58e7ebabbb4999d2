/* qgemm.c's panel dequantization: one panel of a float format (w4-int, mxfp4, w8-int, mxfp8, w16)
 * into fp32 [K][16], on AVX2 (F16C) and AVX-512.  Included by qgemm.c after qgemm_tiles.c. */
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
