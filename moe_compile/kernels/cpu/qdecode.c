/* Quantized MoE decode on CPU: a whole decode step (T <= 16 tokens) on packed weights in one call,
 * the weights streamed once and dequantized in registers: FC1 -> SwiGLU -> FC2 -> weighted combine.
 *
 * Shapes:   T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots.
 *           x [T, H] fp32, ids [T, K] int64, gates [T, K] fp32, y [T, H] fp32 (zeroed by the host).
 *           FC1 [E, 2F, H] (gate rows 0..F-1, up rows F..2F-1), FC2 [E, H, F], in one of the
 *           formats of moe_compile/quant (the host's docstring has the table); a row's reduction
 *           dimension is contiguous, its group scales are [E, N, K/G] beside it.
 *
 * Why: decode reads each touched expert's weights once, so it runs at the speed the weights stream
 * from memory; a 4-bit weight is an eighth of fp32's bytes, but only if dequantizing keeps up.  The
 * loops here spend a few vector operations per 16 or 32 weights and none per weight and token:
 *   - 4-bit, AVX-512: 64 bytes (128 elements) are read as 16 32-bit lanes of 8 nibbles each;
 *     shifted right by 4j, a lane's low nibble (element 8i + j) indexes a 16-entry table of the
 *     format's values (vpermps reads only the index's low 4 bits): 8 lookups and 7 shifts per 128
 *     weights, no byte-widening shuffle; a lane's 8 elements share a group, so the group scales
 *     multiply each row's partial sums once per block (layout T8 below).  The last K mod 128
 *     elements: 16 bytes zero-extended into 16 lanes, low and high nibble into a scaled table.
 *     AVX2's vpermps has 8 entries: w4-int converts the nibble (u - 8) s as one FMA of u, mxfp4
 *     looks up |value| and sets the sign bit.
 *   - One row (T = 1's experts), 4- and 8-bit weight-only formats: the row is held as int16 blocks
 *     and the codes are summed against it in int32 (quantize_i16, dot16, w4_dot16_vnni).
 *   - bf16: a 32-bit lane holding two bf16 values is both of them as fp32, one shifted left 16
 *     bits, the other with its low half masked off.
 *   - int8 / fp16: sign-extend and convert / vcvtph2ps, then times the group scale.
 *   So a lane's weight is not element k of the row: x (and FC2's input) is held in the order the
 *   lanes see ("paired": each block of 2V elements, V = lanes, as its V even elements then its V
 *   odd ones; "T8": each 128 block as 8 vectors of elements j, j+8, ..); only the order of a dot
 *   product's terms changes.  Formats whose lanes hold consecutive elements (int8, fp16, fp8)
 *   read x as it is.
 * Rows:     every weight row is dotted with all of its expert's tokens at once (up to RMAX_* per
 *           pass, x in L1), so the dequantizing is paid once per weight, not once per token.
 * Threads:  both phases split every touched expert's output rows over the OpenMP threads (torch's
 *           own, as skinny.c): FC1 by features (gate row n and up row F+n together, then that
 *           feature's SwiGLU, no barrier needed), FC2 by output columns of y (each owned by one
 *           thread, so a token's K experts never race).  One barrier between the phases.
 * ISA:      AVX2 + FMA + F16C everywhere; the same loops for AVX-512 (F, BW, DQ, VL) compiled for
 *           that target alone and run only where the CPU has it.  The per-ISA part
 *           (qdecode_isa.c) is written once and included twice below, with QDECODE_ISA defined.
 *
 * Files:    one translation unit: this file includes its parts in order, each using what the ones
 *           before it define, then holds the step itself (plan fields, the FC1 / FC2 phases, the
 *           entry points the host binds):
 *             qdecode.h           formats, a role's weights (qweight_t), scale and element
 *                                 conversions, prefetch distances, the dot function types
 *             qdecode_quantize.c  the activation quantizers: int16 blocks for the one-row loops,
 *                                 int8 per row for the a8 formats
 *             qdecode_a8.c        a8w8-int / a8w4-int dots, per channel and group-wise (AVX2, VNNI)
 *             qdecode_rows16.c    T = 1 integer loops: w4-int on int16 rows (VNNI) and the rows16
 *                                 loops on the qgemm panels
 *             qdecode_a8w8g.c     group-wise a8w8-int dots and the grouped a8 row dispatch
 *             qdecode_isa.c       the dequantizing dot loops of every format, once per ISA
 *           Why one unit and not objects linked together: the helpers stay static and inline into
 *           the loops that call them across parts (always_inline, and GCC's default
 *           -ffp-contract=fast fuses a multiply and an add into one FMA only where both end up in
 *           one function), so the code and its bits are what one file gave.  cc.py builds
 *           qdecode.c with its qdecode_*.c parts and the folder's headers beside it, all of them
 *           in the build's hash.
 *
 * Built by moe_compile/kernels/cpu/qdecode.py with `cc -O3 -mavx2 -mfma` on first use.
 */
#include "qdecode.h"          /* formats, qweight_t, conversions (and #pragma F16C for the unit) */
#include "qdecode_quantize.c" /* int16 and int8 activation quantizers */
#include "qdecode_a8.c"       /* a8 dots: per channel and group-wise */
#include "qdecode_rows16.c"   /* T = 1 integer loops, rows16 panels */
#include "qdecode_a8w8g.c"    /* group-wise a8w8 dots, a8g_rows */

#define QDECODE_ISA 2
#pragma GCC push_options
#include "qdecode_isa.c"
#pragma GCC pop_options
#undef QDECODE_ISA

#define QDECODE_ISA 512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
#include "qdecode_isa.c"
#pragma GCC pop_options
#undef QDECODE_ISA

/* The widest ISA this CPU runs the loops in: ISA_AVX512, ISA_AVX2, or 0 (no F16C / FMA). */
int64_t moe_qdecode_best_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) return 0;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512vl"))
        return ISA_AVX512;
    return ISA_AVX2;
}

/* Plan fields (int64 each; pointers as integers), then W_FIELDS for FC1 and for FC2. */
enum { P_X, P_T, P_H, P_F, P_IDS, P_K, P_E, P_GATES, P_Y, P_BETWEEN, P_ISA, P_ROLES };
enum { W_DATA, W_SCALE, W_FMT, W_GROUP, W_FIELDS };
/* After the roles: FC1's and FC2's rows16 panels, data then scale (0, 0: none; rows16_attach). */
enum { P_ROWS16 = P_ROLES + 2 * W_FIELDS, P_FIELDS = P_ROWS16 + 4 };

typedef struct {
    int64_t T, H, F, K, E, S, between, v;
    const float *gates;
    float *y, *xp, *h, *a;             /* xp [T, H] x paired for FC1; h [S, 2F]; a [S, F] paired for FC2 */
    const int64_t *start, *tok, *slot; /* start [E + 1] over the sorted slots; token and slot (t*K+k) of each */
    int16_t *xq, *aq;                  /* x [T, H] and a [S, F] as int16 blocks (roles with i16) */
    int8_t *x8, *a8;                   /* x [T, H] and a [S, F] quantized per row (a8 formats) */
    float *x8s, *a8s;                  /* their scales [T], [S] */
    int32_t *x8sum, *a8sum;            /* their sums of q [T], [S] */
    float *x8b, *a8b;                  /* grouped a8: x8 / a8 per block of 32, lane scales [T, H / 4], [S, F / 4] */
    int32_t *x8o, *a8o;                /* and offsets, same shapes (quantize_int8_blocks) */
    float *xs, *as;                    /* their scales, i16_scale_at: [T, H / I16_LANE], [S, F / I16_LANE] */
    int32_t *xo, *ao;                  /* I16_T4: their lane offsets, same shapes */
    int32_t *x16, *a16;                /* rows16 roles: x [T, H / 2] and a [S, F / 2] as rows16_input's */
    float *x16s, *a16s;                /* their scales [T, H / 4], [S, F / 4] */
    int32_t *x16o, *a16o;              /* and offsets, same shapes */
    int8_t *a16tmp;                    /* [S, F]: rows16_input's scratch of a8w4-int's FC2 input rows */
    qweight_t w1, w2;
    dot_fn dot;
    dot16_fn dot16;
    int rmax;
} step_t;

/* Rows of x (or a) for sorted slots lo .. lo + n - 1, padded up to a kernel's row count with the
 * first row (results for the padding are dropped). */
static int gather_rows(const float *base, int64_t ld, const int64_t *index, int64_t lo, int64_t n, int rmax,
                       const float **rows) {
    int nr = (int)n;
    for (int r = 0; r < nr; ++r) rows[r] = base + (index ? index[lo + r] : lo + r) * ld;
    int padded = nr <= 4 ? nr : nr <= 6 ? 6 : 8;
    padded = padded > rmax ? rmax : padded;
    for (int r = nr; r < padded; ++r) rows[r] = rows[0];
    return padded;
}

/* int8_dot of per-channel a8w8 (FMT_A8W8) on AVX-512 VNNI: u = q_w + 128 (the sign bit flipped:
 * unsigned) times q_x by vpdpbusd, 64 a step, less 128 sum(q_x): exact as int8_dot (every lane's
 * int32 stays below K / 16 * 4 * 255 * 127), 3 operations per 64 weights a row where int8_dot's
 * sign trick takes 12: that loop holds a8w8-int at ~12 GB/s of weights a core.  A last piece under
 * 64 is read with masked loads (zeros: 128 * 0 adds nothing). */
A8G_VNNI static void int8_dot_vnni(int64_t K, const uint8_t *const *rows, const int8_t *const *xq, const int32_t *sums,
                                   int64_t n, int32_t acc[2][16]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t r = 0; r < n; ++r) {
        __m512i t0 = _mm512_setzero_si512(), t1 = t0, t2 = t0, t3 = t0; /* two chains a row */
        int64_t k = 0;
        for (; k + 128 <= K; k += 128) {
            if (r == 0)
                for (int j = 0; j < 2; ++j) {
                    _mm_prefetch((const char *)(rows[j] + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
                    _mm_prefetch((const char *)(rows[j] + k + 64 + PREFETCH_ELEMENTS), PREFETCH_HINT);
                }
            __m512i qa = _mm512_loadu_si512(xq[r] + k), qb = _mm512_loadu_si512(xq[r] + k + 64);
            t0 = _mm512_dpbusd_epi32(t0, _mm512_xor_si512(_mm512_loadu_si512(rows[0] + k), flip), qa);
            t1 = _mm512_dpbusd_epi32(t1, _mm512_xor_si512(_mm512_loadu_si512(rows[1] + k), flip), qa);
            t2 = _mm512_dpbusd_epi32(t2, _mm512_xor_si512(_mm512_loadu_si512(rows[0] + k + 64), flip), qb);
            t3 = _mm512_dpbusd_epi32(t3, _mm512_xor_si512(_mm512_loadu_si512(rows[1] + k + 64), flip), qb);
        }
        for (; k < K; k += 64) {
            __mmask64 m = K - k >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (K - k)) - 1;
            __m512i q = _mm512_maskz_loadu_epi8(m, xq[r] + k);
            t0 = _mm512_dpbusd_epi32(t0, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, rows[0] + k), flip), q);
            t1 = _mm512_dpbusd_epi32(t1, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, rows[1] + k), flip), q);
        }
        acc[0][r] = _mm512_reduce_add_epi32(_mm512_add_epi32(t0, t2)) - 128 * sums[r];
        acc[1][r] = _mm512_reduce_add_epi32(_mm512_add_epi32(t1, t3)) - 128 * sums[r];
    }
}

/* out[w * nr + r] = (acc * s_x) * s_w (the reference's order) of two rows of an a8 format and
 * activation rows r0 .. r0 + n - 1 (through `index` when given) of q / scales / sums. */
static void int8_rows(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales, const int8_t *q,
                      int64_t ld, const float *qs, const int32_t *sums, const int64_t *index, int64_t r0, int64_t n,
                      int nr, float *out) {
    const int8_t *xr[16];
    int32_t acc[2][16], sum[16];
    for (int64_t r = 0; r < n; ++r) {
        int64_t i = index ? index[r0 + r] : r0 + r;
        xr[r] = q + i * ld, sum[r] = sums[i];
    }
    if (wt->fmt == FMT_A8W8 && wt->vnni)
        int8_dot_vnni(wt->k, rows, xr, sum, n, acc);
    else
        int8_dot(wt->fmt, wt->k, rows, xr, sum, n, acc);
    for (int w = 0; w < 2; ++w)
        for (int64_t r = 0; r < n; ++r) {
            float sw;
            memcpy(&sw, scales[w], 4);
            out[w * nr + r] = ((float)acc[w][r] * qs[index ? index[r0 + r] : r0 + r]) * sw;
        }
}

/* FC1 + SwiGLU of this thread's features [f0, f1) of expert e's slots [lo, hi). */
static void fc1_part(const step_t *s, int64_t e, int64_t lo, int64_t hi, int64_t f0, int64_t f1, float limit) {
    const float *rows[16];
    float out[32];
    for (int64_t r0 = lo; r0 < hi; r0 += s->rmax) {
        int64_t n = hi - r0 < s->rmax ? hi - r0 : s->rmax;
        if (rows16_chunk(&s->w1, n)) { /* the gate and up rows' 16-row panels */
            const int64_t F = s->F;
            rows16_set_t gate, up;
            for (int64_t r = 0; r < n; ++r) {
                const int64_t t = s->tok[r0 + r];
                gate.xq[r] = up.xq[r] = s->x16 + t * (s->H / 2);
                gate.sx[r] = up.sx[r] = s->x16s + t * (s->H / 4);
                gate.off[r] = up.off[r] = s->x16o + t * (s->H / 4);
            }
            for (int64_t b = f0 / ROWS16; b < f1 / ROWS16; ++b) {
                for (int64_t r = 0; r < n; ++r)
                    gate.out[r] = s->h + (r0 + r) * 2 * F + ROWS16 * b, up.out[r] = gate.out[r] + F;
                rows16_expert_rows(&s->w1, e, b, &gate, (int)n);
                rows16_expert_rows(&s->w1, e, F / ROWS16 + b, &up, (int)n);
            }
            continue;
        }
        int nr = gather_rows(s->xp, s->H, s->tok, r0, n, s->rmax, rows);
        for (int64_t f = f0; f < f1; ++f) {
            const uint8_t *w[2] = {row_at(&s->w1, e, f), row_at(&s->w1, e, s->F + f)};
            const uint8_t *sc[2] = {scales_at(&s->w1, e, f), scales_at(&s->w1, e, s->F + f)};
            if (a8g(s->w1.fmt)) {
                a8g_rows(&s->w1, w, sc, s->x8, s->H, s->x8b, s->x8o, s->tok, r0, n, nr, out);
            } else if (int8_activations(s->w1.fmt)) {
                int8_rows(&s->w1, w, sc, s->x8, s->H, s->x8s, s->x8sum, s->tok, r0, n, nr, out);
            } else if (n == 1 && s->w1.i16) {
                int64_t t = s->tok[r0];
                int64_t at = i16_scale_at(s->w1.i16, s->H, t, 0);
                s->dot16(&s->w1, w, sc, s->xq + t * s->H, s->xs + at, s->xo + at, out);
            } else {
                s->dot(&s->w1, w, sc, rows, nr, out);
            }
            for (int64_t r = 0; r < n; ++r) {
                s->h[(r0 + r) * 2 * s->F + f] = out[r];
                s->h[(r0 + r) * 2 * s->F + s->F + f] = out[nr + r];
            }
        }
    }
    /* SwiGLU of the features just computed, 2V at a time so each block is stored paired for FC2. */
    for (int64_t r = lo; r < hi; ++r) {
        const float *hr = s->h + r * 2 * s->F;
        float g = s->between ? s->gates[s->slot[r]] : 1.f, blk[128];
        /* fc2_part takes the int16 blocks only for a chunk of one row: the expert's last, when its
         * slot count leaves one over the chunks of rmax */
        int single = r == hi - 1 && (hi - lo - 1) % s->rmax == 0;
        for (int64_t c = f0; c < f1; c += 128) {
            int64_t m = f1 - c < 128 ? f1 - c : 128;
            swiglu_span(blk, hr + c, hr + s->F + c, 0, m, limit, g);
            layout_copy(s->a + r * s->F + c, blk, m, s->v, s->w2.layout);
            if (s->w2.rows16 && s->w2.rows16 != R16_A8W4) { /* int16 blocks (a8w4-int's after FC1, below): every row, chunks of up to ROWS16_MULTI read them; the blocks are whole inside a chunk of 128 */
                int16_t tmp[128];
                rows16_input((int)s->w2.rows16, blk, m, tmp, s->a16 + r * (s->F / 2) + c / 2, s->a16s + r * (s->F / 4) + c / I16_BLOCK,
                             s->a16o + r * (s->F / 4) + c / I16_BLOCK);
            } else if (s->w2.i16 && single) {
                int64_t at = i16_scale_at(s->w2.i16, s->F, r, c);
                quantize_i16_as(s->w2.i16, blk, m, s->aq + r * s->F + c, s->as + at, s->ao + at);
            }
        }
    }
}

/* FC2 of this thread's output columns [n0, n1) of expert e's slots [lo, hi), added into y. */
static void fc2_part(const step_t *s, int64_t e, int64_t lo, int64_t hi, int64_t n0, int64_t n1) {
    const float *rows[16];
    float out[32];
    for (int64_t r0 = lo; r0 < hi; r0 += s->rmax) {
        int64_t n = hi - r0 < s->rmax ? hi - r0 : s->rmax;
        if (rows16_chunk(&s->w2, n)) { /* 16 output columns a panel */
            float o16[ROWS16_MULTI][ROWS16];
            rows16_set_t in;
            for (int64_t r = 0; r < n; ++r) {
                in.xq[r] = s->a16 + (r0 + r) * (s->F / 2), in.sx[r] = s->a16s + (r0 + r) * (s->F / 4);
                in.off[r] = s->a16o + (r0 + r) * (s->F / 4), in.out[r] = o16[r];
            }
            for (int64_t b = n0 / ROWS16; b < n1 / ROWS16; ++b) {
                rows16_expert_rows(&s->w2, e, b, &in, (int)n);
                for (int64_t r = 0; r < n; ++r) {
                    const float g = s->between ? 1.f : s->gates[s->slot[r0 + r]];
                    float *yr = s->y + s->tok[r0 + r] * s->H + ROWS16 * b;
                    for (int i = 0; i < ROWS16; ++i) yr[i] += g * o16[r][i];
                }
            }
            continue;
        }
        int nr = gather_rows(s->a, s->F, NULL, r0, n, s->rmax, rows);
        const int64_t i16_at = i16_scale_at(s->w2.i16, s->F, r0, 0);
        for (int64_t c = n0; c < n1; c += 2) {
            int64_t c2 = c + 1 < n1 ? c + 1 : c; /* an odd count: the last row twice, once kept */
            const uint8_t *w[2] = {row_at(&s->w2, e, c), row_at(&s->w2, e, c2)};
            const uint8_t *sc[2] = {scales_at(&s->w2, e, c), scales_at(&s->w2, e, c2)};
            if (a8g(s->w2.fmt))
                a8g_rows(&s->w2, w, sc, s->a8, s->F, s->a8b, s->a8o, NULL, r0, n, nr, out);
            else if (int8_activations(s->w2.fmt))
                int8_rows(&s->w2, w, sc, s->a8, s->F, s->a8s, s->a8sum, NULL, r0, n, nr, out);
            else if (n == 1 && s->w2.i16)
                s->dot16(&s->w2, w, sc, s->aq + r0 * s->F, s->as + i16_at, s->ao + i16_at, out);
            else
                s->dot(&s->w2, w, sc, rows, nr, out);
            for (int64_t r = 0; r < n; ++r) {
                float g = s->between ? 1.f : s->gates[s->slot[r0 + r]];
                float *yr = s->y + s->tok[r0 + r] * s->H;
                yr[c] += g * out[r];
                if (c2 != c) yr[c2] += g * out[nr + r];
            }
        }
    }
}

static void run_parts(const step_t *s, float limit, int64_t part, int64_t parts) {
    int64_t f0, f1, n0, n1;
    split(s->F, 128, part, parts, &f0, &f1); /* whole T8 blocks of FC2's input per thread */
    for (int64_t e = 0; e < s->E && f0 < f1; ++e)
        if (s->start[e + 1] > s->start[e]) fc1_part(s, e, s->start[e], s->start[e + 1], f0, f1, limit);
#pragma omp barrier
    if (int8_activations(s->w2.fmt) || a8g(s->w2.fmt)) { /* FC2's input re-quantized per row: whole rows, after FC1 */
        int64_t r0, r1;
        split(s->S, 1, part, parts, &r0, &r1);
        for (int64_t r = r0; r < r1; ++r)
            if (a8g(s->w2.fmt)) {
                quantize_int8_blocks(&s->w2, s->a + r * s->F, s->a8 + r * s->F, s->a8b + r * (s->F / A8G_ROW_DIV),
                                     s->a8o + r * (s->F / A8G_ROW_DIV));
                if (s->w2.rows16) /* the same int8 blocks in order, as quads: every row (a few KB) */
                    rows16_input(R16_A8W4, s->a + r * s->F, s->F, s->a16tmp + r * s->F, s->a16 + r * (s->F / 2),
                                 s->a16s + r * (s->F / 4), s->a16o + r * (s->F / 4));
            } else
                s->a8s[r] = quantize_int8_row(s->a + r * s->F, s->F, s->w2.fmt == FMT_A8W4 ? a8w4_block(s->F) : 0,
                                              s->a8 + r * s->F, s->a8sum + r);
#pragma omp barrier
    }
    split(s->H, s->w2.rows16 ? ROWS16 : 2, part, parts, &n0, &n1); /* rows16: whole panels */
    for (int64_t e = 0; e < s->E && n0 < n1; ++e)
        if (s->start[e + 1] > s->start[e]) fc2_part(s, e, s->start[e], s->start[e + 1], n0, n1);
}

static qweight_t role(const int64_t *plan, int which, int64_t n, int64_t k) {
    const int64_t *f = plan + P_ROLES + which * W_FIELDS;
    qweight_t w = {(const uint8_t *)(intptr_t)f[W_DATA], (const uint8_t *)(intptr_t)f[W_SCALE], f[W_FMT], n, k,
                   f[W_GROUP], LAYOUT_NATURAL};
    return w;
}

/* Whether a single row's activations go to the loops as int16 blocks (quantize_i16), and how:
 * on AVX2 for the 4- and 8-bit weight-only formats (dot16_2), on AVX-512 for w8-int (dot16_512)
 * and, where the CPU has VNNI, w4-int rows of whole 128-element chunks whose groups the chunk's
 * lanes can take (w4_dot16_vnni); MOE_COMPILE_QDECODE_I16=0 keeps the fp32 loop (exact, slower). */
static int i16_form(int64_t fmt, int64_t k, int64_t group, int64_t isa) {
    const char *off = getenv("MOE_COMPILE_QDECODE_I16");
    if (k % I16_BLOCK || (off && strcmp(off, "0") == 0)) return 0;
    if (fmt == FMT_W8) return I16_NATURAL;
    if (isa == ISA_AVX512)
        return fmt == FMT_W4 && a8g_vnni() && k % 128 == 0 && (group == 32 || group == 64 || group % 128 == 0) ? I16_T4 : 0;
    return fmt == FMT_W4 || fmt == FMT_MXFP4 ? I16_PAIRED : 0;
}

/* A decode step.  Returns 0; -1 when its scratch (a few hundred KiB at most) could not be
 * allocated, -2 for an ISA this CPU lacks or a format / shape the loops do not take (nothing
 * computed either way).  A role's data pointer 0: the weights are kept as their rows16 panels
 * alone (a model loaded packed, moe_compile/quant/packed.py), which both roles must then have. */
int moe_qdecode_run(const int64_t *plan, float limit, int64_t nparts) {
    step_t s = {.T = plan[P_T], .H = plan[P_H], .F = plan[P_F], .K = plan[P_K], .E = plan[P_E],
                .between = plan[P_BETWEEN], .gates = (const float *)(intptr_t)plan[P_GATES],
                .y = (float *)(intptr_t)plan[P_Y]};
    s.S = s.T * s.K;
    s.w1 = role(plan, 0, 2 * s.F, s.H), s.w2 = role(plan, 1, s.H, s.F);
    int64_t isa = plan[P_ISA];
    if ((isa != ISA_AVX2 && isa != ISA_AVX512) || isa > moe_qdecode_best_isa()) return -2;
    for (int i = 0; i < 2; ++i) {
        const qweight_t *w = i ? &s.w2 : &s.w1;
        if (w->fmt < 1 || w->fmt >= FMT_COUNT || (has_scales(w->fmt) && (w->group % 32 || w->k % w->group)))
            return -2;
        if (int8_activations(w->fmt) && (w->k % 32 || w->group != w->k)) return -2; /* per channel, 32-wide blocks */
        if (a8g(w->fmt) && !a8g_ok(w->k, w->group)) return -2;
    }
    s.v = isa == ISA_AVX512 ? 16 : 8;
    s.w1.layout = layout_of(s.w1.fmt, s.w1.group, isa), s.w2.layout = layout_of(s.w2.fmt, s.w2.group, isa);
    a8g_setup(&s.w1, isa), a8g_setup(&s.w2, isa);
    s.dot = isa == ISA_AVX512 ? dot_512 : dot_2;
    s.dot16 = isa == ISA_AVX512 ? dot16_512 : dot16_2;
    s.rmax = isa == ISA_AVX512 ? RMAX_512 : RMAX_2;
    s.w1.i16 = i16_form(s.w1.fmt, s.w1.k, s.w1.group, isa), s.w2.i16 = i16_form(s.w2.fmt, s.w2.k, s.w2.group, isa);
    rows16_attach(&s.w1, plan[P_ROWS16], plan[P_ROWS16 + 1], isa, s.F % ROWS16 == 0);
    rows16_attach(&s.w2, plan[P_ROWS16 + 2], plan[P_ROWS16 + 3], isa, 1);
    if (!s.w1.data || !s.w2.data) { /* weights kept as their panels alone: every chunk on the rows16 loops */
        if (!s.w1.rows16 || !s.w2.rows16) return -2;
        s.rmax = ROWS16_MULTI;
    }
    /* rows16 roles' inputs: int32 [T, H/2] + [S, F/2], scales and offsets [T, H/4] + [S, F/4] each,
     * the int8 scratch [S, F] */
    const int64_t r16_ints = s.T * s.H / 2 + s.S * s.F / 2, r16_lanes = s.T * (s.H / 4) + s.S * (s.F / 4);
    int32_t *r16 = s.w1.rows16 || s.w2.rows16 ? malloc((size_t)(r16_ints + 2 * r16_lanes) * 4 + (size_t)(s.S * s.F) + 64)
                                               : NULL;
    int16_t *x16tmp = s.w1.rows16 ? malloc((size_t)s.H * 2 + 64) : NULL;
    int64_t *start = calloc((size_t)s.E + 2, sizeof(int64_t)), *tok = malloc((size_t)(2 * s.S + 1) * sizeof(int64_t));
    /* floats: xp, h, a, the int16 rows' scales and offsets of x and a, the int8 rows' scales;
     * int32: their sums; int16: x and a blocks; int8: x and a rows */
    int64_t floats = s.T * s.H + 2 * s.S * s.F + s.S * s.F + 2 * (s.T * s.H + s.S * s.F) / I16_LANE + 16;
    int64_t rows8 = s.T + s.S + 16;
    float *xp = aligned_alloc(64, (size_t)((floats + 2 * rows8) * 4 + (s.T * s.H + s.S * s.F) * 3 + 128) / 64 * 64);
    /* grouped a8: lane scales and offsets of x and a, (T H + S F) / A8G_ROW_DIV of each */
    int grouped = a8g(s.w1.fmt) || a8g(s.w2.fmt);
    float *blk = grouped ? malloc((size_t)(s.T * s.H + s.S * s.F) / A8G_ROW_DIV * 8 + 64) : NULL;
    int status = -1;
    if (!start || !tok || !xp || (grouped && !blk) || ((s.w1.rows16 || s.w2.rows16) && !r16) || (s.w1.rows16 && !x16tmp))
        goto done;
    if (r16) {
        s.x16 = r16, s.a16 = s.x16 + s.T * s.H / 2;
        s.x16s = (float *)(s.a16 + s.S * s.F / 2), s.a16s = s.x16s + s.T * (s.H / 4);
        s.x16o = (int32_t *)(s.a16s + s.S * (s.F / 4)), s.a16o = s.x16o + s.T * (s.H / 4);
        s.a16tmp = (int8_t *)(s.a16o + s.S * (s.F / 4));
    }
    if (grouped) {
        s.x8b = blk, s.a8b = blk + s.T * s.H / A8G_ROW_DIV;
        s.x8o = (int32_t *)(s.a8b + s.S * s.F / A8G_ROW_DIV), s.a8o = s.x8o + s.T * s.H / A8G_ROW_DIV;
    }
    const int64_t *ids = (const int64_t *)(intptr_t)plan[P_IDS];
    const float *x = (const float *)(intptr_t)plan[P_X];
    for (int64_t i = 0; i < s.S; ++i) /* a counting sort of the slots by expert; ids outside [0, E) dropped */
        if (ids[i] >= 0 && ids[i] < s.E) ++start[ids[i] + 2];
    for (int64_t e = 0; e < s.E; ++e) start[e + 2] += start[e + 1];
    int64_t *slot = tok + s.S;
    for (int64_t i = 0; i < s.S; ++i)
        if (ids[i] >= 0 && ids[i] < s.E) {
            int64_t p = start[ids[i] + 1]++;
            tok[p] = i / s.K, slot[p] = i;
        }
    s.start = start, s.tok = tok, s.slot = slot;
    s.xp = xp, s.h = xp + s.T * s.H, s.a = s.h + 2 * s.S * s.F;
    s.xs = s.a + s.S * s.F, s.as = s.xs + s.T * (s.H / I16_LANE);
    s.xo = (int32_t *)(s.as + s.S * (s.F / I16_LANE)), s.ao = s.xo + s.T * (s.H / I16_LANE);
    s.xq = (int16_t *)(s.ao + s.S * (s.F / I16_LANE) + 16), s.aq = s.xq + s.T * s.H;
    s.x8s = (float *)(s.aq + s.S * s.F), s.a8s = s.x8s + s.T;
    s.x8sum = (int32_t *)(s.a8s + s.S + 8), s.a8sum = s.x8sum + s.T;
    s.x8 = (int8_t *)(s.a8sum + s.S + 8), s.a8 = s.x8 + s.T * s.H;
    if (int8_activations(s.w1.fmt))
        for (int64_t t = 0; t < s.T; ++t)
            s.x8s[t] = quantize_int8_row(x + t * s.H, s.H, s.w1.fmt == FMT_A8W4 ? a8w4_block(s.H) : 0, s.x8 + t * s.H,
                                         s.x8sum + t);
    if (a8g(s.w1.fmt))
        for (int64_t t = 0; t < s.T; ++t)
            quantize_int8_blocks(&s.w1, x + t * s.H, s.x8 + t * s.H, s.x8b + t * (s.H / A8G_ROW_DIV),
                                 s.x8o + t * (s.H / A8G_ROW_DIV));
    for (int64_t t = 0; t < s.T; ++t) layout_copy(s.xp + t * s.H, x + t * s.H, s.H, s.v, s.w1.layout);
    if (s.w1.i16)
        for (int64_t t = 0; t < s.T; ++t) {
            int64_t at = i16_scale_at(s.w1.i16, s.H, t, 0);
            quantize_i16_as(s.w1.i16, x + t * s.H, s.H, s.xq + t * s.H, s.xs + at, s.xo + at);
        }
    if (s.w1.rows16)
        for (int64_t t = 0; t < s.T; ++t)
            rows16_input((int)s.w1.rows16, x + t * s.H, s.H, x16tmp, s.x16 + t * (s.H / 2), s.x16s + t * (s.H / 4),
                         s.x16o + t * (s.H / 4));
#pragma omp parallel num_threads(nparts)
    run_parts(&s, limit, omp_get_thread_num(), omp_get_num_threads());
    status = 0;
done:
    free(start), free(tok), free(xp), free(blk), free(r16), free(x16tmp);
    return status;
}

/* A dense linear y [T, N] = x [T, K] . W^T on one packed weight (attention projections, lm_head,
 * dense MLPs: kernels/cpu/dense.py): the E = 1, no-activation case of the decode step, i.e. its
 * FC2 phase alone with x as FC2's input, every row its own slot and weight 1.  The same loops,
 * so the same formats, ISA choice and exactness as a decode step's FC2.
 * Plan: [x, T, K, N, y, isa, data, scale, fmt, group, rows16 data, rows16 scale]; the last two 0, or
 * the weight's rows16 copy (above), which a T = 1 w4-int or group-wise a8w4-int call on AVX-512
 * VNNI then reads instead.
 * y is written whole.  Returns as moe_qdecode_run. */
enum { L_X, L_T, L_K, L_N, L_Y, L_ISA, L_ROLE, L_ROWS16 = L_ROLE + W_FIELDS, L_ROWS16_SCALE };

int moe_qdecode_linear(const int64_t *plan, int64_t nparts) {
    int64_t T = plan[L_T], K = plan[L_K], N = plan[L_N], isa = plan[L_ISA];
    const int64_t *f = plan + L_ROLE;
    qweight_t w = {(const uint8_t *)(intptr_t)f[W_DATA], (const uint8_t *)(intptr_t)f[W_SCALE], f[W_FMT], N, K,
                   f[W_GROUP], LAYOUT_NATURAL};
    if ((isa != ISA_AVX2 && isa != ISA_AVX512) || isa > moe_qdecode_best_isa() || T < 1) return -2;
    if (w.fmt < 1 || w.fmt >= FMT_COUNT || (has_scales(w.fmt) && (w.group % 32 || K % w.group))) return -2;
    if (int8_activations(w.fmt) && (K % 32 || w.group != K)) return -2;
    if (a8g(w.fmt) && !a8g_ok(K, w.group)) return -2;
    a8g_setup(&w, isa);
    const int loop = T == 1 && plan[L_ROWS16] ? rows16_loop(&w, isa) : 0;
    if (loop)
        return rows16_linear(loop, rows16_vnni(isa), (const float *)(intptr_t)plan[L_X], K, N, (const uint8_t *)(intptr_t)plan[L_ROWS16],
                             (const uint8_t *)(intptr_t)plan[L_ROWS16_SCALE], w.group, (float *)(intptr_t)plan[L_Y], nparts);
    step_t s = {.T = T, .H = N, .F = K, .K = 1, .E = 1, .S = T, .between = 0, .y = (float *)(intptr_t)plan[L_Y]};
    s.v = isa == ISA_AVX512 ? 16 : 8;
    s.w2 = w, s.w2.layout = layout_of(w.fmt, w.group, isa);
    s.dot = isa == ISA_AVX512 ? dot_512 : dot_2;
    s.dot16 = isa == ISA_AVX512 ? dot16_512 : dot16_2;
    s.rmax = isa == ISA_AVX512 ? RMAX_512 : RMAX_2;
    s.w2.i16 = i16_form(w.fmt, K, w.group, isa);
    int64_t *idx = malloc((size_t)(T + 2) * sizeof(int64_t));
    float *ones = malloc((size_t)T * sizeof(float));
    /* a [T, K] in the weight's layout, its int16 blocks' scales and offsets, the blocks, its int8
     * rows, scales, sums */
    size_t bytes = (size_t)(T * K * 4 + 2 * T * (K / I16_LANE) * 4 + 64 + T * K * 2 + T * K + 2 * (T + 16) * 4 + 128);
    float *a = aligned_alloc(64, (bytes + 63) / 64 * 64);
    float *blk = a8g(w.fmt) ? malloc((size_t)(T * K / A8G_ROW_DIV) * 8 + 64) : NULL; /* grouped a8: lane scales, offsets */
    int status = -1;
    if (!idx || !ones || !a || (a8g(w.fmt) && !blk)) goto done;
    s.a8b = blk, s.a8o = blk ? (int32_t *)(blk + T * K / A8G_ROW_DIV) : NULL;
    int64_t start[2] = {0, T};
    for (int64_t t = 0; t < T; ++t) idx[t] = t, ones[t] = 1.f;
    s.start = start, s.tok = idx, s.slot = idx, s.gates = ones;
    s.a = a, s.as = a + T * K, s.ao = (int32_t *)(s.as + T * (K / I16_LANE));
    s.aq = (int16_t *)(s.ao + T * (K / I16_LANE) + 16);
    s.a8s = (float *)(s.aq + T * K), s.a8sum = (int32_t *)(s.a8s + T + 16), s.a8 = (int8_t *)(s.a8sum + T + 16);
    const float *x = (const float *)(intptr_t)plan[L_X];
    for (int64_t t = 0; t < T; ++t) {
        layout_copy(s.a + t * K, x + t * K, K, s.v, s.w2.layout);
        if (s.w2.i16) {
            int64_t at = i16_scale_at(s.w2.i16, K, t, 0);
            quantize_i16_as(s.w2.i16, x + t * K, K, s.aq + t * K, s.as + at, s.ao + at);
        }
        if (int8_activations(w.fmt))
            s.a8s[t] = quantize_int8_row(s.a + t * K, K, w.fmt == FMT_A8W4 ? a8w4_block(K) : 0, s.a8 + t * K, s.a8sum + t);
        if (a8g(w.fmt))
            quantize_int8_blocks(&s.w2, x + t * K, s.a8 + t * K, s.a8b + t * (K / A8G_ROW_DIV), s.a8o + t * (K / A8G_ROW_DIV));
    }
    memset(s.y, 0, (size_t)(T * N) * sizeof(float));
#pragma omp parallel num_threads(nparts)
    {
        int64_t n0, n1;
        split(N, 2, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        if (n0 < n1) fc2_part(&s, 0, 0, T, n0, n1);
    }
    status = 0;
done:
    free(idx), free(ones), free(a), free(blk);
    return status;
}

/* Test entry: y [T, N] = x [T, K] . W^T of one group-wise a8 weight [N, K] (fmt FMT_A8W4G or
 * FMT_A8W8G, N even, T <= 16) by the decode loops alone on one thread (quantize_int8_blocks,
 * a8g_rows): no SwiGLU, no routing, so tests hold the loops to the format's grouped_matmul
 * (quant/a8w4_int.py, quant/a8w8_int.py) directly.  Returns 0, -2 for what the loops do not take,
 * -1 without memory. */
int moe_qdecode_a8g_matmul(const float *x, int64_t T, int64_t K, const uint8_t *data, const uint8_t *scale, int64_t N,
                           int64_t G, int64_t isa, int64_t fmt, float *y) {
    if (T < 1 || T > 16 || N % 2 || !a8g(fmt) || !a8g_ok(K, G) || (isa != ISA_AVX2 && isa != ISA_AVX512)
        || isa > moe_qdecode_best_isa())
        return -2;
    qweight_t w = {data, scale, fmt, N, K, G, LAYOUT_NATURAL};
    a8g_setup(&w, isa);
    const int64_t lanes = K / A8G_ROW_DIV;
    int8_t *q = malloc((size_t)(T * K) + 64);
    float *sxe = malloc((size_t)(T * lanes) * 4 + 64);
    int32_t *off = malloc((size_t)(T * lanes) * 4 + 64);
    int status = -1;
    if (q && sxe && off) {
        for (int64_t t = 0; t < T; ++t) quantize_int8_blocks(&w, x + t * K, q + t * K, sxe + t * lanes, off + t * lanes);
        float out[32];
        for (int64_t n = 0; n < N; n += 2) {
            const uint8_t *rows[2] = {row_at(&w, 0, n), row_at(&w, 0, n + 1)}, *sc[2] = {scales_at(&w, 0, n), scales_at(&w, 0, n + 1)};
            a8g_rows(&w, rows, sc, q, K, sxe, off, NULL, 0, T, (int)T, out);
            for (int64_t t = 0; t < T; ++t) y[t * N + n] = out[t], y[t * N + n + 1] = out[T + t];
        }
        status = 0;
    }
    free(q), free(sxe), free(off);
    return status;
}
