/* qdecode.c's activation quantizers, run once per row before a call's parallel region: a row as
 * int16 blocks (quantize_i16 and its forms, for the one-row 4- and 8-bit loops) and as int8 per row
 * (quantize_int8_row, the a8 formats).  Included by qdecode.c after qdecode.h. */
/* 4- and 8-bit weights against one input row on AVX2 (the T = 1 step of most users' CPUs):
 * dequantizing a code to fp32 and an FMA per weight and token keep AVX2's vector ports busy well
 * below the memory's speed (~20 G 4-bit weights/s a core).  Instead that row is held as 16-bit integers per block
 * of I16_BLOCK elements (q = round-half-even(x / s), s = max|x| / 32767 of the block: every element
 * within 2^-16 of its block's largest), the nibbles map to small integers by a byte shuffle, and
 * vpmaddwd sums weight x activation pairs exactly in int32; a block's sum is scaled once by
 * s_w s_x.  1.7-1.8x the fp32 loop's weights per second in one-core A/B, error from the fp32
 * activations' result 1.6e-5 of the output's scale (Gaussian x, K = 1024).  A non-finite element
 * makes its block's scale non-finite, so NaN and inf still reach the output. */
enum { I16_BLOCK = 32, I16_MAX = 32767, I16_PAIRED = 1, I16_NATURAL = 2, I16_T4 = 3 };
/* Scales and offsets of an int16 row are stored one per I16_LANE elements at most (T4 keeps one
 * per int32 lane of its loop, the other forms one per block), so rows are I16_LANE apart. */
enum { I16_LANE = 8 };

/* Index of the scale (and T4 offset) of element c of row r of a row_len-wide int16 input. */
static inline int64_t i16_scale_at(int64_t form, int64_t row_len, int64_t r, int64_t c) {
    return r * (row_len / I16_LANE) + c / (form == I16_T4 ? I16_LANE : I16_BLOCK);
}

/* Where element i of a row is stored when each block of `block` elements is held paired (its even
 * elements, then its odd ones: the order the nibbles of block / 2 packed bytes come in); block 0:
 * in order. */
static inline int64_t paired_index(int64_t i, int64_t block) {
    return block ? i - i % block + (i & 1) * (block / 2) + i % block / 2 : i;
}

static int32_t hsum_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
}

/* The activation quantizers below run once per row before a call's parallel region (on one
 * thread), so they are vectorised: a scalar divide and convert per element cost ~10 us per
 * 2048-wide row, more than a small weight's whole dot product (the router's, k/v's).  Each keeps
 * the scalar form's arithmetic (an IEEE divide by s, MXCSR's round half to even, the same
 * clamps), so the int8 / int16 values are the same bit for bit. */

/* max |x| over n floats (n a multiple of 8), NaNs left out; *nan: whether any element is NaN. */
static float absmax8(const float *x, int64_t n, int *nan) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 big = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        big = _mm256_max_ps(_mm256_andnot_ps(sign, v), big); /* a NaN in the first operand: big kept */
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    *nan = _mm256_movemask_ps(bad) != 0;
    return _mm_cvtss_f32(t);
}

/* A block's largest |x| (n a multiple of 8) as the block quantizers use it: NaN when it holds one
 * (a NaN wins and stays, as in the scalar form). */
static float block_absmax(const float *x, int64_t n) {
    int nan;
    float big = absmax8(x, n, &nan);
    return nan ? __builtin_nanf("") : big;
}

/* round_half_even(x[0..8) / s) as int32 (NaN and out of range: INT_MIN, as _mm_cvtss_si32), clamped. */
static inline __m256i quantize8(const float *x, __m256 s, __m256i lo, __m256i hi) {
    __m256i v = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x), s));
    return _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
}

/* 8 int32 in int8 range -> 8 int8 in the low 8 bytes, in order. */
static inline __m128i bytes8(__m256i v) {
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    return _mm_packs_epi16(w, w);
}

/* Store 8 int8 (low bytes of b) for elements i..i+7 of a row at q, paired per `block` (see
 * paired_index; block a multiple of 16) or, block 0, in order. */
static inline void store8_paired(int8_t *q, int64_t i, int64_t block, __m128i b) {
    if (!block) {
        _mm_storel_epi64((__m128i *)(q + i), b);
        return;
    }
    __m128i eo = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
    int32_t even = _mm_cvtsi128_si32(eo), odd = _mm_extract_epi32(eo, 1);
    int8_t *at = q + paired_index(i, block); /* element i is even: its evens' place */
    memcpy(at, &even, 4), memcpy(at + block / 2, &odd, 4);
}

/* q (I16_BLOCK int16 per block, paired or in order) and one scale per block, of n elements (whole
 * blocks).  A NaN makes its block's scale NaN, an inf infinite: both reach the output. */
static void quantize_i16(const float *x, int64_t n, int paired, int16_t *q, float *scale) {
    const __m256i lo = _mm256_set1_epi32(-I16_MAX), hi = _mm256_set1_epi32(I16_MAX);
    const __m128i split = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int64_t b = 0; b < n; b += I16_BLOCK) {
        float big = block_absmax(x + b, I16_BLOCK);
        float sc = big == 0.f ? 1.f : big / I16_MAX;
        scale[b / I16_BLOCK] = sc;
        const __m256 s = _mm256_set1_ps(sc);
        for (int j = 0; j < I16_BLOCK; j += 8) {
            __m256i v = quantize8(x + b + j, s, lo, hi);
            __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            if (!paired) {
                _mm_storeu_si128((__m128i *)(q + b + j), w);
                continue;
            }
            __m128i eo = _mm_shuffle_epi8(w, split); /* 4 evens, then 4 odds */
            _mm_storel_epi64((__m128i *)(q + b + j / 2), eo);
            _mm_storel_epi64((__m128i *)(q + b + I16_BLOCK / 2 + j / 2), _mm_unpackhi_epi64(eo, eo));
        }
    }
}

/* As quantize_i16 (the same int16 values and block scales), held for w4_dot16_vnni (n a multiple
 * of 128): each 128-element chunk as 4 vectors of 32 int16, vector j's word p element 4p + j (the
 * nibble a 16-bit view of the packed row holds at bits 4j .. 4j + 3 of word p), so int32 lane d of
 * every vector sums elements 8d .. 8d + 7 of the chunk, one block's.  Per lane: scale[d] its
 * block's scale, off[d] = -8 times the sum of those 8 q (the codes are u = q_w + 8; the offset
 * starts the lane's int32 sum, so a lane holds its 8 products alone, no large cancelling term). */
static void quantize_i16_t4(const float *x, int64_t n, int16_t *q, float *scale, int32_t *off) {
    int16_t in_order[128];
    float block_scale[128 / I16_BLOCK];
    for (int64_t c = 0; c < n; c += 128) {
        quantize_i16(x + c, 128, 0, in_order, block_scale);
        for (int p = 0; p < 32; ++p)
            for (int j = 0; j < 4; ++j) q[c + 32 * j + p] = in_order[4 * p + j];
        for (int d = 0; d < 128 / I16_LANE; ++d) {
            int32_t sum = 0;
            for (int i = 0; i < I16_LANE; ++i) sum += in_order[I16_LANE * d + i];
            scale[c / I16_LANE + d] = block_scale[d * I16_LANE / I16_BLOCK], off[c / I16_LANE + d] = -8 * sum;
        }
    }
}

/* Row x (n elements) as int16 in a role's form, its scales (and T4 offsets) from `scale` / `off`. */
static void quantize_i16_as(int64_t form, const float *x, int64_t n, int16_t *q, float *scale, int32_t *off) {
    if (form == I16_T4)
        quantize_i16_t4(x, n, q, scale, off);
    else
        quantize_i16(x, n, form == I16_PAIRED, q, scale);
}

/* quantize_per_token_int8 (quant/common.py) of one row of n floats, bit for bit: s = max|x| / 127
 * (1 for an all-zero row, or one holding NaN, as torch's where(s > 0) gives), q = clamp(
 * round_half_even(x / s), -127, 127), stored paired per `block` elements (its evens, then its odds:
 * the order the nibbles of block / 2 bytes come in; n a multiple of block) or, block 0, in order.
 * Returns s; *sum = sum of q (a8w4's offset). */
static float quantize_int8_row(const float *x, int64_t n, int64_t block, int8_t *q, int32_t *sum) {
    int nan;
    float s = absmax8(x, n, &nan) / 127.f;
    s = nan || !(s > 0.f) ? 1.f : s;
    const __m256 sv = _mm256_set1_ps(s);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    __m256i total = _mm256_setzero_si256();
    for (int64_t i = 0; i < n; i += 8) {
        __m256i v = quantize8(x + i, sv, lo, hi);
        total = _mm256_add_epi32(total, v);
        store8_paired(q, i, block, bytes8(v));
    }
    *sum = hsum_epi32(total);
    return s;
}
