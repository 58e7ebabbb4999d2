/* qdecode.c's T = 1 integer loops: w4-int against one int16 row on AVX-512 VNNI (w4_dot16_vnni), and
 * the rows16 loops that read a dense or expert weight's qgemm panels, 16 rows a vector (AVX2 and
 * VNNI forms, their input preparation and dispatch).  Included by qdecode.c after qdecode_a8.c. */
/* w4-int against one input row held as int16 (quantize_i16_t4), two weight rows, AVX-512 VNNI:
 * out[w] = row_w . x.  Per 128 elements (64 bytes of each row), viewed as 32 16-bit words: word p
 * holds elements 4p .. 4p + 3, so (word >> 4j) & 15 is the code u of element 4p + j, and one
 * vpdpwssd per j sums u x q into int32 lanes that each stay inside one block of 32 (and one
 * group): 3 shifts, 3 ands, 4 vpdpwssd, one convert and two multiplies per 128 weights a row,
 * where the fp32 T8 loop takes 7 shifts, 9 permutes and 10 multiply-adds.  Exact in int32 (a lane
 * sums 8 products |u q| <= 15 x 32767 and its offset -8 sum(q): < 2^24, so its convert is exact
 * too); scaled (sum * s_x) * s_w per lane, as the a8 loops. */
A8G_VNNI static void w4_dot16_vnni(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                                   const int16_t *xq, const float *xs, const int32_t *xo, float *out) {
    const int64_t K = wt->k, G = wt->group, per = G >= 128 ? G / 128 : 0; /* chunks of 128 per group; 0: G < 128 */
    const __m512i low = _mm512_set1_epi16(15);
    __m512 t0 = _mm512_setzero_ps(), t1 = t0, sw0 = t0, sw1 = t0;
    int64_t left = 0, gi = 0; /* chunks left in group gi - 1 (no division in the loop) */
    for (int64_t c = 0; c < K / 128; ++c) {
        const int64_t k = 128 * c;
        vnni_chunk_scales(scales, c, G, per, &left, &gi, &sw0, &sw1);
        _mm_prefetch((const char *)(rows[0] + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
        _mm_prefetch((const char *)(rows[1] + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
        const __m512i x0 = _mm512_loadu_si512(xq + k), x1 = _mm512_loadu_si512(xq + k + 32);
        const __m512i x2 = _mm512_loadu_si512(xq + k + 64), x3 = _mm512_loadu_si512(xq + k + 96);
        const __m512i o = _mm512_loadu_si512(xo + 16 * c);
        const __m512 sx = _mm512_loadu_ps(xs + 16 * c);
        const __m512i v0 = _mm512_loadu_si512(rows[0] + k / 2), v1 = _mm512_loadu_si512(rows[1] + k / 2);
        __m512i a0 = _mm512_dpwssd_epi32(o, _mm512_and_si512(v0, low), x0);
        __m512i a1 = _mm512_dpwssd_epi32(o, _mm512_and_si512(v1, low), x0);
        a0 = _mm512_dpwssd_epi32(a0, _mm512_and_si512(_mm512_srli_epi16(v0, 4), low), x1);
        a1 = _mm512_dpwssd_epi32(a1, _mm512_and_si512(_mm512_srli_epi16(v1, 4), low), x1);
        a0 = _mm512_dpwssd_epi32(a0, _mm512_and_si512(_mm512_srli_epi16(v0, 8), low), x2);
        a1 = _mm512_dpwssd_epi32(a1, _mm512_and_si512(_mm512_srli_epi16(v1, 8), low), x2);
        a0 = _mm512_dpwssd_epi32(a0, _mm512_srli_epi16(v0, 12), x3);
        a1 = _mm512_dpwssd_epi32(a1, _mm512_srli_epi16(v1, 12), x3);
        t0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a0), sx), sw0, t0);
        t1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a1), sx), sw1, t1);
    }
    out[0] = _mm512_reduce_add_ps(t0), out[1] = _mm512_reduce_add_ps(t1);
}

/* Dense linears at T = 1 in w4-int and group-wise a8w4-int on AVX-512 VNNI (AVX2 forms below), on
 * the weight held 16 rows interleaved ("rows16": the weight's qgemm panels, qgemm.py's _code_panels, which the dense
 * host makes at pack time for such weights and the prefill GEMMs read too):
 *   data  [N/16, K/8, 16, 4] bytes: for each block of 16 rows and each 8 elements k0 .. k0 + 7, the
 *         4 packed bytes of those elements of each of the 16 rows (one 64-byte vector);
 *   scale [N/16, K/G, 16] fp16: each group's 16 row scales side by side.
 * Why: w4_dot16_vnni's lanes each hold 8 elements of one row, so every 128 elements of a row cost
 * an fp32 convert, two multiplies and a scale expansion besides the integer work; from memory that
 * arithmetic, not the memory, set the time (a dense T = 1 call with the scaling removed ran 0.65-0.83
 * of the time, 2-core Zen 4).  Here lane r is row r of the block: the int32 lane sums a whole
 * 32-element block of its row (4 vectors x 4 vpdpwssd against broadcast pairs of x), then one
 * convert, multiply and FMA scale 16 rows' block at once, and each thread reads one stream.
 * w4-int's activations are quantize_i16's (int16 per block of 32, the same values as
 * w4_dot16_vnni's), a8w4-int's quantize_int8_blocks' (the format's int8 per block of 32, vpdpbusd 4
 * products a lane); a lane's sum is exact in int32 and in its fp32 convert (|sum (u - 8) q| <=
 * 32 x 8 x 32767 < 2^24), scaled (sum * s_x) * s_w and summed over blocks in order: each row by one
 * thread, so the result does not depend on the thread count.  w8-int has rows16 loops of its own
 * (rows16_w8_rows_vnni: its int16 activations as two bytes; rows16_w8_rows_avx2). */
enum { ROWS16 = 16 };
/* The rows16 loops (rows16_loop's answer, 0 for none): w4-int's, group-wise a8w4-int's, and w8-int's
 * on AVX-512 VNNI (x as byte quads) or AVX2 (x as int16). */
enum { R16_W4 = 1, R16_A8W4, R16_W8_VNNI, R16_W8_AVX2 };

/* x (K floats, K a multiple of 32) for rows16_w4_rows_vnni: quantize_i16's blocks, as int32 pairs
 * xp[4 c + j] = (q[8 c + j], q[8 c + 4 + j]) (the two elements a 16-bit word's nibble j holds in an
 * int32 lane of 8 elements), each block's scale sx and offset off = -8 sum(q) (the codes are
 * u = q_w + 8, so the offset starts the block's sum). */
static void rows16_prepare(const float *x, int64_t K, int16_t *q, int32_t *xp, float *sx, int32_t *off) {
    quantize_i16(x, K, 0, q, sx);
    for (int64_t b = 0; b < K; b += I16_BLOCK) {
        int32_t sum = 0;
        for (int i = 0; i < I16_BLOCK; ++i) sum += q[b + i];
        off[b / I16_BLOCK] = -8 * sum;
    }
    for (int64_t c = 0; c < K / 8; ++c)
        for (int j = 0; j < 4; ++j)
            xp[4 * c + j] = (int32_t)(uint16_t)q[8 * c + j] | (int32_t)((uint32_t)(uint16_t)q[8 * c + 4 + j] << 16);
}

/* x (K floats) for rows16_a8_rows_vnni: the format's int8 blocks (quantize_int8_blocks, in order) as
 * int32 quads, xq[2 c] = q[8 c + 0, 2, 4, 6] and xq[2 c + 1] = q[8 c + 1, 3, 5, 7] (the elements
 * the low and the high nibbles of an int32 lane's 4 bytes hold), each block's scale sx[4 b] and
 * offset off[4 b] (quantize_int8_blocks' lane 0 of the block). */
static void rows16_a8_prepare(const float *x, int64_t K, int8_t *q, int32_t *xq, float *sx, int32_t *off) {
    const qweight_t in_order = {.fmt = FMT_A8W4G, .k = K, .pairing = 0};
    quantize_int8_blocks(&in_order, x, q, sx, off);
    for (int64_t c = 0; c < K / 8; ++c)
        for (int h = 0; h < 2; ++h) {
            uint32_t quad = 0;
            for (int i = 0; i < 4; ++i) quad |= (uint32_t)(uint8_t)q[8 * c + 2 * i + h] << (8 * i);
            xq[2 * c + h] = (int32_t)quad;
        }
}

/* x (K floats) for rows16_w8_rows_vnni: quantize_i16's blocks in order, each int16 q split into its
 * low byte l (0..255) and its high byte h (-128..127), q = 256 h + l exactly, as int32 quads
 * xq[2 j] = l of elements 4 j .. 4 j + 3 and xq[2 j + 1] = their h; each block's scale sx and offset
 * off = -32768 sum(h) (the loop multiplies h by w + 128, the weight's sign bit flipped to make it
 * unsigned for vpdpbusd: 256 x 128 sum(h) too many). */
static void rows16_w8_prepare(const float *x, int64_t K, int16_t *q, int32_t *xq, float *sx, int32_t *off) {
    quantize_i16(x, K, 0, q, sx);
    for (int64_t b = 0; b < K; b += I16_BLOCK) {
        int32_t high = 0;
        for (int i = 0; i < I16_BLOCK; ++i) high += q[b + i] >> 8; /* arithmetic: the signed high byte */
        off[b / I16_BLOCK] = -32768 * high;
    }
    for (int64_t j = 0; j < K / 4; ++j) {
        uint32_t low = 0, high = 0;
        for (int i = 0; i < 4; ++i) {
            const uint16_t v = (uint16_t)q[4 * j + i];
            low |= (uint32_t)(v & 255) << (8 * i), high |= (uint32_t)(v >> 8) << (8 * i);
        }
        xq[2 * j] = (int32_t)low, xq[2 * j + 1] = (int32_t)high;
    }
}

/* The rows16 loops on AVX2 (no VNNI): the same panels, the 16 rows as two halves of 8 (each
 * 64-byte vector's first and last 32 bytes), the same exact int32 block sums, converted, scaled
 * and summed in the same order, so the results are the VNNI loops' bit for bit.  Why: on AVX2 the
 * row loops spend ~11 vector operations a row per 64 weights (a8w4-int; more for w4-int), with a
 * scale expansion and a horizontal sum per row; here 8 rows share each broadcast of x and each
 * block's convert, multiply and FMA.  a8w4-int: vpmaddubsw (u8 codes x s8 x, pairs into int16)
 * summed in int16 over the block's 8 products a lane (|sum| <= 8 x 2 x 15 x 127 = 30480 < 2^15:
 * exact), then one vpmaddwd by ones into the row's int32 lane.  w4-int: vpmaddwd of each nibble's
 * words against the broadcast int16 pairs, as vpdpwssd without the fused add.
 * The loops take 1 .. ROWS16_MULTI rows at once (a lone slot, a dense row, or several slots of one
 * expert: the AVX2 chunk RMAX_2, the first 4 of an AVX-512 one), each panel vector unpacked once for all of them; each row's sums
 * and fp32 order are the same whatever n.  Why several: the row loops that took such chunks
 * dequantize every 4-bit weight to fp32 (w4-int) or sum one row pair at a time (a8w4-int), and on
 * AVX2 that cost more than n rows' integer products.  One-process A/B, 2 threads, 64 MiB read
 * before each call, 2-core Zen 3, a MoE layer at T = 2 / 4 (random routing), of the time before:
 * w4-int 0.62-0.89 / 0.52-0.74, a8w4-int 0.91-0.97 / 0.71-0.89 (Mixtral-like, fine-grained, Qwen3
 * shapes).  The VNNI loops below take the same chunks: there a8w4-int's row loops were integer
 * too, yet the panels' one convert / multiply / FMA per 16 rows won at T = 4 as well (same A/B, 2-core
 * Zen 4, Mixtral-like / fine-grained / Qwen3: w4-int 0.77-0.85 of the time, a8w4-int 0.93-0.95;
 * T = 2 0.86-0.99 / 0.97-1.04). */
enum { ROWS16_MULTI = 4 };

/* The inputs of n rows (each as rows16_input prepares it) and their 16-float outputs. */
typedef struct {
    const int32_t *xq[ROWS16_MULTI];
    const float *sx[ROWS16_MULTI];
    const int32_t *off[ROWS16_MULTI];
    float *out[ROWS16_MULTI];
} rows16_set_t;

/* One nibble's words of a half-panel vector against a broadcast int16 pair, into acc. */
static inline __m256i rows16_w4_nibble(__m256i acc, __m256i words, int32_t pair) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(words, _mm256_set1_epi32(pair)));
}

ALWAYS_INLINE void rows16_a8_rows_avx2(const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                                       const rows16_set_t *in, const int n) {
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    __m256 t[ROWS16_MULTI][2];
    for (int r = 0; r < n; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
    const uint16_t *sg = s; /* as in rows16_w4_rows_vnni */
    for (int64_t g = 0, left = G / A8G_BLOCK; g < K / A8G_BLOCK; ++g) {
        const uint8_t *dg = d + g * 4 * 64;
        __m256i p[ROWS16_MULTI][2];
        for (int r = 0; r < n; ++r) p[r][0] = p[r][1] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            _mm_prefetch((const char *)(dg + 64 * c + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(dg + 64 * c));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(dg + 64 * c + 32));
            const __m256i l0 = _mm256_and_si256(v0, low), h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
            const __m256i l1 = _mm256_and_si256(v1, low), h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
            for (int r = 0; r < n; ++r) {
                const int32_t *xg = in->xq[r] + 8 * g;
                const __m256i xe = _mm256_set1_epi32(xg[2 * c]), xo = _mm256_set1_epi32(xg[2 * c + 1]);
                p[r][0] = _mm256_add_epi16(p[r][0], _mm256_add_epi16(_mm256_maddubs_epi16(l0, xe), _mm256_maddubs_epi16(h0, xo)));
                p[r][1] = _mm256_add_epi16(p[r][1], _mm256_add_epi16(_mm256_maddubs_epi16(l1, xe), _mm256_maddubs_epi16(h1, xo)));
            }
        }
        const __m256 sw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg));
        const __m256 sw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 8)));
        for (int r = 0; r < n; ++r) {
            const __m256i o = _mm256_set1_epi32(in->off[r][4 * g]);
            const __m256 sxg = _mm256_set1_ps(in->sx[r][4 * g]);
            const __m256i a0 = _mm256_add_epi32(o, _mm256_madd_epi16(p[r][0], ones));
            const __m256i a1 = _mm256_add_epi32(o, _mm256_madd_epi16(p[r][1], ones));
            t[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a0), sxg), sw0, t[r][0]);
            t[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a1), sxg), sw1, t[r][1]);
        }
        if (--left == 0) sg += ROWS16, left = G / A8G_BLOCK;
    }
    for (int r = 0; r < n; ++r) _mm256_storeu_ps(in->out[r], t[r][0]), _mm256_storeu_ps(in->out[r] + 8, t[r][1]);
}

ALWAYS_INLINE void rows16_w4_rows_avx2(const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                                       const rows16_set_t *in, const int n) {
    const __m256i low = _mm256_set1_epi16(15);
    __m256 t[ROWS16_MULTI][2];
    for (int r = 0; r < n; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
    const uint16_t *sg = s; /* as in rows16_w4_rows_vnni */
    for (int64_t g = 0, left = G / I16_BLOCK; g < K / I16_BLOCK; ++g) {
        const uint8_t *dg = d + g * 4 * 64;
        __m256i a[ROWS16_MULTI][2];
        for (int r = 0; r < n; ++r) a[r][0] = a[r][1] = _mm256_set1_epi32(in->off[r][g]);
        /* not unrolled: unrolled, gcc computed the 4 vectors' products first and spilled them
         * (in cache, one thread, 2-core Zen 3: 0.83-0.86 of the unrolled loop's time at one row;
         * a8w4-int's loop above has half the products and was 10% slower so) */
#pragma GCC unroll 1
        for (int c = 0; c < 4; ++c) {
            _mm_prefetch((const char *)(dg + 64 * c + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
            const __m256i v0 = _mm256_loadu_si256((const __m256i *)(dg + 64 * c));
            const __m256i v1 = _mm256_loadu_si256((const __m256i *)(dg + 64 * c + 32));
            for (int j = 0; j < 4; ++j) {
                const __m256i w0 = j == 3 ? _mm256_srli_epi16(v0, 12) : _mm256_and_si256(_mm256_srli_epi16(v0, 4 * j), low);
                const __m256i w1 = j == 3 ? _mm256_srli_epi16(v1, 12) : _mm256_and_si256(_mm256_srli_epi16(v1, 4 * j), low);
                for (int r = 0; r < n; ++r) {
                    const int32_t pair = in->xq[r][16 * g + 4 * c + j];
                    a[r][0] = rows16_w4_nibble(a[r][0], w0, pair), a[r][1] = rows16_w4_nibble(a[r][1], w1, pair);
                }
            }
        }
        const __m256 sw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg));
        const __m256 sw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 8)));
        for (int r = 0; r < n; ++r) {
            const __m256 sxg = _mm256_set1_ps(in->sx[r][g]);
            t[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a[r][0]), sxg), sw0, t[r][0]);
            t[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a[r][1]), sxg), sw1, t[r][1]);
        }
        if (--left == 0) sg += ROWS16, left = G / I16_BLOCK;
    }
    for (int r = 0; r < n; ++r) _mm256_storeu_ps(in->out[r], t[r][0]), _mm256_storeu_ps(in->out[r] + 8, t[r][1]);
}

/* w8-int on AVX2 (R16_W8_AVX2): each 16 bytes of a panel vector (4 rows x 4 elements) sign-extended to
 * int16 and multiplied by x's 4 int16 elements (quantize_i16's, in order; broadcast) with vpmaddwd:
 * two exact int32 lanes a row, added across the block, paired up at its end (vphaddd, then a lane
 * permute into row order).  Each row's block sum is the integer w . q the VNNI loop (R16_W8_VNNI) sums, and
 * its convert, multiply and FMA are the same, so the two give the same bits.  Why not the VNNI
 * loop's byte split: vpmaddubsw adds its u8 x s8 pairs in int16, and 2 x 255 x 128 overflows it. */
ALWAYS_INLINE void rows16_w8_rows_avx2(const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                                       const rows16_set_t *in, const int n) {
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    __m256 t[ROWS16_MULTI][2];
    for (int r = 0; r < n; ++r) t[r][0] = t[r][1] = _mm256_setzero_ps();
    const uint16_t *sg = s; /* as in rows16_w4_rows_vnni */
    for (int64_t g = 0, left = G / I16_BLOCK; g < K / I16_BLOCK; ++g) {
        const uint8_t *dg = d + g * 8 * 64;
        __m256i acc[ROWS16_MULTI][4]; /* rows 0-3, 4-7, 8-11, 12-15: two lanes a row */
        for (int r = 0; r < n; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
            _mm_prefetch((const char *)(dg + 64 * c + PREFETCH_ELEMENTS), PREFETCH_HINT);
            __m256i x4[ROWS16_MULTI];
            for (int r = 0; r < n; ++r) {
                int64_t four; /* x's elements 32 g + 4 c .. + 3, int16 */
                memcpy(&four, (const int16_t *)in->xq[r] + 32 * g + 4 * c, 8);
                x4[r] = _mm256_set1_epi64x(four);
            }
            for (int q = 0; q < 4; ++q) {
                const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(dg + 64 * c + 16 * q)));
                for (int r = 0; r < n; ++r) acc[r][q] = _mm256_add_epi32(acc[r][q], _mm256_madd_epi16(w, x4[r]));
            }
        }
        const __m256 sw0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg));
        const __m256 sw1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 8)));
        for (int r = 0; r < n; ++r) {
            const __m256 sxg = _mm256_set1_ps(in->sx[r][g]);
            const __m256i a0 = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(acc[r][0], acc[r][1]), order);
            const __m256i a1 = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(acc[r][2], acc[r][3]), order);
            t[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a0), sxg), sw0, t[r][0]);
            t[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a1), sxg), sw1, t[r][1]);
        }
        if (--left == 0) sg += ROWS16, left = G / I16_BLOCK;
    }
    for (int r = 0; r < n; ++r) _mm256_storeu_ps(in->out[r], t[r][0]), _mm256_storeu_ps(in->out[r] + 8, t[r][1]);
}

/* Rows 16 b .. 16 b + 15 of one panel block (d, s) against the n rows of `in`, the AVX2 loops. */
static void rows16_rows_avx2(int loop, const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                             const rows16_set_t *in, int n) {
#define ROWS16_N(N)                                                                                                  \
    case N:                                                                                                          \
        if (loop == R16_W4)                                                                                          \
            rows16_w4_rows_avx2(d, s, K, G, in, N); /* called, not through a pointer: inlined for each N */       \
        else if (loop == R16_A8W4)                                                                                   \
            rows16_a8_rows_avx2(d, s, K, G, in, N);                                                                 \
        else                                                                                                         \
            rows16_w8_rows_avx2(d, s, K, G, in, N);                                                                 \
        break;
    switch (n) { ROWS16_N(1) ROWS16_N(2) ROWS16_N(3) ROWS16_N(4) }
#undef ROWS16_N
}

/* The rows16 loops on AVX-512 VNNI: a 64-byte vector is one element group of the block's 16 rows,
 * lane r row r.  w4-int: each of a vector's 4 nibbles of every word against the row's broadcast
 * int16 pair, vpdpwssd, the lower three masked where they are (u times 1, 16, 256: three ands
 * and one shift a vector where shifting each down took six; their chains shifted back once a
 * block; in cache 0.93-1.0 of the time, from memory level, 2-core Xeon); a8w4-int: the low and the high nibbles of every byte against
 * broadcast int8 quads of x, vpdpbusd.  Four chains a row (one per vector of the block) keep the
 * dot-product latency hidden at one row.  As on AVX2 the loops take 1 .. ROWS16_MULTI rows, each
 * vector unpacked once for all of them, each row's sums and fp32 order whatever n. */
A8G_VNNI ALWAYS_INLINE void rows16_w4_rows_vnni(const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                                                const rows16_set_t *in, const int n) {
    /* nibble j of every word, masked in place: u, 16 u, 256 u; the top one shifted down (masked in
     * place it would be a negative int16 for u >= 8).  Each scaled chain's lanes sum 8 products of
     * at most 15 x 256 x 32767 a block (< 2^30), a multiple of 16 (256) shifted back exactly. */
    const __m512i m0 = _mm512_set1_epi16(0x000F), m1 = _mm512_set1_epi16(0x00F0), m2 = _mm512_set1_epi16(0x0F00);
    __m512 t[ROWS16_MULTI];
    for (int r = 0; r < n; ++r) t[r] = _mm512_setzero_ps();
    const uint16_t *sg = s; /* the block's 16 group scales, stepped every G / 32 blocks: no division a block */
    for (int64_t g = 0, left = G / I16_BLOCK; g < K / I16_BLOCK; ++g) {
        const uint8_t *dg = d + g * 4 * 64; /* a block's 32 elements: 4 vectors */
        __m512i acc[ROWS16_MULTI][4]; /* per row, nibbles 0, 3 (unscaled), 1 (x 16), 2 (x 256): four chains */
        for (int r = 0; r < n; ++r)
            acc[r][0] = _mm512_set1_epi32(in->off[r][g]), acc[r][1] = acc[r][2] = acc[r][3] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
            _mm_prefetch((const char *)(dg + 64 * c + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
            const __m512i v = _mm512_loadu_si512(dg + 64 * c);
            const __m512i w0 = _mm512_and_si512(v, m0), w1 = _mm512_and_si512(v, m1);
            const __m512i w2 = _mm512_and_si512(v, m2), w3 = _mm512_srli_epi16(v, 12);
            for (int r = 0; r < n; ++r) {
                const int32_t *xg = in->xq[r] + 16 * g + 4 * c;
                acc[r][0] = _mm512_dpwssd_epi32(acc[r][0], w0, _mm512_set1_epi32(xg[0]));
                acc[r][1] = _mm512_dpwssd_epi32(acc[r][1], w3, _mm512_set1_epi32(xg[3]));
                acc[r][2] = _mm512_dpwssd_epi32(acc[r][2], w1, _mm512_set1_epi32(xg[1]));
                acc[r][3] = _mm512_dpwssd_epi32(acc[r][3], w2, _mm512_set1_epi32(xg[2]));
            }
        }
        const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sg));
        for (int r = 0; r < n; ++r) {
            const __m512i scaled = _mm512_add_epi32(_mm512_srai_epi32(acc[r][2], 4), _mm512_srai_epi32(acc[r][3], 8));
            const __m512i a = _mm512_add_epi32(_mm512_add_epi32(acc[r][0], acc[r][1]), scaled);
            t[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(in->sx[r][g])), sw, t[r]);
        }
        if (--left == 0) sg += ROWS16, left = G / I16_BLOCK;
    }
    for (int r = 0; r < n; ++r) _mm512_storeu_ps(in->out[r], t[r]);
}

A8G_VNNI ALWAYS_INLINE void rows16_a8_rows_vnni(const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                                                const rows16_set_t *in, const int n) {
    const __m512i low = _mm512_set1_epi8(15);
    __m512 t[ROWS16_MULTI];
    for (int r = 0; r < n; ++r) t[r] = _mm512_setzero_ps();
    const uint16_t *sg = s; /* as in rows16_w4_rows_vnni */
    for (int64_t g = 0, left = G / A8G_BLOCK; g < K / A8G_BLOCK; ++g) {
        const uint8_t *dg = d + g * 4 * 64;
        __m512i acc[ROWS16_MULTI][4];
        for (int c = 0; c < 4; ++c) {
            _mm_prefetch((const char *)(dg + 64 * c + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
            const __m512i v = _mm512_loadu_si512(dg + 64 * c);
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int r = 0; r < n; ++r) {
                const int32_t *xg = in->xq[r] + 8 * g + 2 * c;
                __m512i a = c ? _mm512_setzero_si512() : _mm512_set1_epi32(in->off[r][4 * g]);
                a = _mm512_dpbusd_epi32(a, lo, _mm512_set1_epi32(xg[0]));
                acc[r][c] = _mm512_dpbusd_epi32(a, hi, _mm512_set1_epi32(xg[1]));
            }
        }
        const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sg));
        for (int r = 0; r < n; ++r) {
            const __m512i a = _mm512_add_epi32(_mm512_add_epi32(acc[r][0], acc[r][1]), _mm512_add_epi32(acc[r][2], acc[r][3]));
            t[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(in->sx[r][4 * g])), sw, t[r]);
        }
        if (--left == 0) sg += ROWS16, left = G / A8G_BLOCK;
    }
    for (int r = 0; r < n; ++r) _mm512_storeu_ps(in->out[r], t[r]);
}

/* w8-int (R16_W8_VNNI): a 64-byte vector is 4 consecutive elements of the block's 16 rows, int8.  Each
 * int16 element of x is its low byte l (unsigned) and high byte h (signed), so a row's block sum
 * sum w q = 256 sum w h + sum w l is two vpdpbusd a vector: l (u8) against w (s8), and w + 128 (u8:
 * the sign bit flipped) against h (s8), whose 128 sum h the prepared offset takes off.  Both sums
 * are exact int32 (|sum w l| <= 32 x 127 x 255, |sum (w + 128) h| <= 32 x 255 x 128; the combined
 * block sum is w . q itself, |.| <= 32 x 127 x 32767 < 2^27), converted and scaled as the 4-bit
 * loops (its convert rounds where |sum| > 2^24).  Why: the row loop sign-extends every 32 weights
 * and converts and scales every block of every row (~41 G weights/s on two cores in cache, 2-core
 * Xeon); here 64 weights cost one xor and two vpdpbusd, and a block's scaling is shared by 16 rows. */
A8G_VNNI ALWAYS_INLINE void rows16_w8_rows_vnni(const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                                                const rows16_set_t *in, const int n) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 t[ROWS16_MULTI];
    for (int r = 0; r < n; ++r) t[r] = _mm512_setzero_ps();
    const uint16_t *sg = s; /* as in rows16_w4_rows_vnni */
    for (int64_t g = 0, left = G / I16_BLOCK; g < K / I16_BLOCK; ++g) {
        const uint8_t *dg = d + g * 8 * 64; /* a block's 32 elements: 8 vectors */
        __m512i lo[ROWS16_MULTI][2], hi[ROWS16_MULTI][2]; /* two chains each, for the latency at one row */
        for (int r = 0; r < n; ++r) lo[r][0] = _mm512_set1_epi32(in->off[r][g]), lo[r][1] = hi[r][0] = hi[r][1] = _mm512_setzero_si512();
        for (int c = 0; c < 8; ++c) {
            _mm_prefetch((const char *)(dg + 64 * c + PREFETCH_ELEMENTS), PREFETCH_HINT);
            const __m512i v = _mm512_loadu_si512(dg + 64 * c), u = _mm512_xor_si512(v, flip);
            for (int r = 0; r < n; ++r) {
                const int32_t *xg = in->xq[r] + 16 * g + 2 * c;
                lo[r][c & 1] = _mm512_dpbusd_epi32(lo[r][c & 1], _mm512_set1_epi32(xg[0]), v);
                hi[r][c & 1] = _mm512_dpbusd_epi32(hi[r][c & 1], u, _mm512_set1_epi32(xg[1]));
            }
        }
        const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sg));
        for (int r = 0; r < n; ++r) {
            const __m512i h = _mm512_slli_epi32(_mm512_add_epi32(hi[r][0], hi[r][1]), 8);
            const __m512i a = _mm512_add_epi32(h, _mm512_add_epi32(lo[r][0], lo[r][1]));
            t[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(in->sx[r][g])), sw, t[r]);
        }
        if (--left == 0) sg += ROWS16, left = G / I16_BLOCK;
    }
    for (int r = 0; r < n; ++r) _mm512_storeu_ps(in->out[r], t[r]);
}

/* As rows16_rows_avx2, on the VNNI loops. */
A8G_VNNI static void rows16_rows_vnni(int loop, const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                                      const rows16_set_t *in, int n) {
#define ROWS16_N(N)                                                                                                  \
    case N:                                                                                                          \
        if (loop == R16_W4)                                                                                          \
            rows16_w4_rows_vnni(d, s, K, G, in, N);                                                                 \
        else if (loop == R16_A8W4)                                                                                   \
            rows16_a8_rows_vnni(d, s, K, G, in, N);                                                                 \
        else                                                                                                         \
            rows16_w8_rows_vnni(d, s, K, G, in, N);                                                                 \
        break;
    switch (n) { ROWS16_N(1) ROWS16_N(2) ROWS16_N(3) ROWS16_N(4) }
#undef ROWS16_N
}

/* Rows 16 b .. 16 b + 15 of one panel block (d, s) against the n rows of `in`, on the VNNI loops or
 * the AVX2 ones (rows prepared by rows16_input for the same loop). */
static void rows16_rows(int loop, int vnni, const uint8_t *d, const uint16_t *s, int64_t K, int64_t G,
                        const rows16_set_t *in, int n) {
    (vnni ? rows16_rows_vnni : rows16_rows_avx2)(loop, d, s, K, G, in, n);
}

/* Bytes of one weight row in loop `loop`'s panels: int8 for w8-int's loops, else 4-bit. */
static int64_t rows16_row_bytes(int loop, int64_t K) { return loop == R16_W8_VNNI || loop == R16_W8_AVX2 ? K : K / 2; }

/* y[16 b .. 16 b + 15] for row blocks [b0, b1) of a rows16 weight (data, scale: its panels) and one
 * prepared row. */
static void rows16_dot(int loop, int vnni, const uint8_t *data, const uint16_t *scale, int64_t K, int64_t G,
                       const int32_t *xq, const float *sx, const int32_t *off, int64_t b0, int64_t b1, float *y) {
    rows16_set_t one = {.xq = {xq}, .sx = {sx}, .off = {off}};
    for (int64_t b = b0; b < b1; ++b) {
        one.out[0] = y + ROWS16 * b;
        rows16_rows(loop, vnni, data + b * ROWS16 * rows16_row_bytes(loop, K), scale + b * (K / G) * ROWS16, K, G, &one, 1);
    }
}

static int i16_form(int64_t fmt, int64_t k, int64_t group, int64_t isa);

/* Whether the rows16 loops run on the AVX-512 VNNI forms at this ISA (else the AVX2 forms). */
static int rows16_vnni(int64_t isa) { return isa == ISA_AVX512 && a8g_vnni(); }

/* Which rows16 loop (R16_*) runs a dense weight at T = 1 on this ISA, 0 none (the row loops on the
 * canonical pack).  The VNNI loops' shape rules (K a multiple of 128, G 32, 64 or a multiple of 128) on every
 * ISA, so which weights have panels does not depend on the CPU; w4-int and w8-int only where their
 * activations go as int16 blocks at all (not under MOE_COMPILE_QDECODE_I16=0, the exact fp32
 * loops). */
static int rows16_loop(const qweight_t *w, int64_t isa) {
    const int64_t G = w->group;
    if (w->n % ROWS16 || w->k % 128 || !(G == 32 || G == 64 || (G > 0 && G % 128 == 0))) return 0;
    if (w->fmt == FMT_W4)
        return (rows16_vnni(isa) ? i16_form(w->fmt, w->k, G, isa) == I16_T4 : i16_form(w->fmt, w->k, G, ISA_AVX2) != 0) ? R16_W4 : 0;
    if (w->fmt == FMT_W8) return i16_form(w->fmt, w->k, G, isa) ? (rows16_vnni(isa) ? R16_W8_VNNI : R16_W8_AVX2) : 0;
    return w->fmt == FMT_A8W4G ? R16_A8W4 : 0;
}

/* rows16_loop of a weight [.., n, k] in format fmt at this ISA, for qdecode.py (rows16_runs: which
 * weights get panels and hand them over); 0 for an ISA this CPU lacks. */
int64_t moe_qdecode_best_isa(void);

int64_t moe_qdecode_rows16_loop(int64_t fmt, int64_t n, int64_t k, int64_t group, int64_t isa) {
    const qweight_t w = {.fmt = fmt, .n = n, .k = k, .group = group};
    return (isa == ISA_AVX2 || isa == ISA_AVX512) && isa <= moe_qdecode_best_isa() ? rows16_loop(&w, isa) : 0;
}

/* One input row (K floats) as the rows16 loop `loop` reads it: xq [K/2] int32 (w4-int's pairs,
 * w8-int's low and high byte quads or its int16 elements; a8w4-int's quads fill K/4), sx and off
 * [K/4] (per block; a8w4-int per lane; R16_W8_AVX2 has no offsets); tmp K int16s. */
static void rows16_input(int loop, const float *x, int64_t K, void *tmp, int32_t *xq, float *sx, int32_t *off) {
    if (loop == R16_W4)
        rows16_prepare(x, K, tmp, xq, sx, off);
    else if (loop == R16_A8W4)
        rows16_a8_prepare(x, K, tmp, xq, sx, off);
    else if (loop == R16_W8_VNNI)
        rows16_w8_prepare(x, K, tmp, xq, sx, off);
    else /* R16_W8_AVX2: quantize_i16's blocks as they are, in order */
        quantize_i16(x, K, 0, (int16_t *)xq, sx);
}

/* y [N] = x [K] . W^T on a rows16 weight (loop: rows16_loop's), the blocks split over nparts
 * threads.  Returns 0, -1 without memory. */
static int rows16_linear(int loop, int vnni, const float *x, int64_t K, int64_t N, const uint8_t *data,
                         const uint8_t *scale, int64_t G, float *y, int64_t nparts) {
    /* int16 (w4, w8) or int8 (a8w4) x, its pairs or quads, per-block (a8: per-lane) scales and offsets */
    void *q = aligned_alloc(64, (size_t)(K * 2 + 63) / 64 * 64);
    int32_t *xp = aligned_alloc(64, (size_t)(K * 2 + 63) / 64 * 64), *off = malloc((size_t)(K / A8G_ROW_DIV + 8) * 4);
    float *sx = malloc((size_t)(K / A8G_ROW_DIV + 8) * 4);
    int status = -1;
    if (q && xp && off && sx) {
        rows16_input(loop, x, K, q, xp, sx, off);
#pragma omp parallel num_threads(nparts)
        {
            const int64_t blocks = N / ROWS16, p = omp_get_thread_num(), P = omp_get_num_threads();
            rows16_dot(loop, vnni, data, (const uint16_t *)scale, K, G, xp, sx, off, blocks * p / P, blocks * (p + 1) / P, y);
        }
        status = 0;
    }
    free(q), free(xp), free(off), free(sx);
    return status;
}

/* An expert role's rows16 panels (qgemm's panels of all E experts: [E, N/16, K'/4, 16, 4] bytes, K'
 * bytes a row, and [E, N/16, K/G, 16] fp16, qdecode.py passes them where rows16_runs holds), read at one slot
 * where rows16_loop takes the role and `aligned` (FC1: F a multiple of 16, so the up rows start a
 * panel).  Why: a slot's 4- or 8-bit FC1 / FC2 is a T = 1 dense linear per expert, arithmetic-bound on
 * the row loops as the dense ones were (dense-layers.md, "4- and 8-bit at T = 1"). */
static void rows16_attach(qweight_t *w, int64_t data, int64_t scale, int64_t isa, int aligned) {
    w->rows16 = data && scale && aligned ? rows16_loop(w, isa) : 0;
    w->r16vnni = rows16_vnni(isa);
    w->r16data = (const uint8_t *)(intptr_t)data, w->r16scale = (const uint8_t *)(intptr_t)scale;
}

/* Whether a chunk of n slots of one expert reads role w's panels: 1 .. ROWS16_MULTI slots, where
 * the role has them. */
static int rows16_chunk(const qweight_t *w, int64_t n) { return w->rows16 && n <= ROWS16_MULTI; }

/* Rows 16 b .. 16 b + 15 of expert e's role w against the n rows of `in` (rows16_chunk). */
static void rows16_expert_rows(const qweight_t *w, int64_t e, int64_t b, const rows16_set_t *in, int n) {
    const int64_t K = w->k, G = w->group, row = e * w->n + b * ROWS16;
    rows16_rows((int)w->rows16, (int)w->r16vnni, w->r16data + row * rows16_row_bytes((int)w->rows16, K), (const uint16_t *)w->r16scale + row * (K / G),
                K, G, in, n);
}
