/* qgemm.c's call: per-token int8 quantization of a row, the tile shape and call state (Shape, Call,
 * Expert), and the phases of one chunk of an expert's rows: integer FC1 + SwiGLU and FC2 + combine,
 * float FC1 / FC2 on dequantized panels.  Included by qgemm.c after qgemm_bf16.c. */
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
