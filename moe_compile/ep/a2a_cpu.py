"""CPU transport of ``ep_dispatch`` / ``ep_combine``: the 2D all-to-all over the shared-memory heap.

Shapes:  R ranks, ne experts per rank, W = NMETA + 2*R*ne words of one header, P row bytes,
         B slab bytes (one source's share of a receive window), N rows this rank receives.

Fixed per-source slabs (DeepEP's low-latency layout): every rank's data window (two copies,
parity = epoch % 2) holds R slabs of B bytes, slab s written only by source s; its control window
holds R header slots.  Per call (epoch e) a source makes ONE C call (``kernels/cpu/ep.Send``):
for each destination its header [meta | splits (and offsets)] into the destination's slot, its
rows for that destination packed into its slab there, and — after every destination's rows —
every destination's flag ``me`` = e.  So counts and rows travel together and a call has ONE wait
(the R flags of this rank's sources, ``kernels/cpu/ep.Wait``: spin, yield, nap); there is no
counts barrier.  Then every rank holds every rank's header, computes the layout itself
(``a2a_layout``, numpy on the window: a read of this host's memory, no torch scalar read), so every
verdict (a bad size, an ``out`` too small, a slab too small) is the same on every rank, and one C
call gathers the slabs' blocks to their rows of ``out`` (uncovered rows zero).

Slab too small: the source sends its header but no rows; every rank sees it in the headers, all
grow the slabs together and the call runs again (a new epoch on the new heap) — once per growth.
A source whose own splits do not fit its input also sends no rows (the verdict is raised on all).
``combine_t`` (a combine's transpose, the backward) needs every rank's counts before it knows
which of its rows go where: it runs a header-only round first.

Parity: a source writes parity p of a peer's windows in call e+2 only after seeing that peer's
flag of call e+1, which the peer stores after all its copies of call e+1 — by then it has finished
reading call e's rows (its input may be its call-e window) — so two copies suffice and nothing is
reset.  Every wait has a deadline: the ranks whose flags never came are named in a
``TimeoutError``.

The fused op's own pair (``dispatch_rows`` / ``combine_sum``) keeps this protocol and its checks
but copies each row once: slot i's row is read at ``x[tokens[i]]`` (no sorted copy) and lands in
slab ``me`` of its expert's rank's window — this rank's own rows in its own window, so that one
base addresses every received row — where the experts read it in place (``Received.idx``: their
row list, from the headers in C); the combine returns only the peers' rows and one C pass adds
the weighted rows into the tokens (``kernels/cpu/ep_copy.c``'s ``*_idx`` / ``*_index`` / ``*_sum``).

Kinds: ``dispatch`` (header: in_splits [R*ne]), ``combine`` (in_splits_offsets [2, ne*R]) and
``combine_t`` (the transpose of a combine, its backward: the same header as the forward combine,
the rows going back from the combine's outputs to the positions of its inputs).
"""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import torch

from moe_compile.ep.a2a_layout import (aligned_tiles, combine_layout, dispatch_layout, dispatch_rows_needed,
                                       exclusive_cumsum)
from moe_compile.ep.context import get_context
from moe_compile.kernels.cpu import ep as cpu_ep
from moe_compile.symm import allocate

KINDS = ("dispatch", "combine", "combine_t")
NMETA = 6  # kind, ne, input rows, out rows, row bytes, major_align (-1 = None)
WAIT_ENV = "MOE_COMPILE_EP_WAIT"  # "yield" (default: spin, yield, nap) or "futex" (sleep until the sender wakes)
SLAB_BYTES = 1 << 20  # a slab's first size (grown, on every rank alike, when a call needs more)


def _grow(nbytes: int) -> int:
    """Round a slab up (+25%, whole MiB) so that a growing T resizes it rarely."""
    return max(SLAB_BYTES, (int(nbytes * 1.25) + (1 << 20) - 1) >> 20 << 20)


class _State:
    """Windows of one (group, ne): a fixed control heap (R header slots x 2 parities, R flags) and a
    resizable data heap (R slabs x 2 parities); the send arrays of each parity, made once."""

    def __init__(self, ctx, ne: int, timeout_s: float):
        R, me = ctx.world, ctx.rank
        self.R, self.ne, self.me, self.W = R, ne, me, NMETA + 2 * R * ne
        # flags: R arrival flags (slot s: source s's epoch), then R "sleeping" words (see ``Wait``)
        self.control = allocate(ctx.store, me, R, 2 * R * self.W * 8, 2 * R, f"{ctx.group_name}/a2a{ne}/ctl",
                                timeout_s)
        sleep_off = R if os.environ.get(WAIT_ENV, "yield") == "futex" else 0
        ctl = np.array([self.control.tensor(r, 0, (1,), torch.uint8).data_ptr() for r in range(R)], dtype=np.uint64)
        flag_base = np.array([self.control.flags(r).ctypes.data for r in range(R)], dtype=np.uint64)
        self.sends = [cpu_ep.Send(R, R * ne, sleep_off) for _ in (0, 1)]  # per parity, dests 0..R-1
        for par, snd in enumerate(self.sends):
            snd.hdr_dst[:] = ctl + np.uint64((par * R + me) * self.W * 8)  # slot ``me`` of each dest
            snd.flags[:] = flag_base + np.uint64(8 * me)
            snd.nblk[:] = ne
        self.slab_rows = np.arange(R, dtype=np.int64)[:, None]  # [R, 1] slab index (times slab bytes)
        self.views = [self.control.tensor(me, par * R * self.W * 8, (R, self.W), torch.int64).numpy() for par in (0, 1)]
        self.wait = cpu_ep.Wait(self.control.flags(me), np.arange(R), sleep_off)
        self.sleep_off = sleep_off
        self.views_at = [v.ctypes.data for v in self.views]
        # the C window path's outputs: oso [2, ne*R], rows each source sent [R], a needed size
        self.oso, self.sent, self.need = np.zeros((2, ne * R), np.int64), np.zeros(R, np.int64), np.zeros(1, np.int64)
        self.out_at = (self.oso.ctypes.data, self.sent.ctypes.data, self.need.ctypes.data)
        self.gather = cpu_ep.Gather(R * ne)
        self.data, self.slab, self.half, self.gen, self.epoch = None, 0, 0, 0, 0
        self.local = [torch.empty(0, dtype=torch.uint8) for _ in (0, 1)]  # compact receive windows (plain memory)
        self.row = np.zeros(self.W, dtype=np.int64)
        self.row_at = self.row.ctypes.data
        # ``dispatch_rows``: the received rows' layout rows and scales (grown on demand), the experts'
        # bounds, each source's region rows
        self.idx, self.scale = np.zeros(0, np.int64), np.zeros(0, np.float32)
        self.bounds, self.region = np.zeros(ne + 1, np.int64), np.zeros(R, np.int64)

    def ensure(self, ctx, slab_bytes: int, timeout_s: float) -> None:
        """Every rank calls it with the same ``slab_bytes`` (computed from the same headers): in step."""
        if self.data is not None and self.slab >= slab_bytes:
            return
        if self.data is not None:
            self.data.close()  # every rank saw every flag of this call: nobody writes the old one
        self.gen += 1
        self.slab = _grow(max(slab_bytes, self.slab))
        self.half = self.R * self.slab
        self.data = allocate(ctx.store, ctx.rank, ctx.world, 2 * self.half, 0,
                             f"{ctx.group_name}/a2a{self.ne}/data{self.gen}", timeout_s)
        base = np.array([self.data.tensor(r, 0, (1,), torch.uint8).data_ptr() for r in range(ctx.world)],
                        dtype=np.uint64)
        self.base_me = int(base[self.me])
        self.dst_base = base  # [R] data window of each dest
        self.slab_at = self.base_me + self.slab_rows * self.slab  # [R, 1] this rank's slab of each source
        # per parity: each dest's window (the combine's rows) and my slab in it (the dispatch's)
        self.win_dst = [base + np.uint64(par * self.half) for par in (0, 1)]
        self.slab_dst = [w + np.uint64(self.me * self.slab) for w in self.win_dst]
        self.win_dst_at = [a.ctypes.data for a in self.win_dst]
        self.slab_dst_at = [a.ctypes.data for a in self.slab_dst]

    def local_window(self, par: int, nbytes: int) -> torch.Tensor:
        if self.local[par].numel() < nbytes:
            self.local[par] = torch.empty(_grow(nbytes), dtype=torch.uint8)
        return self.local[par]


def _state(ctx, ne: int, timeout_s: float) -> _State:
    st = ctx.heaps.get(("a2a", ne))
    if st is None:
        st = ctx.heaps[("a2a", ne)] = _State(ctx, ne, timeout_s)
    return st


def _wait(st: _State, ep: int, timeout_s: float, what: str) -> None:
    if st.wait(ep, timeout_s):
        flags, slots = st.wait.flags, st.wait.slots
        missing = sorted(int(s) for s in slots[flags[slots] < ep])
        raise TimeoutError(f"ep a2a: rank(s) {missing} did not arrive within timeout_s={timeout_s:g}s ({what}; this "
                           f"is rank {st.me})")


def _meta(kind: str, ne: int, rows_in: int, out_rows: int, row_bytes: int, major_align) -> list:
    return [KINDS.index(kind), ne, rows_in, out_rows, row_bytes, -1 if major_align is None else int(major_align)]


_AGREE = np.array([0, 1, 4, 5])  # meta columns every rank must share


def _agree(rows: np.ndarray, me: int) -> None:
    """Every rank called the same kind with the same row width and alignment (else: raise on all)."""
    cols = rows[:, _AGREE]
    if not (cols != cols[0]).any():  # one numpy op on the hot path
        return
    for col, name in ((0, "op"), (1, "experts per rank"), (4, "row bytes"), (5, "major_align")):
        vals = rows[:, col]
        if (vals != vals[0]).any():
            shown = [KINDS[int(v)] for v in vals] if col == 0 else vals.tolist()
            raise ValueError(f"ep a2a: ranks disagree on the {name}: {shown} (by rank; raised on rank {me})")


def _layout(kind: str, rows: np.ndarray, me: int, R: int, ne: int):
    """From every rank's header: this rank's out_splits_offsets (None for ``combine_t``), every
    rank's out rows, and the checks' verdicts — the same on every rank."""
    pay = rows[:, NMETA:]
    rows_in, out_rows = rows[:, 2], rows[:, 3].copy()
    if (pay < 0).any():
        bad = int(np.nonzero((pay < 0).any(1))[0][0])
        raise ValueError(f"ep a2a: rank {bad} passed a negative split or offset (raised on rank {me})")
    if kind == "dispatch":
        align = None if rows[0, 5] < 0 else int(rows[0, 5])
        splits = pay[:, : R * ne]  # [R_src, R*ne]
        o_splits, o_offs = dispatch_layout(splits, ne, align)  # [R_dst, ne*R]
        used, need = splits.sum(1), dispatch_rows_needed(splits, ne, align)  # [R_src], [R_dst]
        oso = np.stack([o_splits[me], o_offs[me]])
    else:
        so = pay.reshape(R, 2, ne * R)  # [R_p, 2, ne*R] every rank's (forward) in_splits_offsets
        o_splits, o_offs, _ = combine_layout(so, ne)  # [R_dst, R*ne]
        ends = (so[:, 0] + so[:, 1]) * (so[:, 0] > 0)  # [R_p, ne*R] end row of each block in p's input
        if kind == "combine":
            used, need = ends.max(1, initial=0), o_splits.sum(1)
            oso = np.stack([o_splits[me], o_offs[me]])
        else:  # combine_t: d sends the rows at its forward outputs back to p's forward inputs
            used, need = o_splits.sum(1), ends.max(1, initial=0)
            oso = None
    out_rows[out_rows < 0] = need[out_rows < 0]  # window mode: exactly what arrives
    for r in range(R):
        if used[r] > rows_in[r]:
            raise ValueError(f"ep a2a {kind}: rank {r}'s splits span {int(used[r])} rows of its input, which has "
                             f"{int(rows_in[r])} (raised on rank {me})")
        if need[r] > out_rows[r]:
            raise ValueError(f"ep a2a {kind}: rank {r} receives {int(need[r])} rows, its out has {int(out_rows[r])} "
                             f"(size out for R*T_max*min(K, E_local) rows + alignment; raised on rank {me})")
    return oso, out_rows


def _next(st: _State) -> tuple[int, int]:
    st.epoch += 1
    return st.epoch, st.epoch % 2


def _own_blocks(kind: str, pay: np.ndarray, rows_in: int, R: int, ne: int, pre, me: int):
    """This source's blocks per dest, ([R_dst, ne] rows, [R_dst, ne] first row in its input), each
    dest's blocks in expert order — from its own header (``combine_t``: from every header of the
    header round, ``pre``).  None when its splits do not fit its input: it then sends no rows and
    every rank raises the verdict from the headers (no read outside the input)."""
    if (pay < 0).any() or (pre is not None and (pre[:, NMETA:] < 0).any()):
        return None
    if kind == "dispatch":
        sp = pay[: R * ne]
        ok = sp.sum() <= rows_in
        blocks = (sp.reshape(R, ne), exclusive_cumsum(sp).reshape(R, ne))
    elif kind == "combine":
        so = pay[: 2 * ne * R].reshape(2, ne, R)
        ok = ((so[0] + so[1]) * (so[0] > 0)).max(initial=0) <= rows_in
        blocks = (so[0].T, so[1].T)
    else:  # combine_t: my input is laid out as the combine's output (rank-major over every source p)
        o_splits, o_offs, _ = combine_layout(pre[:, NMETA : NMETA + 2 * ne * R].reshape(R, 2, ne * R), ne)
        ok = o_splits[me].sum() <= rows_in
        blocks = (o_splits[me].reshape(R, ne), o_offs[me].reshape(R, ne))
    return blocks if ok else None


def _recv_blocks(kind: str, rows: np.ndarray, me: int, R: int, ne: int):
    """From every header: what this rank receives, ([R_src, ne] rows, [R_src, ne] row in ``out``)
    in each source's slab order (expert order), and the rows ``out`` spans."""
    pay = rows[:, NMETA:]
    if kind == "dispatch":
        align = None if rows[0, 5] < 0 else int(rows[0, 5])
        rs = pay[:, me * ne : (me + 1) * ne]  # [R_s, ne]
        tiles = aligned_tiles(rs.sum(0), align)  # [ne]
        offs = exclusive_cumsum(tiles)[:, None] + exclusive_cumsum(rs.T, 1)  # [ne, R_s]: e*R + s
        return rs, offs.T, int(tiles.sum())
    so = pay[:, : 2 * ne * R].reshape(R, 2, ne, R)  # [R_p, 2, ne, R_d] every rank's in_splits_offsets
    if kind == "combine":  # from p: its blocks (e, me), to out's block (p, e), packed rank-major
        rs = so[:, 0, :, me]  # [R_p, ne]
        return rs, exclusive_cumsum(rs.reshape(-1)).reshape(R, ne), int(rs.sum())
    rs, dst = so[me, 0].T, so[me, 1].T  # combine_t, from d: rows back to my forward input's block (e, d)
    return rs, dst, int(((rs + dst) * (rs > 0)).max(initial=0))


def _slab_need(kind: str, rows: np.ndarray, R: int, ne: int) -> int:
    """Most rows any source sends any dest in this call (from every header)."""
    pay = rows[:, NMETA:]
    if kind == "dispatch":
        return int(pay[:, : R * ne].reshape(R, R, ne).sum(2).max(initial=0))
    # combine: p sends d its blocks (e, d); combine_t: d sends p the same rows back
    return int(pay[:, : ne * R].reshape(R, ne, R).sum(1).max(initial=0))


def _send_slabs(st: _State, par: int, ep: int, x: torch.Tensor, row_bytes: int, own) -> None:
    """One C call: header + this rank's rows into its slab of every dest's window, then the flags."""
    snd = st.sends[par]
    snd.dst[:] = st.dst_base + np.uint64(par * st.half + st.me * st.slab)
    if own is None or int(own[0].sum(1).max(initial=0)) * row_bytes > st.slab:
        snd.blk[2] = 0  # header only: every rank sees why in the headers
    else:
        rows, src = own
        snd.blk[0], snd.blk[1], snd.blk[2] = src.reshape(-1), exclusive_cumsum(rows, 1).reshape(-1), rows.reshape(-1)
        snd.blk[2, st.me * st.ne : (st.me + 1) * st.ne] = 0  # own rows: gathered from x directly, never copied twice
    snd(x.data_ptr(), row_bytes, st.row_at, st.W * 8, ep)


def _header_round(st: _State, timeout_s: float) -> np.ndarray:
    """Every rank's header, no rows (``combine_t`` needs every rank's counts to place its own rows)."""
    ep, par = _next(st)
    snd = st.sends[par]
    snd.blk[2] = 0
    snd(0, 0, st.row_at, st.W * 8, ep)
    _wait(st, ep, timeout_s, "the combine_t's counts")
    rows = st.views[par].copy()
    _agree(rows, st.me)
    return rows


def _gather(st: _State, par: int, rs: np.ndarray, dst: np.ndarray, row_bytes: int, out: torch.Tensor,
            expert_major: bool, x: torch.Tensor, own) -> None:
    """One C call: the blocks out of the R slabs of this rank's window — and this rank's own blocks
    straight from its input ``x`` (never copied into its own slab) — into ``out`` (gaps zeroed)."""
    me = st.me
    src = st.slab_at + (par * st.half + exclusive_cumsum(rs, 1) * row_bytes)  # [R_s, ne] addresses in the slabs
    src[me] = x.data_ptr() + own[1][me] * row_bytes
    g = st.gather
    if expert_major:  # dispatch: e*R + s order, sorted by row (one pass)
        rs, dst, src = rs.T, dst.T, src.T
    g.src_at[:], g.dst_row[:], g.rows[:] = src.reshape(-1), dst.reshape(-1), rs.reshape(-1)
    g(out, row_bytes)


def _combine_after(ctx, st: _State, x: torch.Tensor, row_bytes: int, handle, timeout_s: float):
    """A combine of the window dispatch's rows straight after it: every rank already knows where
    each row goes (the dispatch's headers), so each block goes to its FINAL row of the source's
    window (rank-major, as the source sent it) — no header, no gather, one wait."""
    R, ne, me = st.R, st.ne, st.me
    _, _, drows, rs, dst = handle  # rs, dst [R_s, ne]: rows from s and where they sit in my window
    splits = drows[:, NMETA : NMETA + R * ne]  # [R_s, R*ne] every source's dispatch splits
    S = splits.sum(1)  # [R] rows each source sent, and gets back
    back = exclusive_cumsum(splits, 1)[:, me * ne : (me + 1) * ne]  # [R_s, ne] where my blocks sit at s
    if x.shape[0] < int(((rs + dst) * (rs > 0)).max(initial=0)):
        raise ValueError(f"ep a2a combine: input has {x.shape[0]} rows, fewer than the dispatch's window")
    st.ensure(ctx, -(-int(S.max(initial=0)) * row_bytes // R), timeout_s)  # same on every rank
    ep, par = _next(st)
    snd = st.sends[par]
    snd.dst[:] = st.dst_base + np.uint64(par * st.half)
    snd.blk[0], snd.blk[1], snd.blk[2] = dst.reshape(-1), back.reshape(-1), rs.reshape(-1)
    snd(x.data_ptr(), row_bytes, 0, 0, ep)
    _wait(st, ep, timeout_s, "the combine's rows")
    return st.data.tensor(me, par * st.half, (int(S[me]), *x.shape[1:]), x.dtype), None


def _dispatch_window_c(ctx, st: _State, lib, x: torch.Tensor, row_bytes: int, timeout_s: float):
    """The fused op's dispatch, whole in C: one send (header + rows + flags), one wait, one receive
    (checks, layout, gather into the compact window).  The header is in ``st.row`` already."""
    R, me, W = st.R, st.me, st.W
    while True:
        ep, par = _next(st)
        snd = st.sends[par]
        lib.moe_ep_dispatch_send(st.row_at, W, R, me, x.data_ptr(), st.slab_dst_at[par], st.slab, snd._at[5],
                                 snd._at[6], ep, st.sleep_off)
        _wait(st, ep, timeout_s, "the dispatch's rows")
        while True:
            buf = st.local[par]
            cap = buf.numel() // row_bytes if row_bytes else 1 << 62
            n = lib.moe_ep_dispatch_recv(st.views_at[par], W, R, me, st.base_me + par * st.half, st.slab,
                                         x.data_ptr(), buf.data_ptr(), cap, *st.out_at)
            if n != -3:
                break
            st.local_window(par, int(st.need[0]) * row_bytes)
        if n == -1:  # a bad split or a disagreement: the numpy checks name it, on every rank alike
            rows = st.views[par]
            _agree(rows, me)
            _layout("dispatch", rows, me, R, st.ne)
            raise RuntimeError("ep a2a dispatch: the C checks refused headers the numpy checks accept")
        if n >= 0:
            break
        st.ensure(ctx, int(st.need[0]), timeout_s)  # -2: a slab too small: every rank grows, sends again
    view = st.local[par][: n * row_bytes].view(x.dtype).view(n, *x.shape[1:])
    oso = st.oso.copy()
    return view, torch.from_numpy(oso), oso, (ep, st, st.views[par].copy(), oso, st.sent.copy(), int(st.need[0]))


def _combine_after_c(ctx, st: _State, lib, x: torch.Tensor, row_bytes: int, handle, timeout_s: float):
    """``_combine_after`` whole in C: each block to its final row of its source's window, the flags."""
    _, _, drows, oso, sent, used = handle
    if x.shape[0] < used:
        raise ValueError(f"ep a2a combine: input has {x.shape[0]} rows, the dispatch's blocks span {used}")
    st.ensure(ctx, -(-int(sent.max(initial=0)) * row_bytes // st.R), timeout_s)  # same on every rank
    ep, par = _next(st)
    lib.moe_ep_combine_after(drows.ctypes.data, st.W, st.R, st.me, oso.ctypes.data, x.data_ptr(), row_bytes,
                             st.win_dst_at[par], st.sends[par]._at[6], ep, st.sleep_off, 0)
    _wait(st, ep, timeout_s, "the combine's rows")
    return st.data.tensor(st.me, par * st.half, (int(sent[st.me]), *x.shape[1:]), x.dtype), None


@dataclasses.dataclass(frozen=True)
class Received:
    """Where the rows of a ``dispatch_rows`` lie in this rank's receive window (nothing copied).

    ``window`` [L, B] uint8: the window's rows, source s's region at rows [s * slab_rows, ...)
    (``region[s]`` rows: its rows to this rank; this rank's own region: its slots' rows, or by
    token x's T rows), valid until this rank's second exchange after this one; ``idx`` [N] int64:
    the layout row of every received row, expert-major (expert e owns ``idx[bounds[e] :
    bounds[e + 1]]``, its rows from source 0, then 1, ...) and ``scale`` [N] fp32 the weight the
    experts apply (1; by token, the own slots' routing weights: a token's local outputs are summed
    in its own row).  ``packed``: the layout is the regions packed one after another — the caller's
    compact copy of them — and ``idx`` / ``oso`` / ``own_row`` are rows of that copy."""

    window: torch.Tensor
    idx: torch.Tensor
    scale: torch.Tensor
    bounds: list  # ne + 1 host ints
    oso: np.ndarray  # [2, ne*R]: splits and layout row of block (e, s) at e*R + s
    region: np.ndarray  # [R] rows of each source's region
    slab_rows: int
    own_row: int  # layout row of this rank's own region
    by_token: bool
    handle: tuple  # for ``combine_sum``
    x_bytes: int = 0  # bytes of x in a row (the rest: the extra field, e.g. the gate)
    fc2_into: bool = False  # this rank's experts store their peers' rows into the return windows

    def source_rows(self, s: int) -> torch.Tensor:
        """[region[s], B] source s's region of the window (a view)."""
        a = s * self.slab_rows
        return self.window[a : a + int(self.region[s])]


def _record_sent(ctx, row: np.ndarray, me: int, ne: int, row_bytes: int) -> None:
    """``EPContext.sent["a2a dispatch"]`` = (row bytes, rows to the peers) of this dispatch, from
    its header's splits (numpy: no torch read); what the tests and bench_ep.py read."""
    R = ctx.world
    splits = row[NMETA : NMETA + R * ne]
    ctx.sent["a2a dispatch"] = (row_bytes, int(splits.sum() - splits[me * ne : (me + 1) * ne].sum()))


def dispatch_rows(x: torch.Tensor, tokens: torch.Tensor, in_splits: torch.Tensor, group_name: str,
                  timeout_s: float, extra: torch.Tensor | None = None, packed: bool = False,
                  gates: torch.Tensor | None = None, between=None, gate_rows: bool = False,
                  fc2_into: bool = False) -> Received:
    """The fused op's dispatch by token index, whole in C (``ep_copy.moe_ep_dispatch_send_idx``):
    slot i's row is ``x[tokens[i]]`` (x [T, ...] read where it lies, no sorted copy) followed by
    ``extra[i]`` (a per-slot field, [S, m]; the backward's routing weight), slots rank-major
    (``in_splits`` [R*ne] rows each), every slot into the window of its expert's rank — this
    rank's own too, so that its experts read every row in place.  ``gates`` [S] fp32 (no ``extra``):
    this rank's own rows go by token — x's T rows copied once into its own window, however many of
    a token's experts are local — and ``Received.scale`` gives the own slots their routing weight
    (``combine_sum`` then adds the experts' own output rows as they are).  One send, one wait, the
    layout from the headers (no torch scalar read).  ``between()``, when given, runs once after this rank's
    rows are sent and before it waits for its peers' (independent work while the exchange is in
    flight; ``benchmarks/bench_ep.py --overlap`` measures what that buys on CPU).
    ``gate_rows`` (with ``gates``): each slot's gate rides in its row (4 bytes after x), so that
    the peers' experts can weight their outputs; ``fc2_into``: this rank's experts will store
    their peers' rows, weighted, straight into the sources' return windows (``expert_rows``; its
    header says so, and ``combine_sum`` on every source then adds them as they are), and its own
    rows by token are not copied at all (the experts read them in x).  Every rank must pass the
    same ``gate_rows`` (the row width); ``fc2_into`` is each rank's own.  Needs
    ``kernels/cpu/ep.fast_lib()``."""
    ctx = get_context(group_name)
    R, me = ctx.world, ctx.rank
    ne = in_splits.numel() // R
    x = x.contiguous()
    x_bytes = math.prod(x.shape[1:]) * x.element_size()
    if (gate_rows and (gates is None or extra is not None or packed)) or (fc2_into and not gate_rows):
        raise ValueError("ep a2a dispatch_rows: gate_rows needs gates (by token, no extra, not packed); fc2_into "
                         "needs gate_rows")
    by_token = gates is not None and extra is None
    if gate_rows:
        extra = gates.float()[:, None]  # [S, 1] the slot's gate, after x in its row
    extra = None if extra is None else extra.contiguous()
    extra_bytes = 0 if extra is None else math.prod(extra.shape[1:]) * extra.element_size()
    row_bytes = max(x_bytes + extra_bytes, 1)
    st = _state(ctx, ne, timeout_s)
    if st.data is None:
        st.ensure(ctx, SLAB_BYTES, timeout_s)
    lib, W = cpu_ep.fast_lib(), st.W
    gates = gates.float().contiguous() if by_token else None
    st.row[:NMETA] = _meta("dispatch", ne, tokens.numel(), x.shape[0] if by_token else -1, x_bytes + extra_bytes, None)
    st.row[NMETA : NMETA + R * ne] = in_splits.reshape(-1).numpy()
    st.row[NMETA + R * ne] = int(fc2_into)  # the "FC2 into" word (ep_copy.c's FC2_INTO)
    _record_sent(ctx, st.row, me, ne, x_bytes + extra_bytes)
    while True:
        ep, par = _next(st)
        slab_rows = st.slab // row_bytes
        lib.moe_ep_dispatch_send_idx(st.row_at, W, R, me, x.data_ptr(), tokens.data_ptr(), x_bytes,
                                     0 if extra is None else extra.data_ptr(), extra_bytes, st.win_dst_at[par],
                                     slab_rows, st.sends[par]._at[5], st.sends[par]._at[6], ep, st.sleep_off,
                                     int(not fc2_into))
        if between is not None:
            between()
            between = None
        _wait(st, ep, timeout_s, "the dispatch's rows")
        while (n := lib.moe_ep_dispatch_index(st.views_at[par], W, R, me, slab_rows, int(packed),
                                              tokens.data_ptr() if by_token else 0,
                                              gates.data_ptr() if by_token else 0, st.idx.ctypes.data,
                                              st.scale.ctypes.data, st.idx.size, st.bounds.ctypes.data,
                                              st.out_at[0], st.region.ctypes.data, *st.out_at[1:])) == -3:
            st.idx = np.zeros(_grow(int(st.need[0]) * 8) // 8, np.int64)
            st.scale = np.zeros(st.idx.size, np.float32)
        if n == -1:  # a bad split or a disagreement: the numpy checks name it, on every rank alike
            rows = st.views[par].copy()
            if (rows[:, 3] >= 0).any() and not (rows[:, 3] >= 0).all():
                raise ValueError(f"ep a2a dispatch: ranks disagree on sending their own rows by token (raised on "
                                 f"rank {me})")
            rows[:, 3] = -1  # the T of the by-token rows: no out size to check
            _agree(rows, me)
            _layout("dispatch", rows, me, R, ne)
            raise RuntimeError("ep a2a dispatch: the C checks refused headers the numpy checks accept")
        if n >= 0:
            break
        st.ensure(ctx, int(st.need[0]), timeout_s)  # -2: a slab too small: every rank grows, sends again
    oso, region = st.oso.copy(), st.region.copy()
    window = st.data.tensor(me, par * st.half, (R * slab_rows, row_bytes), torch.uint8)
    own_row = int(region[:me].sum()) if packed else me * slab_rows
    handle = (ep, st, st.views[par].copy(), oso, st.sent.copy(), int(st.need[0]))
    return Received(window, torch.from_numpy(st.idx[:n]), torch.from_numpy(st.scale[:n]), st.bounds.tolist(), oso,
                    region, slab_rows, own_row, by_token, handle, x_bytes, fc2_into)


@dataclasses.dataclass(frozen=True)
class ExpertRows:
    """The packed experts kernel's rows of a ``fc2_into`` dispatch by address (``kernels/cpu/
    experts.run``'s ``x_at`` / ``y_at``), expert-major like ``Received.idx``: [N] each."""

    tokens: torch.Tensor  # int64: the own rows' tokens (x's row read, y's row added into), 0 for the peers'
    x_at: torch.Tensor  # int64: a peer's row in this rank's window, 0 for the own (read in x)
    y_at: torch.Tensor  # int64: a peer's row of its source's return window (stored there), 0 for the own
    scale: torch.Tensor  # fp32: the slot's gate (the peers': carried in their rows)


def expert_rows(rcv: Received, tokens: torch.Tensor, gates: torch.Tensor) -> ExpertRows:
    """Where the experts read and write every row of ``rcv`` (a ``fc2_into`` dispatch; ``tokens`` /
    ``gates`` [S] as passed to it): the peers' rows in the window, their outputs straight into the
    row of their source's return window at the combine's parity that ``combine_after`` would have
    copied them to (``moe_ep_expert_rows``).  Safe for the same reason as that copy: this rank has
    seen every source's flag of this dispatch, which each source stores only after it finished
    reading that parity of its window (its previous combine), and no source reads it again before
    this rank's combine flag.  The heap never grows in between: a combine row (H fp32) is never
    wider than the dispatch's (H fp32 + the gate), so the dispatch's slabs hold the combine."""
    if not rcv.fc2_into:
        raise ValueError("ep a2a expert_rows: the dispatch was not sent with fc2_into")
    ep0, st, drows, _, _, _ = rcv.handle
    if st.epoch != ep0:
        raise RuntimeError("ep a2a expert_rows: must follow its dispatch_rows with no exchange between")
    n = rcv.idx.shape[0]
    out = [torch.empty(n, dtype=torch.int64) for _ in range(3)] + [torch.empty(n, dtype=torch.float32)]
    ret = st.win_dst[(ep0 + 1) % 2]  # [R] every source's window at the combine's parity
    got = cpu_ep.fast_lib().moe_ep_expert_rows(drows.ctypes.data, st.W, st.R, st.me, rcv.slab_rows,
                                               rcv.window.data_ptr(), rcv.window.shape[1], rcv.x_bytes,
                                               ret.ctypes.data, tokens.data_ptr(), gates.data_ptr(),
                                               *(t.data_ptr() for t in out))
    if got != n:
        raise RuntimeError(f"ep a2a expert_rows: {got} rows, the dispatch received {n}")
    return ExpertRows(*out)


def gather_rows(rows: ExpertRows, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` [N, H] = the rows the experts read (``rows.x_at``, else x[token]): the kept rows."""
    x = x.contiguous()
    n = rows.tokens.shape[0]
    if out.shape[0] != n or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"ep a2a gather_rows: out must be contiguous {x.dtype} [{n}, H], got {tuple(out.shape)}")
    cpu_ep.fast_lib().moe_ep_gather_rows(out.data_ptr(), x.shape[1] * x.element_size(), n, rows.x_at.data_ptr(),
                                         x.data_ptr(), rows.tokens.data_ptr())
    return out


def combine_sum(out: torch.Tensor, rcv: Received, tokens: torch.Tensor, gates: torch.Tensor, T: int,
                group_name: str, timeout_s: float, between=None) -> torch.Tensor:
    """y [T, H] fp32 = sum over this rank's slots i of gates[i] * (the expert's output row of slot i),
    straight after ``rcv``'s dispatch: ``out`` [L, H] fp32 holds the experts' output rows at
    ``rcv``'s layout rows; the peers' rows go back to their final row of their source's window (one
    C call, no header: the dispatch's layout), this rank's own stay in ``out``, and one C pass adds
    every slot's row, weighted, into its token's row of y (``moe_ep_combine_sum``; own rows sent by
    token are the experts' weighted sums already: y starts as them).  With ``rcv.fc2_into`` the
    experts stored the peers' rows in the return windows already (``expert_rows``) and ``out`` is
    their own outputs by token, [T, H] fp32, which becomes y: this rank sends its flags alone.  A
    peer whose header says "FC2 into" stored its rows weighted: they are added as they are.
    ``between``: as ``dispatch_rows``'s, after this rank's rows are sent."""
    ep0, st, drows, oso, sent, used = rcv.handle
    if st.epoch != ep0:
        raise RuntimeError("ep a2a combine_sum: must follow its dispatch_rows with no exchange between")
    out = out.contiguous()
    rows = T if rcv.fc2_into else used
    if out.dtype != torch.float32 or out.shape[0] < rows:
        raise ValueError(f"ep a2a combine_sum: out must be fp32 with >= {rows} rows, got {out.dtype} "
                         f"{tuple(out.shape)}")
    ctx, lib = get_context(group_name), cpu_ep.fast_lib()
    H = out.shape[1]
    row_bytes = H * 4
    need = -(-int(sent.max(initial=0)) * row_bytes // st.R)
    if need > st.slab and drows[:, NMETA + st.R * st.ne].any():
        raise RuntimeError("ep a2a combine_sum: the heap would grow under rows the experts stored in it")
    st.ensure(ctx, need, timeout_s)  # same on every rank
    ep, par = _next(st)
    lib.moe_ep_combine_after(drows.ctypes.data, st.W, st.R, st.me, oso.ctypes.data, out.data_ptr(), row_bytes,
                             st.win_dst_at[par], st.sends[par]._at[6], ep, st.sleep_off, 2 if rcv.fc2_into else 1)
    if between is not None:
        between()
    _wait(st, ep, timeout_s, "the combine's rows")
    tokens, gates = tokens.contiguous(), gates.float().contiguous()
    if rcv.fc2_into:  # the own outputs by token: y itself
        y, own = out[:T], out.data_ptr()
    else:
        y = (torch.empty if rcv.by_token else torch.zeros)(T, H, dtype=torch.float32)
        own = out.data_ptr() + rcv.own_row * row_bytes
    lib.moe_ep_combine_sum(drows.ctypes.data, st.W, st.R, st.me, st.base_me + par * st.half, own, H,
                           tokens.data_ptr(), gates.data_ptr(), y.data_ptr())
    return y


def exchange(kind: str, input: torch.Tensor, payload: torch.Tensor, group_name: str, out_rows: int,
             major_align=None, timeout_s: float = 60.0, window: bool = False, after=None):
    """One 2D all-to-all of ``input``'s rows on the CPU heap -> (out [out_rows, ...], out_splits_offsets
    [2, R*ne] int64, or None for ``combine_t``).  ``payload``: in_splits (dispatch) or
    in_splits_offsets (combine / combine_t).

    ``window=True`` (the fused op's dispatch): ``out`` is this rank's compact receive window, exactly
    as many rows as arrive (``out_rows`` ignored; expert-major with the alignment, gaps zero), valid
    until this rank's second exchange after this one on the group; the third result is
    out_splits_offsets as numpy (the tiles' bounds, read from this host's memory), the fourth a
    handle for ``after``.

    ``after=handle`` (a combine of that window's rows straight after it): each row goes straight
    to its final row in the source's window (``_combine_after``); ``out`` is a view of this rank's
    shared window (rank-major, exactly the rows this rank sent), valid until this rank's next
    exchange on the group sends, and the second result is None."""
    ctx = get_context(group_name)
    R, me = ctx.world, ctx.rank
    if window and kind != "dispatch":
        raise ValueError(f"ep a2a {kind}: window=True is a dispatch's mode")
    if payload.numel() % (R * (2 if kind != "dispatch" else 1)):
        raise ValueError(f"ep a2a {kind}: {payload.numel()} splits is not a multiple of the world size {R}")
    ne = payload.numel() // (R if kind == "dispatch" else 2 * R)
    x = input.contiguous()
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    st = _state(ctx, ne, timeout_s)
    if st.data is None:
        st.ensure(ctx, SLAB_BYTES, timeout_s)
    lib = cpu_ep.fast_lib()
    if after is not None and kind == "combine" and after[0] == st.epoch and after[1] is st:
        back = (_combine_after_c(ctx, st, lib, x, row_bytes, after, timeout_s) if len(after) == 6
                else _combine_after(ctx, st, x, row_bytes, after, timeout_s))[0]
        if back.shape[0] < out_rows:  # rows this rank sent no block from (dedup's pairs): zero
            back = torch.cat([back, back.new_zeros((out_rows - back.shape[0], *back.shape[1:]))])
        return back, None
    n_pay = payload.numel()
    st.row[:NMETA] = _meta(kind, ne, x.shape[0], -1 if window else out_rows, row_bytes, major_align)
    st.row[NMETA : NMETA + n_pay] = payload.reshape(-1).numpy()
    if kind == "dispatch":
        _record_sent(ctx, st.row, me, ne, row_bytes)
    if window and lib is not None:
        return _dispatch_window_c(ctx, st, lib, x, row_bytes, timeout_s)
    pre = _header_round(st, timeout_s) if kind == "combine_t" else None
    own = _own_blocks(kind, st.row[NMETA:], x.shape[0], R, ne, pre, me)
    while True:
        ep, par = _next(st)
        _send_slabs(st, par, ep, x, row_bytes, own)
        _wait(st, ep, timeout_s, f"the {kind}'s rows")
        rows = st.views[par]
        _agree(rows, me)
        if window and kind == "dispatch":  # numpy's window path: two checks, the layout of this rank only
            pay = rows[:, NMETA : NMETA + R * ne]
            if (pay < 0).any() or (pay.sum(1) > rows[:, 2]).any():
                _layout(kind, rows, me, R, ne)  # raises, on every rank alike
        else:
            oso, out_rows_all = _layout(kind, rows if pre is None else pre, me, R, ne)  # raises on every rank alike
        need = _slab_need(kind, rows, R, ne) * row_bytes
        if need <= st.slab:
            break
        st.ensure(ctx, need, timeout_s)  # a slab too small on some rank: every rank grows, sends again
    rs, dst, n = _recv_blocks(kind, rows if pre is None else pre, me, R, ne)
    if window:
        buf = st.local_window(par, n * row_bytes)
        view = buf[: n * row_bytes].view(x.dtype).view(n, *x.shape[1:])
        _gather(st, par, rs, dst, row_bytes, view, True, x, own)
        oso = np.stack([rs.T.reshape(-1), dst.T.reshape(-1)])  # [2, ne*R]: e*R + s
        return view, torch.from_numpy(oso), oso, (ep, st, rows.copy(), rs.copy(), dst)
    if out_rows < out_rows_all[me]:
        raise ValueError(f"ep a2a {kind}: out has {out_rows} rows, {int(out_rows_all[me])} arrive")
    out = x.new_empty((out_rows, *x.shape[1:]))
    _gather(st, par, rs, dst, row_bytes, out, kind == "dispatch", x, own)
    return out, (None if oso is None else torch.from_numpy(np.ascontiguousarray(oso)))


__all__ = ["ExpertRows", "Received", "combine_sum", "dispatch_rows", "exchange", "expert_rows", "gather_rows", "KINDS"]
