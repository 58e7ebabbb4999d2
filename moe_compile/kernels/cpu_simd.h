/* AVX2 helpers shared by the package's C kernels (cpu_rows.c, cpu_skinny.c); kernels/cpu_cc.py
 * puts this header next to each kernel's source when it builds one, and hashes it with them. */
#ifndef MOE_COMPILE_CPU_SIMD_H
#define MOE_COMPILE_CPU_SIMD_H

#include <immintrin.h>

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

#endif
