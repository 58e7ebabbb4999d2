/* Row work between the expert GEMMs of the CPU prefill loop (kernels/cpu.py, _packed_experts).
 *
 * Why: per expert, prefill runs gather -> FC1 -> SwiGLU -> FC2 -> combine.  With 64 experts of
 * ~64 rows each, torch's index_select / chunk + silu_ + mul_ / index_add_ (which expands its index
 * to an [n, H] int64 tensor for a scatter_add_) are many small calls per expert.  Fine-grained
 * shape (H=1024, F=512, E=64, K=8), T=512, fp32, 2-core CI VM, medians of 30 interleaved calls:
 * all on torch 95.2 ms, combine here 94.5, gather + combine here 93.6, all three here 92.2 ms.
 * What remains of the rows' cost is cache misses: the experts' weights stream through the caches
 * between the steps.
 *
 * Shapes:   n rows, w row width; idx [n] int64 row indices; scale [n] fp32 per-row factor or
 *           NULL (1).  Every row's elements are contiguous; row strides (ld*) are in elements.
 *   moe_rows_gather   out[r, :] = scale[r] * x[idx[r], :]
 *   moe_rows_swiglu   out[r, j] = silu(gate[r, j]) * up[r, j] * scale[r]   (out may be gate)
 *   moe_rows_add      y[idx[r], :] += scale[r] * src[r, :]
 * Threads:  gather and swiglu split rows over `nthreads` OpenMP threads (each output row has one
 *           writer); add splits columns, so repeated indices (one token routed twice to the same
 *           expert by a custom router) never race.
 *
 * Built by moe_compile/kernels/cpu_cc.py with `cc -O3 -mavx2 -mfma -fopenmp` on first use.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "cpu_simd.h"

static inline float row_scale(const float *scale, int64_t r) { return scale ? scale[r] : 1.f; }

void moe_rows_gather(float *out, int64_t ldo, const float *x, int64_t ldx, const int64_t *idx,
                     const float *scale, int64_t n, int64_t w, int64_t nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < n; ++r) {
        const float *src = x + idx[r] * ldx;
        float *dst = out + r * ldo;
        float s = row_scale(scale, r);
        for (int64_t j = 0; j < w; ++j) dst[j] = src[j] * s;
    }
}

void moe_rows_swiglu(float *out, int64_t ldo, const float *gate, int64_t ldg, const float *up,
                     int64_t ldu, const float *scale, int64_t n, int64_t f, int64_t nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < n; ++r) {
        const float *g = gate + r * ldg, *u = up + r * ldu;
        float *o = out + r * ldo;
        float s = row_scale(scale, r);
        __m256 vs = _mm256_set1_ps(s);
        int64_t j = 0;
        for (; j + 8 <= f; j += 8) {
            __m256 silu = silu8(_mm256_loadu_ps(g + j));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(silu, _mm256_loadu_ps(u + j)), vs));
        }
        for (; j < f; ++j) o[j] = g[j] / (1.f + expf(-g[j])) * u[j] * s;
    }
}

void moe_rows_add(float *y, int64_t ldy, const float *src, int64_t lds, const int64_t *idx,
                  const float *scale, int64_t n, int64_t w, int64_t nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
        int64_t step = (w / parts + 15) / 16 * 16; /* whole cache lines per thread */
        int64_t c0 = part * step, c1 = part == parts - 1 ? w : (part + 1) * step;
        if (c1 > w) c1 = w;
        for (int64_t r = 0; r < n && c0 < c1; ++r) {
            float *dst = y + idx[r] * ldy;
            const float *s = src + r * lds;
            float k = row_scale(scale, r);
            for (int64_t j = c0; j < c1; ++j) dst[j] += s[j] * k;
        }
    }
}
