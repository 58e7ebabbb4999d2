/* AVX2 helpers shared by the package's C kernels (rows.c, skinny.c, experts.c); kernels/cpu/cc.py
 * puts this header next to each kernel's source when it builds one, and hashes it with them. */
#ifndef MOE_COMPILE_CPU_SIMD_H
#define MOE_COMPILE_CPU_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* The ISA codes the kernels and their hosts exchange (kernels/cpu/isa.py: ISA_AVX2, ISA_AVX512). */
enum { ISA_AVX2 = 2, ISA_AVX512 = 512 };

/* A function compiled for AVX-512F (the files themselves build for AVX2), run only where the CPU
 * has it. */
#define AVX512_TARGET __attribute__((target("avx512f,avx2,fma")))

/* e^x on 8 lanes: x = n ln2 + r, |r| <= ln2/2, e^r by a degree-7 polynomial (Cephes' expf
 * coefficients), 2^n built in the exponent bits.  Max relative error ~2e-7 (as torch's Sleef
 * expf on the same inputs: tests/kernels/test_cpu_rows.py).  The input is clamped to
 * [-87.3, 88.7] so 2^n stays a normal float; MIN/MAX return their second operand for a NaN, so a
 * NaN input passes through to a NaN result. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), _mm256_min_ps(_mm256_set1_ps(88.7f), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x); /* ln2 in two parts */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* silu(x) = x / (1 + e^-x) on 8 lanes. */
static inline __m256 silu8(__m256 x) {
    return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

/* silu(g) * u of one element, clamped first when limit > 0 (g <= limit, |u| <= limit). */
static inline float swiglu1(float g, float u, float limit) {
    if (limit > 0.f) {
        g = g < limit ? g : limit;
        u = u < -limit ? -limit : (u > limit ? limit : u);
    }
    return _mm256_cvtss_f32(silu8(_mm256_set1_ps(g))) * u;  /* the vector form: no libm needed */
}

/* out[j] = silu(gate[j]) * up[j] * s for j in [j0, j1), gate and up contiguous, clamped as
 * swiglu1 when limit > 0: the SwiGLU of both kernels (cpu_rows' prefill steps, cpu_skinny's
 * decode FFN), eight lanes at a time. */
static inline void swiglu_span(float *out, const float *gate, const float *up, int64_t j0, int64_t j1,
                               float limit, float s) {
    const __m256 lim = _mm256_set1_ps(limit), nlim = _mm256_set1_ps(-limit), vs = _mm256_set1_ps(s);
    int64_t j = j0;
    for (; j + 8 <= j1; j += 8) {
        __m256 g = _mm256_loadu_ps(gate + j), u = _mm256_loadu_ps(up + j);
        if (limit > 0.f) {
            g = _mm256_min_ps(g, lim);
            u = _mm256_min_ps(_mm256_max_ps(u, nlim), lim);
        }
        _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(silu8(g), u), vs));
    }
    for (; j < j1; ++j) out[j] = swiglu1(gate[j], up[j], limit) * s;
}

#endif
