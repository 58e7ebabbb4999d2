/* qgemm.c's bf16 tiles (AVX-512 BF16): a dequantized panel and the activation rows as bf16 k-pairs,
 * and the 8 x 32 vdpbf16ps tile.  Included by qgemm.c after qgemm_dequant.c. */
/* ---- bf16 float tiles (AVX-512 BF16) ----
 * Where the CPU multiplies bf16 natively, the float formats' tiles (not w16's: its 16-bit weights
 * hold more than bf16 keeps) run vdpbf16ps: 2 products a lane and instruction, twice the fp32
 * FMA's, on operands rounded to bf16 (nearest even): the dequantized panel (q * s rounded once)
 * and the activations, the sums in fp32.  kernels/cpu/dense.py's prefill GEMMs do the same
 * (prefill_dtype); the error is ~2^-9 of a product, far under the formats' own.
 * Operands in k-pairs: a bf16 panel is [K/2][16][2] (lane j of pair step kp holds column j's
 * elements 2kp, 2kp + 1), a bf16 row is the row itself (element pairs are 32-bit words). */
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")))

/* fp32 panel [K][16] (K even) -> bf16 k-pairs [K/2][16][2]. */
BF16_TARGET static void panel_to_pairs(const float *src, int64_t K, uint16_t *dst) {
    for (int64_t k = 0; k < K; k += 2) {
        __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k * 16)));
        __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + (k + 1) * 16)));
        _mm512_storeu_si512(dst + k * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

/* dst [n, K] bf16 = src's rows (ld apart), K a multiple of 16: this thread's share of the rows
 * (the caller then waits for the team). */
BF16_TARGET static void rows_to_bf16(const float *src, int64_t ld, int64_t n, int64_t K, uint16_t *dst) {
    int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
    for (int64_t r = n * t / parts; r < n * (t + 1) / parts; ++r) {
        const float *row = src + r * ld;
        for (int64_t k = 0; k < K; k += 16)
            _mm256_storeu_si256((__m256i *)(dst + r * K + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + k)));
    }
}

#define BTILE_ROW(R)                                                                  \
    if (mr > R) {                                                                     \
        __m512bh av = (__m512bh)_mm512_set1_epi32(a##R[kp]);                          \
        c##R##0 = _mm512_dpbf16_ps(c##R##0, av, v0);                                  \
        c##R##1 = _mm512_dpbf16_ps(c##R##1, av, v1);                                  \
    }

/* c [mr][32] = A rows . [b0 | b1] over K (even): A's rows as k-pairs read in place, b0 / b1 bf16
 * panels in k-pairs; mr <= 8 rows x (16 + 16) columns, as f32_tile512. */
BF16_TARGET __attribute__((always_inline)) static inline void bf16_tile512(const int mr, const int32_t *const *a,
                                                                          const uint16_t *b0, const uint16_t *b1,
                                                                          int64_t K, float *c) {
    const int32_t *a0 = a[0], *a1 = a[mr > 1 ? 1 : 0], *a2 = a[mr > 2 ? 2 : 0], *a3 = a[mr > 3 ? 3 : 0],
                  *a4 = a[mr > 4 ? 4 : 0], *a5 = a[mr > 5 ? 5 : 0], *a6 = a[mr > 6 ? 6 : 0], *a7 = a[mr > 7 ? 7 : 0];
    __m512 z = _mm512_setzero_ps();
    __m512 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z;
    __m512 c40 = z, c41 = z, c50 = z, c51 = z, c60 = z, c61 = z, c70 = z, c71 = z;
    for (int64_t kp = 0; kp < K / 2; ++kp) {
        __m512bh v0 = (__m512bh)_mm512_loadu_si512(b0 + kp * 32), v1 = (__m512bh)_mm512_loadu_si512(b1 + kp * 32);
        TILE_EACH8(BTILE_ROW)
    }
    TILE_EACH8(TILE_STORE512)
}

/* bf16_tile512 at a run-time row count mr (1..8). */
TILE512_ANY(bf16_tile512_any, bf16_tile512, int32_t, uint16_t, float, BF16_TARGET)
