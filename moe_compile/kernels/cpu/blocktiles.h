/* Integer tiles with per-block scaling: group-wise a8w4-int's (and a8w8-int's) prefill (qgemm.c) on
 * its own integer semantics, y = sum_b (acc_b * s_x,b) * s_w,g(b), acc_b the exact int32 dot
 * product of one 32-element block of int8 activations with the block's 4-bit (8-bit) weights.
 *
 * Shapes:   one weight panel = 16 output rows (qgemm.py's _code_panels, w4-int's bytes):
 *             codes [K/8][16][4] bytes, lane j of vector c = row j's elements 8c .. 8c + 7 as
 *             nibbles u = q_w + 8 (element 8c + i at bits 4i), so the low nibbles of a lane's 4
 *             bytes are elements 8c + 0, 2, 4, 6 and the high ones 8c + 1, 3, 5, 7;
 *             scales [K/G][16] fp16 (G a multiple of 32: one scale per G / 32 blocks).
 *           mr activation rows (BlockRow, quantized by block_quantize_row): quads xq [K/4] int32,
 *             xq[2c] = q[8c + 0, 2, 4, 6] and xq[2c + 1] = q[8c + 1, 3, 5, 7] (what a lane's low
 *             and high nibbles multiply), sx [K/32] the blocks' scales, off [K/32] = -8 sum(q)
 *             (the codes are q_w + 8, so a block's sum starts at the offset and is exact).
 *           out c [mr][ldc] fp32, 16 columns a panel.
 *
 * Why: with the float panels (w4-int's tiles on q_x s_x) every weight is dequantized to fp32 or
 * bf16 and multiplied there (16 vdpbf16ps a row per block of 32 x 16 columns); here the codes are
 * multiplied as they are stored, 4 products a lane and instruction (8 vpdpbusd a row per block),
 * and each block's int32 sum is converted, scaled and summed once.  The same sums and fp32 order as
 * qdecode.c's rows16 loops (its T = 1 path on the same panels): both ISAs give the same bits.
 *
 *   AVX-512 VNNI: 16 columns a vector, up to BLOCK_MR_512 rows, the low and the high nibbles each
 *     in their own int32 accumulator (two chains a row: vpdpbusd's latency hidden at few rows).
 *   AVX2: 8 columns (half a panel vector) a call, up to BLOCK_MR_256 rows: vpmaddubsw (u8 codes x
 *     s8 activations, pairs into int16) summed in int16 over the block (|sum| <= 8 x 2 x 15 x 127 =
 *     30480 < 2^15: exact), widened once by vpmaddwd against ones.
 *
 *   8-bit weights (group-wise a8w8-int, w8-int's panels), AVX-512 VNNI only: vpdpbusd of x + 128
 *     (unsigned, broadcast) and the int8 codes, the block's 128 x column sums taken off.
 *
 * Included by qgemm.c after simd.h (PREFETCH-free: a panel is re-read from L1 / L2 by every row
 * tile of a chunk, only its first pass comes from memory).
 */
#ifndef MOE_BLOCKTILES_H
#define MOE_BLOCKTILES_H

#include <immintrin.h>
#include <stdint.h>

enum { BLOCK = 32, BLOCK_MR_512 = 8, BLOCK_MR_256 = 4 };

typedef struct {
    const int32_t *xq;  /* [K/4] quads */
    const float *sx;    /* [K/32] */
    const int32_t *off; /* [K/32] */
} BlockRow;

/* One row x [K] (K a multiple of 32) quantized per block of 32 as quant/common.py's
 * quantize_per_block_int8 does: s = max|x| / 127 (1 where that is 0; a NaN or inf makes it
 * non-finite), q = round half to even(x / s) in [-127, 127], 0 where x / s is NaN; stored as
 * BlockRow's quads, scales and offsets: for 4-bit weights (bits8 = 0) as above, for 8-bit ones
 * (bits8 = 1) the quads in order, xq[c] = q[4c .. 4c + 3] + 128 (vpdpbusd's unsigned operand),
 * and no offset (the +128 is taken off per column, block_sums8_vnni). */
static inline void block_quantize_row(const float *x, int64_t K, int bits8, int32_t *xq, float *sx, int32_t *off) {
    /* AVX2, 32 elements (one block) at a time: the same division, rounding and clamp as the
     * reference's elementwise ops, so the same codes bit for bit (test_blocktiles.py) */
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127), nan_code = _mm256_set1_epi32(INT32_MIN);
    /* 4-bit weights: each 8 bytes as their evens then their odds (what a lane's low and high nibbles
     * multiply); 8-bit: in order */
    const __m256i evens_odds = _mm256_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15,
                                                0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleave */
    for (int64_t b = 0; b < K / BLOCK; ++b) {
        const float *xb = x + b * BLOCK;
        __m256 v[4], big = _mm256_setzero_ps();
        int nan = 0;
        for (int i = 0; i < 4; ++i) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            big = _mm256_max_ps(big, _mm256_and_ps(v[i], magnitude));
            nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
        float s = nan ? __builtin_nanf("") : _mm_cvtss_f32(m4) / 127.f; /* a NaN wins and stays */
        s = s == 0.f ? 1.f : s;
        const __m256 vs = _mm256_set1_ps(s);
        __m256i q[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
            __m256i c = _mm256_cvtps_epi32(_mm256_div_ps(v[i], vs)); /* MXCSR's round half to even */
            c = _mm256_andnot_si256(_mm256_cmpeq_epi32(c, nan_code), c); /* NaN (INT_MIN) -> 0 */
            q[i] = _mm256_max_epi32(_mm256_min_epi32(c, lim), nlim);
            sum = _mm256_add_epi32(sum, q[i]);
        }
        __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        bytes = _mm256_permutevar8x32_epi32(bytes, in_order);
        bytes = bits8 ? _mm256_xor_si256(bytes, _mm256_set1_epi8((char)0x80)) : _mm256_shuffle_epi8(bytes, evens_odds);
        _mm256_storeu_si256((__m256i *)(xq + b * 8), bytes);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
        sx[b] = s, off[b] = bits8 ? 0 : -8 * _mm_cvtsi128_si32(s4);
    }
}

#define BLOCK_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))
#define BLOCK_AVX2 __attribute__((target("avx2,fma,f16c")))

/* sum[r] = block b's exact int32 sums of rows[r] against a 4-bit panel's 16 columns, db the
 * block's 4 vectors: the low and the high nibbles in two chains a row (vpdpbusd's latency hidden
 * at few rows), the block's offset -8 sum(q_x) as the low chain's start. */
BLOCK_VNNI __attribute__((always_inline)) static inline void block_sums4_vnni(const uint8_t *db, const BlockRow *rows,
                                                                              const int n, int64_t b, __m512i *sum) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512i hi_acc[BLOCK_MR_512];
    for (int r = 0; r < n; ++r) sum[r] = _mm512_set1_epi32(rows[r].off[b]), hi_acc[r] = _mm512_setzero_si512();
    for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(db + 64 * q);
        const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < n; ++r) {
            const int32_t *xb = rows[r].xq + 8 * b + 2 * q;
            sum[r] = _mm512_dpbusd_epi32(sum[r], lo, _mm512_set1_epi32(xb[0]));
            hi_acc[r] = _mm512_dpbusd_epi32(hi_acc[r], hi, _mm512_set1_epi32(xb[1]));
        }
    }
    for (int r = 0; r < n; ++r) sum[r] = _mm512_add_epi32(sum[r], hi_acc[r]);
}

/* The same for 8-bit weight panels (w8-int's bytes, group-wise a8w8-int): codes [K/4][16][4]
 * int8, lane j of vector c = row j's elements 4c .. 4c + 3; rows' quads in order, offset by 128;
 * db the block's 8 vectors.  vpdpbusd (x + 128 unsigned, broadcast) x (q_w signed) sums
 * q_x q_w + 128 sum q_w, so each block's column sums of q_w (vpdpbusd of ones, once a panel block
 * for all rows) times 128 come off: exact. */
BLOCK_VNNI __attribute__((always_inline)) static inline void block_sums8_vnni(const uint8_t *db, const BlockRow *rows,
                                                                              const int n, int64_t b, __m512i *sum) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i odd[BLOCK_MR_512], colsum = _mm512_setzero_si512();
    for (int r = 0; r < n; ++r) sum[r] = odd[r] = _mm512_setzero_si512();
    for (int q = 0; q < 8; q += 2) {
        const __m512i v0 = _mm512_loadu_si512(db + 64 * q), v1 = _mm512_loadu_si512(db + 64 * q + 64);
        colsum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(colsum, ones, v0), ones, v1);
        for (int r = 0; r < n; ++r) {
            const int32_t *xb = rows[r].xq + 8 * b + q;
            sum[r] = _mm512_dpbusd_epi32(sum[r], _mm512_set1_epi32(xb[0]), v0);
            odd[r] = _mm512_dpbusd_epi32(odd[r], _mm512_set1_epi32(xb[1]), v1);
        }
    }
    const __m512i bias = _mm512_slli_epi32(colsum, 7);
    for (int r = 0; r < n; ++r) sum[r] = _mm512_sub_epi32(_mm512_add_epi32(sum[r], odd[r]), bias);
}

/* c[r][0..15] = the 4-bit (bits8 = 0) or 8-bit (1) panel (d, s) against rows[r], r < n (bits8 and n
 * compile-time constants at each call): each block's exact sums scaled once,
 * t[r] += (sum[r] * s_x,r,b) * s_w (the 16 group scales at sg), the order qdecode's rows16 loops use. */
BLOCK_VNNI __attribute__((always_inline)) static inline void block_rows_vnni(const int bits8, const uint8_t *d,
                                                                             const uint16_t *s, int64_t K, int64_t G,
                                                                             const BlockRow *rows, const int n,
                                                                             float *c, int64_t ldc) {
    __m512 t[BLOCK_MR_512];
    for (int r = 0; r < n; ++r) t[r] = _mm512_setzero_ps();
    const uint16_t *sg = s; /* the blocks' 16 group scales, stepped every G / 32 blocks */
    for (int64_t b = 0, left = G / BLOCK; b < K / BLOCK; ++b) {
        __m512i sum[BLOCK_MR_512];
        if (bits8)
            block_sums8_vnni(d + b * 8 * 64, rows, n, b, sum); /* a block's 32 elements of 16 rows: 8 vectors */
        else
            block_sums4_vnni(d + b * 4 * 64, rows, n, b, sum); /* 4 vectors */
        const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sg));
        for (int r = 0; r < n; ++r)
            t[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum[r]), _mm512_set1_ps(rows[r].sx[b])), sw, t[r]);
        if (--left == 0) sg += 16, left = G / BLOCK;
    }
    for (int r = 0; r < n; ++r) _mm512_storeu_ps(c + r * ldc, t[r]);
}

/* c[r][0..7] = half h (columns 8h .. 8h + 7) of the panel (d, s) against rows[r], r < n. */
BLOCK_AVX2 __attribute__((always_inline)) static inline void block_rows_avx2(const uint8_t *d, const uint16_t *s,
                                                                             int64_t K, int64_t G, int h,
                                                                             const BlockRow *rows, const int n,
                                                                             float *c, int64_t ldc) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 t[BLOCK_MR_256];
    for (int r = 0; r < n; ++r) t[r] = _mm256_setzero_ps();
    const uint16_t *sg = s + 8 * h;
    for (int64_t b = 0, left = G / BLOCK; b < K / BLOCK; ++b) {
        const uint8_t *db = d + b * 4 * 64 + 32 * h;
        __m256i p[BLOCK_MR_256];
        for (int r = 0; r < n; ++r) p[r] = _mm256_setzero_si256();
        for (int q = 0; q < 4; ++q) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(db + 64 * q));
            const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int r = 0; r < n; ++r) {
                const int32_t *xb = rows[r].xq + 8 * b + 2 * q;
                const __m256i even = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xb[0]));
                p[r] = _mm256_add_epi16(p[r], _mm256_add_epi16(even, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xb[1]))));
            }
        }
        const __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg));
        for (int r = 0; r < n; ++r) {
            const __m256i acc = _mm256_add_epi32(_mm256_set1_epi32(rows[r].off[b]), _mm256_madd_epi16(p[r], ones));
            t[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(rows[r].sx[b])), sw, t[r]);
        }
        if (--left == 0) sg += 16, left = G / BLOCK;
    }
    for (int r = 0; r < n; ++r) _mm256_storeu_ps(c + r * ldc, t[r]);
}

/* The 4-bit (or 8-bit: bits8) panel against mr rows (1 .. BLOCK_MR_512), the row count
 * dispatched to a constant. */
BLOCK_VNNI static void block_panel_vnni(int bits8, const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                                        const BlockRow *rows, int mr, float *c, int64_t ldc) {
#define BLOCK_N(N)                                                             \
    case N:                                                                    \
        if (bits8)                                                             \
            block_rows_vnni(1, d, s, K, G, rows, N, c, ldc);                   \
        else                                                                   \
            block_rows_vnni(0, d, s, K, G, rows, N, c, ldc);                   \
        break;
    switch (mr) { BLOCK_N(1) BLOCK_N(2) BLOCK_N(3) BLOCK_N(4) BLOCK_N(5) BLOCK_N(6) BLOCK_N(7) BLOCK_N(8) }
#undef BLOCK_N
}

/* The panel's two halves against mr rows (1 .. BLOCK_MR_256). */
BLOCK_AVX2 static void block_panel_avx2(const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                                        const BlockRow *rows, int mr, float *c, int64_t ldc) {
#define BLOCK_N(N)                                                             \
    case N:                                                                    \
        block_rows_avx2(d, s, K, G, 0, rows, N, c, ldc);                       \
        block_rows_avx2(d, s, K, G, 1, rows, N, c + 8, ldc);                   \
        break;
    switch (mr) { BLOCK_N(1) BLOCK_N(2) BLOCK_N(3) BLOCK_N(4) }
#undef BLOCK_N
}

/* c [mr][ldc] columns 0..15 = panel (d, s) . rows: 4-bit panels on the VNNI tile (vnni) or the
 * AVX2 one, 8-bit panels (bits8) on the VNNI tile only (on AVX2 vpmaddubsw's int16 pairs of 8-bit
 * products need the sign trick and a widening a step: no faster than the fp32 tile there). */
static void block_panel(int vnni, int bits8, const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                        const BlockRow *rows, int mr, float *c, int64_t ldc) {
    if (vnni || bits8)
        block_panel_vnni(bits8, d, s, K, G, rows, mr, c, ldc);
    else
        block_panel_avx2(d, s, K, G, rows, mr, c, ldc);
}

#endif
