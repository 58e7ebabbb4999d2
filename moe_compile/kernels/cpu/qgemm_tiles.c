/* qgemm.c's register tiles: the integer tiles (a8w8 / a8w4 on AVX-512 VNNI and AVX2, dispatched on
 * the row count) and the AVX2 fp32 tile instantiated from tiles.h.  Included by qgemm.c after
 * qgemm.h. */
/* ---- integer tiles: c [mr][2V] int32 = A rows (int8, K) . [b0 | b1] ----
 * b0 / b1 point at a V-column block of a panel (its first column's 4 bytes) and step 64 bytes per
 * 4 k (int8) or per 8 k (4-bit). */

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma"), always_inline)) static inline
#define ROWS8(T)                                                                                       \
    const T *a0 = (const T *)a[0], *a1 = (const T *)a[mr > 1 ? 1 : 0], *a2 = (const T *)a[mr > 2 ? 2 : 0], \
            *a3 = (const T *)a[mr > 3 ? 3 : 0], *a4 = (const T *)a[mr > 4 ? 4 : 0],                        \
            *a5 = (const T *)a[mr > 5 ? 5 : 0], *a6 = (const T *)a[mr > 6 ? 6 : 0],                        \
            *a7 = (const T *)a[mr > 7 ? 7 : 0]
#define ACC512 \
    __m512i c00 = _mm512_setzero_si512(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, \
            c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00, c60 = c00, c61 = c00, c70 = c00, c71 = c00
#define ISTORE512(R)                                                   \
    if (mr > R) {                                                      \
        _mm512_storeu_si512((void *)(c + R * 32), c##R##0);            \
        _mm512_storeu_si512((void *)(c + R * 32 + 16), c##R##1);       \
    }

/* a8w8: a are u8 (q + 128), the weights s8. */
#define DP8(R)                                                         \
    if (mr > R) {                                                      \
        __m512i av = _mm512_set1_epi32(load32(a##R + k));              \
        c##R##0 = _mm512_dpbusd_epi32(c##R##0, av, v0);                \
        c##R##1 = _mm512_dpbusd_epi32(c##R##1, av, v1);                \
    }
VNNI void itile512_w8(const int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K,
                      int32_t *c) {
    ROWS8(uint8_t);
    ACC512;
    for (int64_t k = 0; k < K; k += 4) {
        __m512i v0 = _mm512_loadu_si512((const void *)(b0 + k * 16)), v1 = _mm512_loadu_si512((const void *)(b1 + k * 16));
        TILE_EACH8(DP8)
    }
    TILE_EACH8(ISTORE512)
}

/* a8w4: the weights' nibbles u8, a s8. */
#define DP4(R)                                                         \
    if (mr > R) {                                                      \
        __m512i al = _mm512_set1_epi32(load32(a##R + k));              \
        __m512i ah = _mm512_set1_epi32(load32(a##R + k + 4));          \
        c##R##0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c##R##0, l0, al), h0, ah); \
        c##R##1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c##R##1, l1, al), h1, ah); \
    }
VNNI void itile512_w4(const int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K,
                      int32_t *c) {
    ROWS8(int8_t);
    ACC512;
    const __m512i m = _mm512_set1_epi8(0x0F);
    for (int64_t k = 0; k < K; k += 8) {
        __m512i r0 = _mm512_loadu_si512((const void *)(b0 + k * 8)), r1 = _mm512_loadu_si512((const void *)(b1 + k * 8));
        __m512i l0 = _mm512_and_si512(r0, m), h0 = _mm512_and_si512(_mm512_srli_epi16(r0, 4), m);
        __m512i l1 = _mm512_and_si512(r1, m), h1 = _mm512_and_si512(_mm512_srli_epi16(r1, 4), m);
        TILE_EACH8(DP4)
    }
    TILE_EACH8(ISTORE512)
}

#define ROWS4(T)                                                                                       \
    const T *a0 = (const T *)a[0], *a1 = (const T *)a[mr > 1 ? 1 : 0], *a2 = (const T *)a[mr > 2 ? 2 : 0], \
            *a3 = (const T *)a[mr > 3 ? 3 : 0]
#define ACC256 \
    __m256i c00 = _mm256_setzero_si256(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00
#define EACH4(M) M(0) M(1) M(2) M(3)
#define ISTORE256(R)                                                   \
    if (mr > R) {                                                      \
        _mm256_storeu_si256((__m256i *)(c + R * 16), c##R##0);         \
        _mm256_storeu_si256((__m256i *)(c + R * 16 + 8), c##R##1);     \
    }
#define AVX2 __attribute__((always_inline)) static inline

/* a8w8, sign trick: |a| (u8) x sign(w, a) (s8) = a w, pairs summed into int16, then int32. */
#define MADD8(R)                                                                                       \
    if (mr > R) {                                                                                      \
        __m256i av = _mm256_set1_epi32(load32(a##R + k)), ab = _mm256_abs_epi8(av);                    \
        c##R##0 = _mm256_add_epi32(c##R##0, _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(v0, av)), one)); \
        c##R##1 = _mm256_add_epi32(c##R##1, _mm256_madd_epi16(_mm256_maddubs_epi16(ab, _mm256_sign_epi8(v1, av)), one)); \
    }
AVX2 void itile256_w8(const int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K,
                      int32_t *c) {
    ROWS4(int8_t);
    ACC256;
    const __m256i one = _mm256_set1_epi16(1);
    for (int64_t k = 0; k < K; k += 4) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(b0 + k * 16)), v1 = _mm256_loadu_si256((const __m256i *)(b1 + k * 16));
        EACH4(MADD8)
    }
    EACH4(ISTORE256)
}

/* a8w4: nibbles u (u8) x a (s8); the two halves' int16 pairs (<= 2 * 2 * 15 * 127) added first. */
#define MADD4(R)                                                                                       \
    if (mr > R) {                                                                                      \
        __m256i al = _mm256_set1_epi32(load32(a##R + k)), ah = _mm256_set1_epi32(load32(a##R + k + 4)); \
        c##R##0 = _mm256_add_epi32(c##R##0, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l0, al), \
                                                                                _mm256_maddubs_epi16(h0, ah)), one)); \
        c##R##1 = _mm256_add_epi32(c##R##1, _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(l1, al), \
                                                                                _mm256_maddubs_epi16(h1, ah)), one)); \
    }
AVX2 void itile256_w4(const int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K,
                      int32_t *c) {
    ROWS4(int8_t);
    ACC256;
    const __m256i one = _mm256_set1_epi16(1), m = _mm256_set1_epi8(0x0F);
    for (int64_t k = 0; k < K; k += 8) {
        __m256i r0 = _mm256_loadu_si256((const __m256i *)(b0 + k * 8)), r1 = _mm256_loadu_si256((const __m256i *)(b1 + k * 8));
        __m256i l0 = _mm256_and_si256(r0, m), h0 = _mm256_and_si256(_mm256_srli_epi16(r0, 4), m);
        __m256i l1 = _mm256_and_si256(r1, m), h1 = _mm256_and_si256(_mm256_srli_epi16(r1, 4), m);
        EACH4(MADD4)
    }
    EACH4(ISTORE256)
}

/* One function per (tile, format) with mr dispatched to a constant (the row branches fold). */
#define DISPATCH8(NAME, ATTR) TILE512_ANY(NAME##_any, NAME, void, uint8_t, int32_t, ATTR)
#define DISPATCH4(NAME)                                                                                \
    static void NAME##_any(int mr, const void *const *a, const uint8_t *b0, const uint8_t *b1, int64_t K, int32_t *c) { \
        switch (mr) {                                                                                  \
        case 4: NAME(4, a, b0, b1, K, c); break;                                                       \
        case 3: NAME(3, a, b0, b1, K, c); break;                                                       \
        case 2: NAME(2, a, b0, b1, K, c); break;                                                       \
        default: NAME(1, a, b0, b1, K, c); break;                                                      \
        }                                                                                              \
    }
#define VNNI_FN __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma")))
DISPATCH8(itile512_w8, VNNI_FN)
DISPATCH8(itile512_w4, VNNI_FN)
DISPATCH4(itile256_w8)
DISPATCH4(itile256_w4)

/* ---- float tiles (tiles.h): AVX-512 reads A's rows in place, AVX2 reads A tile-packed (element k
 * of row r at a[r][k * MR_F256]: one memory stream for all rows, as experts.c's AVX2 tile, 3-6%
 * faster there); c rows 32 floats apart, the b1 half at +16 in both ---- */

/* the AVX2 float path packs x's rows and writes FC1's output tile-packed */
F32_TILE256_ANY(ftile256_any, MR_F256, 32, 16)
