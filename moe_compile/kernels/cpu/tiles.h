/* fp32 register tiles shared by experts.c (fp32 prefill) and qgemm.c (its float formats, on
 * panels it dequantizes): c [mr][..] = A rows . [b0 | b1] over K, b0 / b1 stepping PANEL floats
 * per k (PANEL is the includer's), the accumulators in registers over the whole K.
 *
 *   f32_tile512: mr <= 8 rows x (16 + 16) columns; A's rows read in place (a[r][k]); c rows 32 apart.
 *   f32_tile256: mr <= 6 rows x (8 + 8) columns; A read with a_stride (1: rows in place;
 *                6: tile-packed, element k of row r at a[r][k * 6], one memory stream for all
 *                rows); c rows c_stride apart, the b1 block c_half after the b0 block.
 *
 * Always inlined: f32_tile512_any and the callers' F32_TILE256_ANY functions switch over mr and pass
 * mr, a_stride, c_stride and c_half as constants, so each instance compiles to the same code a
 * hand-written tile would. */
#ifndef MOE_TILES_H
#define MOE_TILES_H

#include <immintrin.h>
#include <stdint.h>

#define TILE_EACH8(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)
#define TILE_EACH6(M) M(0) M(1) M(2) M(3) M(4) M(5)

#define TILE_ROW512(R)                                                 \
    if (mr > R) {                                                      \
        __m512 av = _mm512_set1_ps(a##R[k]);                           \
        c##R##0 = _mm512_fmadd_ps(av, v0, c##R##0);                    \
        c##R##1 = _mm512_fmadd_ps(av, v1, c##R##1);                    \
    }
#define TILE_STORE512(R)                                               \
    if (mr > R) {                                                      \
        _mm512_storeu_ps(c + R * 32, c##R##0);                         \
        _mm512_storeu_ps(c + R * 32 + 16, c##R##1);                    \
    }

__attribute__((target("avx512f,avx2,fma"), always_inline)) static inline void
f32_tile512(const int mr, const float *const *a, const float *b0, const float *b1, int64_t K, float *c) {
    const float *a0 = a[0], *a1 = a[mr > 1 ? 1 : 0], *a2 = a[mr > 2 ? 2 : 0], *a3 = a[mr > 3 ? 3 : 0],
                *a4 = a[mr > 4 ? 4 : 0], *a5 = a[mr > 5 ? 5 : 0], *a6 = a[mr > 6 ? 6 : 0], *a7 = a[mr > 7 ? 7 : 0];
    __m512 z = _mm512_setzero_ps();
    __m512 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z;
    __m512 c40 = z, c41 = z, c50 = z, c51 = z, c60 = z, c61 = z, c70 = z, c71 = z;
    for (int64_t k = 0; k < K; ++k) {
        __m512 v0 = _mm512_loadu_ps(b0 + k * PANEL), v1 = _mm512_loadu_ps(b1 + k * PANEL);
        TILE_EACH8(TILE_ROW512)
    }
    TILE_EACH8(TILE_STORE512)
}

#define TILE_ROW256(R)                                                 \
    if (mr > R) {                                                      \
        __m256 av = _mm256_broadcast_ss(a##R + k * a_stride);          \
        c##R##0 = _mm256_fmadd_ps(av, v0, c##R##0);                    \
        c##R##1 = _mm256_fmadd_ps(av, v1, c##R##1);                    \
    }
#define TILE_STORE256(R)                                               \
    if (mr > R) {                                                      \
        _mm256_storeu_ps(c + R * c_stride, c##R##0);                   \
        _mm256_storeu_ps(c + R * c_stride + c_half, c##R##1);          \
    }

__attribute__((always_inline)) static inline void f32_tile256(const int mr, const float *const *a, const float *b0,
                                                              const float *b1, int64_t K, float *c,
                                                              const int64_t a_stride, const int64_t c_stride,
                                                              const int64_t c_half) {
    const float *a0 = a[0], *a1 = a[mr > 1 ? 1 : 0], *a2 = a[mr > 2 ? 2 : 0], *a3 = a[mr > 3 ? 3 : 0],
                *a4 = a[mr > 4 ? 4 : 0], *a5 = a[mr > 5 ? 5 : 0];
    __m256 z = _mm256_setzero_ps();
    __m256 c00 = z, c01 = z, c10 = z, c11 = z, c20 = z, c21 = z, c30 = z, c31 = z, c40 = z, c41 = z, c50 = z, c51 = z;
    for (int64_t k = 0; k < K; ++k) {
        __m256 v0 = _mm256_loadu_ps(b0 + k * PANEL), v1 = _mm256_loadu_ps(b1 + k * PANEL);
        TILE_EACH6(TILE_ROW256)
    }
    TILE_EACH6(TILE_STORE256)
}

/* Defines `static void NAME(int mr, a, b0, b1, K, c)`: TILE (an always-inlined tile of up to 8 rows
 * such as f32_tile512) at a run-time row count mr (1..8), with A_T / B_T / C_T its A rows', panels'
 * and results' element types and ATTR the target attribute it needs. */
#define TILE512_ANY(NAME, TILE, A_T, B_T, C_T, ATTR)                                                     \
    ATTR static void NAME(int mr, const A_T *const *a, const B_T *b0, const B_T *b1, int64_t K, C_T *c) { \
        switch (mr) {                                                                                   \
        case 8: TILE(8, a, b0, b1, K, c); break;                                                        \
        case 7: TILE(7, a, b0, b1, K, c); break;                                                        \
        case 6: TILE(6, a, b0, b1, K, c); break;                                                        \
        case 5: TILE(5, a, b0, b1, K, c); break;                                                        \
        case 4: TILE(4, a, b0, b1, K, c); break;                                                        \
        case 3: TILE(3, a, b0, b1, K, c); break;                                                        \
        case 2: TILE(2, a, b0, b1, K, c); break;                                                        \
        default: TILE(1, a, b0, b1, K, c); break;                                                       \
        }                                                                                               \
    }

/* f32_tile512 at a run-time row count mr (1..8). */
TILE512_ANY(f32_tile512_any, f32_tile512, float, float, float, __attribute__((target("avx512f,avx2,fma"))))

/* Defines `static void NAME(int mr, a, b0, b1, K, c)`: f32_tile256 at a run-time row count mr
 * (1..6) with the caller's constant A stride, c row stride and b1 offset. */
#define F32_TILE256_ANY(NAME, A_STRIDE, C_STRIDE, C_HALF)                                                  \
    static void NAME(int mr, const float *const *a, const float *b0, const float *b1, int64_t K, float *c) { \
        switch (mr) {                                                                                   \
        case 6: f32_tile256(6, a, b0, b1, K, c, A_STRIDE, C_STRIDE, C_HALF); break;                     \
        case 5: f32_tile256(5, a, b0, b1, K, c, A_STRIDE, C_STRIDE, C_HALF); break;                     \
        case 4: f32_tile256(4, a, b0, b1, K, c, A_STRIDE, C_STRIDE, C_HALF); break;                     \
        case 3: f32_tile256(3, a, b0, b1, K, c, A_STRIDE, C_STRIDE, C_HALF); break;                     \
        case 2: f32_tile256(2, a, b0, b1, K, c, A_STRIDE, C_STRIDE, C_HALF); break;                     \
        default: f32_tile256(1, a, b0, b1, K, c, A_STRIDE, C_STRIDE, C_HALF); break;                    \
        }                                                                                               \
    }

#endif
