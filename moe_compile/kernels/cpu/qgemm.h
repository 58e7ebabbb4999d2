/* qgemm.c's shared definitions: the tile sizes (PANEL, MR_*), the formats and small helpers every
 * part uses; it includes tiles.h and blocktiles.h after PANEL.  Included once, first, by qgemm.c. */
#ifndef MOE_QGEMM_H
#define MOE_QGEMM_H
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define PANEL 16
#define MR_512 8   /* rows per tile, AVX-512 (integer and float) */
#define MR_I256 4  /* integer AVX2: 8 accumulators + weights + sign temporaries fill the 16 ymm */
#define MR_F256 6  /* float AVX2 */
#define MR_MAX 8
#define V_MAX 16

#include "tiles.h" /* after PANEL: the tiles step PANEL floats per k */
#include "blocktiles.h"

enum { FMT_A8W8 = 1, FMT_A8W4 = 2, FMT_W8 = 3, FMT_W4 = 4, FMT_MXFP4 = 5, FMT_BF16 = 6, FMT_F16 = 7, FMT_MXFP8 = 8 };

static int is_int(int fmt) { return fmt == FMT_A8W8 || fmt == FMT_A8W4; }
static int is_mx(int fmt) { return fmt == FMT_MXFP4 || fmt == FMT_MXFP8; } /* e8m0 group scales, one byte each */

static inline int32_t load32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#endif /* MOE_QGEMM_H */
