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
 * Threads:  the host splits every task's n_out range into `nparts` parts; the call with
 *           `part` = p computes part p of every task (one call per worker thread, the GIL is
 *           released by ctypes around the call).
 *
 * Built by moe_compile/kernels/cpu_skinny.py with `cc -O3 -mavx2 -mfma` on first use.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

/* One task = TASK_FIELDS int64 values, in this order (see cpu_skinny.py: _pack). */
enum { T_W, T_X, T_Y, T_BIAS, T_ROWS, T_K, T_NOUT, T_LDW, T_LDX, T_LDY, T_TRANSPOSED, TASK_FIELDS };

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

/* One weight row against R x rows (R = 1..4, unrolled): two accumulators per x row, each weight
 * vector loaded once for all R.  One row at a time, in memory order, keeps the hardware
 * prefetcher on a single stream: on the CI VM (one thread, weights not in cache) reading four
 * weight rows at once ran at 16.8 GB/s, one row at a time at 21.7 GB/s, a plain sum at 24.6. */
#define DOT_ROWS(R)                                                                           \
    static void dot_rows##R(const float *w, const float *x, int64_t ldx, int64_t k, float *y,  \
                            int64_t ldy) {                                                    \
        __m256 a[R][2];                                                                       \
        _Pragma("GCC unroll 4") for (int q = 0; q < R; ++q) a[q][0] = a[q][1] = _mm256_setzero_ps(); \
        int64_t i = 0;                                                                        \
        for (; i + 16 <= k; i += 16) {                                                        \
            __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);             \
            _Pragma("GCC unroll 4") for (int q = 0; q < R; ++q) {                             \
                a[q][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + q * ldx + i), a[q][0]);     \
                a[q][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + q * ldx + i + 8), a[q][1]); \
            }                                                                                 \
        }                                                                                     \
        _Pragma("GCC unroll 4") for (int q = 0; q < R; ++q)                                   \
            y[q * ldy] = hsum(_mm256_add_ps(a[q][0], a[q][1])) + dot_tail(w, x + q * ldx, i, k); \
    }
DOT_ROWS(1)
DOT_ROWS(2)
DOT_ROWS(3)
DOT_ROWS(4)

/* Rows n0..n1 of W [n_out, k] against every x row, four x rows at a time while the weight row is
 * in L1.  Each weight row is read from memory once. */
static void run_dot(const float *w, const float *x, float *y, int64_t rows, int64_t k,
                    int64_t ldw, int64_t ldx, int64_t ldy, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
        for (int64_t r = 0; r < rows; r += 4) {
            const float *xr = x + r * ldx;
            float *yr = y + r * ldy + n;
            switch (rows - r < 4 ? rows - r : 4) {
            case 1: dot_rows1(w + n * ldw, xr, ldx, k, yr, ldy); break;
            case 2: dot_rows2(w + n * ldw, xr, ldx, k, yr, ldy); break;
            case 3: dot_rows3(w + n * ldw, xr, ldx, k, yr, ldy); break;
            default: dot_rows4(w + n * ldw, xr, ldx, k, yr, ldy);
            }
        }
    }
}

/* Columns n0..n1 of W [k, n_out]: y[r, n] = sum_i x[r, i] W[i, n].  The y slice stays in L1
 * (AXPY_COLS columns at a time) while the weight rows stream through it. */
enum { AXPY_COLS = 256 };

static void run_axpy(const float *w, const float *x, float *y, int64_t rows, int64_t k,
                     int64_t ldw, int64_t ldx, int64_t ldy, int64_t n0, int64_t n1) {
    for (int64_t c0 = n0; c0 < n1; c0 += AXPY_COLS) {
        int64_t c1 = c0 + AXPY_COLS < n1 ? c0 + AXPY_COLS : n1;
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = c0; c < c1; ++c) y[r * ldy + c] = 0.f;
        for (int64_t i = 0; i < k; ++i) {
            const float *wr = w + i * ldw;
            for (int64_t r = 0; r < rows; ++r) {
                float *yr = y + r * ldy;
                __m256 s = _mm256_set1_ps(x[r * ldx + i]);
                int64_t c = c0;
                for (; c + 8 <= c1; c += 8)
                    _mm256_storeu_ps(yr + c, _mm256_fmadd_ps(s, _mm256_loadu_ps(wr + c),
                                                             _mm256_loadu_ps(yr + c)));
                for (; c < c1; ++c) yr[c] += x[r * ldx + i] * wr[c];
            }
        }
    }
}

/* Part `part` of `nparts` of every task: a contiguous range of output columns, a multiple of
 * eight wide so that the parts' stores never share a cache line's vector. */
void moe_skinny_run(const int64_t *tasks, int64_t ntasks, int64_t part, int64_t nparts) {
    for (int64_t t = 0; t < ntasks; ++t) {
        const int64_t *f = tasks + t * TASK_FIELDS;
        const float *w = (const float *)(intptr_t)f[T_W];
        const float *x = (const float *)(intptr_t)f[T_X];
        float *y = (float *)(intptr_t)f[T_Y];
        const float *bias = (const float *)(intptr_t)f[T_BIAS];
        int64_t n_out = f[T_NOUT], step = (n_out / nparts + 7) / 8 * 8;
        int64_t n0 = part * step, n1 = part == nparts - 1 ? n_out : (part + 1) * step;
        if (n0 >= n_out) continue;
        if (n1 > n_out) n1 = n_out;
        if (f[T_TRANSPOSED])
            run_axpy(w, x, y, f[T_ROWS], f[T_K], f[T_LDW], f[T_LDX], f[T_LDY], n0, n1);
        else
            run_dot(w, x, y, f[T_ROWS], f[T_K], f[T_LDW], f[T_LDX], f[T_LDY], n0, n1);
        if (bias)
            for (int64_t r = 0; r < f[T_ROWS]; ++r)
                for (int64_t n = n0; n < n1; ++n) y[r * f[T_LDY] + n] += bias[n];
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
