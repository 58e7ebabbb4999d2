/* qgemm.c's group-wise a8w4-int / a8w8-int phases on the integer block tiles (blocktiles.h), the
 * float panels' per-block fake quantization of FC2's input, and the per-row quantizer over a
 * thread's rows.  Included by qgemm.c after qgemm_phases.c. */
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
