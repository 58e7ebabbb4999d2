"""The "symm" transport: dispatch and combine through a symmetric heap (CPU: shared memory).

Shapes:  R ranks, El local experts, S' slots this rank sends (sorted by dest, then local expert),
         N rows this rank receives, P payload width (H: x forward, dy backward; 2H: [x | dy] when a
         rank's forward kept no rows), Q result width,
         C chunks per (source, dest) block.

Per call (one "epoch"; every buffer below exists twice and epoch parity picks one, so a fast rank
starting call e+1 never overwrites what a slow rank still reads from call e):
  1. counts: each rank writes its [R, El] counts (+ its S') into its own control segment and
     raises its COUNTS flag in every pad; every rank waits for all R flags and reads the whole
     [R_src, R_dst, El] matrix from the peers' segments (a host read of shared memory — on CPU
     that is a load, not a device sync; there are no split sizes to sync anywhere else).  All
     ranks now agree on every offset, on the overflow verdict (``plan.check_bound``), on a heap
     resize and on the chunk count — with no further communication.
  2. dispatch: rows ``x[tokens]`` are gathered straight into the owning rank's receive window
     (``index_select(out=peer view)``; int8 + per-row scale with ``symm-int8``), C pieces per
     dest, a DATA flag raised in the dest's pad after each piece;
  3. experts: each rank runs its local experts on every piece as soon as its flag is up (between
     its own dispatch pieces, then until all arrived) and writes the result rows straight into
     the source rank's return window, then raises a RET flag in the source's pad;
  4. combine: the source waits for its RET flags; its return window holds the results in its own
     send order, so the weighted combine is one ``index_add_`` (done by the caller).
Every wait has a deadline: a rank that never signals is named in a ``TimeoutError``.

Backward: the same four steps on a heap of its own, chunked like the forward.  The training op's
forward copied each received piece to its row of the kept buffer (``ep/keep.py``: source-major,
which is the window's own order), so when every rank kept (a flag beside its counts) the
backward sends only dy (+ g) and the experts' rank reads x from its kept rows; otherwise
[x | dy] rows travel, as before.

Receive bound: ``max_tokens`` rows per rank when given (exceeding it raises on every rank);
otherwise the window grows, collectively and in step on every rank, to the largest receive of
the call — at most T_max*K*R rows.
"""

from __future__ import annotations

import socket

import torch

from moe_compile.ep import keep as keep_mod
from moe_compile.ep.plan import auto_chunks, check_bound, piece_bounds, piece_counts
from moe_compile.quant.int8 import dequantize, quantize
from moe_compile.symm import allocate
from moe_compile.symm.cpu_shm import backoff

CMAX = 16  # flag slots per (peer, direction): the most chunks a call can use
_A = 64  # byte alignment of the regions inside a segment


def _al(n: int) -> int:
    return (n + _A - 1) // _A * _A


def same_host(ctx) -> bool:
    """True when every rank of the group runs on this host (checked once, through the store)."""
    if "same_host" not in ctx.heaps:
        ctx.store.set(ctx.key("host", ctx.group_name, ctx.rank), socket.gethostname())
        keys = {r: ctx.key("host", ctx.group_name, r) for r in range(ctx.world)}
        ctx.wait_keys(keys, 60.0, "host check")
        hosts = {ctx.store.get(k).decode() for k in keys.values()}
        ctx.heaps["same_host"] = len(hosts) == 1
    return ctx.heaps["same_host"]


class _Flags:
    """Flag slot numbers in a control pad."""

    def __init__(self, R: int):
        self.R = R
        self.total = R + 2 * R * CMAX + R  # COUNTS, DATA, RET, barrier

    def counts(self, s):
        return s

    def data(self, s, j):
        return self.R + s * CMAX + j

    def ret(self, d, j):
        return self.R + self.R * CMAX + d * CMAX + j

    def who(self, slot):
        if slot < self.R:
            return slot
        return ((slot - self.R) % (self.R * CMAX)) // CMAX


class _Layout:
    """Byte offsets of one data segment: per parity, rows | g | scales | results."""

    def __init__(self, cap: int, ret_cap: int, row_bytes: int, q_bytes: int):
        self.cap, self.ret_cap, self.row_bytes, self.q_bytes = cap, ret_cap, row_bytes, q_bytes
        self.rows = _al(cap * row_bytes)
        self.g = _al(cap * 4)
        self.ret = _al(ret_cap * q_bytes)
        self.half = self.rows + 2 * self.g + self.ret
        self.nbytes = 2 * self.half

    def rows_at(self, par, row):
        return par * self.half + row * self.row_bytes

    def g_at(self, par, row):
        return par * self.half + self.rows + row * 4

    def scale_at(self, par, row):
        return par * self.half + self.rows + self.g + row * 4

    def ret_at(self, par, row):
        return par * self.half + self.rows + 2 * self.g + row * self.q_bytes


class _State:
    """Heaps of one (group, payload kind): a fixed control heap and a resizable data heap."""

    def __init__(self, ctx, kind: str, el: int, timeout_s: float):
        R = ctx.world
        self.flags = _Flags(R)
        self.kind, self.el = kind, el
        self.counts_words = R * el + 2  # [R, El] counts + S' + kept flag
        self.control = allocate(ctx.store, ctx.rank, R, 2 * self.counts_words * 8, self.flags.total,
                                f"{ctx.group_name}/{kind}/ctl", timeout_s)
        self.data, self.layout, self.gen, self.epoch = None, None, 0, 0

    def counts_view(self, rank, par):
        return self.control.tensor(rank, par * self.counts_words * 8, (self.counts_words,), torch.int64)

    def ensure(self, ctx, cap, ret_cap, row_bytes, q_bytes, timeout_s):
        lay = self.layout
        if lay and lay.cap >= cap and lay.ret_cap >= ret_cap and lay.row_bytes == row_bytes and lay.q_bytes == q_bytes:
            return
        cap = max(cap, lay.cap if lay else 0)
        ret_cap = max(ret_cap, lay.ret_cap if lay else 0)
        cap, ret_cap = _grow(cap), _grow(ret_cap)
        if self.data is not None:
            self.data.close()
        self.gen += 1
        self.layout = _Layout(cap, ret_cap, row_bytes, q_bytes)
        self.data = allocate(ctx.store, ctx.rank, ctx.world, self.layout.nbytes, 0,
                             f"{ctx.group_name}/{self.kind}/data{self.gen}", timeout_s)


def _grow(n: int) -> int:
    """Round a row capacity up (multiples of 256, +25%) so that a growing T resizes rarely."""
    return max(256, (int(n * 1.25) + 255) // 256 * 256)


def exchange(ctx, plan, base, gpay, compute, q_width: int, q_dtype, *, chunks: int, timeout_s: float,
             quant: bool = False, max_tokens: int = 0, top_k: int = 1, keep=None, backward: bool = False,
             kept=None, resend=None):
    """Send ``base[plan.tokens]`` rows (+ fp32 ``gpay``) to their experts' ranks through the heap,
    run ``compute(rows, g, counts, out, at)`` there on each piece (``at``: its first row among
    this rank's received rows, source-major), return the [S', Q] results (a view of this rank's
    return window, valid until the next exchange on this heap) in send order.

    ``keep`` (a forward; ``ep/keep.Buffers``): the received rows copied to ``keep.rows[at:]`` when
    they fit.  ``backward``: its own heap; ``kept`` (``ep/keep.KeptRows`` or None) this rank's
    forward rows — when every rank has them (a flag beside the counts) ``base`` (dy) goes alone,
    else ``[resend | base]`` rows."""
    R, me, el = ctx.world, ctx.rank, plan.local_experts
    kind = f"{'bwd' if backward else 'fwd'}{'q' if quant else ''}_el{el}"
    st = ctx.heaps.get(("symm", kind))
    if st is None:
        st = ctx.heaps[("symm", kind)] = _State(ctx, kind, el, timeout_s)
    st.epoch += 1
    ep, par, F = st.epoch, st.epoch % 2, st.flags
    # 1. counts through the heap, with this rank's S' and whether it kept its forward rows
    mine = st.counts_view(me, par)
    mine[: R * el].copy_(plan.counts.reshape(-1))
    mine[R * el] = plan.rows
    mine[R * el + 1] = int(kept is not None)
    for r in range(R):
        st.control.signal(r, F.counts(me), ep)
    st.control.wait([F.counts(s) for s in range(R)], ep, timeout_s, F.who, "the counts exchange")
    allc = torch.stack([st.counts_view(s, par).clone() for s in range(R)])  # host read of shm
    matrix = allc[:, : R * el].view(R, R, el)  # [R_src, R_dst, El]
    check_bound(matrix, max_tokens, top_k, me)
    recv = matrix.sum(2)  # [R_src, R_dst] rows
    cnt = matrix.tolist()
    if backward:  # dy alone where every rank kept its forward rows, else [x | dy]
        base, kept = keep_mod.backward_rows(base, kept, resend, bool((allc[:, R * el + 1] == 1).all()),
                                            [cnt[s][me] for s in range(R)], me)
    need = max_tokens if max_tokens > 0 else int(recv.sum(0).max())
    P, item = base.shape[1], base.element_size()
    row_bytes = P if quant else P * item
    q_bytes = q_width * torch.empty((), dtype=q_dtype).element_size()
    st.ensure(ctx, need, int(allc[:, R * el].max()), row_bytes, q_bytes, timeout_s)
    lay, data = st.layout, st.data
    C = min(CMAX, chunks if chunks > 0 else auto_chunks(matrix))
    rl = recv.tolist()
    r_off = [[sum(rl[s2][d] for s2 in range(s)) for d in range(R)] for s in range(R)]  # dest window offsets
    p_off = [[sum(rl[s][d2] for d2 in range(d)) for d in range(R)] for s in range(R)]  # source return offsets
    received = sum(rl[s][me] for s in range(R))
    ctx.sent["backward" if backward else "forward"] = (row_bytes + 4, sum(rl[me]) - rl[me][me], C)
    keep = keep if keep is not None and received <= keep.cap else None
    pending = [(s, j) for s in range(R) for j in range(C)
               if piece_bounds(rl[s][me], C)[j + 1] > piece_bounds(rl[s][me], C)[j]]
    done = set()

    def serve(block: bool):
        """Run the experts on every arrived piece (all of them when ``block``)."""
        spins = 0
        while True:
            todo = [p for p in pending if p not in done]
            if not todo:
                return
            flags = st.control.flags(me)
            ready = [p for p in todo if flags[F.data(*p)] >= ep]
            for s, j in ready:
                a, b = piece_bounds(rl[s][me], C)[j : j + 2]
                row0 = r_off[s][me] + a
                if quant:
                    q = data.tensor(me, lay.rows_at(par, row0), (b - a, P), torch.int8)
                    sc = data.tensor(me, lay.scale_at(par, row0), (b - a,), torch.float32)
                    rows = dequantize(q, sc, base.dtype)
                else:
                    rows = data.tensor(me, lay.rows_at(par, row0), (b - a, P), base.dtype)
                if keep is not None:  # the window's rows are this rank's received rows, source-major
                    keep.rows[row0 : row0 + b - a].copy_(rows)
                g = data.tensor(me, lay.g_at(par, row0), (b - a,), torch.float32)
                out = data.tensor(s, lay.ret_at(par, p_off[s][me] + a), (b - a, q_width), q_dtype)
                compute(rows, g, [piece_counts(cnt[s][me], a, b)], out, row0)
                st.control.signal(s, F.ret(me, j), ep)
                done.add((s, j))
            if not block or len(done) == len(pending):
                return
            if not ready:
                spins += 1
                _deadline_check(st, ep, todo, F, timeout_s, spins)
                backoff(spins)

    # 2. dispatch, C pieces per dest, serving arrived pieces in between
    send_off = [sum(rl[me][:d]) for d in range(R + 1)]
    for j in range(C):
        for k in range(1, R + 1):
            d = (me + k) % R  # start with the next rank: spread the writers over the windows
            a, b = piece_bounds(rl[me][d], C)[j : j + 2]
            if b == a:
                continue
            lo, hi = send_off[d] + a, send_off[d] + b
            row0 = r_off[me][d] + a
            tok = plan.tokens[lo:hi]
            if quant:
                quantize(base.index_select(0, tok),
                         q_out=data.tensor(d, lay.rows_at(par, row0), (b - a, P), torch.int8),
                         s_out=data.tensor(d, lay.scale_at(par, row0), (b - a,), torch.float32))
            else:
                torch.index_select(base, 0, tok, out=data.tensor(d, lay.rows_at(par, row0), (b - a, P), base.dtype))
            data.tensor(d, lay.g_at(par, row0), (b - a,), torch.float32).copy_(gpay[lo:hi])
            st.control.signal(d, F.data(me, j), ep)
        serve(block=False)
    # 3. the rest of the experts
    serve(block=True)
    if keep is not None:
        keep.record(received, [cnt[s][me] for s in range(R)])
    # 4. wait for every result of this rank's rows
    rets = [F.ret(d, j) for d in range(R) for j in range(C)
            if piece_bounds(rl[me][d], C)[j + 1] > piece_bounds(rl[me][d], C)[j]]
    st.control.wait(rets, ep, timeout_s, F.who, "the combine (results from the experts' ranks)")
    return data.tensor(me, lay.ret_at(par, 0), (plan.rows, q_width), q_dtype)


def _deadline_check(st, ep, todo, F, timeout_s, spins):
    """Raise once the serving loop has waited ``timeout_s`` for pieces that never came."""
    import time

    if not hasattr(st, "_serve_t0") or spins == 1:
        st._serve_t0 = time.monotonic()
    if time.monotonic() - st._serve_t0 > timeout_s:
        missing = sorted({s for s, _ in todo})
        raise TimeoutError(
            f"fused_moe_ep: rank(s) {missing} did not deliver their token rows within timeout_s={timeout_s:g}s "
            f"(symm transport, dispatch; this is rank {st.control.rank})"
        )
