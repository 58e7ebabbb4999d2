/* qdecode.c's group-wise a8w8-int dots (AVX2 sign trick, AVX-512 VNNI) and a8g_rows, the one call
 * the step makes for a grouped a8 role's rows.  Included by qdecode.c after qdecode_rows16.c. */
/* out[w * nr + r] of two rows of a group-wise a8w8 role and n activation rows, AVX2: a block of 32
 * a step, 8 exact int32 lanes (the sign trick), each scaled (acc * s_x) * s_w. */
static void a8w8g_dot_avx2(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                           const int8_t *const *xq, const float *const *xs, const int32_t *const *xo, int64_t n, int nr,
                           float *out) {
    (void)xo; /* no offsets: the sign trick multiplies signed by signed */
    const int64_t K = wt->k, per = wt->group / A8G_BLOCK; /* blocks per group */
    const uint16_t *h0 = (const uint16_t *)scales[0], *h1 = (const uint16_t *)scales[1];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t r = 0; r < n; ++r) {
        __m256 t0 = _mm256_setzero_ps(), t1 = t0, sw0 = t0, sw1 = t0;
        int64_t left = 0, gi = 0; /* blocks left in group gi - 1 (no division in the loop) */
        for (int64_t b = 0; b < K / A8G_BLOCK; ++b) {
            const int64_t k = A8G_BLOCK * b;
            if (left-- == 0) {
                sw0 = _mm256_set1_ps(_cvtsh_ss(h0[gi])), sw1 = _mm256_set1_ps(_cvtsh_ss(h1[gi]));
                ++gi, left = per - 1;
            }
            if (r == 0 && !(b & 1)) {
                _mm_prefetch((const char *)(rows[0] + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
                _mm_prefetch((const char *)(rows[1] + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
            }
            __m256i q = _mm256_loadu_si256((const __m256i *)(xq[r] + k));
            __m256 sx = _mm256_loadu_ps(xs[r] + 8 * b);
            __m256i c0 = _mm256_loadu_si256((const __m256i *)(rows[0] + k));
            __m256i c1 = _mm256_loadu_si256((const __m256i *)(rows[1] + k));
            __m256i a0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c0), _mm256_sign_epi8(q, c0)), ones);
            __m256i a1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c1), _mm256_sign_epi8(q, c1)), ones);
            t0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a0), sx), sw0, t0);
            t1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a1), sx), sw1, t1);
        }
        out[r] = hsum8(t0), out[nr + r] = hsum8(t1);
    }
}

/* As a8w8g_dot_avx2, AVX-512 VNNI, 64 elements (two blocks) a step from each lane's offset; K a
 * multiple of 64. */
A8G_VNNI static void a8w8g_dot_vnni(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                                    const int8_t *const *xq, const float *const *xs, const int32_t *const *xo,
                                    int64_t n, int nr, float *out) {
    const int64_t K = wt->k, G = wt->group, per = G >= 64 ? G / 64 : 0; /* steps per group; 0: G = 32 */
    const uint16_t *h0 = (const uint16_t *)scales[0], *h1 = (const uint16_t *)scales[1];
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t r = 0; r < n; ++r) {
        __m512 t0 = _mm512_setzero_ps(), t1 = t0, sw0 = t0, sw1 = t0;
        int64_t left = 0, gi = 0; /* steps left in group gi - 1 (no division in the loop) */
        for (int64_t c = 0; c < K / 64; ++c) {
            const int64_t k = 64 * c;
            if (!per) { /* G = 32: lanes 0-7 take group 2c, lanes 8-15 group 2c + 1 (a8w4's G = 64 spread) */
                sw0 = a8g_scales16(scales[0], c, 64), sw1 = a8g_scales16(scales[1], c, 64);
            } else if (left-- == 0) {
                sw0 = _mm512_set1_ps(_cvtsh_ss(h0[gi])), sw1 = _mm512_set1_ps(_cvtsh_ss(h1[gi]));
                ++gi, left = per - 1;
            }
            if (r == 0) {
                _mm_prefetch((const char *)(rows[0] + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
                _mm_prefetch((const char *)(rows[1] + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
            }
            __m512i q = _mm512_loadu_si512(xq[r] + k), o = _mm512_loadu_si512(xo[r] + 16 * c);
            __m512 sx = _mm512_loadu_ps(xs[r] + 16 * c);
            __m512i a0 = _mm512_dpbusd_epi32(o, _mm512_xor_si512(_mm512_loadu_si512(rows[0] + k), flip), q);
            __m512i a1 = _mm512_dpbusd_epi32(o, _mm512_xor_si512(_mm512_loadu_si512(rows[1] + k), flip), q);
            t0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a0), sx), sw0, t0);
            t1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a1), sx), sw1, t1);
        }
        out[r] = _mm512_reduce_add_ps(t0), out[nr + r] = _mm512_reduce_add_ps(t1);
    }
}

/* out[w * nr + r] of two rows of a grouped a8 role and activation rows r0 .. r0 + n - 1 (through
 * `index` when given) of q [., ld], block scales and offsets [., ld / A8G_ROW_DIV]. */
static void a8g_rows(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales, const int8_t *q,
                     int64_t ld, const float *sxe, const int32_t *off, const int64_t *index, int64_t r0, int64_t n,
                     int nr, float *out) {
    const int8_t *xr[16];
    const float *xs[16];
    const int32_t *xo[16];
    for (int64_t r = 0; r < n; ++r) {
        int64_t i = index ? index[r0 + r] : r0 + r;
        xr[r] = q + i * ld, xs[r] = sxe + i * (ld / A8G_ROW_DIV), xo[r] = off + i * (ld / A8G_ROW_DIV);
    }
    if (wt->fmt == FMT_A8W8G)
        (wt->vnni ? a8w8g_dot_vnni : a8w8g_dot_avx2)(wt, rows, scales, xr, xs, xo, n, nr, out);
    else
        (wt->vnni ? a8g_dot_vnni : a8g_dot_avx2)(wt, rows, scales, xr, xs, xo, n, nr, out);
}
