/* Row moves of the expert-parallel 2D all-to-all on the CPU symmetric heap (ep/a2a_cpu.py).
 *
 * A "block" is rows [src_row, src_row + rows) of a source buffer going to rows
 * [dst_row, dst_row + rows) of a destination buffer; rows are row_bytes wide.  The destination
 * buffers are other processes' shared-memory windows: a block list per destination is copied, then
 * that destination's flag word is stored with release order, so a reader that sees the flag
 * (acquire) sees the rows.  Flag values are call epochs and only grow, so they are never reset.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

static void copy_blocks(const char *src, char *dst, int64_t row_bytes, int64_t n, const int64_t *src_row,
                        const int64_t *dst_row, const int64_t *rows) {
    for (int64_t i = 0; i < n; i++) {
        if (rows[i] > 0)
            memcpy(dst + dst_row[i] * row_bytes, src + src_row[i] * row_bytes, (size_t)(rows[i] * row_bytes));
    }
}

/* For each destination j < ndst: its nblk[j] blocks (the next entries of src_row/dst_row/rows)
 * into dst[j], then *flag[j] = value.  One call moves a whole exchange's rows. */
void moe_ep_push(const char *src, char *const *dst, int64_t row_bytes, int64_t ndst, const int64_t *nblk,
                 const int64_t *src_row, const int64_t *dst_row, const int64_t *rows, int64_t *const *flag,
                 int64_t value) {
    int64_t at = 0;
    for (int64_t j = 0; j < ndst; j++) {
        copy_blocks(src, dst[j], row_bytes, nblk[j], src_row + at, dst_row + at, rows + at);
        at += nblk[j];
        __atomic_store_n(flag[j], value, __ATOMIC_RELEASE);
    }
}

/* Poll flags[slots[i]] >= value for every i, at most `spins` rounds; returns how many are below. */
int64_t moe_ep_poll(const int64_t *flags, const int64_t *slots, int64_t n, int64_t value, int64_t spins) {
    int64_t pending = n;
    for (int64_t s = 0; s < spins; s++) {
        pending = 0;
        for (int64_t i = 0; i < n; i++)
            pending += __atomic_load_n(flags + slots[i], __ATOMIC_ACQUIRE) < value;
        if (pending == 0)
            return 0;
        _mm_pause();
    }
    return pending;
}

/* dst rows [0, total): block i's rows [off[i], off[i] + rows[i]) copied from src at the same rows,
 * every row no block covers zeroed.  Blocks sorted by offset take one pass; otherwise dst is zeroed
 * first. */
void moe_ep_unpack(const char *src, char *dst, int64_t row_bytes, int64_t n, const int64_t *off,
                   const int64_t *rows, int64_t total) {
    int sorted = 1;
    for (int64_t i = 1; i < n && sorted; i++)
        sorted = off[i] >= off[i - 1] + rows[i - 1];
    if (!sorted) {
        memset(dst, 0, (size_t)(total * row_bytes));
        copy_blocks(src, dst, row_bytes, n, off, off, rows);
        return;
    }
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        if (rows[i] <= 0)
            continue;
        if (off[i] > at)
            memset(dst + at * row_bytes, 0, (size_t)((off[i] - at) * row_bytes));
        memcpy(dst + off[i] * row_bytes, src + off[i] * row_bytes, (size_t)(rows[i] * row_bytes));
        at = off[i] + rows[i];
    }
    if (total > at)
        memset(dst + at * row_bytes, 0, (size_t)((total - at) * row_bytes));
}
