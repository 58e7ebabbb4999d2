/* Decode attention on CPU: out = softmax(scale q k^T + mask) v for a few query rows against a KV
 * cache, the query heads that share a key/value head served together, the keys split into chunks
 * merged at the end (flash-decoding).
 *
 * Shapes:  B batch, H query heads, G key/value heads (H = G R), L query rows, S key positions,
 *          D head dim (a multiple of 16).
 *          q [B, H, L, D]   k, v [B, G, S, D]   mask [B|1, H|1, L|1, S]   out [B, H, L, D]
 *          Last dims contiguous; every other stride is free (in elements), 0 for a broadcast
 *          mask dim.  Query head h reads key/value head h / R (SDPA's enable_gqa).
 *
 * One work item is (b, g, a chunk of keys); its NR = R L rows are (query head of g, query row):
 *   1. scores  s[i, j] = scale (q_i . k_j) + mask(i, j) for the chunk's keys, two keys and four
 *              rows at a time (8 accumulators); a key that every row masks is skipped.
 *   2. softmax pieces per row: m = max_j s, p = e^(s - m) (0 where masked), l = sum_j p.
 *   3. acc[i] = sum_j p[i, j] v_j, four rows x 16 lanes at a time.
 * Then per row: M = max over chunks m_c, out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c.
 *
 * Why: torch's CPU flash-attention kernel takes ~0.3 ms a layer for one query row against 577
 * cached positions of a 32/4-head model (10x what reading the cache costs): it blocks over query
 * rows, of which decode has one.  Here each thread reads a K/V head once for its R query heads.
 *
 * Mask kinds: 0 none, 1 bool (true attends), 2 fp32 added to the scores (-inf masks).  A row that
 * masks every key (or whose every score is NaN) has no softmax: the call returns 1 and the caller
 * runs torch's kernel instead, whose answer there it does not reproduce.  A NaN anywhere else
 * reaches the output as in SDPA.  Returns 2 for a shape it does not serve.
 * AVX2 + FMA; where the CPU has AVX-512 (and the caller has not held it to AVX2:
 * moe_attention_set_isa) phases 1 and 3 take eight rows at a time in 16 lanes, so each key and
 * value row is read once for eight query heads: 89 -> 75 us a warm call of a 32/4-head layer at
 * 561 positions on 2 threads (AVX2 blocks against these), the arithmetic being what a warm call
 * waits on.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

enum { Q, K, V, MASK, OUT, NB, NH, NG, NL, NS, ND, QSB, QSH, QSL, KSB, KSG, KSS, VSB, VSG, VSS,
       MSB, MSH, MSL, MSS, MKIND, OSB, OSH, OSL, PLAN_FIELDS };

#define ROWS 4         /* query rows per register block (AVX2) */
#define ROWS512 8      /* with AVX-512, where the padded rows come in eights */
#define MIN_CHUNK 64   /* keys per work item, at least */

typedef struct {
    const int64_t *p;
    float scale;
    int64_t R, NR, NRP, CS, chunks;  /* rows per item, padded to ROWS; keys per chunk */
    int64_t lo, hi;                  /* the keys some row attends lie in [lo, hi) (attended_span) */
    int64_t block;                   /* rows per register block: ROWS, or ROWS512 */
    float *acc, *m, *l;              /* [items][NRP][D], [items][NRP], [items][NRP] */
} Job;

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static const float *q_row(const Job *J, int64_t b, int64_t g, int64_t i) {
    const int64_t *p = J->p;
    if (i >= J->NR) i = 0;  /* a padding row computes row 0's scores; they are dropped */
    int64_t h = g * J->R + i / p[NL], l = i % p[NL];
    return (const float *)p[Q] + b * p[QSB] + h * p[QSH] + l * p[QSL];
}

/* The mask as an additive value at element offset at: 0, a float, or -inf. */
static inline float mask_at(const int64_t *p, int64_t at) {
    if (p[MKIND] == 1) return ((const uint8_t *)p[MASK])[at] ? 0.f : -INFINITY;
    return ((const float *)p[MASK])[at];
}

/* The 8 lane sums of a[0..7] as one vector (a transpose-and-add tree: 3 levels of hadd). */
static inline __m256 hsum8x8(const __m256 *a) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* out[2 r + c] = q_r . k_c for the ROWS rows qr and the keys k0, k1: raw dot products. */
static void dots_2x4(const float *const *qr, const float *k0, const float *k1, int64_t D, float *out) {
    __m256 a[2 * ROWS];
    for (int r = 0; r < 2 * ROWS; ++r) a[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        __m256 x0 = _mm256_loadu_ps(k0 + d), x1 = _mm256_loadu_ps(k1 + d);
        for (int r = 0; r < ROWS; ++r) {
            __m256 y = _mm256_loadu_ps(qr[r] + d);
            a[2 * r] = _mm256_fmadd_ps(y, x0, a[2 * r]);
            a[2 * r + 1] = _mm256_fmadd_ps(y, x1, a[2 * r + 1]);
        }
    }
    _mm256_storeu_ps(out, hsum8x8(a));
}

/* The upper 256 bits of a 512-bit vector plus its lower ones (AVX512F alone, no DQ). */
AVX512_TARGET static inline __m256 fold512(__m512 a) {
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(a), hi);
}

/* dots_2x4 for ROWS512 rows in 16 lanes: out[2 r + c] = q_r . k_c, 16 accumulators. */
AVX512_TARGET static void dots_2x8(const float *const *qr, const float *k0, const float *k1, int64_t D, float *out) {
    __m512 a[2 * ROWS512];
    for (int r = 0; r < 2 * ROWS512; ++r) a[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        __m512 x0 = _mm512_loadu_ps(k0 + d), x1 = _mm512_loadu_ps(k1 + d);
        for (int r = 0; r < ROWS512; ++r) {
            __m512 y = _mm512_loadu_ps(qr[r] + d);
            a[2 * r] = _mm512_fmadd_ps(y, x0, a[2 * r]);
            a[2 * r + 1] = _mm512_fmadd_ps(y, x1, a[2 * r + 1]);
        }
    }
    __m256 h[2 * ROWS512];
    for (int r = 0; r < 2 * ROWS512; ++r) h[r] = fold512(a[r]);
    _mm256_storeu_ps(out, hsum8x8(h));
    _mm256_storeu_ps(out + 8, hsum8x8(h + 8));
}

/* Ask for rows [row, row + count) of a [*, D] fp32 matrix with row stride ld into the cache: one
 * prefetch per 64-byte line.  Keys are fetched PREFETCH_KEYS ahead of their dot products, values
 * while the scores are computed, so phase 3 reads them from L2. */
#define PREFETCH_KEYS 16
static inline void prefetch_rows(const float *row, int64_t count, int64_t ld, int64_t D) {
    for (int64_t r = 0; r < count; ++r)
        for (int64_t d = 0; d < D; d += 16) _mm_prefetch((const char *)(row + r * ld + d), _MM_HINT_T1);
}

/* Whether every row of an item reads one mask row (no mask, or one broadcast over heads and rows). */
static int one_mask_row(const int64_t *p) {
    return p[MKIND] == 0 || (p[MSH] == 0 && (p[NL] == 1 || p[MSL] == 0));
}

/* row[j] += madd[j], and -inf where madd[j] is -inf (a key no row attends: its score was not
 * computed). */
static void add_mask_row(float *row, const float *madd, int64_t n) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 m = _mm256_loadu_ps(madd + j);
        __m256 sum = _mm256_add_ps(_mm256_loadu_ps(row + j), m);
        _mm256_storeu_ps(row + j, _mm256_blendv_ps(sum, ninf, _mm256_cmp_ps(m, ninf, _CMP_EQ_OQ)));
    }
    for (; j < n; ++j) row[j] = madd[j] == -INFINITY ? -INFINITY : row[j] + madd[j];
}

/* Phase 1 for one item: sc [NRP][n] scores, attend[j] whether any row attends key s0 + j;
 * madd [n] is scratch for a mask every row shares, read once per key. */
static void item_scores(const Job *J, int64_t b, int64_t g, int64_t s0, int64_t n, float *sc, uint8_t *attend,
                        float *madd) {
    const int64_t *p = J->p, D = p[ND];
    const float *kb = (const float *)p[K] + b * p[KSB] + g * p[KSG];
    const int shared = one_mask_row(p);
    int64_t row_mask[J->NR];  /* each row's mask offset at key 0 */
    for (int64_t i = 0; i < J->NR; ++i)
        row_mask[i] = b * p[MSB] + (g * J->R + i / p[NL]) * p[MSH] + (i % p[NL]) * p[MSL];
    for (int64_t j = 0; j < n; ++j) {
        if (shared) {
            madd[j] = p[MKIND] == 0 ? 0.f : mask_at(p, row_mask[0] + (s0 + j) * p[MSS]);
            attend[j] = !(madd[j] == -INFINITY);  /* a NaN attends: SDPA gives NaN there */
            continue;
        }
        uint8_t any = 0;
        for (int64_t i = 0; i < J->NR && !any; ++i)
            any = !(mask_at(p, row_mask[i] + (s0 + j) * p[MSS]) == -INFINITY);
        attend[j] = any;
    }
    const float *vb = (const float *)p[V] + b * p[VSB] + g * p[VSG];
    const int64_t rows = J->block;
    for (int64_t i0 = 0; i0 < J->NRP; i0 += rows) {
        const float *qr[ROWS512];
        for (int r = 0; r < rows; ++r) qr[r] = q_row(J, b, g, i0 + r);
        for (int64_t j = 0; j < n; j += 2) {
            int64_t j1 = j + 1 < n ? j + 1 : j;  /* an odd tail pairs the last key with itself */
            if (i0 == 0) {  /* the cache comes from memory: fetch keys ahead and this chunk's values */
                prefetch_rows(kb + (s0 + j + PREFETCH_KEYS) * p[KSS], j + PREFETCH_KEYS < n ? 2 : 0, p[KSS], D);
                prefetch_rows(vb + (s0 + j) * p[VSS], j1 - j + 1, p[VSS], D);
            }
            if (!attend[j] && !attend[j1]) continue;
            float d8[2 * ROWS512];
            if (rows == ROWS512)
                dots_2x8(qr, kb + (s0 + j) * p[KSS], kb + (s0 + j1) * p[KSS], D, d8);
            else
                dots_2x4(qr, kb + (s0 + j) * p[KSS], kb + (s0 + j1) * p[KSS], D, d8);
            for (int r = 0; r < rows; ++r) {
                sc[(i0 + r) * n + j] = d8[2 * r] * J->scale;
                if (j1 != j) sc[(i0 + r) * n + j1] = d8[2 * r + 1] * J->scale;
            }
        }
    }
    if (shared) {  /* the same additions for every row: a loop the compiler vectorises */
        for (int64_t i = 0; i < J->NRP; ++i) {
            float *row = sc + i * n;
            if (i >= J->NR) {
                for (int64_t j = 0; j < n; ++j) row[j] = -INFINITY;
                continue;
            }
            if (p[MKIND] != 0)  /* without a mask every key is attended and nothing is added */
                add_mask_row(row, madd, n);
        }
        return;
    }
    for (int64_t i = 0; i < J->NRP; ++i)
        for (int64_t j = 0; j < n; ++j)
            if (i >= J->NR || !attend[j])
                sc[i * n + j] = -INFINITY;
            else if (p[MKIND] != 0)
                sc[i * n + j] += mask_at(p, row_mask[i] + (s0 + j) * p[MSS]);
}

/* Phase 2 for one row of n scores, in place: p = e^(s - m), 0 where s = -inf; returns l, sets *m. */
static float row_softmax_pieces(float *s, int64_t n, float *m_out) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);  /* max_ps drops a NaN in s (its second operand wins) */
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(_mm256_loadu_ps(s + j), vmax);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    for (; j < n; ++j) m = s[j] > m ? s[j] : m;
    *m_out = m;
    if (m == -INFINITY) {
        memset(s, 0, (size_t)n * sizeof(float));
        return 0.f;
    }
    const __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 x = _mm256_loadu_ps(s + j);
        __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, vm)), _mm256_cmp_ps(x, ninf, _CMP_NEQ_UQ));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float l = hsum8(sum);
    for (; j < n; ++j) {
        s[j] = s[j] != -INFINITY ? _mm256_cvtss_f32(exp8(_mm256_set1_ps(s[j] - m))) : 0.f;
        l += s[j];
    }
    return l;
}

/* Phase 3 for rows [i0, i0 + ROWS): acc[r][:] = sum_j p[r][j] v_j over attended keys. */
static void weighted_values(const Job *J, const float *vb, int64_t s0, int64_t n, const float *pr,
                            const uint8_t *attend, float *acc) {
    const int64_t D = J->p[ND], vs = J->p[VSS];
    for (int64_t d = 0; d < D; d += 16) {
        __m256 a[ROWS][2];
        for (int r = 0; r < ROWS; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
            if (!attend[j]) continue;
            const float *vj = vb + (s0 + j) * vs + d;
            __m256 x0 = _mm256_loadu_ps(vj), x1 = _mm256_loadu_ps(vj + 8);
            for (int r = 0; r < ROWS; ++r) {
                __m256 w = _mm256_broadcast_ss(pr + r * n + j);
                a[r][0] = _mm256_fmadd_ps(w, x0, a[r][0]);
                a[r][1] = _mm256_fmadd_ps(w, x1, a[r][1]);
            }
        }
        for (int r = 0; r < ROWS; ++r) {
            _mm256_storeu_ps(acc + r * D + d, a[r][0]);
            _mm256_storeu_ps(acc + r * D + d + 8, a[r][1]);
        }
    }
}

/* weighted_values for rows [i0, i0 + ROWS512) in 16 lanes: 32 of D at a time (16 at the tail). */
AVX512_TARGET static void weighted_values_8(const Job *J, const float *vb, int64_t s0, int64_t n, const float *pr,
                                            const uint8_t *attend, float *acc) {
    const int64_t D = J->p[ND], vs = J->p[VSS];
    for (int64_t d = 0; d < D; d += 32) {
        const int two = d + 32 <= D;  /* D is a multiple of 16: the last piece may be 16 wide */
        __m512 a[ROWS512][2];
        for (int r = 0; r < ROWS512; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
            if (!attend[j]) continue;
            const float *vj = vb + (s0 + j) * vs + d;
            __m512 x0 = _mm512_loadu_ps(vj), x1 = two ? _mm512_loadu_ps(vj + 16) : x0;
            for (int r = 0; r < ROWS512; ++r) {
                __m512 w = _mm512_set1_ps(pr[r * n + j]);
                a[r][0] = _mm512_fmadd_ps(w, x0, a[r][0]);
                a[r][1] = _mm512_fmadd_ps(w, x1, a[r][1]);
            }
        }
        for (int r = 0; r < ROWS512; ++r) {
            _mm512_storeu_ps(acc + r * D + d, a[r][0]);
            if (two) _mm512_storeu_ps(acc + r * D + d + 16, a[r][1]);
        }
    }
}

static void run_item(const Job *J, int64_t item, float *sc, float *madd, uint8_t *attend) {
    const int64_t *p = J->p, D = p[ND];
    int64_t c = item % J->chunks, bg = item / J->chunks, b = bg / p[NG], g = bg % p[NG];
    int64_t s0 = J->lo + c * J->CS, n = J->hi - s0 < J->CS ? J->hi - s0 : J->CS;
    float *acc = J->acc + item * J->NRP * D, *m = J->m + item * J->NRP, *l = J->l + item * J->NRP;
    item_scores(J, b, g, s0, n, sc, attend, madd);
    for (int64_t i = 0; i < J->NRP; ++i) l[i] = row_softmax_pieces(sc + i * n, n, m + i);
    const float *vb = (const float *)p[V] + b * p[VSB] + g * p[VSG];
    for (int64_t i0 = 0; i0 < J->NRP; i0 += J->block)
        if (J->block == ROWS512)
            weighted_values_8(J, vb, s0, n, sc + i0 * n, attend, acc + i0 * D);
        else
            weighted_values(J, vb, s0, n, sc + i0 * n, attend, acc + i0 * D);
}

/* The chunks' pieces of row i of (b, g) into out; 1 when every key is masked for it. */
static int merge_row(const Job *J, int64_t b, int64_t g, int64_t i) {
    const int64_t *p = J->p, D = p[ND];
    int64_t first = (b * p[NG] + g) * J->chunks;
    float M = -INFINITY, L = 0.f;
    for (int64_t c = 0; c < J->chunks; ++c) {
        float mc = J->m[(first + c) * J->NRP + i];
        M = mc > M ? mc : M;
    }
    if (M == -INFINITY) return 1;
    float w[J->chunks];
    for (int64_t c = 0; c < J->chunks; ++c) {
        float mc = J->m[(first + c) * J->NRP + i];
        w[c] = mc == -INFINITY ? 0.f : _mm256_cvtss_f32(exp8(_mm256_set1_ps(mc - M)));
        L += w[c] * J->l[(first + c) * J->NRP + i];
    }
    int64_t h = g * J->R + i / p[NL], lq = i % p[NL];
    float *o = (float *)p[OUT] + b * p[OSB] + h * p[OSH] + lq * p[OSL];
    for (int64_t d = 0; d < D; d += 8) {
        __m256 sum = _mm256_setzero_ps();
        for (int64_t c = 0; c < J->chunks; ++c)
            sum = _mm256_fmadd_ps(_mm256_set1_ps(w[c]),
                                  _mm256_loadu_ps(J->acc + ((first + c) * J->NRP + i) * D + d), sum);
        _mm256_storeu_ps(o + d, _mm256_div_ps(sum, _mm256_set1_ps(L)));
    }
    return 0;
}

/* [lo, hi): from the first to the last key that some row of the mask attends (every key without a
 * mask).  Why: a static KV cache is as long as the longest generation (HF's static cache: prompt
 * + max_new_tokens), its unwritten tail masked; chunked over all of it, the items past the
 * written keys did nothing but check the mask, and most of the work fell to the thread that got
 * the written ones (a 32/4-head layer, 512 keys written of 4096: 396 us against 70 with only the
 * 512 keys, 2 threads).  Keys outside the span are masked for every row, so they add nothing. */
static void attended_span(const int64_t *p, int64_t *lo, int64_t *hi) {
    *lo = 0, *hi = p[NS];
    if (p[MKIND] == 0) return;
    int64_t first = p[NS], last = -1;
    const int64_t nb = p[MSB] ? p[NB] : 1, nh = p[MSH] ? p[NH] : 1, nl = p[MSL] ? p[NL] : 1;
    for (int64_t b = 0; b < nb; ++b)
        for (int64_t h = 0; h < nh; ++h)
            for (int64_t l = 0; l < nl; ++l) {
                const int64_t row = b * p[MSB] + h * p[MSH] + l * p[MSL];
                for (int64_t j = 0; j < first; ++j)
                    if (!(mask_at(p, row + j * p[MSS]) == -INFINITY)) { /* a NaN attends, as in item_scores */
                        first = j;
                        break;
                    }
                for (int64_t j = p[NS] - 1; j > last; --j)
                    if (!(mask_at(p, row + j * p[MSS]) == -INFINITY)) {
                        last = j;
                        break;
                    }
            }
    *lo = first, *hi = last + 1;
}

/* Keys per item: at least MIN_CHUNK, and enough items that every thread gets ~4. */
static int64_t chunk_keys(int64_t S, int64_t heads, int64_t threads) {
    int64_t want = (4 * threads + heads - 1) / heads;
    int64_t cs = (S + want - 1) / want;
    cs = cs < MIN_CHUNK ? MIN_CHUNK : cs;
    return (cs + 7) / 8 * 8;
}

/* 512: the AVX-512 blocks serve calls whose padded rows come in eights; 2: AVX2 alone. */
static int64_t isa_in_use = 2;

/* The widest blocks this CPU runs: 512 or 2. */
int64_t moe_attention_best_isa(void) {
    return __builtin_cpu_supports("avx512f") ? 512 : 2;
}

/* Hold the kernel to isa (2 or 512, at most moe_attention_best_isa()); returns the one before. */
int64_t moe_attention_set_isa(int64_t isa) {
    int64_t before = isa_in_use;
    isa_in_use = isa == 512 && moe_attention_best_isa() == 512 ? 512 : 2;
    return before;
}

int moe_decode_attention(const int64_t *p, double scale, int64_t threads) {
    if (p[ND] <= 0 || p[ND] % 16 || p[NG] <= 0 || p[NH] % p[NG] || p[NL] <= 0 || p[NB] <= 0 || p[NS] <= 0 ||
        p[MKIND] < 0 || p[MKIND] > 2)
        return 2;
    Job J = {p, (float)scale};
    J.R = p[NH] / p[NG], J.NR = J.R * p[NL], J.NRP = (J.NR + ROWS - 1) / ROWS * ROWS;
    J.block = isa_in_use == 512 && J.NRP % ROWS512 == 0 ? ROWS512 : ROWS;
    attended_span(p, &J.lo, &J.hi);
    if (J.lo >= J.hi) return 1; /* every row masks every key: torch's kernel answers */
    J.CS = chunk_keys(J.hi - J.lo, p[NB] * p[NG], threads);
    J.chunks = (J.hi - J.lo + J.CS - 1) / J.CS;
    int64_t items = p[NB] * p[NG] * J.chunks, D = p[ND];
    J.acc = malloc((size_t)(items * J.NRP * (D + 2)) * sizeof(float));
    if (J.acc == NULL) return 2;
    J.m = J.acc + items * J.NRP * D, J.l = J.m + items * J.NRP;
    threads = threads < 1 ? 1 : (threads > items ? items : threads);
    /* per thread: scores [NRP][CS], a shared mask row [CS], then attend [CS] */
    int64_t scratch = (J.NRP + 1) * J.CS * (int64_t)sizeof(float) + J.CS;
    char *per_thread = malloc((size_t)(threads * scratch));
    if (per_thread == NULL) {
        free(J.acc);
        return 2;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t item = 0; item < items; ++item) {
        char *mine = per_thread + omp_get_thread_num() * scratch;
        float *scores = (float *)mine;
        run_item(&J, item, scores, scores + J.NRP * J.CS, (uint8_t *)(scores + (J.NRP + 1) * J.CS));
    }
    free(per_thread);
    int failed = 0;
    for (int64_t bg = 0; bg < p[NB] * p[NG] && !failed; ++bg)
        for (int64_t i = 0; i < J.NR && !failed; ++i) failed = merge_row(&J, bg / p[NG], bg % p[NG], i);
    free(J.acc);
    return failed;
}
