/* Quantized MoE decode on CPU: a whole decode step (T <= 16 tokens) on packed weights in one call,
 * the weights streamed once and dequantized in registers: FC1 -> SwiGLU -> FC2 -> weighted combine.
 *
 * Shapes:   T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots.
 *           x [T, H] fp32, ids [T, K] int64, gates [T, K] fp32, y [T, H] fp32 (zeroed by the host).
 *           FC1 [E, 2F, H] (gate rows 0..F-1, up rows F..2F-1), FC2 [E, H, F], in one of the
 *           formats of moe_compile/quant (the host's docstring has the table); a row's reduction
 *           dimension is contiguous, its group scales are [E, N, K/G] beside it.
 *
 * Why: decode reads each touched expert's weights once, so it runs at the speed the weights stream
 * from memory; a 4-bit weight is an eighth of fp32's bytes, but only if dequantizing keeps up.  The
 * loops here spend a few vector operations per 16 or 32 weights and none per weight and token:
 *   - 4-bit, AVX-512: 64 bytes (128 elements) are read as 16 32-bit lanes of 8 nibbles each;
 *     shifted right by 4j, a lane's low nibble (element 8i + j) indexes a 16-entry table of the
 *     format's values (vpermps reads only the index's low 4 bits): 8 lookups and 7 shifts per 128
 *     weights, no byte-widening shuffle; a lane's 8 elements share a group, so the group scales
 *     multiply each row's partial sums once per block (layout T8 below).  The last K mod 128
 *     elements: 16 bytes zero-extended into 16 lanes, low and high nibble into a scaled table.
 *     AVX2's vpermps has 8 entries: w4-int converts the nibble (u - 8) s as one FMA of u, mxfp4
 *     looks up |value| and sets the sign bit.
 *   - One row (T = 1's experts), 4- and 8-bit weight-only formats: the row is held as int16 blocks
 *     and the codes are summed against it in int32 (quantize_i16, dot16, w4_dot16_vnni).
 *   - bf16: a 32-bit lane holding two bf16 values is both of them as fp32, one shifted left 16
 *     bits, the other with its low half masked off.
 *   - int8 / fp16: sign-extend and convert / vcvtph2ps, then times the group scale.
 *   So a lane's weight is not element k of the row: x (and FC2's input) is held in the order the
 *   lanes see ("paired": each block of 2V elements, V = lanes, as its V even elements then its V
 *   odd ones; "T8": each 128 block as 8 vectors of elements j, j+8, ..); only the order of a dot
 *   product's terms changes.  Formats whose lanes hold consecutive elements (int8, fp16, fp8)
 *   read x as it is.
 * Rows:     every weight row is dotted with all of its expert's tokens at once (up to RMAX_* per
 *           pass, x in L1), so the dequantizing is paid once per weight, not once per token.
 * Threads:  both phases split every touched expert's output rows over the OpenMP threads (torch's
 *           own, as skinny.c): FC1 by features (gate row n and up row F+n together, then that
 *           feature's SwiGLU, no barrier needed), FC2 by output columns of y (each owned by one
 *           thread, so a token's K experts never race).  One barrier between the phases.
 * ISA:      AVX2 + FMA + F16C everywhere; the same loops for AVX-512 (F, BW, DQ, VL) compiled for
 *           that target alone and run only where the CPU has it.  The per-ISA part is written once
 *           below and included twice (this file includes itself with QDECODE_ISA defined).
 *
 * Built by moe_compile/kernels/cpu/qdecode.py with `cc -O3 -mavx2 -mfma` on first use.
 */
#ifndef QDECODE_ISA /* ------------------------------------------------ shared part, compiled once */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#pragma GCC target("f16c")

/* Weight formats (qdecode.py: _FORMATS). */
enum { FMT_BF16 = 1, FMT_FP16, FMT_W8, FMT_W4, FMT_MXFP4, FMT_MXFP8, FMT_A8W8, FMT_A8W4, FMT_A8W4G, FMT_A8W8G, FMT_COUNT };
/* Group scales of one weight row converted to fp32 SEG at a time (a stack buffer per row). */
enum { SEG = 256 };
/* Software prefetch distance into the weight rows, in elements (so the same time ahead whatever
 * the format's bytes: 8 KiB of int8 / fp8, 16 KiB of bf16; 4-bit rows below); rows of one
 * expert are contiguous, so it runs on into the next rows, and past an expert's end it is
 * harmless.  A/B in one process, 2 threads, 64 MiB read before each call, medians of 100
 * interleaved, 2-core EPYC (Zen 5), 4 runs, ms at 2 KiB (the old fixed distance) / this:
 *   w8-int: Mixtral-like T=1 0.371-0.396 / 0.304-0.335 (AVX2 and AVX-512), T=4 1.14-1.34 / 0.99-1.15;
 *   bf16: from 0.569 / 0.470 (Mixtral-like T=1, AVX2) to level (0.62 / 0.64) from run to run;
 *   w4-int: level (compute-bound on AVX2).
 * Earlier, prefetching at all against not: w4-int 0.338 / 0.438, w8-int 0.542 / 0.577 (1 thread). */
/* Prefetches go to L2 (T1), not L1 (T0).  Into L1 each one holds one of the core's few L1 miss
 * buffers until DRAM answers, so a loop doing real work per line got no more lines in flight
 * than it had before, and time from memory was memory time plus compute time.  Into L2 the
 * prefetches run on their own (skinny.c's fp32 loop already did this).  Dense linears at T = 1,
 * 2 threads, 64 MiB read before each call, medians of 25, 2-core EPYC Zen 4 (AVX-512 VNNI),
 * lm_head [32000, 2048] ms T0 -> T1: w8-int 4.22 -> 2.56, a8w8-int 6.05 -> 2.33, w16 6.18 -> 3.59,
 * a8w4-int g32 2.26 -> 1.46; w4-int level (2.03 -> 1.93).  A standalone loop streaming 4 MB of
 * int4 rows through the w4 VNNI dot: 13.7 GB/s (T0) -> 27-38 GB/s (T1 or T2), the sum of the
 * same bytes 29 GB/s. */
#ifndef QDECODE_PREFETCH_HINT
#define QDECODE_PREFETCH_HINT _MM_HINT_T1
#endif
#define PREFETCH_HINT QDECODE_PREFETCH_HINT
/* 8 KiB of int8 (16 of bf16) since the hint went to L2, from 4 KiB: a dense row of 4096 int8 was
 * then exactly the distance, so the loops' two rows a pass prefetched the pair's other row, not
 * the next pair's.  One-process A/B, 2 threads, 64 MiB read before each call, 2-core Zen 4, ms at
 * 4 KiB / 8 KiB: dense T = 1 w8-int o_proj [2048, 4096] 0.37-0.38 / 0.21-0.30, q_proj [4096, 2048]
 * 0.24-0.33 / 0.22-0.31, lm_head [32000, 2048] 1.77-2.29 / 1.45-2.29; bf16 o_proj 0.63-0.72 /
 * 0.59-0.63; the MoE step (bench shapes, T = 1 and 4: w8-int, w16, a8w8-int) 0.95-1.04 of before. */
#ifndef QDECODE_PREFETCH_ELEMENTS /* a -D override for A/B builds */
#define QDECODE_PREFETCH_ELEMENTS 8192
#endif
enum { PREFETCH_ELEMENTS = QDECODE_PREFETCH_ELEMENTS };
/* 4-bit rows: 8 KiB ahead (twice the elements).  Their integer loops run at ~45 G weights/s a core
 * in cache, so 2 KiB is ~90 ns ahead, under DRAM's latency; one-process A/B, AVX2, T=1 / T=4,
 * Mixtral-like: a8w4-int 0.185 / 0.581 -> 0.171 / 0.542 ms, w4-int 0.254 / 0.891 -> 0.245 / 0.873;
 * 8-bit formats and bf16 were then (prefetching into L1) level or 3% slower at the doubled distance.
 * Into L2 (above), 4 -> 8 KiB: a8w4-int q_proj / o_proj [4096, 2048] / [2048, 4096] 0.288 / 0.291 ->
 * 0.278 / 0.253 ms, at 16 KiB lm_head slower again (1.46 -> 2.01). */
enum { PREFETCH_4BIT_BYTES = 8192 };

#define ALWAYS_INLINE __attribute__((always_inline)) static inline

/* One role (FC1 or FC2) of all experts: row n of expert e is data + (e N + n) row_bytes, its
 * scales scale + (e N + n) (k / group) scale_bytes. */
typedef struct {
    const uint8_t *data, *scale;
    int64_t fmt, n, k, group, layout; /* layout: how its x rows are held (LAYOUT_*) */
    int64_t i16; /* against one row its input is read as int16 blocks (I16_BLOCK, below): 0 no,
                  * I16_PAIRED (4-bit: evens then odds), I16_NATURAL (int8: in order) or I16_T4
                  * (w4-int on AVX-512 VNNI: w4_dot16_vnni's order) */
    int64_t pairing; /* FMT_A8W4G: its int8 input paired per 64 (AVX2 loop) or 128 (AVX-512 VNNI loop) */
    int64_t vnni;    /* grouped a8 formats and per-channel a8w8: the AVX-512 VNNI loop runs it (a8g_setup) */
    int64_t rows16;  /* an expert role read as 16-row panels at one slot (rows16_attach): 0 no, else
                      * rows16_loop's kind; r16data / r16scale those panels, all experts' */
    int64_t r16vnni; /* those panels read by the AVX-512 VNNI loops (else the AVX2 ones) */
    const uint8_t *r16data, *r16scale;
} qweight_t;

/* How a weight's input rows (x for FC1, the activations for FC2) are held, see the header:
 * NATURAL as they are; PAIRED each 2V block as V evens then V odds; T8 (AVX-512, 4-bit) each
 * 128-element block as 8 vectors, vector j holding elements j, j+8, .., j+120, and the tail (K
 * mod 128, whole 32-element groups) PAIRED. */
enum { LAYOUT_NATURAL, LAYOUT_PAIRED, LAYOUT_T8 };

static int64_t row_bytes(const qweight_t *w) {
    return w->fmt == FMT_W4 || w->fmt == FMT_MXFP4 || w->fmt == FMT_A8W4 || w->fmt == FMT_A8W4G ? w->k / 2
           : w->fmt == FMT_BF16 || w->fmt == FMT_FP16                  ? 2 * w->k
                                                                       : w->k;
}

/* The a8 formats: activations quantized per row to int8 (quant/common.py: quantize_per_token_int8),
 * weights int8 / int4 per output channel with an fp32 scale, int32 sums (int8_dot below). */
static int int8_activations(int64_t fmt) { return fmt == FMT_A8W8 || fmt == FMT_A8W4; }

/* The group-wise a8 formats: activations int8 per row and block of 32, fp16 weight scales per group
 * (quant/common.py: QuantWeight.grouped_activations), each block's int32 sum scaled once (a8g_rows). */
static int a8g(int64_t fmt) { return fmt == FMT_A8W4G || fmt == FMT_A8W8G; }

static int has_scales(int64_t fmt) { return fmt != FMT_BF16 && fmt != FMT_FP16; }

static const uint8_t *row_at(const qweight_t *w, int64_t e, int64_t n) {
    return w->data + (e * w->n + n) * row_bytes(w);
}

static const uint8_t *scales_at(const qweight_t *w, int64_t e, int64_t n) {
    int64_t per_row = w->k / w->group,
            bytes = w->fmt == FMT_W8 || w->fmt == FMT_W4 || a8g(w->fmt) ? 2 : int8_activations(w->fmt) ? 4 : 1;
    return has_scales(w->fmt) ? w->scale + (e * w->n + n) * per_row * bytes : NULL;
}

/* The layout a weight's loops read its input in on this ISA.  T8 needs each 16-lane vector's
 * lanes to see whole groups per lane of a 128 block: groups dividing 128 or multiples of it. */
static int64_t layout_of(int64_t fmt, int64_t group, int64_t isa) {
    int four_bit = fmt == FMT_W4 || fmt == FMT_MXFP4;
    if (four_bit && isa == ISA_AVX512 && (128 % group == 0 || group % 128 == 0)) return LAYOUT_T8;
    return (four_bit || fmt == FMT_BF16) && !int8_activations(fmt) ? LAYOUT_PAIRED : LAYOUT_NATURAL;
}

static float bits_float(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* e8m0 (OCP MX): 2^(b - 127); 0 is 2^-127 (a subnormal fp32), 255 is NaN. */
static float e8m0_float(uint8_t b) {
    return bits_float(b == 255 ? 0x7FC00000u : b == 0 ? 0x00400000u : (uint32_t)b << 23);
}

/* e4m3fn (OCP FP8): bias 7, subnormals at exponent 0, S.1111.111 is NaN, no infinities. */
static float e4m3_float(uint8_t c) {
    int e = (c >> 3) & 15, m = c & 7;
    float v = (e == 15 && m == 7) ? bits_float(0x7FC00000u)
              : e == 0            ? (float)m * (1.f / 512.f)
                                  : bits_float((uint32_t)(e + 120) << 23 | (uint32_t)m << 20);
    return c & 0x80 ? -v : v;
}

/* The OCP e2m1 values of the 16 codes (sign in bit 3). */
static const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

/* Scales g0 .. g0 + n - 1 of a row as fp32 (fp16 for the int formats, e8m0 for MX). */
static void convert_scales(int64_t fmt, const uint8_t *s, int64_t g0, int64_t n, float *out) {
    int64_t i = 0;
    if (fmt == FMT_W8 || fmt == FMT_W4) {
        const uint16_t *h = (const uint16_t *)s + g0;
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
        for (; i < n; ++i) out[i] = _cvtsh_ss(h[i]);
    } else { /* 2^(b - 127) is b in the exponent bits; 0 and 255 patched to 2^-127 and NaN */
        const __m256i zero = _mm256_setzero_si256(), ones = _mm256_set1_epi32(255);
        for (; i + 8 <= n; i += 8) {
            __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(s + g0 + i)));
            __m256i f = _mm256_slli_epi32(b, 23);
            f = _mm256_blendv_epi8(f, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(b, zero));
            f = _mm256_blendv_epi8(f, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(b, ones));
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(f));
        }
        for (; i < n; ++i) out[i] = e8m0_float(s[g0 + i]);
    }
}

/* Element k of a weight row, one at a time: the tails of rows whose length is not a whole number
 * of 2V-element blocks (only w16, whose group is the whole row). */
static float element(int64_t fmt, const uint8_t *row, int64_t k) {
    uint16_t h;
    memcpy(&h, row + 2 * k, 2);
    return fmt == FMT_BF16 ? bits_float((uint32_t)h << 16) : _cvtsh_ss(h);
}

/* dst = src (n floats from element `at` of a row on) in `layout` (`at` a multiple of 128 for T8;
 * n a whole number of blocks but at the row's end). */
static void layout_copy(float *dst, const float *src, int64_t n, int64_t v, int64_t layout) {
    int64_t i = 0;
    if (layout == LAYOUT_T8)
        for (; i + 128 <= n; i += 128)
            for (int64_t j = 0; j < 8; ++j)
                for (int64_t l = 0; l < 16; ++l) dst[i + 16 * j + l] = src[i + 8 * l + j];
    if (layout != LAYOUT_NATURAL)
        for (; i + 2 * v <= n; i += 2 * v)
            for (int64_t j = 0; j < v; ++j) dst[i + j] = src[i + 2 * j], dst[i + v + j] = src[i + 2 * j + 1];
    for (; i < n; ++i) dst[i] = src[i];
}

/* Output rows [lo, hi) of part `part` of `parts`, the split points multiples of `align`. */
static void split(int64_t n, int64_t align, int64_t part, int64_t parts, int64_t *lo, int64_t *hi) {
    int64_t step = (n / parts + align - 1) / align * align;
    *lo = part * step < n ? part * step : n;
    *hi = part == parts - 1 || (part + 1) * step > n ? n : (part + 1) * step;
}

/* dot(nw weight rows, nr x rows): out[w * nr + r] = row_w . x_r over k elements.  One per ISA. */
typedef void (*dot_fn)(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                       const float *const *x, int nr, float *out);

/* dot of two 4- or 8-bit weight rows with one input row held as int16 blocks: out[w] = row_w . x;
 * xs its scales and xo its lane offsets (I16_T4 only) from the row's first (i16_scale_at). */
typedef void (*dot16_fn)(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                         const int16_t *xq, const float *xs, const int32_t *xo, float *out);

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

/* out[w * nr + r] of two rows of a group-wise a8w8 role and n activation rows, AVX2: a block of 32
 * a step, 8 exact int32 lanes (the sign trick), each scaled (acc * s_x) * s_w. */
static void a8w8g_dot_avx2(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                           const int8_t *const *xq, const float *const *xs, const int32_t *const *xo, int64_t n, int nr,
                           float *out) {
    (void)xo; /* no offsets: the sign trick multiplies signed by signed */
    const int64_t K = wt->k, per = wt->group / A8G_BLOCK; /* blocks per group */
    const uint16_t *h0 = (const uint16_t *)scales[0], *h1 = (const uint16_t *)scales[1];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t r = 0; r < n; ++r) {
        __m256 t0 = _mm256_setzero_ps(), t1 = t0, sw0 = t0, sw1 = t0;
        int64_t left = 0, gi = 0; /* blocks left in group gi - 1 (no division in the loop) */
        for (int64_t b = 0; b < K / A8G_BLOCK; ++b) {
            const int64_t k = A8G_BLOCK * b;
            if (left-- == 0) {
                sw0 = _mm256_set1_ps(_cvtsh_ss(h0[gi])), sw1 = _mm256_set1_ps(_cvtsh_ss(h1[gi]));
                ++gi, left = per - 1;
            }
            if (r == 0 && !(b & 1)) {
                _mm_prefetch((const char *)(rows[0] + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
                _mm_prefetch((const char *)(rows[1] + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
            }
            __m256i q = _mm256_loadu_si256((const __m256i *)(xq[r] + k));
            __m256 sx = _mm256_loadu_ps(xs[r] + 8 * b);
            __m256i c0 = _mm256_loadu_si256((const __m256i *)(rows[0] + k));
            __m256i c1 = _mm256_loadu_si256((const __m256i *)(rows[1] + k));
            __m256i a0 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c0), _mm256_sign_epi8(q, c0)), ones);
            __m256i a1 = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c1), _mm256_sign_epi8(q, c1)), ones);
            t0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a0), sx), sw0, t0);
            t1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a1), sx), sw1, t1);
        }
        out[r] = hsum8(t0), out[nr + r] = hsum8(t1);
    }
}

/* As a8w8g_dot_avx2, AVX-512 VNNI, 64 elements (two blocks) a step from each lane's offset; K a
 * multiple of 64. */
A8G_VNNI static void a8w8g_dot_vnni(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                                    const int8_t *const *xq, const float *const *xs, const int32_t *const *xo,
                                    int64_t n, int nr, float *out) {
    const int64_t K = wt->k, G = wt->group, per = G >= 64 ? G / 64 : 0; /* steps per group; 0: G = 32 */
    const uint16_t *h0 = (const uint16_t *)scales[0], *h1 = (const uint16_t *)scales[1];
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t r = 0; r < n; ++r) {
        __m512 t0 = _mm512_setzero_ps(), t1 = t0, sw0 = t0, sw1 = t0;
        int64_t left = 0, gi = 0; /* steps left in group gi - 1 (no division in the loop) */
        for (int64_t c = 0; c < K / 64; ++c) {
            const int64_t k = 64 * c;
            if (!per) { /* G = 32: lanes 0-7 take group 2c, lanes 8-15 group 2c + 1 (a8w4's G = 64 spread) */
                sw0 = a8g_scales16(scales[0], c, 64), sw1 = a8g_scales16(scales[1], c, 64);
            } else if (left-- == 0) {
                sw0 = _mm512_set1_ps(_cvtsh_ss(h0[gi])), sw1 = _mm512_set1_ps(_cvtsh_ss(h1[gi]));
                ++gi, left = per - 1;
            }
            if (r == 0) {
                _mm_prefetch((const char *)(rows[0] + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
                _mm_prefetch((const char *)(rows[1] + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
            }
            __m512i q = _mm512_loadu_si512(xq[r] + k), o = _mm512_loadu_si512(xo[r] + 16 * c);
            __m512 sx = _mm512_loadu_ps(xs[r] + 16 * c);
            __m512i a0 = _mm512_dpbusd_epi32(o, _mm512_xor_si512(_mm512_loadu_si512(rows[0] + k), flip), q);
            __m512i a1 = _mm512_dpbusd_epi32(o, _mm512_xor_si512(_mm512_loadu_si512(rows[1] + k), flip), q);
            t0 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a0), sx), sw0, t0);
            t1 = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a1), sx), sw1, t1);
        }
        out[r] = _mm512_reduce_add_ps(t0), out[nr + r] = _mm512_reduce_add_ps(t1);
    }
}

/* out[w * nr + r] of two rows of a grouped a8 role and activation rows r0 .. r0 + n - 1 (through
 * `index` when given) of q [., ld], block scales and offsets [., ld / A8G_ROW_DIV]. */
static void a8g_rows(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales, const int8_t *q,
                     int64_t ld, const float *sxe, const int32_t *off, const int64_t *index, int64_t r0, int64_t n,
                     int nr, float *out) {
    const int8_t *xr[16];
    const float *xs[16];
    const int32_t *xo[16];
    for (int64_t r = 0; r < n; ++r) {
        int64_t i = index ? index[r0 + r] : r0 + r;
        xr[r] = q + i * ld, xs[r] = sxe + i * (ld / A8G_ROW_DIV), xo[r] = off + i * (ld / A8G_ROW_DIV);
    }
    if (wt->fmt == FMT_A8W8G)
        (wt->vnni ? a8w8g_dot_vnni : a8w8g_dot_avx2)(wt, rows, scales, xr, xs, xo, n, nr, out);
    else
        (wt->vnni ? a8g_dot_vnni : a8g_dot_avx2)(wt, rows, scales, xr, xs, xo, n, nr, out);
}

#define QDECODE_ISA 2
#pragma GCC push_options
#include "qdecode.c"
#pragma GCC pop_options
#undef QDECODE_ISA

#define QDECODE_ISA 512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
#include "qdecode.c"
#pragma GCC pop_options
#undef QDECODE_ISA

/* The widest ISA this CPU runs the loops in: ISA_AVX512, ISA_AVX2, or 0 (no F16C / FMA). */
int64_t moe_qdecode_best_isa(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") || !__builtin_cpu_supports("f16c")) return 0;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512vl"))
        return ISA_AVX512;
    return ISA_AVX2;
}

/* Plan fields (int64 each; pointers as integers), then W_FIELDS for FC1 and for FC2. */
enum { P_X, P_T, P_H, P_F, P_IDS, P_K, P_E, P_GATES, P_Y, P_BETWEEN, P_ISA, P_ROLES };
enum { W_DATA, W_SCALE, W_FMT, W_GROUP, W_FIELDS };
/* After the roles: FC1's and FC2's rows16 panels, data then scale (0, 0: none; rows16_attach). */
enum { P_ROWS16 = P_ROLES + 2 * W_FIELDS, P_FIELDS = P_ROWS16 + 4 };

typedef struct {
    int64_t T, H, F, K, E, S, between, v;
    const float *gates;
    float *y, *xp, *h, *a;             /* xp [T, H] x paired for FC1; h [S, 2F]; a [S, F] paired for FC2 */
    const int64_t *start, *tok, *slot; /* start [E + 1] over the sorted slots; token and slot (t*K+k) of each */
    int16_t *xq, *aq;                  /* x [T, H] and a [S, F] as int16 blocks (roles with i16) */
    int8_t *x8, *a8;                   /* x [T, H] and a [S, F] quantized per row (a8 formats) */
    float *x8s, *a8s;                  /* their scales [T], [S] */
    int32_t *x8sum, *a8sum;            /* their sums of q [T], [S] */
    float *x8b, *a8b;                  /* grouped a8: x8 / a8 per block of 32, lane scales [T, H / 4], [S, F / 4] */
    int32_t *x8o, *a8o;                /* and offsets, same shapes (quantize_int8_blocks) */
    float *xs, *as;                    /* their scales, i16_scale_at: [T, H / I16_LANE], [S, F / I16_LANE] */
    int32_t *xo, *ao;                  /* I16_T4: their lane offsets, same shapes */
    int32_t *x16, *a16;                /* rows16 roles: x [T, H / 2] and a [S, F / 2] as rows16_input's */
    float *x16s, *a16s;                /* their scales [T, H / 4], [S, F / 4] */
    int32_t *x16o, *a16o;              /* and offsets, same shapes */
    int8_t *a16tmp;                    /* [S, F]: rows16_input's scratch of a8w4-int's FC2 input rows */
    qweight_t w1, w2;
    dot_fn dot;
    dot16_fn dot16;
    int rmax;
} step_t;

/* Rows of x (or a) for sorted slots lo .. lo + n - 1, padded up to a kernel's row count with the
 * first row (results for the padding are dropped). */
static int gather_rows(const float *base, int64_t ld, const int64_t *index, int64_t lo, int64_t n, int rmax,
                       const float **rows) {
    int nr = (int)n;
    for (int r = 0; r < nr; ++r) rows[r] = base + (index ? index[lo + r] : lo + r) * ld;
    int padded = nr <= 4 ? nr : nr <= 6 ? 6 : 8;
    padded = padded > rmax ? rmax : padded;
    for (int r = nr; r < padded; ++r) rows[r] = rows[0];
    return padded;
}

/* int8_dot of per-channel a8w8 (FMT_A8W8) on AVX-512 VNNI: u = q_w + 128 (the sign bit flipped:
 * unsigned) times q_x by vpdpbusd, 64 a step, less 128 sum(q_x): exact as int8_dot (every lane's
 * int32 stays below K / 16 * 4 * 255 * 127), 3 operations per 64 weights a row where int8_dot's
 * sign trick takes 12: that loop holds a8w8-int at ~12 GB/s of weights a core.  A last piece under
 * 64 is read with masked loads (zeros: 128 * 0 adds nothing). */
A8G_VNNI static void int8_dot_vnni(int64_t K, const uint8_t *const *rows, const int8_t *const *xq, const int32_t *sums,
                                   int64_t n, int32_t acc[2][16]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t r = 0; r < n; ++r) {
        __m512i t0 = _mm512_setzero_si512(), t1 = t0, t2 = t0, t3 = t0; /* two chains a row */
        int64_t k = 0;
        for (; k + 128 <= K; k += 128) {
            if (r == 0)
                for (int j = 0; j < 2; ++j) {
                    _mm_prefetch((const char *)(rows[j] + k + PREFETCH_ELEMENTS), PREFETCH_HINT);
                    _mm_prefetch((const char *)(rows[j] + k + 64 + PREFETCH_ELEMENTS), PREFETCH_HINT);
                }
            __m512i qa = _mm512_loadu_si512(xq[r] + k), qb = _mm512_loadu_si512(xq[r] + k + 64);
            t0 = _mm512_dpbusd_epi32(t0, _mm512_xor_si512(_mm512_loadu_si512(rows[0] + k), flip), qa);
            t1 = _mm512_dpbusd_epi32(t1, _mm512_xor_si512(_mm512_loadu_si512(rows[1] + k), flip), qa);
            t2 = _mm512_dpbusd_epi32(t2, _mm512_xor_si512(_mm512_loadu_si512(rows[0] + k + 64), flip), qb);
            t3 = _mm512_dpbusd_epi32(t3, _mm512_xor_si512(_mm512_loadu_si512(rows[1] + k + 64), flip), qb);
        }
        for (; k < K; k += 64) {
            __mmask64 m = K - k >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (K - k)) - 1;
            __m512i q = _mm512_maskz_loadu_epi8(m, xq[r] + k);
            t0 = _mm512_dpbusd_epi32(t0, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, rows[0] + k), flip), q);
            t1 = _mm512_dpbusd_epi32(t1, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, rows[1] + k), flip), q);
        }
        acc[0][r] = _mm512_reduce_add_epi32(_mm512_add_epi32(t0, t2)) - 128 * sums[r];
        acc[1][r] = _mm512_reduce_add_epi32(_mm512_add_epi32(t1, t3)) - 128 * sums[r];
    }
}

/* out[w * nr + r] = (acc * s_x) * s_w (the reference's order) of two rows of an a8 format and
 * activation rows r0 .. r0 + n - 1 (through `index` when given) of q / scales / sums. */
static void int8_rows(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales, const int8_t *q,
                      int64_t ld, const float *qs, const int32_t *sums, const int64_t *index, int64_t r0, int64_t n,
                      int nr, float *out) {
    const int8_t *xr[16];
    int32_t acc[2][16], sum[16];
    for (int64_t r = 0; r < n; ++r) {
        int64_t i = index ? index[r0 + r] : r0 + r;
        xr[r] = q + i * ld, sum[r] = sums[i];
    }
    if (wt->fmt == FMT_A8W8 && wt->vnni)
        int8_dot_vnni(wt->k, rows, xr, sum, n, acc);
    else
        int8_dot(wt->fmt, wt->k, rows, xr, sum, n, acc);
    for (int w = 0; w < 2; ++w)
        for (int64_t r = 0; r < n; ++r) {
            float sw;
            memcpy(&sw, scales[w], 4);
            out[w * nr + r] = ((float)acc[w][r] * qs[index ? index[r0 + r] : r0 + r]) * sw;
        }
}

/* FC1 + SwiGLU of this thread's features [f0, f1) of expert e's slots [lo, hi). */
static void fc1_part(const step_t *s, int64_t e, int64_t lo, int64_t hi, int64_t f0, int64_t f1, float limit) {
    const float *rows[16];
    float out[32];
    for (int64_t r0 = lo; r0 < hi; r0 += s->rmax) {
        int64_t n = hi - r0 < s->rmax ? hi - r0 : s->rmax;
        if (rows16_chunk(&s->w1, n)) { /* the gate and up rows' 16-row panels */
            const int64_t F = s->F;
            rows16_set_t gate, up;
            for (int64_t r = 0; r < n; ++r) {
                const int64_t t = s->tok[r0 + r];
                gate.xq[r] = up.xq[r] = s->x16 + t * (s->H / 2);
                gate.sx[r] = up.sx[r] = s->x16s + t * (s->H / 4);
                gate.off[r] = up.off[r] = s->x16o + t * (s->H / 4);
            }
            for (int64_t b = f0 / ROWS16; b < f1 / ROWS16; ++b) {
                for (int64_t r = 0; r < n; ++r)
                    gate.out[r] = s->h + (r0 + r) * 2 * F + ROWS16 * b, up.out[r] = gate.out[r] + F;
                rows16_expert_rows(&s->w1, e, b, &gate, (int)n);
                rows16_expert_rows(&s->w1, e, F / ROWS16 + b, &up, (int)n);
            }
            continue;
        }
        int nr = gather_rows(s->xp, s->H, s->tok, r0, n, s->rmax, rows);
        for (int64_t f = f0; f < f1; ++f) {
            const uint8_t *w[2] = {row_at(&s->w1, e, f), row_at(&s->w1, e, s->F + f)};
            const uint8_t *sc[2] = {scales_at(&s->w1, e, f), scales_at(&s->w1, e, s->F + f)};
            if (a8g(s->w1.fmt)) {
                a8g_rows(&s->w1, w, sc, s->x8, s->H, s->x8b, s->x8o, s->tok, r0, n, nr, out);
            } else if (int8_activations(s->w1.fmt)) {
                int8_rows(&s->w1, w, sc, s->x8, s->H, s->x8s, s->x8sum, s->tok, r0, n, nr, out);
            } else if (n == 1 && s->w1.i16) {
                int64_t t = s->tok[r0];
                int64_t at = i16_scale_at(s->w1.i16, s->H, t, 0);
                s->dot16(&s->w1, w, sc, s->xq + t * s->H, s->xs + at, s->xo + at, out);
            } else {
                s->dot(&s->w1, w, sc, rows, nr, out);
            }
            for (int64_t r = 0; r < n; ++r) {
                s->h[(r0 + r) * 2 * s->F + f] = out[r];
                s->h[(r0 + r) * 2 * s->F + s->F + f] = out[nr + r];
            }
        }
    }
    /* SwiGLU of the features just computed, 2V at a time so each block is stored paired for FC2. */
    for (int64_t r = lo; r < hi; ++r) {
        const float *hr = s->h + r * 2 * s->F;
        float g = s->between ? s->gates[s->slot[r]] : 1.f, blk[128];
        /* fc2_part takes the int16 blocks only for a chunk of one row: the expert's last, when its
         * slot count leaves one over the chunks of rmax */
        int single = r == hi - 1 && (hi - lo - 1) % s->rmax == 0;
        for (int64_t c = f0; c < f1; c += 128) {
            int64_t m = f1 - c < 128 ? f1 - c : 128;
            swiglu_span(blk, hr + c, hr + s->F + c, 0, m, limit, g);
            layout_copy(s->a + r * s->F + c, blk, m, s->v, s->w2.layout);
            if (s->w2.rows16 && s->w2.rows16 != R16_A8W4) { /* int16 blocks (a8w4-int's after FC1, below): every row, chunks of up to ROWS16_MULTI read them; the blocks are whole inside a chunk of 128 */
                int16_t tmp[128];
                rows16_input((int)s->w2.rows16, blk, m, tmp, s->a16 + r * (s->F / 2) + c / 2, s->a16s + r * (s->F / 4) + c / I16_BLOCK,
                             s->a16o + r * (s->F / 4) + c / I16_BLOCK);
            } else if (s->w2.i16 && single) {
                int64_t at = i16_scale_at(s->w2.i16, s->F, r, c);
                quantize_i16_as(s->w2.i16, blk, m, s->aq + r * s->F + c, s->as + at, s->ao + at);
            }
        }
    }
}

/* FC2 of this thread's output columns [n0, n1) of expert e's slots [lo, hi), added into y. */
static void fc2_part(const step_t *s, int64_t e, int64_t lo, int64_t hi, int64_t n0, int64_t n1) {
    const float *rows[16];
    float out[32];
    for (int64_t r0 = lo; r0 < hi; r0 += s->rmax) {
        int64_t n = hi - r0 < s->rmax ? hi - r0 : s->rmax;
        if (rows16_chunk(&s->w2, n)) { /* 16 output columns a panel */
            float o16[ROWS16_MULTI][ROWS16];
            rows16_set_t in;
            for (int64_t r = 0; r < n; ++r) {
                in.xq[r] = s->a16 + (r0 + r) * (s->F / 2), in.sx[r] = s->a16s + (r0 + r) * (s->F / 4);
                in.off[r] = s->a16o + (r0 + r) * (s->F / 4), in.out[r] = o16[r];
            }
            for (int64_t b = n0 / ROWS16; b < n1 / ROWS16; ++b) {
                rows16_expert_rows(&s->w2, e, b, &in, (int)n);
                for (int64_t r = 0; r < n; ++r) {
                    const float g = s->between ? 1.f : s->gates[s->slot[r0 + r]];
                    float *yr = s->y + s->tok[r0 + r] * s->H + ROWS16 * b;
                    for (int i = 0; i < ROWS16; ++i) yr[i] += g * o16[r][i];
                }
            }
            continue;
        }
        int nr = gather_rows(s->a, s->F, NULL, r0, n, s->rmax, rows);
        const int64_t i16_at = i16_scale_at(s->w2.i16, s->F, r0, 0);
        for (int64_t c = n0; c < n1; c += 2) {
            int64_t c2 = c + 1 < n1 ? c + 1 : c; /* an odd count: the last row twice, once kept */
            const uint8_t *w[2] = {row_at(&s->w2, e, c), row_at(&s->w2, e, c2)};
            const uint8_t *sc[2] = {scales_at(&s->w2, e, c), scales_at(&s->w2, e, c2)};
            if (a8g(s->w2.fmt))
                a8g_rows(&s->w2, w, sc, s->a8, s->F, s->a8b, s->a8o, NULL, r0, n, nr, out);
            else if (int8_activations(s->w2.fmt))
                int8_rows(&s->w2, w, sc, s->a8, s->F, s->a8s, s->a8sum, NULL, r0, n, nr, out);
            else if (n == 1 && s->w2.i16)
                s->dot16(&s->w2, w, sc, s->aq + r0 * s->F, s->as + i16_at, s->ao + i16_at, out);
            else
                s->dot(&s->w2, w, sc, rows, nr, out);
            for (int64_t r = 0; r < n; ++r) {
                float g = s->between ? 1.f : s->gates[s->slot[r0 + r]];
                float *yr = s->y + s->tok[r0 + r] * s->H;
                yr[c] += g * out[r];
                if (c2 != c) yr[c2] += g * out[nr + r];
            }
        }
    }
}

static void run_parts(const step_t *s, float limit, int64_t part, int64_t parts) {
    int64_t f0, f1, n0, n1;
    split(s->F, 128, part, parts, &f0, &f1); /* whole T8 blocks of FC2's input per thread */
    for (int64_t e = 0; e < s->E && f0 < f1; ++e)
        if (s->start[e + 1] > s->start[e]) fc1_part(s, e, s->start[e], s->start[e + 1], f0, f1, limit);
#pragma omp barrier
    if (int8_activations(s->w2.fmt) || a8g(s->w2.fmt)) { /* FC2's input re-quantized per row: whole rows, after FC1 */
        int64_t r0, r1;
        split(s->S, 1, part, parts, &r0, &r1);
        for (int64_t r = r0; r < r1; ++r)
            if (a8g(s->w2.fmt)) {
                quantize_int8_blocks(&s->w2, s->a + r * s->F, s->a8 + r * s->F, s->a8b + r * (s->F / A8G_ROW_DIV),
                                     s->a8o + r * (s->F / A8G_ROW_DIV));
                if (s->w2.rows16) /* the same int8 blocks in order, as quads: every row (a few KB) */
                    rows16_input(R16_A8W4, s->a + r * s->F, s->F, s->a16tmp + r * s->F, s->a16 + r * (s->F / 2),
                                 s->a16s + r * (s->F / 4), s->a16o + r * (s->F / 4));
            } else
                s->a8s[r] = quantize_int8_row(s->a + r * s->F, s->F, s->w2.fmt == FMT_A8W4 ? a8w4_block(s->F) : 0,
                                              s->a8 + r * s->F, s->a8sum + r);
#pragma omp barrier
    }
    split(s->H, s->w2.rows16 ? ROWS16 : 2, part, parts, &n0, &n1); /* rows16: whole panels */
    for (int64_t e = 0; e < s->E && n0 < n1; ++e)
        if (s->start[e + 1] > s->start[e]) fc2_part(s, e, s->start[e], s->start[e + 1], n0, n1);
}

static qweight_t role(const int64_t *plan, int which, int64_t n, int64_t k) {
    const int64_t *f = plan + P_ROLES + which * W_FIELDS;
    qweight_t w = {(const uint8_t *)(intptr_t)f[W_DATA], (const uint8_t *)(intptr_t)f[W_SCALE], f[W_FMT], n, k,
                   f[W_GROUP], LAYOUT_NATURAL};
    return w;
}

/* Whether a single row's activations go to the loops as int16 blocks (quantize_i16), and how:
 * on AVX2 for the 4- and 8-bit weight-only formats (dot16_2), on AVX-512 for w8-int (dot16_512)
 * and, where the CPU has VNNI, w4-int rows of whole 128-element chunks whose groups the chunk's
 * lanes can take (w4_dot16_vnni); MOE_COMPILE_QDECODE_I16=0 keeps the fp32 loop (exact, slower). */
static int i16_form(int64_t fmt, int64_t k, int64_t group, int64_t isa) {
    const char *off = getenv("MOE_COMPILE_QDECODE_I16");
    if (k % I16_BLOCK || (off && strcmp(off, "0") == 0)) return 0;
    if (fmt == FMT_W8) return I16_NATURAL;
    if (isa == ISA_AVX512)
        return fmt == FMT_W4 && a8g_vnni() && k % 128 == 0 && (group == 32 || group == 64 || group % 128 == 0) ? I16_T4 : 0;
    return fmt == FMT_W4 || fmt == FMT_MXFP4 ? I16_PAIRED : 0;
}

/* A decode step.  Returns 0; -1 when its scratch (a few hundred KiB at most) could not be
 * allocated, -2 for an ISA this CPU lacks or a format / shape the loops do not take (nothing
 * computed either way).  A role's data pointer 0: the weights are kept as their rows16 panels
 * alone (a model loaded packed, moe_compile/quant/packed.py), which both roles must then have. */
int moe_qdecode_run(const int64_t *plan, float limit, int64_t nparts) {
    step_t s = {.T = plan[P_T], .H = plan[P_H], .F = plan[P_F], .K = plan[P_K], .E = plan[P_E],
                .between = plan[P_BETWEEN], .gates = (const float *)(intptr_t)plan[P_GATES],
                .y = (float *)(intptr_t)plan[P_Y]};
    s.S = s.T * s.K;
    s.w1 = role(plan, 0, 2 * s.F, s.H), s.w2 = role(plan, 1, s.H, s.F);
    int64_t isa = plan[P_ISA];
    if ((isa != ISA_AVX2 && isa != ISA_AVX512) || isa > moe_qdecode_best_isa()) return -2;
    for (int i = 0; i < 2; ++i) {
        const qweight_t *w = i ? &s.w2 : &s.w1;
        if (w->fmt < 1 || w->fmt >= FMT_COUNT || (has_scales(w->fmt) && (w->group % 32 || w->k % w->group)))
            return -2;
        if (int8_activations(w->fmt) && (w->k % 32 || w->group != w->k)) return -2; /* per channel, 32-wide blocks */
        if (a8g(w->fmt) && !a8g_ok(w->k, w->group)) return -2;
    }
    s.v = isa == ISA_AVX512 ? 16 : 8;
    s.w1.layout = layout_of(s.w1.fmt, s.w1.group, isa), s.w2.layout = layout_of(s.w2.fmt, s.w2.group, isa);
    a8g_setup(&s.w1, isa), a8g_setup(&s.w2, isa);
    s.dot = isa == ISA_AVX512 ? dot_512 : dot_2;
    s.dot16 = isa == ISA_AVX512 ? dot16_512 : dot16_2;
    s.rmax = isa == ISA_AVX512 ? RMAX_512 : RMAX_2;
    s.w1.i16 = i16_form(s.w1.fmt, s.w1.k, s.w1.group, isa), s.w2.i16 = i16_form(s.w2.fmt, s.w2.k, s.w2.group, isa);
    rows16_attach(&s.w1, plan[P_ROWS16], plan[P_ROWS16 + 1], isa, s.F % ROWS16 == 0);
    rows16_attach(&s.w2, plan[P_ROWS16 + 2], plan[P_ROWS16 + 3], isa, 1);
    if (!s.w1.data || !s.w2.data) { /* weights kept as their panels alone: every chunk on the rows16 loops */
        if (!s.w1.rows16 || !s.w2.rows16) return -2;
        s.rmax = ROWS16_MULTI;
    }
    /* rows16 roles' inputs: int32 [T, H/2] + [S, F/2], scales and offsets [T, H/4] + [S, F/4] each,
     * the int8 scratch [S, F] */
    const int64_t r16_ints = s.T * s.H / 2 + s.S * s.F / 2, r16_lanes = s.T * (s.H / 4) + s.S * (s.F / 4);
    int32_t *r16 = s.w1.rows16 || s.w2.rows16 ? malloc((size_t)(r16_ints + 2 * r16_lanes) * 4 + (size_t)(s.S * s.F) + 64)
                                               : NULL;
    int16_t *x16tmp = s.w1.rows16 ? malloc((size_t)s.H * 2 + 64) : NULL;
    int64_t *start = calloc((size_t)s.E + 2, sizeof(int64_t)), *tok = malloc((size_t)(2 * s.S + 1) * sizeof(int64_t));
    /* floats: xp, h, a, the int16 rows' scales and offsets of x and a, the int8 rows' scales;
     * int32: their sums; int16: x and a blocks; int8: x and a rows */
    int64_t floats = s.T * s.H + 2 * s.S * s.F + s.S * s.F + 2 * (s.T * s.H + s.S * s.F) / I16_LANE + 16;
    int64_t rows8 = s.T + s.S + 16;
    float *xp = aligned_alloc(64, (size_t)((floats + 2 * rows8) * 4 + (s.T * s.H + s.S * s.F) * 3 + 128) / 64 * 64);
    /* grouped a8: lane scales and offsets of x and a, (T H + S F) / A8G_ROW_DIV of each */
    int grouped = a8g(s.w1.fmt) || a8g(s.w2.fmt);
    float *blk = grouped ? malloc((size_t)(s.T * s.H + s.S * s.F) / A8G_ROW_DIV * 8 + 64) : NULL;
    int status = -1;
    if (!start || !tok || !xp || (grouped && !blk) || ((s.w1.rows16 || s.w2.rows16) && !r16) || (s.w1.rows16 && !x16tmp))
        goto done;
    if (r16) {
        s.x16 = r16, s.a16 = s.x16 + s.T * s.H / 2;
        s.x16s = (float *)(s.a16 + s.S * s.F / 2), s.a16s = s.x16s + s.T * (s.H / 4);
        s.x16o = (int32_t *)(s.a16s + s.S * (s.F / 4)), s.a16o = s.x16o + s.T * (s.H / 4);
        s.a16tmp = (int8_t *)(s.a16o + s.S * (s.F / 4));
    }
    if (grouped) {
        s.x8b = blk, s.a8b = blk + s.T * s.H / A8G_ROW_DIV;
        s.x8o = (int32_t *)(s.a8b + s.S * s.F / A8G_ROW_DIV), s.a8o = s.x8o + s.T * s.H / A8G_ROW_DIV;
    }
    const int64_t *ids = (const int64_t *)(intptr_t)plan[P_IDS];
    const float *x = (const float *)(intptr_t)plan[P_X];
    for (int64_t i = 0; i < s.S; ++i) /* a counting sort of the slots by expert; ids outside [0, E) dropped */
        if (ids[i] >= 0 && ids[i] < s.E) ++start[ids[i] + 2];
    for (int64_t e = 0; e < s.E; ++e) start[e + 2] += start[e + 1];
    int64_t *slot = tok + s.S;
    for (int64_t i = 0; i < s.S; ++i)
        if (ids[i] >= 0 && ids[i] < s.E) {
            int64_t p = start[ids[i] + 1]++;
            tok[p] = i / s.K, slot[p] = i;
        }
    s.start = start, s.tok = tok, s.slot = slot;
    s.xp = xp, s.h = xp + s.T * s.H, s.a = s.h + 2 * s.S * s.F;
    s.xs = s.a + s.S * s.F, s.as = s.xs + s.T * (s.H / I16_LANE);
    s.xo = (int32_t *)(s.as + s.S * (s.F / I16_LANE)), s.ao = s.xo + s.T * (s.H / I16_LANE);
    s.xq = (int16_t *)(s.ao + s.S * (s.F / I16_LANE) + 16), s.aq = s.xq + s.T * s.H;
    s.x8s = (float *)(s.aq + s.S * s.F), s.a8s = s.x8s + s.T;
    s.x8sum = (int32_t *)(s.a8s + s.S + 8), s.a8sum = s.x8sum + s.T;
    s.x8 = (int8_t *)(s.a8sum + s.S + 8), s.a8 = s.x8 + s.T * s.H;
    if (int8_activations(s.w1.fmt))
        for (int64_t t = 0; t < s.T; ++t)
            s.x8s[t] = quantize_int8_row(x + t * s.H, s.H, s.w1.fmt == FMT_A8W4 ? a8w4_block(s.H) : 0, s.x8 + t * s.H,
                                         s.x8sum + t);
    if (a8g(s.w1.fmt))
        for (int64_t t = 0; t < s.T; ++t)
            quantize_int8_blocks(&s.w1, x + t * s.H, s.x8 + t * s.H, s.x8b + t * (s.H / A8G_ROW_DIV),
                                 s.x8o + t * (s.H / A8G_ROW_DIV));
    for (int64_t t = 0; t < s.T; ++t) layout_copy(s.xp + t * s.H, x + t * s.H, s.H, s.v, s.w1.layout);
    if (s.w1.i16)
        for (int64_t t = 0; t < s.T; ++t) {
            int64_t at = i16_scale_at(s.w1.i16, s.H, t, 0);
            quantize_i16_as(s.w1.i16, x + t * s.H, s.H, s.xq + t * s.H, s.xs + at, s.xo + at);
        }
    if (s.w1.rows16)
        for (int64_t t = 0; t < s.T; ++t)
            rows16_input((int)s.w1.rows16, x + t * s.H, s.H, x16tmp, s.x16 + t * (s.H / 2), s.x16s + t * (s.H / 4),
                         s.x16o + t * (s.H / 4));
#pragma omp parallel num_threads(nparts)
    run_parts(&s, limit, omp_get_thread_num(), omp_get_num_threads());
    status = 0;
done:
    free(start), free(tok), free(xp), free(blk), free(r16), free(x16tmp);
    return status;
}

/* A dense linear y [T, N] = x [T, K] . W^T on one packed weight (attention projections, lm_head,
 * dense MLPs: kernels/cpu/dense.py): the E = 1, no-activation case of the decode step, i.e. its
 * FC2 phase alone with x as FC2's input, every row its own slot and weight 1.  The same loops,
 * so the same formats, ISA choice and exactness as a decode step's FC2.
 * Plan: [x, T, K, N, y, isa, data, scale, fmt, group, rows16 data, rows16 scale]; the last two 0, or
 * the weight's rows16 copy (above), which a T = 1 w4-int or group-wise a8w4-int call on AVX-512
 * VNNI then reads instead.
 * y is written whole.  Returns as moe_qdecode_run. */
enum { L_X, L_T, L_K, L_N, L_Y, L_ISA, L_ROLE, L_ROWS16 = L_ROLE + W_FIELDS, L_ROWS16_SCALE };

int moe_qdecode_linear(const int64_t *plan, int64_t nparts) {
    int64_t T = plan[L_T], K = plan[L_K], N = plan[L_N], isa = plan[L_ISA];
    const int64_t *f = plan + L_ROLE;
    qweight_t w = {(const uint8_t *)(intptr_t)f[W_DATA], (const uint8_t *)(intptr_t)f[W_SCALE], f[W_FMT], N, K,
                   f[W_GROUP], LAYOUT_NATURAL};
    if ((isa != ISA_AVX2 && isa != ISA_AVX512) || isa > moe_qdecode_best_isa() || T < 1) return -2;
    if (w.fmt < 1 || w.fmt >= FMT_COUNT || (has_scales(w.fmt) && (w.group % 32 || K % w.group))) return -2;
    if (int8_activations(w.fmt) && (K % 32 || w.group != K)) return -2;
    if (a8g(w.fmt) && !a8g_ok(K, w.group)) return -2;
    a8g_setup(&w, isa);
    const int loop = T == 1 && plan[L_ROWS16] ? rows16_loop(&w, isa) : 0;
    if (loop)
        return rows16_linear(loop, rows16_vnni(isa), (const float *)(intptr_t)plan[L_X], K, N, (const uint8_t *)(intptr_t)plan[L_ROWS16],
                             (const uint8_t *)(intptr_t)plan[L_ROWS16_SCALE], w.group, (float *)(intptr_t)plan[L_Y], nparts);
    step_t s = {.T = T, .H = N, .F = K, .K = 1, .E = 1, .S = T, .between = 0, .y = (float *)(intptr_t)plan[L_Y]};
    s.v = isa == ISA_AVX512 ? 16 : 8;
    s.w2 = w, s.w2.layout = layout_of(w.fmt, w.group, isa);
    s.dot = isa == ISA_AVX512 ? dot_512 : dot_2;
    s.dot16 = isa == ISA_AVX512 ? dot16_512 : dot16_2;
    s.rmax = isa == ISA_AVX512 ? RMAX_512 : RMAX_2;
    s.w2.i16 = i16_form(w.fmt, K, w.group, isa);
    int64_t *idx = malloc((size_t)(T + 2) * sizeof(int64_t));
    float *ones = malloc((size_t)T * sizeof(float));
    /* a [T, K] in the weight's layout, its int16 blocks' scales and offsets, the blocks, its int8
     * rows, scales, sums */
    size_t bytes = (size_t)(T * K * 4 + 2 * T * (K / I16_LANE) * 4 + 64 + T * K * 2 + T * K + 2 * (T + 16) * 4 + 128);
    float *a = aligned_alloc(64, (bytes + 63) / 64 * 64);
    float *blk = a8g(w.fmt) ? malloc((size_t)(T * K / A8G_ROW_DIV) * 8 + 64) : NULL; /* grouped a8: lane scales, offsets */
    int status = -1;
    if (!idx || !ones || !a || (a8g(w.fmt) && !blk)) goto done;
    s.a8b = blk, s.a8o = blk ? (int32_t *)(blk + T * K / A8G_ROW_DIV) : NULL;
    int64_t start[2] = {0, T};
    for (int64_t t = 0; t < T; ++t) idx[t] = t, ones[t] = 1.f;
    s.start = start, s.tok = idx, s.slot = idx, s.gates = ones;
    s.a = a, s.as = a + T * K, s.ao = (int32_t *)(s.as + T * (K / I16_LANE));
    s.aq = (int16_t *)(s.ao + T * (K / I16_LANE) + 16);
    s.a8s = (float *)(s.aq + T * K), s.a8sum = (int32_t *)(s.a8s + T + 16), s.a8 = (int8_t *)(s.a8sum + T + 16);
    const float *x = (const float *)(intptr_t)plan[L_X];
    for (int64_t t = 0; t < T; ++t) {
        layout_copy(s.a + t * K, x + t * K, K, s.v, s.w2.layout);
        if (s.w2.i16) {
            int64_t at = i16_scale_at(s.w2.i16, K, t, 0);
            quantize_i16_as(s.w2.i16, x + t * K, K, s.aq + t * K, s.as + at, s.ao + at);
        }
        if (int8_activations(w.fmt))
            s.a8s[t] = quantize_int8_row(s.a + t * K, K, w.fmt == FMT_A8W4 ? a8w4_block(K) : 0, s.a8 + t * K, s.a8sum + t);
        if (a8g(w.fmt))
            quantize_int8_blocks(&s.w2, x + t * K, s.a8 + t * K, s.a8b + t * (K / A8G_ROW_DIV), s.a8o + t * (K / A8G_ROW_DIV));
    }
    memset(s.y, 0, (size_t)(T * N) * sizeof(float));
#pragma omp parallel num_threads(nparts)
    {
        int64_t n0, n1;
        split(N, 2, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        if (n0 < n1) fc2_part(&s, 0, 0, T, n0, n1);
    }
    status = 0;
done:
    free(idx), free(ones), free(a), free(blk);
    return status;
}

/* Test entry: y [T, N] = x [T, K] . W^T of one group-wise a8 weight [N, K] (fmt FMT_A8W4G or
 * FMT_A8W8G, N even, T <= 16) by the decode loops alone on one thread (quantize_int8_blocks,
 * a8g_rows): no SwiGLU, no routing, so tests hold the loops to the format's grouped_matmul
 * (quant/a8w4_int.py, quant/a8w8_int.py) directly.  Returns 0, -2 for what the loops do not take,
 * -1 without memory. */
int moe_qdecode_a8g_matmul(const float *x, int64_t T, int64_t K, const uint8_t *data, const uint8_t *scale, int64_t N,
                           int64_t G, int64_t isa, int64_t fmt, float *y) {
    if (T < 1 || T > 16 || N % 2 || !a8g(fmt) || !a8g_ok(K, G) || (isa != ISA_AVX2 && isa != ISA_AVX512)
        || isa > moe_qdecode_best_isa())
        return -2;
    qweight_t w = {data, scale, fmt, N, K, G, LAYOUT_NATURAL};
    a8g_setup(&w, isa);
    const int64_t lanes = K / A8G_ROW_DIV;
    int8_t *q = malloc((size_t)(T * K) + 64);
    float *sxe = malloc((size_t)(T * lanes) * 4 + 64);
    int32_t *off = malloc((size_t)(T * lanes) * 4 + 64);
    int status = -1;
    if (q && sxe && off) {
        for (int64_t t = 0; t < T; ++t) quantize_int8_blocks(&w, x + t * K, q + t * K, sxe + t * lanes, off + t * lanes);
        float out[32];
        for (int64_t n = 0; n < N; n += 2) {
            const uint8_t *rows[2] = {row_at(&w, 0, n), row_at(&w, 0, n + 1)}, *sc[2] = {scales_at(&w, 0, n), scales_at(&w, 0, n + 1)};
            a8g_rows(&w, rows, sc, q, K, sxe, off, NULL, 0, T, (int)T, out);
            for (int64_t t = 0; t < T; ++t) y[t * N + n] = out[t], y[t * N + n + 1] = out[T + t];
        }
        status = 0;
    }
    free(q), free(sxe), free(off);
    return status;
}

#else /* ------------------------------------------------------------- per-ISA part (QDECODE_ISA) */

#if QDECODE_ISA == 512
#define SFX(name) name##_512
#define V 16
#define vf __m512
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSET1(f) _mm512_set1_ps(f)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VHSUM(v) _mm512_reduce_add_ps(v)
/* Rows of x per pass: 2 weight rows x 8 x rows = 16 accumulators of the 32 zmm registers. */
enum { RMAX_512 = 8 };
#define RMAX RMAX_512
#else
#define SFX(name) name##_2
#define V 8
#define vf __m256
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSET1(f) _mm256_set1_ps(f)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
static inline float SFX(hsum)(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VHSUM(v) SFX(hsum)(v)
/* 2 weight rows x 4 x rows = 8 accumulators of the 16 ymm registers. */
enum { RMAX_2 = 4 };
#define RMAX RMAX_2
#endif

/* What a group's scale turns into for the loop (a scaled lookup table, or the scale itself). */
typedef struct {
    vf t, u;
} SFX(gscale);

ALWAYS_INLINE SFX(gscale) SFX(group_setup)(const int fmt, float s) {
    SFX(gscale) g;
#if QDECODE_ISA == 512
    if (fmt == FMT_W4) {
        g.t = VMUL(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), VSET1(s)), g.u = g.t;
    } else if (fmt == FMT_MXFP4) {
        g.t = VMUL(_mm512_loadu_ps(E2M1), VSET1(s)), g.u = g.t;
    }
#else
    if (fmt == FMT_W4) {
        g.t = VSET1(s), g.u = VSET1(-8.f * s); /* (u - 8) s = fma(u, s, -8 s), exact: it is representable */
    } else if (fmt == FMT_MXFP4) {
        g.t = VMUL(_mm256_loadu_ps(E2M1), VSET1(s)), g.u = g.t; /* |value| * s; the sign from bit 3 */
    }
#endif
    else {
        g.t = VSET1(s), g.u = g.t;
    }
    return g;
}

/* Elements k .. k + 2V - 1 of a row as two vectors of fp32 weights (paired or in order, see the
 * header), scaled by the group's scale. */
ALWAYS_INLINE void SFX(dequant)(const int fmt, const uint8_t *row, int64_t k, SFX(gscale) g, vf *w0, vf *w1) {
#if QDECODE_ISA == 512
    if (fmt == FMT_W4 || fmt == FMT_MXFP4) {
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k / 2)));
        *w0 = _mm512_permutexvar_ps(d, g.t);
        *w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), g.t);
    } else if (fmt == FMT_W8) {
        *w0 = VMUL(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k)))), g.t);
        *w1 = VMUL(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k + 16)))), g.t);
    } else if (fmt == FMT_BF16) {
        __m512i b = _mm512_loadu_si512((const void *)(row + 2 * k));
        *w0 = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
        *w1 = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xFFFF0000u)));
    } else if (fmt == FMT_FP16) {
        *w0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * k)));
        *w1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * k + 32)));
    } else { /* FMT_MXFP8: e4m3 bits placed in an fp32 (exponent 2^-120 off, subnormals included), then scaled */
        __m512i d0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k)));
        __m512i d1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k + 16)));
        const __m512i mag = _mm512_set1_epi32(0x7F), sign = _mm512_set1_epi32((int)0x80000000u);
        const __m512 two120 = _mm512_set1_ps(0x1p120f), nan = _mm512_set1_ps(__builtin_nanf(""));
        __m512i m0 = _mm512_and_si512(d0, mag), m1 = _mm512_and_si512(d1, mag);
        __m512i b0 = _mm512_ternarylogic_epi32(_mm512_slli_epi32(m0, 20), _mm512_slli_epi32(d0, 24), sign, 0xF8);
        __m512i b1 = _mm512_ternarylogic_epi32(_mm512_slli_epi32(m1, 20), _mm512_slli_epi32(d1, 24), sign, 0xF8);
        *w0 = VMUL(VMUL(_mm512_castsi512_ps(b0), two120), g.t);
        *w1 = VMUL(VMUL(_mm512_castsi512_ps(b1), two120), g.t);
        *w0 = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(m0, mag), *w0, nan);
        *w1 = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(m1, mag), *w1, nan);
    }
#else
    if (fmt == FMT_W4) {
        __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k / 2)));
        *w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(15))), g.t, g.u);
        *w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(d, 4)), g.t, g.u);
    } else if (fmt == FMT_MXFP4) {
        __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k / 2)));
        __m256i dh = _mm256_srli_epi32(d, 4);
        const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
        __m256 s0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28), sign));
        __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(dh, 28)); /* dh < 16: bits 28..30 hold its 3 low bits */
        s1 = _mm256_and_ps(s1, _mm256_castsi256_ps(sign));
        *w0 = _mm256_xor_ps(_mm256_permutevar8x32_ps(g.t, d), s0);
        *w1 = _mm256_xor_ps(_mm256_permutevar8x32_ps(g.t, dh), s1);
    } else if (fmt == FMT_W8) {
        *w0 = VMUL(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k)))), g.t);
        *w1 = VMUL(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k + 8)))), g.t);
    } else if (fmt == FMT_BF16) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(row + 2 * k));
        *w0 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
        *w1 = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xFFFF0000u)));
    } else if (fmt == FMT_FP16) {
        *w0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k)));
        *w1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * k + 16)));
    } else { /* FMT_MXFP8, as the AVX-512 branch */
        __m256i d0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k)));
        __m256i d1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k + 8)));
        const __m256i mag = _mm256_set1_epi32(0x7F), sign = _mm256_set1_epi32((int)0x80000000u);
        const __m256 two120 = _mm256_set1_ps(0x1p120f), nan = _mm256_set1_ps(__builtin_nanf(""));
        __m256i m0 = _mm256_and_si256(d0, mag), m1 = _mm256_and_si256(d1, mag);
        __m256i b0 = _mm256_or_si256(_mm256_slli_epi32(m0, 20), _mm256_and_si256(_mm256_slli_epi32(d0, 24), sign));
        __m256i b1 = _mm256_or_si256(_mm256_slli_epi32(m1, 20), _mm256_and_si256(_mm256_slli_epi32(d1, 24), sign));
        *w0 = VMUL(VMUL(_mm256_castsi256_ps(b0), two120), g.t);
        *w1 = VMUL(VMUL(_mm256_castsi256_ps(b1), two120), g.t);
        *w0 = _mm256_blendv_ps(*w0, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m0, mag)));
        *w1 = _mm256_blendv_ps(*w1, nan, _mm256_castsi256_ps(_mm256_cmpeq_epi32(m1, mag)));
    }
#endif
}

/* One 2V-element chunk at element k of NW weight rows into R rows' accumulators: dequantize once,
 * FMA into acc[w][r][j0] (first vector) and acc[w][r][j1] (second). */
ALWAYS_INLINE void SFX(chunk)(const int fmt, const int NW, const int R, const uint8_t *const *rows,
                              const float *const *x, int64_t k, const SFX(gscale) *gs, vf acc[2][RMAX][4],
                              const int j0, const int j1) {
    vf w0[2], w1[2];
    /* one prefetch per 64-byte line: a chunk is 16 (AVX2 4-bit) to 64 bytes */
    const int64_t at = fmt == FMT_W4 || fmt == FMT_MXFP4 ? k / 2 : fmt == FMT_BF16 || fmt == FMT_FP16 ? 2 * k : k;
    const int64_t ahead = fmt == FMT_W4 || fmt == FMT_MXFP4 ? PREFETCH_4BIT_BYTES
                          : fmt == FMT_BF16 || fmt == FMT_FP16 ? 2 * PREFETCH_ELEMENTS : PREFETCH_ELEMENTS;
    _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) {
        if ((at & 63) == 0) _mm_prefetch((const char *)(rows[w] + at + ahead), PREFETCH_HINT);
        SFX(dequant)(fmt, rows[w], k, gs[w], &w0[w], &w1[w]);
    }
    _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
        vf x0 = VLOAD(x[r] + k), x1 = VLOAD(x[r] + k + V);
        _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) {
            acc[w][r][j0] = VFMA(w0[w], x0, acc[w][r][j0]);
            acc[w][r][j1] = VFMA(w1[w], x1, acc[w][r][j1]);
        }
    }
}

#if QDECODE_ISA == 512
/* One 128-element block (64 bytes) of NW 4-bit rows in the T8 layout: lane i of the 32-bit view
 * holds bytes 4i..4i+3, i.e. elements 8i..8i+7; shifted right by 4j its low nibble is element 8i+j,
 * looked up in the unscaled table (vpermps reads the low 4 bits).  No byte-widening shuffle, one
 * table per format: the per-lane group scales `sv` multiply each row's partial sums once per block
 * (a lane's 8 elements share their group).  Partial chains: 2 for up to two x rows, else 1. */
ALWAYS_INLINE void t8_block(const int NW, const int R, const uint8_t *const *rows, const float *const *x,
                            int64_t k, __m512 tbl, const __m512 *sv, vf acc[2][RMAX][4]) {
    const int NP = R <= 2 ? 2 : 1;
    __m512i d[2];
    vf p[2][RMAX][2];
    _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) {
        d[w] = _mm512_loadu_si512((const void *)(rows[w] + k / 2));
        _mm_prefetch((const char *)(rows[w] + k / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
    }
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) {
        vf wj[2];
        _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w)
            wj[w] = _mm512_permutexvar_ps(j ? _mm512_srli_epi32(d[w], 4 * j) : d[w], tbl);
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
            vf xj = VLOAD(x[r] + k + 16 * j);
            _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) {
                const int c = NP == 2 ? (j & 1) : 0;
                p[w][r][c] = j < NP ? VMUL(wj[w], xj) : VFMA(wj[w], xj, p[w][r][c]);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w)
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
            _Pragma("GCC unroll 2") for (int c = 0; c < NP; ++c) acc[w][r][c] = VFMA(p[w][r][c], sv[w], acc[w][r][c]);
}
#endif

/* NW weight rows (1 or 2) against R x rows, both compile-time: the loop every format and row count
 * is instantiated from.  Accumulator chains per (weight row, x row): 4 for one x row, 2 for two,
 * else 1, so that at least 8 FMA chains are in flight where the registers allow (an FMA's latency
 * is 4 cycles, two issue per cycle).  Groups of 32 (the default and MX's) run one flat loop, two
 * groups an iteration; other groups a loop per group. */
ALWAYS_INLINE void SFX(dot_body)(const int fmt, const int NW, const int R, const qweight_t *wt,
                                 const uint8_t *const *rows, const uint8_t *const *scales, const float *const *x,
                                 float *out) {
    const int NA = R == 1 ? 4 : R == 2 ? 2 : 1;
    vf acc[2][RMAX][4];
    _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w)
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r)
            _Pragma("GCC unroll 4") for (int j = 0; j < NA; ++j) acc[w][r][j] = VZERO();
    const int64_t K = wt->k, G = has_scales(fmt) ? wt->group : K, blocks = K / (2 * V) * (2 * V);
    float sbuf[2][SEG + 16]; /* + 16: T8 reads a whole vector of scales from any group */
    SFX(gscale) gs[2], gs2[2];
    if (!has_scales(fmt)) {
        _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) gs[w] = SFX(group_setup)(fmt, 1.f);
        int64_t k = 0;
        for (; NA == 4 && k + 4 * V <= blocks; k += 4 * V) {
            SFX(chunk)(fmt, NW, R, rows, x, k, gs, acc, 0, 1);
            SFX(chunk)(fmt, NW, R, rows, x, k + 2 * V, gs, acc, 2, 3);
        }
        for (; k < blocks; k += 2 * V) SFX(chunk)(fmt, NW, R, rows, x, k, gs, acc, 0, NA - 1);
    }
    for (int64_t seg = 0; has_scales(fmt) && seg < K; seg += SEG * G) { /* K is whole groups of 32 */
        int64_t end = seg + SEG * G < K ? seg + SEG * G : K;
        _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) convert_scales(fmt, scales[w], seg / G, (end - seg) / G, sbuf[w]);
#if QDECODE_ISA == 512
        if ((fmt == FMT_W4 || fmt == FMT_MXFP4) && wt->layout == LAYOUT_T8) {
            /* lane i of a block starting at k reads group (k + 8 i) / G: (k - seg) / G + 8 i / G */
            const __m512i lane_group = _mm512_srlv_epi32(_mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96,
                                                                             104, 112, 120),
                                                         _mm512_set1_epi32(__builtin_ctzll((uint64_t)G)));
            const __m512 tbl = fmt == FMT_W4 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                             : _mm512_loadu_ps(E2M1);
            int64_t k = seg;
            for (; k + 128 <= end; k += 128) {
                __m512 sv[2];
                _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w)
                    sv[w] = _mm512_permutexvar_ps(lane_group, _mm512_loadu_ps(sbuf[w] + (k - seg) / G));
                t8_block(NW, R, rows, x, k, tbl, sv, acc);
            }
            for (; k < end; k += 2 * V) { /* the row's last K mod 128 elements, PAIRED */
                _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) gs[w] = SFX(group_setup)(fmt, sbuf[w][(k - seg) / G]);
                SFX(chunk)(fmt, NW, R, rows, x, k, gs, acc, 0, NA > 1);
            }
            continue;
        }
#endif
        if (G == 32) {
            for (int64_t k = seg; k < end; k += 64) { /* two groups: K / 32 may be odd */
                const int two = k + 64 <= end;
                _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) {
                    gs[w] = SFX(group_setup)(fmt, sbuf[w][(k - seg) >> 5]);
                    gs2[w] = SFX(group_setup)(fmt, sbuf[w][((k - seg) >> 5) + two]);
                }
                _Pragma("GCC unroll 2") for (int c = 0; c < 32; c += 2 * V) SFX(chunk)(fmt, NW, R, rows, x, k + c, gs, acc, 0, NA > 1);
                if (two)
                    _Pragma("GCC unroll 2") for (int c = 32; c < 64; c += 2 * V)
                        SFX(chunk)(fmt, NW, R, rows, x, k + c, gs2, acc, NA - 1 - (NA > 1), NA - 1);
            }
        } else {
            for (int64_t k0 = seg; k0 < end; k0 += G) {
                _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w) gs[w] = SFX(group_setup)(fmt, sbuf[w][(k0 - seg) / G]);
                for (int64_t k = k0; k < k0 + G; k += 2 * V) SFX(chunk)(fmt, NW, R, rows, x, k, gs, acc, 0, NA - 1);
            }
        }
    }
    _Pragma("GCC unroll 2") for (int w = 0; w < NW; ++w)
        _Pragma("GCC unroll 8") for (int r = 0; r < R; ++r) {
            vf v = acc[w][r][0];
            _Pragma("GCC unroll 4") for (int j = 1; j < NA; ++j) v = VADD(v, acc[w][r][j]);
            float sum = VHSUM(v);
            for (int64_t k = blocks; k < K; ++k) sum += element(fmt, rows[w], k) * x[r][k]; /* w16 tails */
            out[w * R + r] = sum;
        }
}

/* One function per (format, row count) with both weight rows; dot_<isa> picks it. */
#define DOT_FOR(FMT, R)                                                                                      \
    static void SFX(dot_##FMT##_##R)(const qweight_t *wt, const uint8_t *const *rows,                        \
                                     const uint8_t *const *scales, const float *const *x, float *out) {      \
        SFX(dot_body)(FMT, 2, R, wt, rows, scales, x, out);                                                   \
    }
#if QDECODE_ISA == 512
#define DOT_ROWS(FMT) DOT_FOR(FMT, 1) DOT_FOR(FMT, 2) DOT_FOR(FMT, 3) DOT_FOR(FMT, 4) DOT_FOR(FMT, 6) DOT_FOR(FMT, 8)
#define DOT_CASES(FMT)                                                                                       \
    switch (nr) {                                                                                            \
    case 1: SFX(dot_##FMT##_1)(wt, rows, scales, x, out); return;                                            \
    case 2: SFX(dot_##FMT##_2)(wt, rows, scales, x, out); return;                                            \
    case 3: SFX(dot_##FMT##_3)(wt, rows, scales, x, out); return;                                            \
    case 4: SFX(dot_##FMT##_4)(wt, rows, scales, x, out); return;                                            \
    case 6: SFX(dot_##FMT##_6)(wt, rows, scales, x, out); return;                                            \
    default: SFX(dot_##FMT##_8)(wt, rows, scales, x, out); return;                                           \
    }
#else
#define DOT_ROWS(FMT) DOT_FOR(FMT, 1) DOT_FOR(FMT, 2) DOT_FOR(FMT, 3) DOT_FOR(FMT, 4)
#define DOT_CASES(FMT)                                                                                       \
    switch (nr) {                                                                                            \
    case 1: SFX(dot_##FMT##_1)(wt, rows, scales, x, out); return;                                            \
    case 2: SFX(dot_##FMT##_2)(wt, rows, scales, x, out); return;                                            \
    case 3: SFX(dot_##FMT##_3)(wt, rows, scales, x, out); return;                                            \
    default: SFX(dot_##FMT##_4)(wt, rows, scales, x, out); return;                                           \
    }
#endif
DOT_ROWS(FMT_BF16)
DOT_ROWS(FMT_FP16)
DOT_ROWS(FMT_W8)
DOT_ROWS(FMT_W4)
DOT_ROWS(FMT_MXFP4)
DOT_ROWS(FMT_MXFP8)

/* 4- and 8-bit weights against one input row held as int16 blocks (see quantize_i16 for why): two
 * rows, one I16_BLOCK per step, then one convert and one fma with the block's scale.
 * AVX2 (dot16_2; w4-int, mxfp4, w8-int): the nibbles mapped by vpshufb to the format's values as
 * integers (w4-int u - 8; mxfp4 twice its e2m1 value, so the scale takes the 1/2), int8
 * sign-extended; two vpmaddwd of 16 lanes.  |q| <= 127: the 4-product lane sums < 2^24, exact as fp32.
 * AVX-512 (dot16_512; w8-int, i16_form): the block's 32 int8 sign-extended to one zmm and one
 * vpmaddwd: 5 vector operations per 32 weights a row where the fp32 loop takes 8 (convert, scale
 * and fma of every 16), which holds w8-int at ~9 GB/s of weights a core, under the memory's speed
 * with 2 threads.  w4-int with VNNI goes to w4_dot16_vnni (128 weights a step, I16_T4); mxfp4
 * keeps AVX-512's fp32 loop, whose permute lookup gives its values directly. */
static void SFX(dot16)(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                       const int16_t *xq, const float *xs, const int32_t *xo, float *out) {
#if QDECODE_ISA == 512
    if (wt->i16 == I16_T4) {
        w4_dot16_vnni(wt, rows, scales, xq, xs, xo, out);
        return;
    }
#else
    (void)xo;
#endif
    const uint64_t K = (uint64_t)wt->k, G = (uint64_t)wt->group, blocks_per_group = G / I16_BLOCK;
#if QDECODE_ISA == 2
    const int mx = wt->fmt == FMT_MXFP4, w8 = wt->fmt == FMT_W8;
    const __m128i low = _mm_set1_epi8(15);
    const __m128i values = mx ? _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
                              : _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    const float unit = mx ? 0.5f : 1.f;
#else
    const float unit = 1.f;
#endif
    vf acc[2] = {VZERO(), VZERO()};
    float sbuf[2][SEG];
    for (uint64_t seg = 0; seg < K; seg += SEG * G) {
        uint64_t end = seg + SEG * G < K ? seg + SEG * G : K;
        for (int w = 0; w < 2; ++w) convert_scales(wt->fmt, scales[w], (int64_t)(seg / G), (int64_t)((end - seg) / G), sbuf[w]);
        uint64_t g = 0, in_group = 0;
        for (uint64_t k0 = seg; k0 < end; k0 += I16_BLOCK) {
#if QDECODE_ISA == 2
            __m256i qe = _mm256_loadu_si256((const __m256i *)(xq + k0));
            __m256i qo = _mm256_loadu_si256((const __m256i *)(xq + k0 + I16_BLOCK / 2));
#else
            __m512i q = _mm512_loadu_si512((const void *)(xq + k0));
#endif
            float sx = xs[k0 / I16_BLOCK] * unit;
            _Pragma("GCC unroll 2") for (int w = 0; w < 2; ++w) {
#if QDECODE_ISA == 2
                __m256i lo, hi; /* the block's elements as int16: 4-bit evens / odds, int8 first / second half */
                if (w8) {
                    _mm_prefetch((const char *)(rows[w] + k0 + PREFETCH_ELEMENTS), PREFETCH_HINT);
                    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rows[w] + k0)));
                    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rows[w] + k0 + 16)));
                } else {
                    _mm_prefetch((const char *)(rows[w] + k0 / 2 + PREFETCH_4BIT_BYTES), PREFETCH_HINT);
                    __m128i v = _mm_loadu_si128((const __m128i *)(rows[w] + k0 / 2));
                    lo = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(values, _mm_and_si128(v, low)));
                    hi = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(values, _mm_and_si128(_mm_srli_epi16(v, 4), low)));
                }
                __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(lo, qe), _mm256_madd_epi16(hi, qo)));
#else
                _mm_prefetch((const char *)(rows[w] + k0 + PREFETCH_ELEMENTS), PREFETCH_HINT);
                __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(rows[w] + k0)));
                __m512 p = _mm512_cvtepi32_ps(_mm512_madd_epi16(v, q));
#endif
                acc[w] = VFMA(p, VSET1(sbuf[w][g] * sx), acc[w]);
            }
            if (++in_group == blocks_per_group) in_group = 0, ++g;
        }
    }
    for (int w = 0; w < 2; ++w) out[w] = VHSUM(acc[w]);
}

/* out[w * nr + r] = row w . x_r for the two rows and nr x rows (nr one of the instantiated counts). */
static void SFX(dot)(const qweight_t *wt, const uint8_t *const *rows, const uint8_t *const *scales,
                     const float *const *x, int nr, float *out) {
    switch (wt->fmt) {
    case FMT_BF16: DOT_CASES(FMT_BF16)
    case FMT_FP16: DOT_CASES(FMT_FP16)
    case FMT_W8: DOT_CASES(FMT_W8)
    case FMT_W4: DOT_CASES(FMT_W4)
    case FMT_MXFP4: DOT_CASES(FMT_MXFP4)
    default: DOT_CASES(FMT_MXFP8)
    }
}

#undef SFX
#undef V
#undef VZERO
#undef vf
#undef VLOAD
#undef VSET1
#undef VFMA
#undef VMUL
#undef VADD
#undef VHSUM
#undef RMAX
#undef DOT_FOR
#undef DOT_ROWS
#undef DOT_CASES
#endif
