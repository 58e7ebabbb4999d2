/* Quantized prefill: every expert's SwiGLU FFN of a CPU call (T > 16 rows) in one kernel call, on
 * weights of a quantized format (called by kernels/cpu/qgemm.py's run, the prefill half of
 * kernels/cpu/quant.py's dispatch; the decode half is qdecode.c).
 *
 * Shapes:   T tokens, H hidden, F expert FFN width; slots sorted by expert, expert e owning rows
 *           [bounds[e], bounds[e+1]) of tok [S'] (each slot's token) and scale [S'] (its routing
 *           weight).  FC1 W1 [2F, H] (gate rows then up rows), FC2 W2 [H, F], y = x W^T.
 * Formats:  integer GEMM (activations quantized per token to int8, int32 accumulation):
 *             a8w8-int  int8 weights, fp32 scale per output channel
 *             a8w4-int  4-bit weights u = q + 8, fp32 scale per output channel
 *           y = acc * s_x * s_w; FC2's input (the SwiGLU output, fp32) re-quantized per row.
 *           Group-wise a8w4-int / a8w8-int (activations int8 per token and block of 32, fp16 group
 *           scales: quant/a8w4_int.py, quant/a8w8_int.py) run their own integer semantics on
 *           w4-int's / w8-int's panels (their bytes are theirs): the block tiles of blocktiles.h,
 *           exact int32 sums a block, y = sum_b (acc_b s_x) s_w (ACT_INT; a8w8-int with AVX-512
 *           VNNI only).  Elsewhere, and on request, they run as those formats' float panels on
 *           activations quantized per block and dequantized (x by the host, FC2's input here:
 *           fake_quantize_blocks), so y equals its reference up to fp32 rounding: sum_k (q_x s_x)
 *           (q_w s_w) instead (ACT_FLOAT).
 *           Float GEMM on fp32 activations, one weight panel dequantized at a time into a
 *           [K][16] fp32 buffer of the thread (never a dequantized copy of a whole weight):
 *             w4-int (nibble - 8) * fp16 group scale, mxfp4 e2m1 * 2^(e8m0 - 127),
 *             w8-int q * fp16 group scale, mxfp8 e4m3 * 2^(e8m0 - 127), w16 bf16 / fp16.
 * Panels:   16 output rows each (qgemm.py packs them once):
 *             int8 (a8w8)   [K/4][16][4] bytes: byte (k, j) at (k/4)*64 + 4j + k%4
 *             4-bit (a8w4)  [K/8][16][4] bytes: (k, j) in byte (k/8)*64 + 4j + k%4, low nibble
 *                           for k%8 < 4, high nibble else
 *             float formats, 8- and 4-bit codes [K'/4][16][4] bytes (K' bytes a row, the
 *                           canonical packing): lane j of vector c = row j's bytes 4c .. 4c + 3
 *                           (8-bit: k = 4c + i in byte i; 4-bit: k = 8c + i at bits 4i), the
 *                           layout qdecode.c's rows16 loops read for dense T = 1 too; w16 [K][16]
 *                           elements; scales [K/G][16] in the format's own dtype
 *           so one 32-bit lane of a vector holds 4 (or 8) k of one column: what vpdpbusd /
 *           vpmaddubsw reduce.
 * Tiles:    integer: MR rows x two V-column blocks of int32 accumulators over the whole K.
 *             AVX-512 VNNI 8 x (16 + 16): vpdpbusd (u8 x s8, exact int32).  a8w8: activations
 *               offset to u8 (q + 128), so acc = sum (q + 128) w, less 128 * colsum(w) (pack
 *               time); a8w4: the nibbles u are the unsigned operand, acc = sum u q_x, less
 *               8 * sum(q_x) (per row).
 *             AVX2 4 x (8 + 8): vpmaddubsw + vpmaddwd.  a8w8 with the sign trick
 *               (|a| x sign(w, a): pairs stay <= 2 * 127 * 127 < 2^15, no saturation); a8w4 with
 *               the nibbles unsigned as above (pairs <= 2 * 15 * 127).
 *           float: fp32 FMA tiles, AVX-512 8 x (16 + 16) reading A's rows in place, AVX2 6 x (8 + 8)
 *           reading A tile-packed (x's rows packed per chunk by the team, FC1 writing its output so);
 *           with AVX-512 BF16 (the call's bf16 field, every float format but w16) bf16 tiles 8 x
 *           (16 + 16), vdpbf16ps on x, FC2's input and the dequantized panels rounded to bf16.
 *           FC1's two blocks are gate and up of the same features, FC2's consecutive columns of y.
 * Threads:  as experts.c: each GEMM splits its column units evenly over the OpenMP team (every
 *           weight read once, each column of y one writer); per chunk of an expert's rows one
 *           barrier after FC1 (and one after the re-quantization for integer formats).
 *
 * Files:    one translation unit (as qdecode.c, for the same reason: static helpers inlined across
 *           parts, the code what one file gave): this file includes its parts in order, each using
 *           what the ones before it define, then holds the entry points the host binds:
 *             qgemm.h          tile sizes, the formats, small helpers (and tiles.h, blocktiles.h)
 *             qgemm_tiles.c    the integer tiles (AVX-512 VNNI, AVX2) and the AVX2 fp32 tile
 *             qgemm_dequant.c  a float-format panel dequantized to fp32 [K][16] (AVX2, AVX-512)
 *             qgemm_bf16.c     the bf16 tiles (AVX-512 BF16): panels and rows as bf16 k-pairs
 *             qgemm_phases.c   per-token int8 quantization, the call's state, the integer and
 *                              float FC1 / FC2 phases
 *             qgemm_block.c    group-wise a8w4-int / a8w8-int on the block tiles, and the
 *                              quantizers of FC2's input
 *
 * Built by moe_compile/kernels/cpu/cc.py (with its qgemm_*.c parts and the folder's headers) with
 * `cc -O3 -mavx2 -mfma -fopenmp` on first use; the AVX-512 tiles are compiled for their target
 * alone and run only where the CPU has it.
 */
#include "qgemm.h"         /* tile sizes, formats, helpers (tiles.h, blocktiles.h) */
#include "qgemm_tiles.c"   /* integer tiles, AVX2 fp32 tile */
#include "qgemm_dequant.c" /* float-format panels to fp32 */
#include "qgemm_bf16.c"    /* bf16 tiles */
#include "qgemm_phases.c"  /* row quantizer, call state, integer and float FC phases */
#include "qgemm_block.c"   /* group-wise a8 block-tile phases */

/* ---- entry points ---- */

/* Bit 0: AVX-512F (float tiles), bit 1: AVX-512 VNNI + BW (integer tiles), bit 2: AVX-512 BF16 + BW
 * (the float formats' bf16 tiles). */
int64_t moe_qgemm_cpu_features(void) {
    __builtin_cpu_init();
    int64_t f = 0;
    if (__builtin_cpu_supports("avx512f")) f |= 1;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
        f |= 2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16"))
        f |= 4;
    return f;
}

static int isa_ok(int isa, int fmt) {
    if (isa == ISA_AVX2) return 1;
    int64_t need = is_int(fmt) ? 2 : 1;
    return isa == ISA_AVX512 && (moe_qgemm_cpu_features() & need) == need;
}

/* Call fields, int64 each (pointers as integers):
 *   x, ldx, y, ldy, tok, scale, H, F, G1, G2, chunk, scratch, isa, fmt, between, qx, sx, sumx, qa, sa, suma,
 *   act_blocks (grouped a8w4-int / a8w8-int on FMT_W4 / FMT_W8 panels, F % 32 == 0: ACT_FLOAT, x already
 *   quantized per block and dequantized by the host, the float tiles; ACT_INT, the integer block tiles
 *   (a8w4-int on FMT_W4, a8w8-int on FMT_W8 with AVX-512 VNNI; groups multiples of 32, no bf16), x
 *   as it is, quantized here),
 *   bf16 (1: the float formats' bf16 tiles, AVX-512 BF16 only; not w16)
 * experts: E rows of (w1, w2, s1, s2, cs1, cs2) pointers; bounds: E + 1 slot offsets.  scratch:
 * FC1's output of two chunks, 2 * (chunk + MR_MAX) * F floats; qx [T, H] bytes, sx / sumx [T];
 * qa [chunk + MR_MAX, F] bytes, sa / suma [chunk + MR_MAX] (integer formats; sumx / suma used by
 * a8w4 alone, may be 0 otherwise).  Returns 0; -1 for an ISA this CPU lacks or sizes the tiles do
 * not divide; -2 when the dequantization buffers cannot be allocated. */
enum { C_X, C_LDX, C_Y, C_LDY, C_TOK, C_SCALE, C_H, C_F, C_G1, C_G2, C_CHUNK, C_SCRATCH, C_ISA, C_FMT, C_BETWEEN,
       C_QX, C_SX, C_SUMX, C_QA, C_SA, C_SUMA, C_ACT_BLOCKS, C_BF16, C_FIELDS };
#define PTR(type, f, i) ((type *)(intptr_t)(f)[i])

/* Rows of x already quantized by the host (plain int8 q [n, K] in place of the kernel's own
 * quantize_rows): this thread's share moved to the tiles' form — q + 128 for vpdpbusd's unsigned
 * operand when `offset`, the row sums a8w4 needs into sum. */
static void adopt_rows(int8_t *q, int64_t n, int64_t K, int32_t *sum, int offset) {
    int64_t r0, r1;
    my_units(n, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
        int8_t *row = q + r * K;
        int32_t total = 0;
        for (int64_t k = 0; k < K; ++k) {
            total += row[k];
            if (offset) row[k] = (int8_t)((uint8_t)row[k] ^ 0x80);
        }
        if (sum) sum[r] = total;
    }
}

static int64_t run_call(const int64_t *f, const int64_t *experts, const int64_t *bounds, int64_t num_experts,
                        int64_t num_tokens, float limit, int64_t nthreads, int prequantized);

int64_t moe_qgemm_run(const int64_t *f, const int64_t *experts, const int64_t *bounds, int64_t num_experts,
                      int64_t num_tokens, float limit, int64_t nthreads) {
    return run_call(f, experts, bounds, num_experts, num_tokens, limit, nthreads, 0);
}

/* moe_qgemm_run on rows the host quantized (integer formats only): qx holds q [num_tokens, H] as
 * plain int8 and sx its per-row scales (quant/common.py's quantize_per_token_int8, e.g. rows that
 * arrived quantized over the expert-parallel exchange); x is not read.  qx is rewritten in place
 * (the tiles' form).  Otherwise the same call, the same results as quantizing x here. */
int64_t moe_qgemm_run_quantized(const int64_t *f, const int64_t *experts, const int64_t *bounds, int64_t num_experts,
                                int64_t num_tokens, float limit, int64_t nthreads) {
    if (!is_int((int)f[C_FMT])) return -1;
    return run_call(f, experts, bounds, num_experts, num_tokens, limit, nthreads, 1);
}

static int64_t run_call(const int64_t *f, const int64_t *experts, const int64_t *bounds, int64_t num_experts,
                        int64_t num_tokens, float limit, int64_t nthreads, int prequantized) {
    int fmt = (int)f[C_FMT];
    Shape s = shape_of((int)f[C_ISA], fmt);
    if (!isa_ok(s.isa, fmt) || f[C_F] % PANEL || f[C_H] % 32 || f[C_CHUNK] < 1) return -1;
    if (!is_int(fmt) && (f[C_G1] < 1 || f[C_G2] < 1 || f[C_H] % f[C_G1] || f[C_F] % f[C_G2])) return -1;
    if (f[C_ACT_BLOCKS] && ((fmt != FMT_W4 && fmt != FMT_W8) || f[C_F] % 32)) return -1;
    if (f[C_ACT_BLOCKS] < ACT_NONE || f[C_ACT_BLOCKS] > ACT_INT) return -1;
    /* the block tiles: a8w4-int on w4 panels, a8w8-int on w8 panels (AVX-512 VNNI), whole blocks a group */
    int block_int = f[C_ACT_BLOCKS] == ACT_INT, vnni = s.isa == ISA_AVX512 && (moe_qgemm_cpu_features() & 2);
    if (block_int && ((fmt != FMT_W4 && !(fmt == FMT_W8 && vnni)) || f[C_G1] % BLOCK || f[C_G2] % BLOCK || f[C_BF16]))
        return -1;
    Call cl = {PTR(const float, f, C_X), f[C_LDX], PTR(float, f, C_Y), f[C_LDY], PTR(const int64_t, f, C_TOK),
               PTR(const float, f, C_SCALE), f[C_H], f[C_F], f[C_G1], f[C_G2], limit, (int)f[C_BETWEEN],
               PTR(int8_t, f, C_QX), PTR(float, f, C_SX), PTR(int32_t, f, C_SUMX), PTR(int8_t, f, C_QA),
               PTR(float, f, C_SA), PTR(int32_t, f, C_SUMA)};
    cl.act_blocks = (int)f[C_ACT_BLOCKS];
    cl.bf16 = (int)f[C_BF16];
    if (cl.bf16 && (is_int(fmt) || fmt == FMT_BF16 || fmt == FMT_F16 || s.isa != ISA_AVX512 ||
                    !(moe_qgemm_cpu_features() & 4)))
        return -1;
    int64_t chunk = f[C_CHUNK], kmax = cl.H > cl.F ? cl.H : cl.F;
    int offset = fmt == FMT_A8W8 && s.isa == ISA_AVX512;  /* vpdpbusd's unsigned operand */
    float *scratch[2] = {PTR(float, f, C_SCRATCH), PTR(float, f, C_SCRATCH) + (chunk + MR_MAX) * cl.F};
    /* per thread: two panels [kmax][16] fp32 (the bf16 tiles: their k-pairs), and the bf16 tiles' fp32 panel */
    const int64_t per_thread = (cl.bf16 ? 3 : 2) * kmax * 16;
    int panels = !is_int(fmt) && !block_int, packed = s.packed && !block_int; /* the float tiles' buffers */
    float *bufs = panels ? malloc(sizeof(float) * nthreads * per_thread) : NULL;
    float *xp = packed ? malloc(sizeof(float) * (chunk + MR_MAX) * cl.H) : NULL;
    uint16_t *bf = cl.bf16 ? malloc(sizeof(uint16_t) * (num_tokens * cl.H + (chunk + MR_MAX) * cl.F)) : NULL;
    /* the block tiles' rows: x [T, H] and FC2's input [chunk + MR_MAX, F], a quad, a scale and an
     * offset per 4 / 32 / 32 elements: 4 + 4 / 32 * 8 bytes a 4 elements */
    const int64_t xn = num_tokens * cl.H, an = (chunk + MR_MAX) * cl.F;
    int32_t *blk = block_int ? malloc((size_t)(xn + an) / 4 * 4 + (size_t)(xn + an) / BLOCK * 8 + 64) : NULL;
    if ((panels && bufs == NULL) || (packed && xp == NULL) || (cl.bf16 && bf == NULL) || (block_int && blk == NULL))
        return free(bufs), free(xp), free(bf), free(blk), -2;
    cl.xb = bf, cl.ab = bf ? bf + num_tokens * cl.H : NULL;
    if (block_int) {
        cl.vnni = vnni, cl.bits8 = fmt == FMT_W8;
        cl.xq = blk, cl.aq = cl.xq + xn / 4;
        cl.xo = cl.aq + an / 4, cl.ao = cl.xo + xn / BLOCK;
        cl.xs = (float *)(cl.ao + an / BLOCK), cl.as = cl.xs + xn / BLOCK;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int64_t step = 0;
        float *buf = bufs ? bufs + omp_get_thread_num() * per_thread : NULL, *tmp = buf ? buf + 2 * kmax * 16 : NULL;
        if (cl.bf16) {
            rows_to_bf16(cl.x, cl.ldx, num_tokens, cl.H, cl.xb);
#pragma omp barrier
        }
        if (block_int) {
            block_quantize_rows(&cl, cl.x, cl.ldx, num_tokens, cl.H, cl.xq, cl.xs, cl.xo);
#pragma omp barrier
        }
        if (is_int(fmt)) {
            if (prequantized)
                adopt_rows(cl.qx, num_tokens, cl.H, cl.sumx, offset);
            else
                quantize_rows(cl.x, num_tokens, cl.H, cl.qx, cl.sx, cl.sumx, offset);  /* ldx == H: the host's copy */
#pragma omp barrier
        }
        for (int64_t e = 0; e < num_experts; ++e) {
            const int64_t *p = experts + 6 * e;
            Expert ex = {PTR(const uint8_t, p, 0), PTR(const uint8_t, p, 1), PTR(const void, p, 2),
                         PTR(const void, p, 3), PTR(const int32_t, p, 4), PTR(const int32_t, p, 5)};
            for (int64_t lo = bounds[e]; lo < bounds[e + 1]; lo += chunk) {
                int64_t n = bounds[e + 1] - lo < chunk ? bounds[e + 1] - lo : chunk;
                float *a = scratch[step++ & 1];
                if (block_int) {
                    block_chunk(&cl, lo, n, &ex, a);
                } else if (is_int(fmt)) {
                    ifc1(&cl, s, lo, n, &ex, a);
#pragma omp barrier
                    quantize_rows(a, n, cl.F, cl.qa, cl.sa, cl.suma, offset);
#pragma omp barrier
                    ifc2(&cl, s, lo, n, &ex);
                } else {
                    if (s.packed) {  /* xp is free: every thread is past the last FC1 */
                        pack_x(&cl, s, lo, n, xp);
#pragma omp barrier
                    }
                    ffc1(&cl, s, lo, n, &ex, xp, a, buf, tmp);
#pragma omp barrier
                    if (cl.act_blocks) {
                        fake_quantize_blocks(s, a, n, cl.F);
#pragma omp barrier
                    }
                    if (cl.bf16) { /* FC2's input as bf16: every thread's FC2 of the last chunk is done */
                        rows_to_bf16(a, cl.F, n, cl.F, cl.ab);
#pragma omp barrier
                    }
                    ffc2(&cl, s, lo, n, &ex, a, buf, tmp);
                }
            }
        }
    }
    free(bufs), free(xp), free(bf), free(blk);
    return 0;
}

/* Test entries.  The exact int32 product acc [M, N] = q_a [M, K] . W^T of an integer-format weight
 * (its panels, N / 16 of them; colsum [N] for a8w8) on one thread, through the run's tiles. */
int64_t moe_qgemm_int_matmul(int64_t isa, int64_t fmt, const int8_t *qa, int64_t M, int64_t K, const uint8_t *w,
                             const int32_t *colsum, int64_t N, int32_t *out) {
    Shape s = shape_of((int)isa, (int)fmt);
    if (!is_int((int)fmt) || !isa_ok(s.isa, (int)fmt) || N % (2 * s.v) || K % 8) return -1;
    int offset = fmt == FMT_A8W8 && s.isa == ISA_AVX512;
    int8_t *a = malloc(M * K);
    int32_t *rowsum = malloc(sizeof(int32_t) * (M + 1));
    if (!a || !rowsum) return free(a), free(rowsum), -2;
    for (int64_t r = 0; r < M; ++r) {
        rowsum[r] = 0;
        for (int64_t k = 0; k < K; ++k) rowsum[r] += qa[r * K + k], a[r * K + k] = offset ? (int8_t)(qa[r * K + k] ^ 0x80) : qa[r * K + k];
    }
    int32_t c[MR_MAX * 2 * V_MAX];
    const void *rows[MR_MAX];
    for (int64_t c0 = 0; c0 < N; c0 += 2 * s.v)
        for (int64_t r0 = 0; r0 < M; r0 += s.mr) {
            int mr = rows_at(s, M, r0);
            for (int i = 0; i < mr; ++i) rows[i] = a + (r0 + i) * K;
            itile(s, mr, rows, icolumn(s.fmt, w, c0, K), icolumn(s.fmt, w, c0 + s.v, K), K, c);
            for (int i = 0; i < mr; ++i) {
                Offsets o = offsets(s, colsum, rowsum, r0 + i);
                for (int j = 0; j < 2 * s.v; ++j)
                    out[(r0 + i) * N + c0 + j] = c[i * 2 * s.v + j] - o.row_offset - (o.colsum ? 128 * o.colsum[c0 + j] : 0);
            }
        }
    free(a), free(rowsum);
    return 0;
}

/* Panel p of a float-format weight dequantized: out [K][16]. */
int64_t moe_qgemm_dequant_panel(int64_t isa, int64_t fmt, const uint8_t *w, const void *scales, int64_t p, int64_t K,
                                int64_t G, float *out) {
    Shape s = shape_of((int)isa, (int)fmt);
    if (!isa_ok(s.isa, s.fmt)) return -1;
    dequant(s, w, scales, p, K, G, out);
    return 0;
}

/* Rows of x [n, K] quantized per token (quant/common.py's quantize_per_token_int8): q, s, sum. */
void moe_qgemm_quantize(const float *x, int64_t n, int64_t K, int8_t *q, float *s, int32_t *sum) {
#pragma omp parallel num_threads(1)
    quantize_rows(x, n, K, q, s, sum, 0);
}

/* Rows of x [n, K] (K a multiple of 32) as the block tiles read them (block_quantize_row, for
 * 4-bit or 8-bit weights): quads xq [n, K/4], scales sx and offsets off [n, K/32]. */
void moe_qgemm_block_quantize(const float *x, int64_t n, int64_t K, int64_t bits8, int32_t *xq, float *sx,
                              int32_t *off) {
    for (int64_t r = 0; r < n; ++r)
        block_quantize_row(x + r * K, K, (int)bits8, xq + r * (K / 4), sx + r * (K / BLOCK), off + r * (K / BLOCK));
}

/* moe_qgemm_dequant_kn's step along k: whole groups, DQ_KC elements where the group divides it */
enum { DQ_KC = 256 };
static int64_t dequant_kn_step(int64_t G) { return G > 0 && G < DQ_KC ? DQ_KC / G * G : G > 0 ? G : DQ_KC; }

/* 16 fp32 values as bf16, rounded to nearest even: (bits + 0x7FFF + lsb) >> 16 a lane, the rule
 * torch's fp32 -> bf16 conversion follows for finite values (the packs' values are finite). */
static inline __m256i bf16x16(const float *src) {
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1);
    __m256i h[2];
    for (int i = 0; i < 2; ++i) {
        const __m256i bits = _mm256_load_si256((const __m256i *)(src + 8 * i));
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
        h[i] = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias, lsb)), 16);
    }
    /* packus interleaves the 128-bit lanes (a0-3 b0-3 a4-7 b4-7): the permute puts them in order */
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xD8);
}

/* Panels [p, p + np) (np 1 or 2) of a float-format weight dequantized into their columns of
 * out [K][N]: `step` elements of k at a time (dequant_kn_step) into the thread's buffer
 * buf [2][step][16] (32 KiB at step 256, in L1 / L2), then each k's 64 bytes (fp32: one panel;
 * bf16: two) stored to memory as one line, non-temporally where the lines are whole and aligned
 * (`stream`: then N is a multiple of 32 and np is 2). */
static void dequant_kn_panels(Shape s, const uint8_t *w, const void *scales, int64_t p, int np, int64_t N, int64_t K,
                              int64_t G, int64_t step, void *out, int bf16, int stream, float *buf) {
    const int64_t code_bytes = panel_bytes(s.fmt, K) / K, scale_bytes = is_mx(s.fmt) ? 1 : 2; /* a k, a group */
    for (int64_t k0 = 0; k0 < K; k0 += step) {
        const int64_t kc = K - k0 < step ? K - k0 : step;
        for (int i = 0; i < np; ++i) {
            const uint8_t *codes = w + (p + i) * panel_bytes(s.fmt, K) + k0 * code_bytes;
            const void *sk = scales ? (const uint8_t *)panel_scales(s.fmt, scales, p + i, K, G) + (k0 / G) * PANEL * scale_bytes
                                    : NULL;
            if (s.isa == ISA_AVX512)
                dequant_panel512(s.fmt, codes, sk, kc, G, buf + i * step * PANEL); /* [kc][16] */
            else
                dequant_panel(s.fmt, codes, sk, kc, G, buf + i * step * PANEL);
        }
        for (int64_t k = 0; k < kc; k++) {
            const float *b0 = buf + k * PANEL, *b1 = b0 + step * PANEL;
            if (!bf16) {
                float *o = (float *)out + (k0 + k) * N + p * PANEL;
                for (int i = 0; i < np; ++i, o += PANEL, b0 = b1)
                    if (stream)
                        _mm256_stream_ps(o, _mm256_load_ps(b0)), _mm256_stream_ps(o + 8, _mm256_load_ps(b0 + 8));
                    else
                        _mm256_storeu_ps(o, _mm256_load_ps(b0)), _mm256_storeu_ps(o + 8, _mm256_load_ps(b0 + 8));
            } else {
                __m256i *o = (__m256i *)((uint16_t *)out + (k0 + k) * N + p * PANEL);
                if (stream && np == 2)
                    _mm256_stream_si256(o, bf16x16(b0)), _mm256_stream_si256(o + 1, bf16x16(b1));
                else
                    for (int i = 0; i < np; ++i) _mm256_storeu_si256(o + i, bf16x16(i ? b1 : b0));
            }
        }
    }
}

/* A float-format weight [N, K] (panel layout, N a multiple of 16) dequantized into its transpose:
 * out [K][N], fp32 (bf16 = 0) or bf16 rounded to nearest even (bf16 = 1).  A dense linear's prefill
 * GEMM operand (kernels/cpu/dense.py): x [T, K] @ out, the layout torch's GEMM takes as its second
 * operand as it is.  Why so: a panel dequantizes into [K][16], so each k is 16 columns' values side
 * by side, one 64-byte line of fp32 (two panels' of bf16), stored whole and non-temporally (no
 * read of the line before it is written).  Written as rows [N][K] the same values were a strided
 * scalar gather: a [4096, 2048] a8w4-int weight took 3.5 ms against its bf16 GEMM's 4.8 at 512 rows
 * (2-core Xeon with AMX).  Panel pairs split over the threads.  0, or -1 when the ISA is not on
 * this CPU, -2 out of memory. */
int64_t moe_qgemm_dequant_kn(int64_t isa, int64_t fmt, const uint8_t *w, const void *scales, int64_t N, int64_t K,
                             int64_t G, void *out, int64_t bf16, int64_t threads) {
    Shape s = shape_of((int)isa, (int)fmt);
    if (!isa_ok(s.isa, s.fmt)) return -1;
    const int64_t row_bytes = N * (bf16 ? 2 : 4);
    const int stream = (uintptr_t)out % 64 == 0 && row_bytes % 64 == 0;
    const int64_t pairs = (N / PANEL + 1) / 2, step = dequant_kn_step(G);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *buf = aligned_alloc(64, sizeof(float) * 2 * step * PANEL);
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t q = 0; q < pairs; q++) {
                const int np = 2 * q + 1 < N / PANEL ? 2 : 1;
                dequant_kn_panels(s, w, scales, 2 * q, np, N, K, G, step, out, (int)bf16, stream, buf);
            }
            _mm_sfence(); /* the streamed lines visible before the GEMM reads them */
            free(buf);
        }
    }
    return failed ? -2 : 0;
}
