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
#include <time.h>
#include <sched.h>
#include <limits.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>
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

/* Flags are int64 epochs; a waiter sleeps in a futex on the flag's low 32 bits (x86 is little
 * endian: the int64's address is its low word), shared between processes (not FUTEX_PRIVATE: the
 * word lives in another process's mapping too).  The epoch only grows, so the low word changes on
 * every store (until 2^32 calls). */
static void flag_wake(int64_t *flag) {
    syscall(SYS_futex, (int32_t *)flag, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Each flag has a "sleeping" word `sleep_off` int64s after it: a waiter sets it before it sleeps
 * and the sender wakes only when it is set, so a call whose waiter is still spinning costs no
 * system call.  Both sides use seq_cst (store, then load the other word): either the sender sees
 * the waiter asleep and wakes it, or the waiter sees the new flag and does not sleep. */

/* flag[j] = value for every destination j, each followed by a wake of its waiter if it sleeps. */
static void store_flags(int64_t *const *flag, int64_t n, int64_t value, int64_t sleep_off) {
    for (int64_t j = 0; j < n; j++) {
        __atomic_store_n(flag[j], value, __ATOMIC_SEQ_CST);
        if (sleep_off && __atomic_load_n(flag[j] + sleep_off, __ATOMIC_SEQ_CST))
            flag_wake(flag[j]);
    }
}

/* One source's whole exchange step (the slab transport, ep/a2a_cpu.py): for each destination j its
 * header (hdr_bytes of hdr; none when 0) into hdr_dst[j] and its nblk[j] blocks into dst[j]; then,
 * only after every destination's rows, every flag[j] = value, each followed by a futex wake of its
 * waiter.  Storing the flags last means that when a peer sees its flag this rank has finished
 * reading its input (which may be its previous receive window) for every destination, so the peer
 * may reuse that window in its next call. */
void moe_ep_send(const char *src, char *const *dst, int64_t row_bytes, int64_t ndst, const int64_t *nblk,
                 const int64_t *src_row, const int64_t *dst_row, const int64_t *rows, const char *hdr,
                 int64_t hdr_bytes, char *const *hdr_dst, int64_t *const *flag, int64_t value, int64_t sleep_off) {
    int64_t at = 0;
    for (int64_t j = 0; j < ndst; j++) {
        if (hdr_bytes > 0)
            memcpy(hdr_dst[j], hdr, (size_t)hdr_bytes);
        copy_blocks(src, dst[j], row_bytes, nblk[j], src_row + at, dst_row + at, rows + at);
        at += nblk[j];
    }
    store_flags(flag, ndst, value, sleep_off);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Wait until flags[slots[i]] >= value for every i, or timeout_ns; returns how many are still below.
 * Ranks share the cores with each other and with other processes, so a waiter must not hold a core:
 * a short pause-spin (~5 us: the peer is usually that close on the other core), then it sleeps in
 * the kernel on the first missing flag (futex, 1 ms slices to check the deadline) and its sender's
 * wake puts it back on a core at once — where sched_yield would hand the core to whatever else is
 * runnable for a whole time slice (measured: bench_ep.py --exchange-only on the 2-core VM under
 * load 3-5, see the module docstring of ep/a2a_cpu.py). */
int64_t moe_ep_wait(int64_t *flags, const int64_t *slots, int64_t n, int64_t value, int64_t timeout_ns,
                    int64_t sleep_off) {
    for (int s = 0; s < 64; s++) {
        int64_t i = 0;
        while (i < n && __atomic_load_n(flags + slots[i], __ATOMIC_ACQUIRE) >= value)
            i++;
        if (i == n)
            return 0;
        _mm_pause();
    }
    int64_t t0 = now_ns();
    for (int64_t i = 0; i < n;) {
        int64_t *f = flags + slots[i];
        int64_t v = __atomic_load_n(f, __ATOMIC_ACQUIRE);
        if (v >= value) {
            i++;
            continue;
        }
        int64_t left = timeout_ns - (now_ns() - t0);
        if (left <= 0) {
            int64_t pending = 0;
            for (int64_t k = 0; k < n; k++)
                pending += __atomic_load_n(flags + slots[k], __ATOMIC_ACQUIRE) < value;
            return pending;
        }
        if (!sleep_off) {  /* no sleeping words: yield, then nap */
            if (now_ns() - t0 < 2000000)
                sched_yield();
            else
                nanosleep(&(struct timespec){0, 20000}, NULL);
            continue;
        }
        struct timespec ts = {0, left < 1000000 ? left : 1000000};
        __atomic_store_n(f + sleep_off, 1, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(f, __ATOMIC_SEQ_CST) == v)
            syscall(SYS_futex, (int32_t *)f, FUTEX_WAIT, (int32_t)v, &ts, NULL, 0);  /* returns at once if *f moved */
        __atomic_store_n(f + sleep_off, 0, __ATOMIC_RELAXED);
    }
    return 0;
}

/* dst rows [0, total): block i's rows [dst_row[i], dst_row[i] + rows[i]) from the rows[i] * row_bytes
 * bytes at address src_at[i] (a slab of this rank's window, or this rank's own input); every row no
 * block covers zeroed.  Blocks sorted
 * by dst_row take one pass (memset only the gaps); otherwise dst is zeroed first. */
void moe_ep_gather(char *dst, int64_t row_bytes, int64_t n, const char *const *src_at, const int64_t *dst_row,
                   const int64_t *rows, int64_t total) {
    int sorted = 1;
    for (int64_t i = 1, end = 0; i < n && sorted; i++) {
        if (rows[i - 1] > 0)
            end = dst_row[i - 1] + rows[i - 1];
        sorted = rows[i] <= 0 || dst_row[i] >= end;
    }
    if (!sorted)
        memset(dst, 0, (size_t)(total * row_bytes));
    int64_t at = 0;
    for (int64_t i = 0; i < n; i++) {
        if (rows[i] <= 0)
            continue;
        if (sorted && dst_row[i] > at)
            memset(dst + at * row_bytes, 0, (size_t)((dst_row[i] - at) * row_bytes));
        memcpy(dst + dst_row[i] * row_bytes, src_at[i], (size_t)(rows[i] * row_bytes));
        at = dst_row[i] + rows[i];
    }
    if (sorted && total > at)
        memset(dst + at * row_bytes, 0, (size_t)((total - at) * row_bytes));
}

/* ---- the fused op's dispatch and combine, whole in C (ep/a2a_cpu.py's window path) -------------
 * Header of rank r (W int64s): meta[0..5] = kind, ne, input rows, out rows, row bytes, major_align
 * (-1 = None), then its in_splits [R*ne] (block (d, e) = rows for expert e of rank d).  Python's
 * per-call numpy work (tens of small-array ops, ~2 us each) was most of a decode exchange. */
#define NMETA 6

/* Rows a header's splits sp [R*ne] send to rank d: the sum of its ne expert blocks. */
static int64_t dest_rows(const int64_t *sp, int64_t d, int64_t ne) {
    int64_t n = 0;
    for (int64_t e = 0; e < ne; e++)
        n += sp[d * ne + e];
    return n;
}

/* Whether every split of a header is >= 0, each dest's n rows fit (n * unit <= limit: unit 1 for a
 * limit in rows, the row's bytes for one in bytes) and their total fits the input's rows_in. */
static int64_t splits_fit(const int64_t *sp, int64_t R, int64_t ne, int64_t limit, int64_t unit, int64_t rows_in) {
    int64_t total = 0, ok = 1;
    for (int64_t d = 0; d < R; d++) {
        int64_t n = 0;
        for (int64_t e = 0; e < ne; e++) {
            ok &= sp[d * ne + e] >= 0;
            n += sp[d * ne + e];
        }
        ok &= n * unit <= limit;
        total += n;
    }
    return ok & (total <= rows_in);
}

/* Send this rank's dispatch: header into every dest's slot, its rows for dest d (contiguous in x:
 * the input is rank-major) into its slab of d's window, none to itself (gathered from x by the
 * receive), then the flags.  Rows are sent only when every split is valid and fits its slab; else
 * headers only and the receive reports why on every rank.  Returns 0 (rows sent) or 1 (headers only). */
int64_t moe_ep_dispatch_send(const int64_t *hdr, int64_t W, int64_t R, int64_t me, const char *x,
                             char *const *slab_dst, int64_t slab_bytes, char *const *hdr_dst, int64_t *const *flag,
                             int64_t value, int64_t sleep_off) {
    int64_t ne = hdr[1], rows_in = hdr[2], row_bytes = hdr[4];
    const int64_t *sp = hdr + NMETA;
    int64_t ok = splits_fit(sp, R, ne, slab_bytes, row_bytes, rows_in);
    int64_t at = 0;
    for (int64_t d = 0; d < R; d++) {
        memcpy(hdr_dst[d], hdr, (size_t)(W * 8));
        int64_t n = dest_rows(sp, d, ne);
        if (ok && d != me && n > 0)
            memcpy(slab_dst[d], x + at * row_bytes, (size_t)(n * row_bytes));
        at += n;
    }
    store_flags(flag, R, value, sleep_off);
    return ok ? 0 : 1;
}

/* Receive the dispatch into out (expert-major, tiles rounded up to major_align, gaps zeroed):
 * hdrs [R, W] every source's header (this rank's control window), slabs = this rank's data window
 * (slab s at s * slab_bytes), x = this rank's own input.  Writes oso [2, ne*R] (splits, offsets at
 * e*R + s), sent [R] (rows each source sent in all) and *need = the end of the last block with
 * rows (what a combine of out reads).  Returns N >= 0 rows; -1: the headers
 * disagree or a split is bad (Python raises the verdict); -2: a slab too small, *need = bytes; -3:
 * out holds fewer than *need rows. */
/* Every source's dispatch header agrees with source 0's (kind, ne, row bytes, alignment), has no
 * negative split and fits its input; sent[s] = rows source s sends in all.  Returns the most rows
 * any source sends one dest, or -1 (Python's numpy checks then name the verdict). */
static int64_t check_dispatch_headers(const int64_t *hdrs, int64_t W, int64_t R, int64_t *sent) {
    int64_t ne = hdrs[1], row_bytes = hdrs[4], most = 0;
    for (int64_t s = 0; s < R; s++) {
        const int64_t *h = hdrs + s * W;
        if (h[0] != hdrs[0] || h[1] != ne || h[4] != row_bytes || h[5] != hdrs[5])
            return -1;
        int64_t tot = 0;
        for (int64_t d = 0; d < R; d++) {
            int64_t n = 0;
            for (int64_t e = 0; e < ne; e++) {
                if (h[NMETA + d * ne + e] < 0)
                    return -1;
                n += h[NMETA + d * ne + e];
            }
            most = n > most ? n : most;
            tot += n;
        }
        if (tot > h[2])
            return -1;
        sent[s] = tot;
    }
    return most;
}

int64_t moe_ep_dispatch_recv(const int64_t *hdrs, int64_t W, int64_t R, int64_t me, const char *slabs,
                             int64_t slab_bytes, const char *x, char *out, int64_t out_cap, int64_t *oso,
                             int64_t *sent, int64_t *need) {
    int64_t ne = hdrs[1], row_bytes = hdrs[4], align = hdrs[5] < 0 ? 1 : hdrs[5];
    int64_t most = check_dispatch_headers(hdrs, W, R, sent);
    if (most < 0)
        return -1;
    if (most * row_bytes > slab_bytes) {
        *need = most * row_bytes;
        return -2;
    }
    int64_t N = 0;
    for (int64_t e = 0; e < ne; e++) {
        int64_t n = 0;
        for (int64_t s = 0; s < R; s++)
            n += hdrs[s * W + NMETA + me * ne + e];
        n = (n + align - 1) / align * align;
        N += n < align ? align : n;
    }
    if (N > out_cap) {
        *need = N;
        return -3;
    }
    /* where each source's blocks for me start: in its slab (peers), in x (this rank) */
    int64_t at = 0, used = 0;
    for (int64_t e = 0; e < ne; e++) {
        int64_t o = at;
        for (int64_t s = 0; s < R; s++) {
            const int64_t *sp = hdrs + s * W + NMETA;
            int64_t first = 0;  /* rows before block (me, e) in s's slab for me (or in x, rank-major) */
            int64_t lo = s == me ? 0 : me * ne;
            for (int64_t i = lo; i < me * ne + e; i++)
                first += sp[i];
            int64_t n = sp[me * ne + e];
            oso[e * R + s] = n;
            oso[ne * R + e * R + s] = o;
            if (n > 0) {
                const char *src = s == me ? x + first * row_bytes : slabs + s * slab_bytes + first * row_bytes;
                memcpy(out + o * row_bytes, src, (size_t)(n * row_bytes));
                used = o + n;
            }
            o += n;
        }
        int64_t tile = (o - at + align - 1) / align * align;
        tile = tile < align ? align : tile;
        if (at + tile > o)
            memset(out + o * row_bytes, 0, (size_t)((at + tile - o) * row_bytes));
        at += tile;
    }
    *need = used;
    return N;
}

/* The combine of that window's rows straight back: block (e, s) of x (laid out as the dispatch's
 * out: rows oso[1][e*R+s], oso[0][e*R+s] of them) to its final row of source s's window — where
 * source s sent it from (rank-major: after s's blocks for ranks < me and experts < e) — then the
 * flags.  hdrs: the dispatch's headers (a copy).  skip_self: this rank's own blocks stay where
 * they are (moe_ep_combine_sum reads them in x). */
void moe_ep_combine_after(const int64_t *hdrs, int64_t W, int64_t R, int64_t me, const int64_t *oso, const char *x,
                          int64_t row_bytes, char *const *dst, int64_t *const *flag, int64_t value, int64_t sleep_off,
                          int64_t skip_self) {
    int64_t ne = hdrs[1];
    for (int64_t s = 0; s < R; s++) {
        /* skip_self 1: this rank's own rows stay where its experts wrote them; 2: every row is in
         * place already (the experts stored them into the sources' windows): the flags alone */
        if ((skip_self && s == me) || skip_self == 2)
            continue;
        const int64_t *sp = hdrs + s * W + NMETA;
        int64_t first = 0;
        for (int64_t i = 0; i < me * ne; i++)
            first += sp[i];
        for (int64_t e = 0; e < ne; e++) {
            int64_t n = oso[e * R + s];
            if (n > 0)
                memcpy(dst[s] + first * row_bytes, x + oso[ne * R + e * R + s] * row_bytes, (size_t)(n * row_bytes));
            first += n;
        }
    }
    store_flags(flag, R, value, sleep_off);
}

/* ---- the fused op's exchanges by token index (ep/a2a_cpu.py: dispatch_rows, combine_sum) -------
 * A row is [x[tok[i]] (x_bytes) | extra[i] (extra_bytes)]: the token's row read where it lies in x
 * (no sorted copy) and, optionally, a per-slot field (the backward's routing weight).  Source s's
 * rows for dest d go to rows [s * slab_rows, s * slab_rows + n) of d's window.  This rank's own
 * rows go into its own window too, so that one base addresses every row the local experts read:
 * by slot like the others, or — "by token", hdr[3] = T >= 0 (no extra field) — as x's T rows
 * themselves, one copy per token however many of its K experts are local (the experts then read
 * row tok[i] of that copy and add the K local outputs of a token into one row) — or not copied at
 * all (copy_own = 0: the packed experts kernel reads them in x by address, moe_ep_expert_rows).
 * The extra field may ride with own rows by token (the gate, read by the peers' experts): the own
 * copy then holds x's rows at the row stride, its extra field unwritten.
 * Word NMETA + R*ne of a dispatch header ("FC2 into"): 1 when that rank's experts store their
 * output rows of its peers' slots, already times the gate carried in the rows' last 4 bytes, into
 * each source's return window at the combine's parity (moe_ep_expert_rows); 0 when it sends them
 * back by moe_ep_combine_after, unweighted.  Each source reads it per peer (moe_ep_combine_sum).
 */
#define OWN_BY_TOKEN(h) ((h)[3] >= 0)
#define FC2_INTO(h, R, ne) ((h)[NMETA + (R) * (ne)])

/* Send this rank's sorted slots (tok [S]: slot i's token; hdr[2] = S): header into every dest's
 * slot, dest d's rows (slots [at_d, at_d + n_d), rank-major) into slab `me` of d's window, then the
 * flags.  Rows only when every split is valid and fits a slab; else headers only (the receive says
 * why on every rank).  Returns 0 (rows sent) or 1 (headers only). */
int64_t moe_ep_dispatch_send_idx(const int64_t *hdr, int64_t W, int64_t R, int64_t me, const char *x,
                                 const int64_t *tok, int64_t x_bytes, const char *extra, int64_t extra_bytes,
                                 char *const *win_dst, int64_t slab_rows, char *const *hdr_dst, int64_t *const *flag,
                                 int64_t value, int64_t sleep_off, int64_t copy_own) {
    int64_t ne = hdr[1], rows_in = hdr[2], row_bytes = hdr[4], by_token = OWN_BY_TOKEN(hdr);
    const int64_t *sp = hdr + NMETA;
    int64_t ok = row_bytes == x_bytes + extra_bytes && (!by_token || hdr[3] <= slab_rows);
    ok &= splits_fit(sp, R, ne, slab_rows, 1, rows_in);
    int64_t at = 0;
    for (int64_t d = 0; d < R; d++) {
        memcpy(hdr_dst[d], hdr, (size_t)(W * 8));
        int64_t n = dest_rows(sp, d, ne);
        char *dst = win_dst[d] + me * slab_rows * row_bytes;
        if (ok && d == me && by_token && copy_own && !extra_bytes)
            memcpy(dst, x, (size_t)(hdr[3] * row_bytes));
        else if (ok && d == me && by_token && copy_own)
            for (int64_t t = 0; t < hdr[3]; t++)
                memcpy(dst + t * row_bytes, x + t * x_bytes, (size_t)x_bytes);
        else if (ok && d == me && by_token)
            ;  /* not copied: the experts read them in x */
        else if (ok)
            for (int64_t j = 0; j < n; j++, dst += row_bytes) {
                memcpy(dst, x + tok[at + j] * x_bytes, (size_t)x_bytes);
                if (extra_bytes)
                    memcpy(dst + x_bytes, extra + (at + j) * extra_bytes, (size_t)extra_bytes);
            }
        at += n;
    }
    store_flags(flag, R, value, sleep_off);
    return ok ? 0 : 1;
}

/* Where the rows that moe_ep_dispatch_send_idx sent this rank lie, copying nothing.  Layout rows:
 * source s's rows from row s * slab_rows (packed == 0: the window itself), or packed source after
 * source (packed != 0: a compact copy of the window's rows, source-major; region[s] rows each).
 * Writes idx [N] (the layout row of every received row, expert-major: expert e's rows from source
 * 0, then 1, ...) and scale [N] (1; by token: this rank's own slots' gate, from gate [S] in slot
 * order, so that the experts weight them and sum a token's local outputs), bounds [ne + 1] (expert
 * e owns idx[bounds[e], bounds[e+1])), oso [2, ne*R] (splits, and the layout row of block (e, s)
 * at e*R + s; by token, this rank's own blocks' offsets are its region's first row), region [R]
 * (rows of each source's region: its rows to me; by token, T for this rank), sent [R] and
 * *need = the end of the last region with rows.  Returns N; -1: bad headers (Python names why);
 * -2: a slab too small (*need = bytes); -3: idx holds fewer than N (*need = N). */
int64_t moe_ep_dispatch_index(const int64_t *hdrs, int64_t W, int64_t R, int64_t me, int64_t slab_rows,
                              int64_t packed, const int64_t *tok, const float *gate, int64_t *idx, float *scale,
                              int64_t cap, int64_t *bounds, int64_t *oso, int64_t *region, int64_t *sent,
                              int64_t *need) {
    int64_t ne = hdrs[1], row_bytes = hdrs[4], by_token = OWN_BY_TOKEN(hdrs + me * W);
    int64_t most = check_dispatch_headers(hdrs, W, R, sent);
    if (most < 0)
        return -1;
    for (int64_t s = 0; s < R; s++) {
        const int64_t *h = hdrs + s * W;
        if (OWN_BY_TOKEN(h) != by_token)
            return -1;
        most = by_token && h[3] > most ? h[3] : most;
    }
    if (most > slab_rows) {
        *need = most * row_bytes;
        return -2;
    }
    int64_t N = 0, start_me = 0;  /* start_me: my slots to me begin after my slots to ranks < me */
    for (int64_t s = 0; s < R; s++) {
        region[s] = dest_rows(hdrs + s * W + NMETA, me, ne);
        N += region[s];
    }
    for (int64_t i = 0; i < me * ne; i++)
        start_me += hdrs[me * W + NMETA + i];
    if (by_token)
        region[me] = hdrs[me * W + 3];
    if (N > cap) {
        *need = N;
        return -3;
    }
    int64_t k = 0, used = 0;
    bounds[0] = 0;
    for (int64_t e = 0; e < ne; e++) {
        int64_t base = 0;  /* packed: rows of the regions before s */
        for (int64_t s = 0; s < R; s++) {
            const int64_t *sp = hdrs + s * W + NMETA + me * ne;  /* s's splits for my experts */
            int64_t r0 = packed ? base : s * slab_rows, first = 0, n = sp[e];
            for (int64_t i = 0; i < e; i++)
                first += sp[i];
            int64_t own = by_token && s == me;
            oso[e * R + s] = n;
            oso[ne * R + e * R + s] = own ? r0 : r0 + first;
            for (int64_t j = 0; j < n; j++, k++) {
                idx[k] = own ? r0 + tok[start_me + first + j] : r0 + first + j;
                scale[k] = own ? gate[start_me + first + j] : 1.f;
            }
            int64_t end = own ? r0 + region[s] : r0 + first + n;
            if ((own ? region[s] : n) > 0 && end > used)
                used = end;
            base += region[s];
        }
        bounds[e + 1] = k;
    }
    *need = used;
    return N;
}

/* y [T, h] fp32 (zeroed by the caller) += gate[i] * row i, for every slot i this rank sent (hdr:
 * its dispatch header; slots rank-major, dest d's at [at_d, at_d + n_d)): peer d's rows came back
 * by the combine to row i of `back` (where the slot was sent from); this rank's own are the
 * experts' output rows in `own`: rows [0, n_me) by slot, or — by token (hdr[3] = T >= 0) — rows
 * [0, T), already weighted and summed per token, added as they are.  Slots past the valid ones
 * (invalid ids) are not read.  A token's rows are added in slot order. */
void moe_ep_combine_sum(const int64_t *hdrs, int64_t W, int64_t R, int64_t me, const float *back, const float *own,
                        int64_t h, const int64_t *tok, const float *gate, float *y) {
    const int64_t *hdr = hdrs + me * W;
    int64_t ne = hdr[1], at = 0, by_token = OWN_BY_TOKEN(hdr);
    const int64_t *sp = hdr + NMETA;
    if (by_token && own != y)
        memcpy(y, own, (size_t)(hdr[3] * h * 4));
    for (int64_t d = 0; d < R; d++) {
        int64_t n = dest_rows(sp, d, ne), weighted = d != me && FC2_INTO(hdrs + d * W, R, ne);
        for (int64_t j = 0; j < n && !(by_token && d == me); j++) {
            int64_t i = at + j;
            const float *src = d == me ? own + j * h : back + i * h;
            float *dst = y + tok[i] * h;
            if (weighted)  /* d's experts stored g * row already */
                for (int64_t c = 0; c < h; c++)
                    dst[c] += src[c];
            else
                for (int64_t c = 0; c < h; c++)
                    dst[c] += gate[i] * src[c];
        }
        at += n;
    }
}

/* The packed experts kernel's rows by address (experts.c's x_at / y_at) for a dispatch this rank
 * received by token with the gate in each row's last 4 bytes (hdrs: its headers, a copy; window:
 * this rank's window of that dispatch, source s's rows from row s * slab_rows; x: this rank's own
 * input, x_bytes a row; ret[s]: source s's return window at the combine's parity).  Expert-major
 * like moe_ep_dispatch_index (expert e's rows from source 0, then 1, ...), for every row k:
 *   a peer's:  x_at = its row in the window, scale = the gate it carries, y_at = its row of the
 *              source's return window (where the source sent the slot from: after its slots for
 *              ranks < me and for my experts < e), tok = 0;
 *   my own:    x_at = y_at = 0 and tok = the slot's token (the kernel reads x[tok] and adds into
 *              y[tok]: a token's local outputs summed in one row), scale = its gate from gate [S].
 * Returns N (the caller sized the arrays from moe_ep_dispatch_index's N). */
int64_t moe_ep_expert_rows(const int64_t *hdrs, int64_t W, int64_t R, int64_t me, int64_t slab_rows,
                           const char *window, int64_t row_bytes, int64_t x_bytes, char *const *ret,
                           const int64_t *tok, const float *gate, int64_t *out_tok, int64_t *x_at, int64_t *y_at,
                           float *scale) {
    int64_t ne = hdrs[1], k = 0;
    for (int64_t e = 0; e < ne; e++)
        for (int64_t s = 0; s < R; s++) {
            const int64_t *sp = hdrs + s * W + NMETA;
            /* s's slots for ranks < me (before), then for my experts < e (first) */
            int64_t first = 0, before = 0, n = sp[me * ne + e];
            for (int64_t i = 0; i < me * ne; i++)
                before += sp[i];
            for (int64_t i = me * ne; i < me * ne + e; i++)
                first += sp[i];
            for (int64_t j = 0; j < n; j++, k++) {
                if (s == me) {
                    out_tok[k] = tok[before + first + j], x_at[k] = 0, y_at[k] = 0;
                    scale[k] = gate[before + first + j];
                    continue;
                }
                const char *row = window + (s * slab_rows + first + j) * row_bytes;
                float g;
                memcpy(&g, row + x_bytes, 4);
                out_tok[k] = 0, x_at[k] = (int64_t)(intptr_t)row, scale[k] = g;
                y_at[k] = (int64_t)(intptr_t)(ret[s] + (before + first + j) * x_bytes);
            }
        }
    return k;
}

/* dst [n, row_bytes] = row k from x_at[k] where nonzero, else row tok[k] of x (row_bytes apart):
 * the rows the experts read by address, gathered (the training op's kept rows). */
void moe_ep_gather_rows(char *dst, int64_t row_bytes, int64_t n, const int64_t *x_at, const char *x,
                        const int64_t *tok) {
    for (int64_t k = 0; k < n; k++) {
        const char *src = x_at[k] ? (const char *)(intptr_t)x_at[k] : x + tok[k] * row_bytes;
        memcpy(dst + k * row_bytes, src, (size_t)row_bytes);
    }
}
