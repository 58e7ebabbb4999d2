/* qdecode.c's shared definitions: the weight formats, a role's weights (qweight_t) and how its input
 * rows are laid out, prefetch distances, scale and element conversions, the row split over threads,
 * and the types of the per-ISA dot functions.  Included once, first, by qdecode.c (its parts build on
 * it); the pragma below sets F16C for the rest of that unit. */
#ifndef MOE_QDECODE_H
#define MOE_QDECODE_H
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

#endif /* MOE_QDECODE_H */
