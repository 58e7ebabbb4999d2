/* Row work between the expert GEMMs of the CPU prefill loop (kernels/cpu/forward.py, _packed_experts).
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
 *   gather   out[r, :] = scale[r] * x[idx[r], :]
 *   swiglu   out[r, j] = silu(gate[r, j]) * up[r, j] * scale[r]   (out may be gate)
 *   add      y[idx[r], :] += scale[r] * src[r, :]
 *   moe_rows_step runs any of them in one OpenMP region.
 * Threads:  gather and swiglu split rows over `nthreads` OpenMP threads (each output row has one
 *           writer); add splits columns, so repeated indices (one token routed twice to the same
 *           expert by a custom router) never race.
 *
 * Built by moe_compile/kernels/cpu/cc.py with `cc -O3 -mavx2 -mfma -fopenmp` on first use.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

static inline float row_scale(const float *scale, int64_t r) { return scale ? scale[r] : 1.f; }

/* Rows lo..hi of part `part` of `parts` (static, equal split). */
static void part_range(int64_t n, int64_t part, int64_t parts, int64_t *lo, int64_t *hi) {
    *lo = n * part / parts, *hi = n * (part + 1) / parts;
}

/* Operand fields of each step, int64 each (pointers as integers, NULL: none):
 *   gather  out, ldo, x, ldx, idx, scale, n, w        out[r, :] = scale[r] * x[idx[r], :]
 *   swiglu  out, ldo, gate, ldg, up, ldu, scale, n, f  out[r, j] = silu(gate[r, j]) * up[r, j] * scale[r]
 *   add     y, ldy, src, lds, idx, scale, n, w        y[idx[r], :] += scale[r] * src[r, :] */
enum { G_OUT, G_LDO, G_X, G_LDX, G_IDX, G_SCALE, G_N, G_W };
enum { S_OUT, S_LDO, S_GATE, S_LDG, S_UP, S_LDU, S_SCALE, S_N, S_F };
enum { D_Y, D_LDY, D_SRC, D_LDS, D_IDX, D_SCALE, D_N, D_W };
#define PTR(type, f, i) ((type *)(intptr_t)(f)[i])

static void gather_part(const int64_t *f, int64_t part, int64_t parts) {
    int64_t lo, hi;
    part_range(f[G_N], part, parts, &lo, &hi);
    const int64_t *idx = PTR(const int64_t, f, G_IDX);
    for (int64_t r = lo; r < hi; ++r) {
        const float *src = PTR(const float, f, G_X) + idx[r] * f[G_LDX];
        float *dst = PTR(float, f, G_OUT) + r * f[G_LDO];
        float s = row_scale(PTR(const float, f, G_SCALE), r);
        for (int64_t j = 0; j < f[G_W]; ++j) dst[j] = src[j] * s;
    }
}

static void swiglu_part(const int64_t *f, int64_t part, int64_t parts) {
    int64_t lo, hi;
    part_range(f[S_N], part, parts, &lo, &hi);
    for (int64_t r = lo; r < hi; ++r)
        swiglu_span(PTR(float, f, S_OUT) + r * f[S_LDO], PTR(const float, f, S_GATE) + r * f[S_LDG],
                    PTR(const float, f, S_UP) + r * f[S_LDU], 0, f[S_F], 0.f, row_scale(PTR(const float, f, S_SCALE), r));
}

/* Columns, not rows, per part: repeated indices (one token routed twice to the same expert by a
 * custom router) then never race. */
static void add_part(const int64_t *f, int64_t part, int64_t parts) {
    int64_t w = f[D_W], step = (w / parts + 15) / 16 * 16; /* whole cache lines per thread */
    int64_t c0 = part * step, c1 = part == parts - 1 ? w : (part + 1) * step;
    if (c1 > w) c1 = w;
    const int64_t *idx = PTR(const int64_t, f, D_IDX);
    for (int64_t r = 0; r < f[D_N] && c0 < c1; ++r) {
        float *dst = PTR(float, f, D_Y) + idx[r] * f[D_LDY];
        const float *src = PTR(const float, f, D_SRC) + r * f[D_LDS];
        float k = row_scale(PTR(const float, f, D_SCALE), r);
        for (int64_t j = c0; j < c1; ++j) dst[j] += src[j] * k;
    }
}

/* Any of the three (NULL: skipped) in one OpenMP region, each thread doing its part of each: the
 * prefill loop runs the previous expert's add, this expert's SwiGLU and the next expert's gather
 * between this expert's GEMMs, one region instead of three.  The caller guarantees the three
 * touch disjoint memory (y; the SwiGLU's buffers; the gather's output). */
void moe_rows_step(const int64_t *add, const int64_t *swiglu, const int64_t *gather, int64_t nthreads) {
#pragma omp parallel num_threads(nthreads)
    {
        int64_t part = omp_get_thread_num(), parts = omp_get_num_threads();
        if (add) add_part(add, part, parts);
        if (swiglu) swiglu_part(swiglu, part, parts);
        if (gather) gather_part(gather, part, parts);
    }
}
