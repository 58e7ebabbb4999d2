/* Every expert's SwiGLU FFN of a CPU prefill call in one kernel call: FC1 with the SwiGLU in its
 * epilogue, FC2 with the weighted combine into y in its epilogue (called by kernels/cpu/forward.py's
 * fused_moe_cpu through cpu_experts.run).
 *
 * Why: the per-expert loop on oneDNN pays, for each of 64 experts, two oneDNN calls (~14 us of
 * fixed cost each), the Python between them and a C call for the rows' gather / SwiGLU /
 * combine (~8 ms of a ~75 ms fine-grained T=512 call, 2-core CI VM).  Here FC1's output never
 * leaves the tiles for more than the scratch a (no [n, 2F] buffer) and FC2's output goes
 * straight into y.  The GEMM tiles run at oneDNN's speed on this VM (all 64 experts' FC1 + FC2
 * at 64 rows each, fp32, 2 threads: 67 vs 70 ms, AVX-512 tile).
 *
 * Shapes:   T tokens, H hidden, F expert FFN width; slots sorted by expert, expert e owning rows
 *           [bounds[e], bounds[e+1]) of tok [S'] (each slot's token) and scale [S'] (its routing
 *           weight, NULL: 1).
 * Weights:  packed in panels of 16 output rows: W [out, in] -> panel p = [in][16], element (k, j)
 *           = W[16 p + j, k], panels one after another (moe_experts_pack).  Per expert: gate and
 *           up [F, H] (K = H), down [H, F] (K = F), each a pointer to its first panel.
 * Per expert, n rows (a chunk of at most `chunk` of them at a time):
 *   FC1  a[r, f]     = swiglu(x[tok[r]] . gate[f], x[tok[r]] . up[f])       a: [n, F] scratch
 *   FC2  y[tok[r], c] += scale[r] * (a[r] . down[c])
 * Rows by address (the expert-parallel op, ep/fused_a2a.py): where x_at[r] != 0 slot r's x row is
 * read at that address (a peer's row in this rank's receive window) instead of x[tok[r]], and
 * where y_at[r] != 0 its FC2 row is stored there, scale[r] * (a[r] . down[c]) (a peer's return
 * window: one slot, one row, so a store, no zeroing), instead of added into y[tok[r]].  NULL
 * arrays (the single-device op) take the token rows alone: the same instructions as before.
 * Tiles:    MR rows x two V-column blocks: AVX-512 8 x (16 + 16), AVX2 6 x (8 + 8) (accumulators in
 *           registers over the whole K).  FC1's two blocks are gate and up of the same V features;
 *           FC2's are 2V consecutive columns of y.  The AVX-512 tile reads x's rows where they lie
 *           (no gather); the AVX2 tile reads its A operands tile-packed (Shape.packed): the team
 *           packs x's rows per chunk, and FC1 writes a packed.
 * Threads:  each GEMM splits its column blocks ("units") into equal ranges over the OpenMP threads:
 *           each weight is read once whatever the thread count, and each column of y has one writer
 *           (a token routed twice to one expert never races).  Per chunk of an expert's rows, one
 *           barrier, between FC1 and FC2: a and (AVX2) the packed x rows are double-buffered, and
 *           the team packs the next chunk's x rows before that barrier, so the next FC1 needs none
 *           (a second barrier per chunk after packing cost 64 waits a fine-grained T=512 call).
 *
 * Built by moe_compile/kernels/cpu/cc.py with `cc -O3 -mavx2 -mfma -fopenmp` on first use; the
 * AVX-512 tile is compiled for that target alone and run only where the CPU has it.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

#define PANEL 16
#define MR_AVX512 8 /* rows per tile */
#define MR_AVX2 6
#define MR_MAX MR_AVX512
#define V_MAX 16

#include "tiles.h" /* after PANEL: the tiles step PANEL floats per k */

/* ---- tiles (tiles.h): c [mr][2V] = A rows . [b0 | b1], b0 / b1 stepping PANEL floats per k ----
 * The AVX-512 tile reads A's rows where they lie (a[r][k]); the AVX2 tile reads A tile-packed
 * (a[r] = the tile's base + r, element k at a[r][k * MR_AVX2]: one memory stream for all rows,
 * 3-5% faster for it, 0-5% slower for the AVX-512 tile, in-process A/B, BENCHMARKS.md). */

F32_TILE256_ANY(tile256_any, MR_AVX2, 16, 8)

/* The ISA's tile shape: rows MR, block width V, and whether its A operands are tile-packed:
 * [n, K] held MR rows at a time, each tile [K][MR], the tile of rows r0.. at r0 * K. */
typedef struct {
    int isa, mr, v, packed;
} Shape;

static Shape shape_of(int64_t isa) {
    Shape s = {ISA_AVX2, MR_AVX2, 8, 1};
    if (isa == ISA_AVX512) s.isa = ISA_AVX512, s.mr = MR_AVX512, s.v = 16, s.packed = 0;
    return s;
}

/* Rows in the tile starting at row r0 of n: MR, fewer in the last tile. */
static int rows_at(Shape s, int64_t n, int64_t r0) { return n - r0 < s.mr ? (int)(n - r0) : s.mr; }

/* Row pointers of the tile of rows r0 .. r0 + mr - 1 of an A operand [n, K] in the ISA's layout. */
static void tile_rows(Shape s, const float *base, int64_t r0, int mr, int64_t K, const float **rows) {
    for (int i = 0; i < mr; ++i) rows[i] = s.packed ? base + r0 * K + i : base + (r0 + i) * K;
}

/* Where element (r, k) of an A operand [n, K] lies in the ISA's layout. */
static int64_t element_at(Shape s, int64_t r, int64_t k, int64_t K) {
    return s.packed ? (r - r % s.mr) * K + k * s.mr + r % s.mr : r * K + k;
}

static void tile(Shape s, int mr, const float *const *a, const float *b0, const float *b1, int64_t K, float *c) {
    if (s.isa == ISA_AVX512)
        f32_tile512_any(mr, a, b0, b1, K, c);
    else
        tile256_any(mr, a, b0, b1, K, c);
}

/* Column `col` (a multiple of 8) of a packed weight with K inputs: its panel, then its lane. */
static const float *column(const float *packed, int64_t col, int64_t K) {
    return packed + (col / PANEL) * K * PANEL + col % PANEL;
}

/* Units [u0, u1) of `units` split evenly over the team. */
static void my_units(int64_t units, int64_t *u0, int64_t *u1) {
    int64_t t = omp_get_thread_num(), parts = omp_get_num_threads();
    *u0 = units * t / parts, *u1 = units * (t + 1) / parts;
}

/* ---- one expert ---- */

typedef struct {
    const float *x;
    int64_t ldx;
    float *y;
    int64_t ldy;
    const int64_t *tok;
    const float *scale;
    int64_t H, F;
    float limit;
    const int64_t *x_at, *y_at; /* per-slot row addresses (0: the token's row), or NULL */
} Call;

/* x's row of slot r, where it lies: at x_at[r] when given, else row tok[r] of x. */
static const float *x_row(const Call *cl, int64_t r) {
    if (cl->x_at && cl->x_at[r]) return (const float *)(intptr_t)cl->x_at[r];
    return cl->x + cl->tok[r] * cl->ldx;
}

/* x's rows of slots lo + r0 .. lo + r0 + mr - 1, where they lie. */
static void token_rows(const Call *cl, int64_t lo, int64_t r0, int mr, const float **rows) {
    for (int i = 0; i < mr; ++i) rows[i] = x_row(cl, lo + r0 + i);
}

/* Tile-packed x rows of slots [lo, lo + n) into xp, this thread's share of the tiles (the ISAs
 * whose tiles read A packed; the caller then waits for the team). */
static void pack_x(const Call *cl, Shape s, int64_t lo, int64_t n, float *xp) {
    const float *src[MR_MAX];
    int64_t t0, t1;
    my_units((n + s.mr - 1) / s.mr, &t0, &t1);
    for (int64_t r0 = t0 * s.mr; r0 < n && r0 < t1 * s.mr; r0 += s.mr) {
        int mr = rows_at(s, n, r0);
        float *dst = xp + r0 * cl->H;
        token_rows(cl, lo, r0, mr, src);
        for (int64_t k = 0; k < cl->H; ++k)  /* written in order, mr read streams */
            for (int i = 0; i < mr; ++i) dst[k * s.mr + i] = src[i][k];
    }
}

/* FC1 + SwiGLU of slots [lo, lo + n): this thread's features of a [n, F] (in the ISA's layout).
 * xp: x's rows tile-packed (pack_x) where the ISA's tiles read them so, else unused. */
static void fc1_swiglu(const Call *cl, Shape s, int64_t lo, int64_t n, const float *xp, const float *gate,
                       const float *up, float *a) {
    float c[MR_MAX * 2 * V_MAX], act[V_MAX];
    const float *rows[MR_MAX];
    int64_t u0, u1;
    my_units(cl->F / s.v, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
        int64_t f0 = u * s.v;
        const float *b0 = column(gate, f0, cl->H), *b1 = column(up, f0, cl->H);
        for (int64_t r0 = 0; r0 < n; r0 += s.mr) {
            int mr = rows_at(s, n, r0);
            if (s.packed)
                tile_rows(s, xp, r0, mr, cl->H, rows);
            else
                token_rows(cl, lo, r0, mr, rows);
            tile(s, mr, rows, b0, b1, cl->H, c);
            for (int i = 0; i < mr; ++i) {
                const float *gate_out = c + i * 2 * s.v, *up_out = gate_out + s.v;
                if (!s.packed) {  /* the row's V features are contiguous in a */
                    swiglu_span(a + element_at(s, r0 + i, f0, cl->F), gate_out, up_out, 0, s.v, cl->limit, 1.f);
                    continue;
                }
                swiglu_span(act, gate_out, up_out, 0, s.v, cl->limit, 1.f);
                for (int j = 0; j < s.v; ++j) a[element_at(s, r0 + i, f0 + j, cl->F)] = act[j];
            }
        }
    }
}

/* FC2 + weighted combine of slots [lo, lo + n): this thread's columns of y. */
static void fc2_combine(const Call *cl, Shape s, int64_t lo, int64_t n, const float *down, const float *a) {
    float c[MR_MAX * 2 * V_MAX];
    const float *rows[MR_MAX];
    int64_t u0, u1, w = 2 * s.v;
    my_units(cl->H / w, &u0, &u1);
    for (int64_t u = u0; u < u1; ++u) {
        int64_t c0 = u * w;
        const float *b0 = column(down, c0, cl->F), *b1 = column(down, c0 + s.v, cl->F);
        for (int64_t r0 = 0; r0 < n; r0 += s.mr) {
            int mr = rows_at(s, n, r0);
            tile_rows(s, a, r0, mr, cl->F, rows);
            tile(s, mr, rows, b0, b1, cl->F, c);
            for (int i = 0; i < mr; ++i) {
                int64_t slot = lo + r0 + i;
                float k = cl->scale ? cl->scale[slot] : 1.f;
                if (cl->y_at && cl->y_at[slot]) {  /* the slot's own row elsewhere: stored, not added */
                    float *dst = (float *)(intptr_t)cl->y_at[slot] + c0;
                    for (int64_t j = 0; j < w; ++j) dst[j] = k * c[i * w + j];
                    continue;
                }
                float *dst = cl->y + cl->tok[slot] * cl->ldy + c0;
                for (int64_t j = 0; j < w; ++j) dst[j] += k * c[i * w + j];
            }
        }
    }
}

/* ---- entry points ---- */

/* The widest tile this CPU runs: ISA_AVX512 or ISA_AVX2. */
int64_t moe_experts_best_isa(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") ? ISA_AVX512 : ISA_AVX2;
}

/* Call fields, int64 each (pointers as integers):
 *   x, ldx, y, ldy, tok, scale (0: none), H, F, chunk, scratch, isa, x_at (0: none), y_at (0: none)
 * experts: E rows of (gate, up, down) packed-weight pointers; bounds: E + 1 slot offsets (rows of
 * tok / scale).  An expert's rows run `chunk` at a time (FC1 then FC2), so the scratch stays
 * small whatever T is: 2 * (chunk + MR_MAX) * F floats, FC1's output of two chunks.  Returns 0;
 * -1 for an ISA this CPU lacks or sizes the tiles do not divide; -2 when the buffer for x's
 * packed rows cannot be allocated. */
enum { C_X, C_LDX, C_Y, C_LDY, C_TOK, C_SCALE, C_H, C_F, C_CHUNK, C_SCRATCH, C_ISA, C_X_AT, C_Y_AT };
#define PTR(type, f, i) ((type *)(intptr_t)(f)[i])

/* The first expert from e on with rows (num_experts when none). */
static int64_t with_rows(const int64_t *bounds, int64_t num_experts, int64_t e) {
    while (e < num_experts && bounds[e + 1] == bounds[e]) ++e;
    return e;
}

/* The step after expert e's chunk of rows from lo: (e, lo + chunk) while e has rows left, else
 * the next expert with rows from its first; *e_next = num_experts when there is none. */
static void next_step(const int64_t *bounds, int64_t num_experts, int64_t chunk, int64_t e, int64_t lo,
                      int64_t *e_next, int64_t *lo_next) {
    if (lo + chunk < bounds[e + 1]) {
        *e_next = e, *lo_next = lo + chunk;
        return;
    }
    *e_next = with_rows(bounds, num_experts, e + 1);
    *lo_next = *e_next < num_experts ? bounds[*e_next] : 0;
}

static int64_t step_rows(const int64_t *bounds, int64_t chunk, int64_t e, int64_t lo) {
    return bounds[e + 1] - lo < chunk ? bounds[e + 1] - lo : chunk;
}

int64_t moe_experts_run(const int64_t *f, const int64_t *experts, const int64_t *bounds, int64_t num_experts,
                        float limit, int64_t nthreads) {
    Shape s = shape_of(f[C_ISA]);
    if (f[C_ISA] != s.isa || (s.isa == ISA_AVX512 && moe_experts_best_isa() != ISA_AVX512))
        return -1;
    if (f[C_F] % PANEL || f[C_H] % PANEL || f[C_H] % (2 * s.v) || f[C_CHUNK] < 1) return -1;
    Call cl = {PTR(const float, f, C_X), f[C_LDX], PTR(float, f, C_Y), f[C_LDY], PTR(const int64_t, f, C_TOK),
               PTR(const float, f, C_SCALE), f[C_H], f[C_F], limit, PTR(const int64_t, f, C_X_AT),
               PTR(const int64_t, f, C_Y_AT)};
    int64_t chunk = f[C_CHUNK], xp_floats = (chunk + MR_MAX) * cl.H;
    float *scratch[2] = {PTR(float, f, C_SCRATCH), PTR(float, f, C_SCRATCH) + (chunk + MR_MAX) * f[C_F]};
    /* Packed x rows, double-buffered like a: the next step's rows are packed before the barrier
     * between this step's FC1 and FC2, so that barrier is the only one per step. */
    float *xp_block = s.packed ? malloc(sizeof(float) * 2 * xp_floats) : NULL;
    float *xp[2] = {xp_block, xp_block ? xp_block + xp_floats : NULL};
    if (s.packed && xp_block == NULL) return -2;
    int64_t e0 = with_rows(bounds, num_experts, 0), lo0 = e0 < num_experts ? bounds[e0] : 0;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t step = 0, e = e0, lo = lo0;
        if (s.packed && e < num_experts) {
            pack_x(&cl, s, lo, step_rows(bounds, chunk, e, lo), xp[0]);
#pragma omp barrier
        }
        while (e < num_experts) {
            const int64_t *w = experts + 3 * e;
            int64_t n = step_rows(bounds, chunk, e, lo), e_next, lo_next;
            float *a = scratch[step & 1];
            fc1_swiglu(&cl, s, lo, n, xp[step & 1], PTR(const float, w, 0), PTR(const float, w, 1), a);
            next_step(bounds, num_experts, chunk, e, lo, &e_next, &lo_next);
            /* xp[(step + 1) & 1] is free: every thread is past the FC1 that read it (the last barrier) */
            if (s.packed && e_next < num_experts)
                pack_x(&cl, s, lo_next, step_rows(bounds, chunk, e_next, lo_next), xp[(step + 1) & 1]);
#pragma omp barrier
            fc2_combine(&cl, s, lo, n, PTR(const float, w, 2), a);
            e = e_next, lo = lo_next, ++step;
        }
    }
    free(xp_block);
    return 0;
}

/* Pack `count` weights W [out, in] (element (o, k) at w + i * ld_w + o * ld_out + k * ld_in for
 * weight i; any strides, so transposed views need no copy) into panels at
 * dst + i * out * in; out a multiple of PANEL. */
void moe_experts_pack(const float *w, int64_t count, int64_t ld_w, int64_t ld_out, int64_t ld_in, int64_t out,
                      int64_t in, float *dst, int64_t nthreads) {
    int64_t panels = out / PANEL;
#pragma omp parallel for collapse(2) num_threads(nthreads)
    for (int64_t i = 0; i < count; ++i)
        for (int64_t p = 0; p < panels; ++p) {
            const float *src = w + i * ld_w + p * PANEL * ld_out;
            float *d = dst + i * out * in + p * in * PANEL;
            for (int64_t k = 0; k < in; ++k)
                for (int64_t j = 0; j < PANEL; ++j) d[k * PANEL + j] = src[j * ld_out + k * ld_in];
        }
}
