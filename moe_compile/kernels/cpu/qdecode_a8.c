/* qdecode.c's a8w8-int / a8w4-int dot loops: per-channel int8 dots (int8_dot, a8w4_dot64) and the
 * group-wise forms (a8g_*: block quantizer, AVX2 and AVX-512 VNNI dots).  Included by qdecode.c
 * after qdecode_quantize.c. */
/* acc[w][r] = q_w . q_x[r] in int32, exact, for two weight rows of an a8 format and n int8
 * activation rows: a8w4 as vpmaddubsw of the nibbles u = q_w + 8 (unsigned) with q_x, less
 * 8 sum(q_x); int16 partial sums of 8 blocks (4 per chain) stay below 8 * 2 * 15 * 127 < 2^15.  a8w8 with the
 * sign trick (|w| x sign(x, w): pairs <= 2 * 127 * 127 < 2^15), widened every block. */
/* One block of 32 elements of weight row `row` into `part` (see int8_dot). */
ALWAYS_INLINE __m256i int8_block(int64_t fmt, const uint8_t *row, int64_t k, __m256i q, __m256i part, int fetch) {
    if (fmt == FMT_A8W4) {
        if (fetch) _mm_prefetch((const char *)(row + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
        const __m128i low = _mm_set1_epi8(15);
        __m128i v = _mm_loadu_si128((const __m128i *)(row + k / 2));
        __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
        return _mm256_add_epi16(part, _mm256_maddubs_epi16(u, q));
    }
    if (fetch) _mm_prefetch((const char *)(row + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
    __m256i c = _mm256_loadu_si256((const __m256i *)(row + k));
    __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(q, c));
    return _mm256_add_epi32(part, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* How a8w4's activations are paired (quantize_int8_row's block): 64 where K allows, so that one
 * 32-byte load gives two vectors of 32 nibbles (evens and odds) for two vpmaddubsw: 4 operations
 * per 32 weights instead of 7 for the 32-element pairing. */
static int64_t a8w4_block(int64_t K) { return K % 64 == 0 ? 64 : 32; }

/* a8w4 rows with 64-element pairing: two weight rows, 4 chains of int16 sums flushed every 512. */
static void a8w4_dot64(int64_t K, const uint8_t *const *rows, const int8_t *xr, __m256i *tot0, __m256i *tot1, int fetch) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
    for (int64_t k0 = 0; k0 < K; k0 += 512) { /* 8 steps a chain: 8 * 2 * 15 * 127 < 2^15 */
        int64_t end = k0 + 512 < K ? k0 + 512 : K;
        __m256i p00 = _mm256_setzero_si256(), p01 = p00, p10 = p00, p11 = p00;
        for (int64_t k = k0; k < end; k += 64) {
            __m256i qe = _mm256_loadu_si256((const __m256i *)(xr + k)), qo = _mm256_loadu_si256((const __m256i *)(xr + k + 32));
            if (fetch) {
                _mm_prefetch((const char *)(rows[0] + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
                _mm_prefetch((const char *)(rows[1] + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
            }
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(rows[0] + k / 2));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(rows[1] + k / 2));
            p00 = _mm256_add_epi16(p00, _mm256_maddubs_epi16(_mm256_and_si256(v0, low), qe));
            p01 = _mm256_add_epi16(p01, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), qo));
            p10 = _mm256_add_epi16(p10, _mm256_maddubs_epi16(_mm256_and_si256(v1, low), qe));
            p11 = _mm256_add_epi16(p11, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), qo));
        }
        *tot0 = _mm256_add_epi32(*tot0, _mm256_add_epi32(_mm256_madd_epi16(p00, ones), _mm256_madd_epi16(p01, ones)));
        *tot1 = _mm256_add_epi32(*tot1, _mm256_add_epi32(_mm256_madd_epi16(p10, ones), _mm256_madd_epi16(p11, ones)));
    }
}

static void int8_dot(int64_t fmt, int64_t K, const uint8_t *const *rows, const int8_t *const *xq,
                     const int32_t *sums, int64_t n, int32_t acc[2][16]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t r = 0; r < n; ++r) {
        if (fmt == FMT_A8W4 && a8w4_block(K) == 64) {
            __m256i t0 = _mm256_setzero_si256(), t1 = t0;
            a8w4_dot64(K, rows, xq[r], &t0, &t1, r == 0);
            acc[0][r] = hsum_epi32(t0) - 8 * sums[r], acc[1][r] = hsum_epi32(t1) - 8 * sums[r];
            continue;
        }
        __m256i tot0 = _mm256_setzero_si256(), tot1 = _mm256_setzero_si256();
        for (int64_t k0 = 0; k0 < K; k0 += 256) { /* 4 chains: two rows x two blocks */
            int64_t end = k0 + 256 < K ? k0 + 256 : K, k = k0;
            __m256i p00 = _mm256_setzero_si256(), p01 = p00, p10 = p00, p11 = p00;
            for (; k + 64 <= end; k += 64) {
                __m256i qa = _mm256_loadu_si256((const __m256i *)(xq[r] + k));
                __m256i qb = _mm256_loadu_si256((const __m256i *)(xq[r] + k + 32));
                p00 = int8_block(fmt, rows[0], k, qa, p00, r == 0);
                p10 = int8_block(fmt, rows[1], k, qa, p10, r == 0);
                p01 = int8_block(fmt, rows[0], k + 32, qb, p01, 0);
                p11 = int8_block(fmt, rows[1], k + 32, qb, p11, 0);
            }
            if (k < end) { /* K is whole blocks of 32: one left */
                __m256i qa = _mm256_loadu_si256((const __m256i *)(xq[r] + k));
                p00 = int8_block(fmt, rows[0], k, qa, p00, r == 0);
                p10 = int8_block(fmt, rows[1], k, qa, p10, r == 0);
            }
            if (fmt == FMT_A8W4) { /* int16 pair sums -> int32 */
                p00 = _mm256_madd_epi16(p00, ones), p01 = _mm256_madd_epi16(p01, ones);
                p10 = _mm256_madd_epi16(p10, ones), p11 = _mm256_madd_epi16(p11, ones);
            }
            tot0 = _mm256_add_epi32(tot0, _mm256_add_epi32(p00, p01));
            tot1 = _mm256_add_epi32(tot1, _mm256_add_epi32(p10, p11));
        }
        int32_t offset = fmt == FMT_A8W4 ? 8 * sums[r] : 0;
        acc[0][r] = hsum_epi32(tot0) - offset, acc[1][r] = hsum_epi32(tot1) - offset;
    }
}

/* ---- a8w4-int and a8w8-int, group-wise (FMT_A8W4G / FMT_A8W8G: the grouped forms of quant/a8w4_int.py
 * and quant/a8w8_int.py, torchao's "8da4w", ggml's q4_0 / q8_0 x q8_0) ----
 * Activations quantized per row in blocks of 32 (quant/common.py: quantize_per_block_int8), 4-bit
 * weights u = q + 8 with an fp16 scale per group of G (32, 64 or a multiple of 128) along K.  Each
 * block's int32 sum is scaled once: y = sum_b (acc_b * s_x,b) * s_w,g.  The loops sum u x q_x with
 * vpmaddubsw (AVX2, 64 elements a step) or vpdpbusd (AVX-512 VNNI, 128 a step) into int32 lanes, 4
 * lanes per block of 32 (16 bytes of nibbles), starting from the block's offset -8 sum_b(q_x) in its
 * first lane: so acc_b = q_w . q_x exactly, held as 4 partial sums; each lane is converted to fp32
 * and scaled (acc * s_x) * s_w, summed in fp32 at the row's end.  The int32 sums are exact; the
 * result differs from the reference by the fp32 rounding of the 4 scaled partials of a block and
 * the order of the fp32 sum over blocks.
 * a8w8 (int8 weights, elements in order): 8 int32 lanes per block of 32 (4 consecutive bytes each).
 * AVX2 sums |q_w| x sign(q_x, q_w) with vpmaddubsw (pairs <= 2 * 127^2 < 2^15, exact), 32 a step;
 * AVX-512 VNNI sums u = q_w + 128 (the sign bit flipped: unsigned) x q_x with vpdpbusd, 64 a step,
 * from each lane's offset -128 (the sum of its 4 q_x): a lane's int32 is its 4 products alone.
 * Per row the block scales and offsets are held per int32 lane, K / A8G_ROW_DIV of each (a8w8's 8
 * lanes per block; a8w4 uses the first half of its row's). */
enum { A8G_BLOCK = 32, A8G_ROW_DIV = 4 };

/* int32 lanes per block of 32, and the activation offset's factor (u = q_w + bias), of a format. */
static int a8g_lanes(int64_t fmt) { return fmt == FMT_A8W8G ? 8 : 4; }
static int32_t a8g_bias(int64_t fmt) { return fmt == FMT_A8W8G ? 128 : 8; }

static int a8g_vnni(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    }
    return known;
}

/* Whether the loops take a grouped a8 role of reduction width K and group G. */
static int a8g_ok(int64_t K, int64_t G) { return (G == 32 || G == 64 || (G > 0 && G % 128 == 0)) && K % G == 0; }

/* A role's loop on this ISA: a8w4's pairing (64, or 128 for its VNNI loop, K % 128 == 0); grouped
 * a8w8 reads its input in order and runs the VNNI loop where K % 64 == 0, per-channel a8w8
 * (int8_dot_vnni) at any K. */
static void a8g_setup(qweight_t *w, int64_t isa) {
    const int wide = isa == ISA_AVX512 && a8g_vnni();
    w->pairing = w->fmt == FMT_A8W8G ? 0 : wide && w->k % 128 == 0 ? 128 : 64;
    w->vnni = w->fmt == FMT_A8W8G ? wide && w->k % 64 == 0 : w->fmt == FMT_A8W8 ? wide : w->pairing == 128;
}

/* One input row of role w (n = w->k floats, a multiple of 32) quantized per block as
 * quantize_per_block_int8, bit for bit: s = max|x| / 127 (1 where that is 0; a NaN or inf makes it
 * non-finite), q = clamp(round half to even(x / s), -127, 127), 0 where x / s is NaN; q stored
 * paired per w->pairing elements (a last 32 that does not fill one: paired per 32, the AVX2 loop's
 * tail), in order for pairing 0.  Per block b, L = a8g_lanes lanes: sxe[L b / 32 + i] = s (one per
 * int32 lane of the block); a8w4: off[L b / 32] = -8 sum_b(q), its other lanes' 0; a8w8: each
 * lane's off = -128 times the sum of its 4 elements' q. */
static void quantize_int8_blocks(const qweight_t *w, const float *x, int8_t *q, float *sxe, int32_t *off) {
    const int64_t n = w->k, pairing = w->pairing, whole = pairing ? n - n % pairing : n;
    const int lanes = a8g_lanes(w->fmt);
    const int32_t bias = a8g_bias(w->fmt);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127), nan_code = _mm256_set1_epi32(INT32_MIN);
    for (int64_t b = 0; b < n; b += A8G_BLOCK) {
        const int64_t P = b < whole ? pairing : A8G_BLOCK, at = b / A8G_BLOCK * lanes;
        float s = block_absmax(x + b, A8G_BLOCK) / 127.f;
        s = s == 0.f ? 1.f : s;
        const __m256 sv = _mm256_set1_ps(s);
        int32_t total = 0, part[8]; /* part: the sums of q over each 4 consecutive elements */
        for (int j = 0; j < A8G_BLOCK; j += 8) {
            __m256i v = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(x + b + j), sv));
            v = _mm256_andnot_si256(_mm256_cmpeq_epi32(v, nan_code), v); /* NaN -> 0 */
            v = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
            __m256i quads = _mm256_hadd_epi32(v, v);
            quads = _mm256_hadd_epi32(quads, quads); /* each 128-bit half: the sum of its 4 elements */
            part[j / 4] = _mm256_cvtsi256_si32(quads), part[j / 4 + 1] = _mm256_extract_epi32(quads, 4);
            total += part[j / 4] + part[j / 4 + 1];
            store8_paired(q, b + j, P, bytes8(v));
        }
        /* a8w8's lanes hold 4 consecutive elements each: each lane its own offset, so a lane's int32
         * is its 4 products alone (no large offset cancelling in fp32); a8w4's paired lanes: lane 0 */
        for (int i = 0; i < lanes; ++i)
            sxe[at + i] = s, off[at + i] = lanes == 8 ? -bias * part[i] : i ? 0 : -bias * total;
    }
}

/* The weight scale of each int32 lane of 64 elements (chunk c) for G = 32: two blocks' groups. */
static inline __m256 a8g_scales8(const uint8_t *sc, int64_t c, int64_t G) {
    (void)G;
    uint32_t two;
    memcpy(&two, (const uint16_t *)sc + 2 * c, 4);
    __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)two));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(f), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

static float hsum8(__m256 v) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* out[w * nr + r] of two weight rows and n activation rows (q, block scales, offsets), AVX2. */
static void a8g_dot_avx2(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                         const int8_t *const *xq, const float *const *xs, const int32_t *const *xo, int64_t n, int nr,
                         float *out) {
    const int64_t K = wt->k, G = wt->group, per = G >= 64 ? G / 64 : 0; /* chunks of 64 per group; 0: G = 32 */
    const uint16_t *h0 = (const uint16_t *)scales[0], *h1 = (const uint16_t *)scales[1];
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t r = 0; r < n; ++r) {
        __m256 t0 = _mm256_setzero_ps(), t1 = t0, sw0 = t0, sw1 = t0;
        int64_t left = 0, gi = 0; /* chunks left in group gi - 1 (no division in the loop) */
        for (int64_t c = 0; c < K / 64; ++c) {
            const int64_t k = 64 * c;
            if (!per) {
                sw0 = a8g_scales8(scales[0], c, G), sw1 = a8g_scales8(scales[1], c, G);
            } else if (left-- == 0) {
                sw0 = _mm256_set1_ps(_cvtsh_ss(h0[gi])), sw1 = _mm256_set1_ps(_cvtsh_ss(h1[gi]));
                ++gi, left = per - 1;
            }
            if (r == 0 && !(c & 1)) {
                _mm_prefetch((const char *)(rows[0] + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
                _mm_prefetch((const char *)(rows[1] + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
            }
            __m256i qe = _mm256_loadu_si256((const __m256i *)(xq[r] + k)), qo = _mm256_loadu_si256((const __m256i *)(xq[r] + k + 32));
            __m256i o = _mm256_loadu_si256((const __m256i *)(xo[r] + 8 * c));
            __m256 sx = _mm256_loadu_ps(xs[r] + 8 * c);
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(rows[0] + k / 2));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(rows[1] + k / 2));
            /* pair sums <= 2 * 15 * 127; two of them added <= 7620 < 2^15 */
            __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v0, low), qe),
                                          _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), qo));
            __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v1, low), qe),
                                          _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), qo));
            __m256i a0 = _mm256_add_epi32(_mm256_madd_epi16(p0, ones), o), a1 = _mm256_add_epi32(_mm256_madd_epi16(p1, ones), o);
            t0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a0), sx), sw0, t0);
            t1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a1), sx), sw1, t1);
        }
        if (K % 64) { /* the last 32, paired per 32: 16 bytes give [low nibbles | high nibbles], all one block */
            const int64_t k = K - 32, b = k / A8G_BLOCK;
            const __m128i low16 = _mm_set1_epi8(15);
            __m256i qb = _mm256_loadu_si256((const __m256i *)(xq[r] + k));
            __m256i o = _mm256_setr_epi32(xo[r][4 * b], 0, 0, 0, 0, 0, 0, 0);
            __m256 sx = _mm256_set1_ps(xs[r][4 * b]);
            __m256 t[2] = {t0, t1};
            for (int w = 0; w < 2; ++w) {
                __m128i v = _mm_loadu_si128((const __m128i *)(rows[w] + k / 2));
                __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low16), _mm_and_si128(v, low16));
                __m256i a = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, qb), ones), o);
                __m256 sw = _mm256_set1_ps(_cvtsh_ss(((const uint16_t *)scales[w])[k / G]));
                t[w] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a), sx), sw, t[w]);
            }
            t0 = t[0], t1 = t[1];
        }
        out[r] = hsum8(t0), out[nr + r] = hsum8(t1);
    }
}

#define A8G_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* The weight scale of each int32 lane of 128 elements (chunk c) for G = 32 or 64: four blocks' groups. */
A8G_VNNI static inline __m512 a8g_scales16(const uint8_t *sc, int64_t c, int64_t G) {
    const uint16_t *h = (const uint16_t *)sc;
    if (G == 32) {
        __m128 f = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(h + 4 * c)));
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm512_castps128_ps512(f));
    }
    if (G == 64) {
        uint32_t two;
        memcpy(&two, h + 2 * c, 4);
        __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128((int)two));
        return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), _mm512_castps128_ps512(f));
    }
    return _mm512_set1_ps(_cvtsh_ss(h[c])); /* not reached: G >= 128 takes the loop's own scale */
}

/* The weight scales of two rows' int32 lanes for chunk c of 128 elements: per lane for G < 128
 * (per = 0), else one per group, stepped every `per` chunks (*left, *gi: no division a chunk). */
A8G_VNNI static inline void vnni_chunk_scales(const uint8_t *const *scales, int64_t c, int64_t G, int64_t per,
                                              int64_t *left, int64_t *gi, __m512 *sw0, __m512 *sw1) {
    if (!per) {
        *sw0 = a8g_scales16(scales[0], c, G), *sw1 = a8g_scales16(scales[1], c, G);
    } else if ((*left)-- == 0) {
        *sw0 = _mm512_set1_ps(_cvtsh_ss(((const uint16_t *)scales[0])[*gi]));
        *sw1 = _mm512_set1_ps(_cvtsh_ss(((const uint16_t *)scales[1])[*gi]));
        ++*gi, *left = per - 1;
    }
}

/* As a8g_dot_avx2, AVX-512 VNNI, 128 elements (64 bytes of each row) a step; K a multiple of 128. */
A8G_VNNI static void a8g_dot_vnni(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                                  const int8_t *const *xq, const float *const *xs, const int32_t *const *xo, int64_t n,
                                  int nr, float *out) {
    const int64_t K = wt->k, G = wt->group, per = G >= 128 ? G / 128 : 0; /* chunks of 128 per group; 0: G < 128 */
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t r = 0; r < n; ++r) {
        __m512 t0 = _mm512_setzero_ps(), t1 = t0, sw0 = t0, sw1 = t0;
        int64_t left = 0, gi = 0; /* chunks left in group gi - 1 (no division in the loop) */
        for (int64_t c = 0; c < K / 128; ++c) {
            const int64_t k = 128 * c;
            vnni_chunk_scales(scales, c, G, per, &left, &gi, &sw0, &sw1);
            if (r == 0) {
                _mm_prefetch((const char *)(rows[0] + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
                _mm_prefetch((const char *)(rows[1] + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
            }
            __m512i qe = _mm512_loadu_si512(xq[r] + k), qo = _mm512_loadu_si512(xq[r] + k + 64);
            __m512i o = _mm512_loadu_si512(xo[r] + 16 * c);
            __m512 sx = _mm512_loadu_ps(xs[r] + 16 * c);
            __m512i v0 = _mm512_loadu_si512(rows[0] + k / 2), v1 = _mm512_loadu_si512(rows[1] + k / 2);
            __m512i a0 = _mm512_dpbusd_epi32(o, _mm512_and_si512(v0, low), qe);
            __m512i a1 = _mm512_dpbusd_epi32(o, _mm512_and_si512(v1, low), qe);
            a0 = _mm512_dpbusd_epi32(a0, _mm512_and_si512(_mm512_srli_epi16(v0, 4), low), qo);
            a1 = _mm512_dpbusd_epi32(a1, _mm512_and_si512(_mm512_srli_epi16(v1, 4), low), qo);
            t0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a0), sx), sw0, t0);
            t1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a1), sx), sw1, t1);
        }
        out[r] = _mm512_reduce_add_ps(t0), out[nr + r] = _mm512_reduce_add_ps(t1);
    }
}
