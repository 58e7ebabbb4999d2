/* Skinny fp32 GEMMs for MoE decode on CPU: y [r, n_out] = x [r, k] . W^T (+ bias), r small.
 *
 * Why: with a handful of rows per expert, decode is bound by reading the experts' weights once.
 * MKL's sgemm/sgemv read a [4096, 1024] fp32 weight at ~10-15 GB/s on the 2-core CI VM where a
 * plain sum over the same weights reads ~40 GB/s.  These loops read each weight row once for all
 * rows of x (x stays in L1) with independent accumulators, so they run at the memory's speed.
 *
 * Shapes:   r     rows of x (tokens routed to this expert), any count; kept in L1.
 *           k     input width, n_out output width.
 *           W     [n_out, k] row-major ("dot" form, F.linear's weight) or
 *                 [k, n_out] row-major ("axpy" form, transposed: x @ W).
 * Rows:     x row r is x[xidx[r]] when a row index is given (the tokens of an expert's slots:
 *           no gathered copy of x); y row r is y[yidx[r]] when given, and then the result is
 *           accumulated, scaled by scale[r]: y[yidx[r]] += scale[r] * (W x_r + b), the MoE
 *           combine.  Without yidx, y[r] = scale[r] * (W x_r + b) (scale 1 when not given).
 * Threads:  every task's n_out range is split into `nparts` parts; part p of every task runs on
 *           OpenMP thread p.  Each output element belongs to one part, so tasks accumulating
 *           into the same y row (a token's K experts) never race.
 *
 * FFN:      moe_skinny_ffn_parallel runs a chunk's FC1 tasks, the SwiGLU between them and its FC2
 *           tasks in one OpenMP region (barriers between the phases): at decode sizes the torch
 *           calls of the activation and a second kernel launch cost 0.1-0.3 ms with the caches cold
 *           after the weights streamed through them, 3-6% of a step.
 *
 * ISA:      AVX2 + FMA everywhere; where the CPU has AVX-512 (and the caller has not held it to
 *           AVX2: moe_skinny_set_isa) the one-row dot product, decode's common case, runs in 16
 *           lanes (dot_rows1_512), compiled for that target alone.
 *
 * Built by moe_compile/kernels/cpu/skinny.py with `cc -O3 -mavx2 -mfma` on first use.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

/* One task = TASK_FIELDS int64 values, in this order (see cpu_skinny.py: task). */
enum {
    T_W, T_X, T_Y, T_BIAS, T_ROWS, T_K, T_NOUT, T_LDW, T_LDX, T_LDY, T_TRANSPOSED, T_XIDX, T_YIDX,
    T_SCALE, TASK_FIELDS
};

typedef struct {
    const float *w, *x, *bias, *scale;
    float *y;
    const int64_t *xidx, *yidx;
    int64_t rows, k, n_out, ldw, ldx, ldy;
} task_t;

static task_t unpack(const int64_t *f) {
    task_t t = {
        (const float *)(intptr_t)f[T_W], (const float *)(intptr_t)f[T_X],
        (const float *)(intptr_t)f[T_BIAS], (const float *)(intptr_t)f[T_SCALE],
        (float *)(intptr_t)f[T_Y], (const int64_t *)(intptr_t)f[T_XIDX],
        (const int64_t *)(intptr_t)f[T_YIDX], f[T_ROWS], f[T_K], f[T_NOUT], f[T_LDW], f[T_LDX],
        f[T_LDY],
    };
    return t;
}

static inline const float *x_row(const task_t *t, int64_t r) {
    return t->x + (t->xidx ? t->xidx[r] : r) * t->ldx;
}

/* Output element (r, n) of a task: bias, scale, then store or (with yidx) accumulate. */
static inline void store(const task_t *t, int64_t r, int64_t n, float v) {
    if (t->bias) v += t->bias[n];
    if (t->scale) v *= t->scale[r];
    if (t->yidx)
        t->y[t->yidx[r] * t->ldy + n] += v;
    else
        t->y[r * t->ldy + n] = v;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot_tail(const float *w, const float *x, int64_t k0, int64_t k) {
    float s = 0.f;
    for (int64_t i = k0; i < k; ++i) s += w[i] * x[i];
    return s;
}

/* One weight row against R x rows (R = 1..4, unrolled): A accumulators per x row (four for R <= 2:
 * 1-1.5% faster than two on the CI VM at decode, within the 16 AVX2 registers), each weight
 * vector loaded once for all R.  One row at a time, in memory order, keeps the hardware
 * prefetcher on a single stream: on the CI VM (one thread, weights not in cache) reading four
 * weight rows at once ran at 16.8 GB/s, one row at a time at 21.7 GB/s, a plain sum at 24.6. */
/* Software prefetch 8 KiB (PREFETCH_AHEAD floats) ahead into L2, one per 64-byte line, at every
 * row count.  With two or more x rows the loop carries 2-3x the instructions per weight byte and
 * keeps fewer loads in flight than the hardware prefetcher needs: +4-12% on a Mixtral step (rows
 * 1-2 per expert) on the 2-core CI VM of 2026-11-30 (~29 GB/s).  With one row it cost 2-5% there
 * and was left out; on the 2-core EPYC of 2026-12-01 (cpuid family 26, ~85-100 GB/s) it is the
 * other way: kernel alone, caches flushed, medians of 40, ms without / with it at one row:
 * Mixtral T=1 0.567 / 0.484, fine-grained T=1 0.580 / 0.490 (T=4: 1.44 / 1.37, 2.23 / 2.01);
 * 2 KiB / 4 KiB / 12 KiB ahead: 0.576 / 0.544 / 0.471 at Mixtral T=1, all slower at T=4 than
 * 8 KiB (BENCHMARKS.md, "decode kernel").  The faster the memory, the more a single stream needs
 * the prefetches; at 29 GB/s they cost a few percent. */
enum { PREFETCH_AHEAD = 2048 };

#define DOT_ROWS(R, A)                                                                        \
    static void dot_rows##R(const float *w, const float *const *x, int64_t k, float *out) {   \
        __m256 a[R][A];                                                                       \
        _Pragma("GCC unroll 4") for (int q = 0; q < R; ++q)                                   \
            _Pragma("GCC unroll 4") for (int j = 0; j < A; ++j) a[q][j] = _mm256_setzero_ps(); \
        int64_t i = 0;                                                                        \
        for (; i + 8 * A <= k; i += 8 * A) {                                                  \
            __m256 wv[A];                                                                     \
            _Pragma("GCC unroll 4") for (int j = 0; j < A; ++j) wv[j] = _mm256_loadu_ps(w + i + 8 * j); \
            for (int j = 0; j < A; j += 2) /* one prefetch per 64-byte line */                \
                _mm_prefetch((const char *)(w + i + PREFETCH_AHEAD + 8 * j), _MM_HINT_T1); \
            _Pragma("GCC unroll 4") for (int q = 0; q < R; ++q)                               \
                _Pragma("GCC unroll 4") for (int j = 0; j < A; ++j)                           \
                    a[q][j] = _mm256_fmadd_ps(wv[j], _mm256_loadu_ps(x[q] + i + 8 * j), a[q][j]); \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int q = 0; q < R; ++q) {                                 \
            __m256 s = a[q][0];                                                               \
            _Pragma("GCC unroll 4") for (int j = 1; j < A; ++j) s = _mm256_add_ps(s, a[q][j]); \
            out[q] = hsum(s) + dot_tail(w, x[q], i, k);                                       \
        }                                                                                     \
    }
DOT_ROWS(1, 4)
DOT_ROWS(2, 4)
DOT_ROWS(3, 2)
DOT_ROWS(4, 2)

/* dot_rows1 in 16 lanes: four accumulators, 64 floats (four 64-byte lines, one prefetch each) a
 * step.  Why: half the loads and FMAs for the same bytes leave the core more room to keep lines
 * in flight.  One process, the two builds alternating, 2 threads, 600 MiB read before each call,
 * 2-core Xeon (family 6 model 207), fp32 decode step of one MoE layer, of the AVX2 loop's time in
 * two runs: Mixtral-like T = 1 0.98 / 0.93, fine-grained 0.97 / 0.97, Qwen3-like 0.95 / 0.94
 * (T = 4, mostly one row an expert: 0.92-1.03) (BENCHMARKS.md, bench_quant_decode.py). */
AVX512_TARGET static void dot_rows1_512(const float *w, const float *const *x, int64_t k, float *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float *x0 = x[0];
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {
        for (int j = 0; j < 64; j += 16) _mm_prefetch((const char *)(w + i + PREFETCH_AHEAD + j), _MM_HINT_T1);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x0 + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x0 + i + 16), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 32), _mm512_loadu_ps(x0 + i + 32), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 48), _mm512_loadu_ps(x0 + i + 48), a3);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3));
    out[0] = _mm512_reduce_add_ps(s) + dot_tail(w, x0, i, k);
}

/* ISA_AVX512: one-row dot products in 16 lanes (where the CPU has AVX-512F); ISA_AVX2 until set. */
static int64_t isa_in_use = ISA_AVX2;

/* The widest loops this CPU runs: ISA_AVX512 or ISA_AVX2. */
int64_t moe_skinny_best_isa(void) { return __builtin_cpu_supports("avx512f") ? ISA_AVX512 : ISA_AVX2; }

/* Hold the kernel to isa (at most moe_skinny_best_isa()); returns the setting before. */
int64_t moe_skinny_set_isa(int64_t isa) {
    int64_t before = isa_in_use;
    isa_in_use = isa == ISA_AVX512 && moe_skinny_best_isa() == ISA_AVX512 ? ISA_AVX512 : ISA_AVX2;
    return before;
}

/* Rows n0..n1 of W [n_out, k] against every x row, four x rows at a time while the weight row is
 * in L1.  Each weight row is read from memory once. */
static void run_dot(const task_t *t, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
        const float *w = t->w + n * t->ldw;
        for (int64_t r = 0; r < t->rows; r += 4) {
            int64_t q = t->rows - r < 4 ? t->rows - r : 4;
            const float *xr[4];
            float out[4];
            for (int64_t j = 0; j < q; ++j) xr[j] = x_row(t, r + j);
            switch (q) {
            case 1:
                if (isa_in_use == ISA_AVX512)
                    dot_rows1_512(w, xr, t->k, out);
                else
                    dot_rows1(w, xr, t->k, out);
                break;
            case 2: dot_rows2(w, xr, t->k, out); break;
            case 3: dot_rows3(w, xr, t->k, out); break;
            default: dot_rows4(w, xr, t->k, out);
            }
            for (int64_t j = 0; j < q; ++j) store(t, r + j, n, out[j]);
        }
    }
}

/* Columns n0..n1 of W [k, n_out]: out[r, c] = sum_i x[r, i] W[i, c], AXPY_ROWS x rows and
 * AXPY_COLS columns at a time in a local buffer (in L1) while the weight rows stream through it. */
enum { AXPY_COLS = 256, AXPY_ROWS = 16 };

static void run_axpy(const task_t *t, int64_t n0, int64_t n1) {
    float acc[AXPY_ROWS][AXPY_COLS];
    for (int64_t r0 = 0; r0 < t->rows; r0 += AXPY_ROWS) {
        int64_t nr = t->rows - r0 < AXPY_ROWS ? t->rows - r0 : AXPY_ROWS;
        for (int64_t c0 = n0; c0 < n1; c0 += AXPY_COLS) {
            int64_t nc = n1 - c0 < AXPY_COLS ? n1 - c0 : AXPY_COLS;
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t c = 0; c < nc; ++c) acc[r][c] = 0.f;
            for (int64_t i = 0; i < t->k; ++i) {
                const float *wr = t->w + i * t->ldw + c0;
                for (int64_t r = 0; r < nr; ++r) {
                    float xv = x_row(t, r0 + r)[i];
                    __m256 s = _mm256_set1_ps(xv);
                    int64_t c = 0;
                    for (; c + 8 <= nc; c += 8)
                        _mm256_storeu_ps(acc[r] + c, _mm256_fmadd_ps(s, _mm256_loadu_ps(wr + c),
                                                                     _mm256_loadu_ps(acc[r] + c)));
                    for (; c < nc; ++c) acc[r][c] += xv * wr[c];
                }
            }
            for (int64_t r = 0; r < nr; ++r)
                for (int64_t c = 0; c < nc; ++c) store(t, r0 + r, c0 + c, acc[r][c]);
        }
    }
}

/* Part `part` of `nparts` of every task: a contiguous range of output columns, a multiple of
 * eight wide. */
static void moe_skinny_run(const int64_t *tasks, int64_t ntasks, int64_t part, int64_t nparts) {
    for (int64_t i = 0; i < ntasks; ++i) {
        const int64_t *f = tasks + i * TASK_FIELDS;
        task_t t = unpack(f);
        int64_t step = (t.n_out / nparts + 7) / 8 * 8;
        int64_t n0 = part * step, n1 = part == nparts - 1 ? t.n_out : (part + 1) * step;
        if (n0 >= t.n_out) continue;
        if (n1 > t.n_out) n1 = t.n_out;
        if (f[T_TRANSPOSED])
            run_axpy(&t, n0, n1);
        else
            run_dot(&t, n0, n1);
    }
}

/* The SwiGLU of FC1's output h [rows, 2F] into a [rows, F] (fields below, int64 each):
 *   a[r, c] = silu(gate) * up,  gate/up = h[r, c] / h[r, F + c] (halves) or h[r, 2c] / h[r, 2c + 1]
 *   (interleaved); with limit > 0 first gate = min(gate, limit), up = clamp(up, -limit, limit);
 *   times scale[r] when given (routing weight "between" activation and FC2). */
enum { A_H, A_LDH, A_A, A_LDA, A_ROWS, A_F, A_INTERLEAVED, A_SCALE, ACT_FIELDS };

/* Columns c0..c1 of every row (the halves layout eight at a time). */
static void run_swiglu(const int64_t *f, float limit, int64_t c0, int64_t c1) {
    const float *h = (const float *)(intptr_t)f[A_H], *scale = (const float *)(intptr_t)f[A_SCALE];
    float *a = (float *)(intptr_t)f[A_A];
    int64_t F = f[A_F], ldh = f[A_LDH], lda = f[A_LDA];
    for (int64_t r = 0; r < f[A_ROWS]; ++r) {
        const float *hr = h + r * ldh;
        float *ar = a + r * lda;
        float s = scale ? scale[r] : 1.f;
        if (!f[A_INTERLEAVED])
            swiglu_span(ar, hr, hr + F, c0, c1, limit, s);
        else
            for (int64_t c = c0; c < c1; ++c) ar[c] = swiglu1(hr[2 * c], hr[2 * c + 1], limit) * s;
    }
}

/* All parts at once, on OpenMP threads.  Linked with -fopenmp, this library shares the OpenMP
 * runtime torch has already loaded (same soname, libgomp.so.1), so the parts run on torch's own
 * intra-op threads.  Python threads would share the cores with those threads instead: after any
 * torch op they spin-wait for a while (GNU OpenMP's default), and two Python threads streaming
 * weights read no faster than one (~21 GB/s for both on the CI VM, 28 GB/s for a C program's two). */
void moe_skinny_run_parallel(const int64_t *tasks, int64_t ntasks, int64_t nparts) {
#pragma omp parallel num_threads(nparts)
    {
        int64_t part = omp_get_thread_num(), parts = omp_get_num_threads();
        moe_skinny_run(tasks, ntasks, part, parts);
    }
}

/* A chunk's whole FFN in one OpenMP region: FC1 tasks (into h), SwiGLU (h -> a, ACT_FIELDS), FC2
 * tasks (from a).  The SwiGLU's columns are split over the threads like the tasks' outputs; the
 * barriers order the phases (FC2 reads every column of a, the SwiGLU both halves of h). */
void moe_skinny_ffn_parallel(const int64_t *fc1, int64_t n1, const int64_t *act, float limit,
                             const int64_t *fc2, int64_t n2, int64_t nparts) {
#pragma omp parallel num_threads(nparts)
    {
        int64_t part = omp_get_thread_num(), parts = omp_get_num_threads();
        moe_skinny_run(fc1, n1, part, parts);
#pragma omp barrier
        int64_t F = act[A_F], step = (F / parts + 7) / 8 * 8;
        int64_t c0 = part * step, c1 = part == parts - 1 ? F : (part + 1) * step;
        if (c1 > F) c1 = F;
        if (c0 < c1) run_swiglu(act, limit, c0, c1);
#pragma omp barrier
        moe_skinny_run(fc2, n2, part, parts);
    }
}

/* A whole decode step on stacked weights in one call: the sort of the T*K slots by expert (a
 * counting sort, stable), every expert's FC1 / FC2 task and the SwiGLU built here, then
 * moe_skinny_ffn_parallel.  Python would spend 0.2-0.3 ms a step on the sort, the index tensors
 * and the task lists with the caches cold after the weights streamed through them.
 *
 * Plan fields (int64 each; pointers as integers), then ROLE_FIELDS for each of the six roles
 * fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias (base 0: role absent); expert e's matrix
 * (or bias) starts at base + e * estride bytes, ld is its row stride in elements:
 *   x [T, hidden] (row stride ldx), ids [T, K] int64 (or int32), gates [T, K] fp32, y [T, hidden]
 *   fp32 (row stride ldy; zeroed here, then every slot's FC2 output added);
 *   up_separate: fc1_up holds the up projection (h's right half), else fc1 is [2*ffn, hidden]
 *   gate|up or interleaved; between: the routing weight scales a's rows, else FC2's outputs.
 * The scratch (the sort, the task lists, FC1's output h [T*K, 2*ffn] and the activation a
 * [T*K, ffn]) is one allocation made here: two torch tensors fewer per step, ~15 us of the
 * op's ~160 us fixed cost with the caches cold (BENCHMARKS.md, "fixed cost"). */
enum {
    P_X, P_LDX, P_IDS, P_IDS_INT32, P_GATES, P_T, P_K, P_E, P_Y, P_LDY, P_HIDDEN, P_FFN,
    P_UP_SEPARATE, P_TRANSPOSED, P_INTERLEAVED, P_BETWEEN, P_ROLES
};
enum { R_BASE, R_ESTRIDE, R_LD, ROLE_FIELDS };
enum { ROLE_FC1, ROLE_FC1_UP, ROLE_FC2, ROLE_FC1_BIAS, ROLE_FC1_UP_BIAS, ROLE_FC2_BIAS };

static int64_t role_at(const int64_t *plan, int role, int64_t e) {
    const int64_t *r = plan + P_ROLES + role * ROLE_FIELDS;
    return r[R_BASE] ? r[R_BASE] + e * r[R_ESTRIDE] : 0;
}

/* One task of expert e's weight role `role` (bias `bias`): rows x[xidx[r]] or x[r] -> y, as task_t. */
static int64_t *put_task(int64_t *f, const int64_t *plan, int role, int bias, int64_t e, int64_t x, int64_t ldx,
                         int64_t y, int64_t ldy, int64_t rows, int64_t k, int64_t n_out, int64_t xidx,
                         int64_t yidx, int64_t scale) {
    f[T_W] = role_at(plan, role, e);
    f[T_LDW] = plan[P_ROLES + role * ROLE_FIELDS + R_LD];
    f[T_X] = x, f[T_LDX] = ldx, f[T_Y] = y, f[T_LDY] = ldy, f[T_BIAS] = role_at(plan, bias, e);
    f[T_ROWS] = rows, f[T_K] = k, f[T_NOUT] = n_out, f[T_TRANSPOSED] = plan[P_TRANSPOSED];
    f[T_XIDX] = xidx, f[T_YIDX] = yidx, f[T_SCALE] = scale;
    return f + TASK_FIELDS;
}

/* Returns 0, or -1 when its scratch could not be allocated (nothing computed, y untouched). */
int moe_skinny_decode(const int64_t *plan, float limit, int64_t nparts) {
    int64_t T = plan[P_T], K = plan[P_K], E = plan[P_E], S = T * K, H = plan[P_HIDDEN], F = plan[P_FFN];
    int64_t up_separate = plan[P_UP_SEPARATE], fc1_out = up_separate ? F : 2 * F;
    int64_t touched = S < E ? S : E;
    /* One block: h [S, 2F] and a [S, F] (64-byte aligned: first), start [E + 2], tok [S], fc1
     * tasks [2 * touched], fc2 tasks [touched] (int64 each), scale [S] (fp32, last). */
    size_t floats = (size_t)S * 3 * (size_t)F, ints = (size_t)E + 2 + S + 3 * (size_t)touched * TASK_FIELDS;
    size_t bytes = ((floats * sizeof(float) + 63) / 64) * 64 + ints * sizeof(int64_t) + (size_t)S * sizeof(float);
    float *block = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!block) return -1;
    float *hbuf = block, *abuf = block + (size_t)S * 2 * F;
    int64_t *start = (int64_t *)((char *)block + ((floats * sizeof(float) + 63) / 64) * 64);
    int64_t *tok = start + E + 2, *fc1 = tok + S, *fc2 = fc1 + 2 * touched * TASK_FIELDS;
    float *scale = (float *)(fc2 + touched * TASK_FIELDS);
    for (int64_t e = 0; e < E + 2; ++e) start[e] = 0;
    float *y = (float *)(intptr_t)plan[P_Y];
    for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < H; ++c) y[t * plan[P_LDY] + c] = 0.f;
    const int64_t *ids64 = (const int64_t *)(intptr_t)plan[P_IDS];
    const int32_t *ids32 = (const int32_t *)(intptr_t)plan[P_IDS];
    const float *gates = (const float *)(intptr_t)plan[P_GATES];
#define ID(s) (plan[P_IDS_INT32] ? (int64_t)ids32[s] : ids64[s])
    for (int64_t s = 0; s < S; ++s)  /* ids outside [0, E) are dropped slots */
        if (ID(s) >= 0 && ID(s) < E) ++start[ID(s) + 2];
    for (int64_t e = 0; e < E; ++e) start[e + 2] += start[e + 1];
    for (int64_t s = 0; s < S; ++s)  /* start[e + 1]: the next free row of expert e */
        if (ID(s) >= 0 && ID(s) < E) {
            int64_t p = start[ID(s) + 1]++;
            tok[p] = s / K, scale[p] = gates[s];
        }
#undef ID
    /* start[e]..start[e + 1]: expert e's rows in tok / scale / h / a. */
    int64_t *f1 = fc1, *f2 = fc2, h = (int64_t)(intptr_t)hbuf, a = (int64_t)(intptr_t)abuf;
    int64_t between = plan[P_BETWEEN];
    for (int64_t e = 0; e < E; ++e) {
        int64_t lo = start[e], n = start[e + 1] - lo, xidx = (int64_t)(intptr_t)(tok + lo);
        if (n == 0) continue;
        int64_t h_rows = h + lo * 2 * F * (int64_t)sizeof(float);
        f1 = put_task(f1, plan, ROLE_FC1, ROLE_FC1_BIAS, e, plan[P_X], plan[P_LDX], h_rows, 2 * F, n, H, fc1_out,
                      xidx, 0, 0);
        if (up_separate)
            f1 = put_task(f1, plan, ROLE_FC1_UP, ROLE_FC1_UP_BIAS, e, plan[P_X], plan[P_LDX],
                          h_rows + F * (int64_t)sizeof(float), 2 * F, n, H, F, xidx, 0, 0);
        f2 = put_task(f2, plan, ROLE_FC2, ROLE_FC2_BIAS, e, a + lo * F * (int64_t)sizeof(float), F, plan[P_Y],
                      plan[P_LDY], n, F, H, 0, xidx, between ? 0 : (int64_t)(intptr_t)(scale + lo));
    }
    int64_t act[ACT_FIELDS] = {h, 2 * F, a, F, start[E], F, plan[P_INTERLEAVED],
                               between ? (int64_t)(intptr_t)scale : 0};
    moe_skinny_ffn_parallel(fc1, (f1 - fc1) / TASK_FIELDS, act, limit, fc2, (f2 - fc2) / TASK_FIELDS, nparts);
    free(block);
    return 0;
}
