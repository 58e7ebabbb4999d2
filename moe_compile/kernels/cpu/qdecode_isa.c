/* qdecode.c's per-ISA part: the vector macros of one ISA (QDECODE_ISA 2 or 512), a group's scale
 * setup, dequantizing 2V elements of every format, and the dot loops over 1-2 weight rows and up to
 * RMAX x rows, named with the ISA's suffix (dot_2, dot_512, ...).  qdecode.c includes it twice, once
 * per ISA inside that ISA's target pragma; so no include guard, and it undefines its macros at the end. */
#if QDECODE_ISA == 512
#define SFX(name) name##_512
#define V 16
#define vf __m512
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSET1(f) _mm512_set1_ps(f)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VHSUM(v) _mm512_reduce_add_ps(v)
/* Rows of x per pass: 2 weight rows x 8 x rows = 16 accumulators of the 32 zmm registers. */
enum { RMAX_512 = 8 };
#define RMAX RMAX_512
#else
#define SFX(name) name##_2
#define V 8
#define vf __m256
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSET1(f) _mm256_set1_ps(f)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
static inline float SFX(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VHSUM(v) SFX(hsum)(v)
/* 2 weight rows x 4 x rows = 8 accumulators of the 16 ymm registers. */
enum { RMAX_2 = 4 };
#define RMAX RMAX_2
#endif

/* What a group's scale turns into for the loop (a scaled lookup table, or the scale itself). */
typedef struct {
    vf t, u;
} SFX(gscale);

ALWAYS_INLINE SFX(gscale) SFX(group_setup)(const int fmt, float s) {
    SFX(gscale) g;
#if QDECODE_ISA == 512
    if (fmt == FMT_W4) {
        g.t = VMUL(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), VSET1(s)), g.u = g.t;
    } else if (fmt == FMT_MXFP4) {
        g.t = VMUL(_mm512_loadu_ps(E2M1), VSET1(s)), g.u = g.t;
    }
#else
    if (fmt == FMT_W4) {
        g.t = VSET1(s), g.u = VSET1(-8.f * s); /* (u - 8) s = fma(u, s, -8 s), exact: it is representable */
    } else if (fmt == FMT_MXFP4) {
        g.t = VMUL(_mm256_loadu_ps(E2M1), VSET1(s)), g.u = g.t; /* |value| * s; the sign from bit 3 */
    }
#endif
    else {
        g.t = VSET1(s), g.u = g.t;
    }
    return g;
}

/* Elements k .. k + 2V - 1 of a row as two vectors of fp32 weights (paired or in order, see the
 * header), scaled by the group's scale. */
ALWAYS_INLINE void SFX(dequant)(const int fmt, const uint8_t *row, int64_t k, SFX(gscale) g, vf *w0, vf *w1) {
#if QDECODE_ISA == 512
    if (fmt == FMT_W4 || fmt == FMT_MXFP4) {
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k / 2)));
        *w0 = _mm512_permutexvar_ps(d, g.t);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), g.t);
    } else if (fmt == FMT_W8) {
        *w0 = VMUL(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k)))), g.t);
        *w1 = VMUL(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k + 16)))), g.t);
    } else if (fmt == FMT_BF16) {
        __m512i b = _mm512_loadu_si512((const void *)(row + 2 * k));
        *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
        *w1 = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else if (fmt == FMT_FP16) {
        *w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * k)));
        *w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * k + 32)));
    } else { /* FMT_MXFP8: e4m3 bits placed in an fp32 (exponent 2^-120 off, subnormals included), then scaled */
        __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k)));
        __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k + 16)));
        const __m512i mag = _mm512_set1_epi32(0x7F), sign = _mm512_set1_epi32((int)0x80000000u);
        const __m512 two120 = _mm512_set1_ps(0x1p120f), nan = _mm512_set1_ps(__builtin_nanf(""));
        __m512i m0 = _mm512_and_si512(d0, mag), m1 = _mm512_and_si512(d1, mag);
        __m512i b0 = _mm512_ternarylogic_epi32(_mm512_slli_epi32(m0, 20), _mm512_slli_epi32(d0, 24), sign, 0xF8);
        __m512i b1 = _mm512_ternarylogic_epi32(_mm512_slli_epi32(m1, 20), _mm512_slli_epi32(d1, 24), sign, 0xF8);
        *w0 = VMUL(VMUL(_mm512_castsi512_ps(b0), two120), g.t);
        *w1 = VMUL(VMUL(_mm512_castsi512_ps(b1), two120), g.t);
        *w0 = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(m0, mag), *w0, nan);
        *w1 = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(m1, mag), *w1, nan);
    }
#else
    if (fmt == FMT_W4) {
        __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k / 2)));
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15))), g.t, g.u);
        *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4)), g.t, g.u);
    } else if (fmt == FMT_MXFP4) {
        __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k / 2)));
        __m256i dh = _mm256_srli_epi32(d, 4);
        const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
        __m256 s0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28), sign));
        __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(dh, 28)); /* dh < 16: bits 28..30 hold its 3 low bits */
        s1 = _mm256_and_ps(s1, _mm256_castsi256_ps(sign));
        *w0 = _mm256_xor_ps(_mm256_permutevar8x32_ps(g.t, d), s0);
        *w1 = _mm256_xor_ps(_mm256_permutevar8x32_ps(g.t, dh), s1);
    } else if (fmt == FMT_W8) {
        *w0 = VMUL(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k)))), g.t);
        *w1 = VMUL(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k + 8)))), g.t);
    } else if (fmt == FMT_BF16) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(row + 2 * k));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
        *w1 = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u)));
    } else if (fmt == FMT_FP16) {
        *w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k)));
        *w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k + 16)));
    } else { /* FMT_MXFP8, as the AVX-512 branch */
        __m256i d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k)));
        __m256i d1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k + 8)));
        const __m256i mag = _mm256_set1_epi32(0x7F), sign = _mm256_set1_epi32((int)0x80000000u);
        const __m256 two120 = _mm256_set1_ps(0x1p120f), nan = _mm256_set1_ps(__builtin_nanf(""));
        __m256i m0 = _mm256_and_si256(d0, mag), m1 = _mm256_and_si256(d1, mag);
        __m256i b0 = _mm256_or_si256(_mm256_slli_epi32(m0, 20), _mm256_and_si256(_mm256_slli_epi32(d0, 24), sign));
        __m256i b1 = _mm256_or_si256(_mm256_slli_epi32(m1, 20), _mm256_and_si256(_mm256_slli_epi32(d1, 24), sign));
        *w0 = VMUL(VMUL(_mm256_castsi256_ps(b0), two120), g.t);
        *w1 = VMUL(VMUL(_mm256_castsi256_ps(b1), two120), g.t);
        *w0 = _mm256_blendv_ps(*w0, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m0, mag)));
        *w1 = _mm256_blendv_ps(*w1, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m1, mag)));
    }
#endif
}

/* One 2V-element chunk at element k of NW weight rows into R rows' accumulators: dequantize once,
 * FMA into acc[w][r][j0] (first vector) and acc[w][r][j1] (second). */
ALWAYS_INLINE void SFX(chunk)(const int fmt, const int NW, const int R, const uint8_t *const *rows,
                              const float *const *x, int64_t k, const SFX(gscale) *gs, vf acc[2][RMAX][4],
                              const int j0, const int j1) {
    vf w0[2], w1[2];
    /* one prefetch per 64-byte line: a chunk is 16 (AVX2 4-bit) to 64 bytes */
    const int64_t at = fmt == FMT_W4 || fmt == FMT_MXFP4 ? k / 2 : fmt == FMT_BF16 || fmt == FMT_FP16 ? 2 * k : k;
    const int64_t ahead = fmt == FMT_W4 || fmt == FMT_MXFP4 ? PREFETCH_4BIT_BYTES
                          : fmt == FMT_BF16 || fmt == FMT_FP16 ? 2 * PREFETCH_ELEMENTS : PREFETCH_ELEMENTS;
    _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) {
        if ((at & 63) == 0) _mm_prefetch((const char *)(rows[w] + at + ahead), PREFETCH_HINT);
        SFX(dequant)(fmt, rows[w], k, gs[w], &w0[w], &w1[w]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        vf x0 = VLOAD(x[r] + k), x1 = VLOAD(x[r] + k + V);
        _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) {
            acc[w][r][j0] = VFMA(w0[w], x0, acc[w][r][j0]);
            acc[w][r][j1] = VFMA(w1[w], x1, acc[w][r][j1]);
        }
    }
}

#if QDECODE_ISA == 512
/* One 128-element block (64 bytes) of NW 4-bit rows in the T8 layout: lane i of the 32-bit view
 * holds bytes 4i..4i+3, i.e. elements 8i..8i+7; shifted right by 4j its low nibble is element 8i+j,
 * looked up in the unscaled table (vpermps reads the low 4 bits).  No byte-widening shuffle, one
 * table per format: the per-lane group scales `sv` multiply each row's partial sums once per block
 * (a lane's 8 elements share their group).  Partial chains: 2 for up to two x rows, else 1. */
ALWAYS_INLINE void t8_block(const int NW, const int R, const uint8_t *const *rows, const float *const *x,
                            int64_t k, __m512 tbl, const __m512 *sv, vf acc[2][RMAX][4]) {
    const int NP = R <= 2 ? 2 : 1;
    __m512i d[2];
    vf p[2][RMAX][2];
    _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) {
        d[w] = _mm512_loadu_si512((const void *)(rows[w] + k / 2));
        _mm_prefetch((const char *)(rows[w] + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) {
        vf wj[2];
        _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w)
            wj[w] = _mm512_permutexvar_ps(j ? _mm512_srli_epi32(d[w], 4 * j) : d[w], tbl);
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
            vf xj = VLOAD(x[r] + k + 16 * j);
            _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) {
                const int c = NP == 2 ? (j & 1) : 0;
                p[w][r][c] = j < NP ? VMUL(wj[w], xj) : VFMA(wj[w], xj, p[w][r][c]);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w)
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
            _Pragma("GCC unroll 2") for (int c = 0; c < NP; ++c) acc[w][r][c] = VFMA(p[w][r][c], sv[w], acc[w][r][c]);
}
#endif

/* NW weight rows (1 or 2) against R x rows, both compile-time: the loop every format and row count
 * is instantiated from.  Accumulator chains per (weight row, x row): 4 for one x row, 2 for two,
 * else 1, so that at least 8 FMA chains are in flight where the registers allow (an FMA's latency
 * is 4 cycles, two issue per cycle).  Groups of 32 (the default and MX's) run one flat loop, two
 * groups an iteration; other groups a loop per group. */
ALWAYS_INLINE void SFX(dot_body)(const int fmt, const int NW, const int R, const qweight_t *wt,
                                 const uint8_t *const *rows, const uint8_t *const *scales, const float *const *x,
                                 float *out) {
    const int NA = R == 1 ? 4 : R == 2 ? 2 : 1;
    vf acc[2][RMAX][4];
    _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w)
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
            _Pragma("GCC unroll 4") for (int j = 0; j < NA; ++j) acc[w][r][j] = VZERO();
    const int64_t K = wt->k, G = has_scales(fmt) ? wt->group : K, blocks = K / (2 * V) * (2 * V);
    float sbuf[2][SEG + 16]; /* + 16: T8 reads a whole vector of scales from any group */
    SFX(gscale) gs[2], gs2[2];
    if (!has_scales(fmt)) {
        _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) gs[w] = SFX(group_setup)(fmt, 1.f);
        int64_t k = 0;
        for (; NA == 4 && k + 4 * V <= blocks; k += 4 * V) {
            SFX(chunk)(fmt, NW, R, rows, x, k, gs, acc, 0, 1);
            SFX(chunk)(fmt, NW, R, rows, x, k + 2 * V, gs, acc, 2, 3);
        }
        for (; k < blocks; k += 2 * V) SFX(chunk)(fmt, NW, R, rows, x, k, gs, acc, 0, NA - 1);
    }
    for (int64_t seg = 0; has_scales(fmt) && seg < K; seg += SEG * G) { /* K is whole groups of 32 */
        int64_t end = seg + SEG * G < K ? seg + SEG * G : K;
        _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) convert_scales(fmt, scales[w], seg / G, (end - seg) / G, sbuf[w]);
#if QDECODE_ISA == 512
        if ((fmt == FMT_W4 || fmt == FMT_MXFP4) && wt->layout == LAYOUT_T8) {
            /* lane i of a block starting at k reads group (k + 8 i) / G: (k - seg) / G + 8 i / G */
            const __m512i lane_group = _mm512_srlv_epi32(_mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96,
                                                                             104, 112, 120),
                                                         _mm512_set1_epi32(__builtin_ctzll((uint64_t)G)));
            const __m512 tbl = fmt == FMT_W4 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                             : _mm512_loadu_ps(E2M1);
            int64_t k = seg;
            for (; k + 128 <= end; k += 128) {
                __m512 sv[2];
                _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w)
                    sv[w] = _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(sbuf[w] + (k - seg) / G));
                t8_block(NW, R, rows, x, k, tbl, sv, acc);
            }
            for (; k < end; k += 2 * V) { /* the row's last K mod 128 elements, PAIRED */
                _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) gs[w] = SFX(group_setup)(fmt, sbuf[w][(k - seg) / G]);
                SFX(chunk)(fmt, NW, R, rows, x, k, gs, acc, 0, NA > 1);
            }
            continue;
        }
#endif
        if (G == 32) {
            for (int64_t k = seg; k < end; k += 64) { /* two groups: K / 32 may be odd */
                const int two = k + 64 <= end;
                _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) {
                    gs[w] = SFX(group_setup)(fmt, sbuf[w][(k - seg) >> 5]);
                    gs2[w] = SFX(group_setup)(fmt, sbuf[w][((k - seg) >> 5) + two]);
                }
                _Pragma("GCC unroll 2") for (int c = 0; c < 32; c += 2 * V) SFX(chunk)(fmt, NW, R, rows, x, k + c, gs, acc, 0, NA > 1);
                if (two)
                    _Pragma("GCC unroll 2") for (int c = 32; c < 64; c += 2 * V)
                        SFX(chunk)(fmt, NW, R, rows, x, k + c, gs2, acc, NA - 1 - (NA > 1), NA - 1);
            }
        } else {
            for (int64_t k0 = seg; k0 < end; k0 += G) {
                _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) gs[w] = SFX(group_setup)(fmt, sbuf[w][(k0 - seg) / G]);
                for (int64_t k = k0; k < k0 + G; k += 2 * V) SFX(chunk)(fmt, NW, R, rows, x, k, gs, acc, 0, NA - 1);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w)
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
            vf v = acc[w][r][0];
            _Pragma("GCC unroll 4") for (int j = 1; j < NA; ++j) v = VADD(v, acc[w][r][j]);
            float sum = VHSUM(v);
            for (int64_t k = blocks; k < K; ++k) sum += element(fmt, rows[w], k) * x[r][k]; /* w16 tails */
            out[w * R + r] = sum;
        }
}

/* One function per (format, row count) with both weight rows; dot_<isa> picks it. */
#define DOT_FOR(FMT, R)                                                                                      \
    static void SFX(dot_##FMT##_##R)(const qweight_t *wt, const uint8_t *const *rows,                        \
                                     const uint8_t *const *scales, const float *const *x, float *out) {      \
        SFX(dot_body)(FMT, 2, R, wt, rows, scales, x, out);                                                   \
    }
#if QDECODE_ISA == 512
#define DOT_ROWS(FMT) DOT_FOR(FMT, 1) DOT_FOR(FMT, 2) DOT_FOR(FMT, 3) DOT_FOR(FMT, 4) DOT_FOR(FMT, 6) DOT_FOR(FMT, 8)
#define DOT_CASES(FMT)                                                                                       \
    switch (nr) {                                                                                            \
    case 1: SFX(dot_##FMT##_1)(wt, rows, scales, x, out); return;                                            \
    case 2: SFX(dot_##FMT##_2)(wt, rows, scales, x, out); return;                                            \
    case 3: SFX(dot_##FMT##_3)(wt, rows, scales, x, out); return;                                            \
    case 4: SFX(dot_##FMT##_4)(wt, rows, scales, x, out); return;                                            \
    case 6: SFX(dot_##FMT##_6)(wt, rows, scales, x, out); return;                                            \
    default: SFX(dot_##FMT##_8)(wt, rows, scales, x, out); return;                                           \
    }
#else
#define DOT_ROWS(FMT) DOT_FOR(FMT, 1) DOT_FOR(FMT, 2) DOT_FOR(FMT, 3) DOT_FOR(FMT, 4)
#define DOT_CASES(FMT)                                                                                       \
    switch (nr) {                                                                                            \
    case 1: SFX(dot_##FMT##_1)(wt, rows, scales, x, out); return;                                            \
    case 2: SFX(dot_##FMT##_2)(wt, rows, scales, x, out); return;                                            \
    case 3: SFX(dot_##FMT##_3)(wt, rows, scales, x, out); return;                                            \
    default: SFX(dot_##FMT##_4)(wt, rows, scales, x, out); return;                                           \
    }
#endif
DOT_ROWS(FMT_BF16)
DOT_ROWS(FMT_FP16)
DOT_ROWS(FMT_W8)
DOT_ROWS(FMT_W4)
DOT_ROWS(FMT_MXFP4)
DOT_ROWS(FMT_MXFP8)

/* 4- and 8-bit weights against one input row held as int16 blocks (see quantize_i16 for why): two
 * rows, one I16_BLOCK per step, then one convert and one fma with the block's scale.
 * AVX2 (dot16_2; w4-int, mxfp4, w8-int): the nibbles mapped by vpshufb to the format's values as
 * integers (w4-int u - 8; mxfp4 twice its e2m1 value, so the scale takes the 1/2), int8
 * sign-extended; two vpmaddwd of 16 lanes.  |q| <= 127: the 4-product lane sums < 2^24, exact as fp32.
 * AVX-512 (dot16_512; w8-int, i16_form): the block's 32 int8 sign-extended to one zmm and one
 * vpmaddwd: 5 vector operations per 32 weights a row where the fp32 loop takes 8 (convert, scale
 * and fma of every 16), which holds w8-int at ~9 GB/s of weights a core, under the memory's speed
 * with 2 threads.  w4-int with VNNI goes to w4_dot16_vnni (128 weights a step, I16_T4); mxfp4
 * keeps AVX-512's fp32 loop, whose permute lookup gives its values directly. */
static void SFX(dot16)(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                       const int16_t *xq, const float *xs, const int32_t *xo, float *out) {
#if QDECODE_ISA == 512
    if (wt->i16 == I16_T4) {
        w4_dot16_vnni(wt, rows, scales, xq, xs, xo, out);
        return;
    }
#else
    (void)xo;
#endif
    const uint64_t K = (uint64_t)wt->k, G = (uint64_t)wt->group, blocks_per_group = G / I16_BLOCK;
#if QDECODE_ISA == 2
    const int mx = wt->fmt == FMT_MXFP4, w8 = wt->fmt == FMT_W8;
    const __m128i low = _mm_set1_epi8(15);
    const __m128i values = mx ? _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
                              : _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const float unit = mx ? 0.5f : 1.f;
#else
    const float unit = 1.f;
#endif
    vf acc[2] = {VZERO(), VZERO()};
    float sbuf[2][SEG];
    for (uint64_t seg = 0; seg < K; seg += SEG * G) {
        uint64_t end = seg + SEG * G < K ? seg + SEG * G : K;
        for (int w = 0; w < 2; ++w) convert_scales(wt->fmt, scales[w], (int64_t)(seg / G), (int64_t)((end - seg) / G), sbuf[w]);
        uint64_t g = 0, in_group = 0;
        for (uint64_t k0 = seg; k0 < end; k0 += I16_BLOCK) {
#if QDECODE_ISA == 2
            __m256i qe = _mm256_loadu_si256((const __m256i *)(xq + k0));
            __m256i qo = _mm256_loadu_si256((const __m256i *)(xq + k0 + I16_BLOCK / 2));
#else
            __m512i q = _mm512_loadu_si512((const void *)(xq + k0));
#endif
            float sx = xs[k0 / I16_BLOCK] * unit;
            _Pragma("GCC unroll 2") for (int w = 0; w < 2; ++w) {
#if QDECODE_ISA == 2
                __m256i lo, hi; /* the block's elements as int16: 4-bit evens / odds, int8 first / second half */
                if (w8) {
                    _mm_prefetch((const char *)(rows[w] + k0 + PREFETCH_ELEMENTS), PREFETCH_HINT);
                    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rows[w] + k0)));
                    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rows[w] + k0 + 16)));
                } else {
                    _mm_prefetch((const char *)(rows[w] + k0 / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
                    __m128i v = _mm_loadu_si128((const __m128i *)(rows[w] + k0 / 2));
                    lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(values, _mm_and_si128(v, low)));
                    hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(v, 4), low)));
                }
                __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(lo, qe), _mm256_madd_epi16(hi, qo)));
#else
                _mm_prefetch((const char *)(rows[w] + k0 + PREFETCH_ELEMENTS), PREFETCH_HINT);
                __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(rows[w] + k0)));
                __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(v, q));
#endif
                acc[w] = VFMA(p, VSET1(sbuf[w][g] * sx), acc[w]);
            }
            if (++in_group == blocks_per_group) in_group = 0, ++g;
        }
    }
    for (int w = 0; w < 2; ++w) out[w] = VHSUM(acc[w]);
}

/* out[w * nr + r] = row w . x_r for the two rows and nr x rows (nr one of the instantiated counts). */
static void SFX(dot)(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                     const float *const *x, int nr, float *out) {
    switch (wt->fmt) {
    case FMT_BF16: DOT_CASES(FMT_BF16)
    case FMT_FP16: DOT_CASES(FMT_FP16)
    case FMT_W8: DOT_CASES(FMT_W8)
    case FMT_W4: DOT_CASES(FMT_W4)
    case FMT_MXFP4: DOT_CASES(FMT_MXFP4)
    default: DOT_CASES(FMT_MXFP8)
    }
}

#undef SFX
#undef V
#undef VZERO
#undef vf
#undef VLOAD
#undef VSET1
#undef VFMA
#undef VMUL
#undef VADD
#undef VHSUM
#undef RMAX
#undef DOT_FOR
#undef DOT_ROWS
#undef DOT_CASES
