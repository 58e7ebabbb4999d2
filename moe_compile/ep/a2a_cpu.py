"""CPU transport of ``ep_dispatch`` / ``ep_combine``: the 2D all-to-all over the shared-memory heap.

Shapes:  R ranks, ne experts per rank, W = NMETA + 2*R*ne words of one control row, P row bytes.

Per call (epoch e; parity e % 2 picks one of two copies of every window):
  1. publish + barrier: this rank's control row [meta | splits (and offsets)] goes into slot ``me``
     of every peer's control window, each followed by the peer's COUNTS flag ``me`` = e — one C call
     (``kernels/cpu/ep.push``).  Waiting for the R COUNTS flags is the call's one barrier: then every
     rank holds every rank's row and computes the whole layout itself (``a2a_layout``, numpy on the
     window: a read of this host's memory, no torch scalar read), so every verdict (a bad size, an
     ``out`` too small, a heap resize) is the same on every rank with no further message.
  2. rows: one C call copies this rank's blocks straight to their final rows in each dest's data
     window and stores the dest's DATA flag ``me`` = e after that dest's blocks.
  3. wait for the R DATA flags; one C call unpacks the window into ``out`` (uncovered rows zero).
Parity: a rank writes parity p of a peer's windows in call e+2 only after that peer published in
call e+1, i.e. after it finished reading call e — so two copies suffice and nothing is reset.
Every wait has a deadline: the ranks whose flags never came are named in a ``TimeoutError``.

Kinds: ``dispatch`` (row: in_splits [R*ne]), ``combine`` (row: in_splits_offsets [2, ne*R]) and
``combine_t`` (the transpose of a combine, its backward: the same row as the forward combine, the
rows going back from the combine's outputs to the positions of its inputs).
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from moe_compile.ep.a2a_layout import combine_layout, dispatch_layout, dispatch_rows_needed, exclusive_cumsum
from moe_compile.ep.context import get_context
from moe_compile.kernels.cpu import ep as cpu_ep
from moe_compile.symm import allocate
from moe_compile.symm.cpu_shm import backoff

KINDS = ("dispatch", "combine", "combine_t")
NMETA = 6  # kind, ne, input rows, out rows, row bytes, major_align (-1 = None)
SPINS = 128  # polls per C call (~10 us) before Python yields the core: ranks may outnumber cores


def _grow(nbytes: int) -> int:
    """Round a window up (+25%, whole MiB) so that a growing T resizes it rarely."""
    return max(1 << 16, (int(nbytes * 1.25) + (1 << 20) - 1) >> 20 << 20)


class _State:
    """Windows of one (group, ne): a fixed control heap (rows + flags) and a resizable data heap."""

    def __init__(self, ctx, ne: int, timeout_s: float):
        R = ctx.world
        self.R, self.ne, self.W = R, ne, NMETA + 2 * R * ne
        self.control = allocate(ctx.store, ctx.rank, R, 2 * R * self.W * 8, 2 * R,
                                f"{ctx.group_name}/a2a{ne}/ctl", timeout_s)
        me = ctx.rank
        ctl = np.array([self.control.tensor(r, 0, (1,), torch.uint8).data_ptr() for r in range(R)], dtype=np.uint64)
        self.flag_base = np.array([self.control.flags(r).ctypes.data for r in range(R)], dtype=np.uint64)
        # Everything the hot path passes to C, made once: the counts row's destinations per parity,
        # the COUNTS / DATA flag addresses, the dests in push order (the next rank first, to spread
        # the writers over the windows) and the per-parity views of this rank's control window.
        self.order = np.array([(me + k) % R for k in range(1, R + 1)], dtype=np.int64)
        self.counts_push = []  # per parity: my row into slot ``me`` of every peer's window, then COUNTS[me]
        for par in (0, 1):
            p = cpu_ep.Push(R, R)
            p.dst[:] = ctl + np.uint64((par * R + me) * self.W * 8)
            p.flags[:] = self.flag_base + np.uint64(8 * me)
            p.nblk[:], p.blk[0], p.blk[1], p.blk[2] = 1, 0, 0, 1
            self.counts_push.append(p)
        self.data_push = [cpu_ep.Push(R, R * ne) for _ in (0, 1)]  # per parity, dests in ``order``
        for p in self.data_push:
            p.flags[:] = self.flag_base[self.order] + np.uint64(8 * (R + me))
            p.nblk[:] = ne
        self.views = [self.control.tensor(me, par * R * self.W * 8, (R, self.W), torch.int64).numpy() for par in (0, 1)]
        own = self.control.flags(me)
        self.counts_poll = cpu_ep.Poll(own, np.arange(R))
        self.data_poll = cpu_ep.Poll(own, np.arange(R, 2 * R))
        self.unpack = cpu_ep.Unpack(R * ne)
        self.data, self.half, self.gen, self.epoch = None, 0, 0, 0
        self.row = np.zeros(self.W, dtype=np.int64)
        self.row_at = self.row.ctypes.data

    def rows_of(self, par: int) -> np.ndarray:
        """[R, W] this rank's control window, parity ``par`` (every rank's published row)."""
        return self.views[par]

    def ensure(self, ctx, nbytes: int, timeout_s: float) -> None:
        """Every rank calls it with the same ``nbytes`` (computed from the same rows): in step."""
        if self.data is not None and self.half >= nbytes:
            return
        if self.data is not None:
            self.data.close()  # every rank is past this call's barrier: nobody reads the old one
        self.gen += 1
        self.half = _grow(max(nbytes, self.half))
        self.data = allocate(ctx.store, ctx.rank, ctx.world, 2 * self.half, 0,
                             f"{ctx.group_name}/a2a{self.ne}/data{self.gen}", timeout_s)
        self.data_base = [self.data.tensor(r, 0, (1,), torch.uint8).data_ptr() for r in range(ctx.world)]
        base = np.array(self.data_base, dtype=np.uint64)[self.order]
        for par, p in enumerate(self.data_push):
            p.dst[:] = base + np.uint64(par * self.half)


def _state(ctx, ne: int, timeout_s: float) -> _State:
    st = ctx.heaps.get(("a2a", ne))
    if st is None:
        st = ctx.heaps[("a2a", ne)] = _State(ctx, ne, timeout_s)
    return st


def _wait(st: _State, poll, ep: int, timeout_s: float, what: str) -> None:
    if not poll(ep, SPINS):
        return
    flags, slots = poll.flags, poll.slots
    deadline, spins = time.monotonic() + timeout_s, 0
    while poll(ep, SPINS):
        if time.monotonic() > deadline:
            missing = sorted(int(s) % st.R for s in slots[flags[slots] < ep])
            raise TimeoutError(
                f"ep a2a: rank(s) {missing} did not arrive within timeout_s={timeout_s:g}s ({what}; this is "
                f"rank {st.control.rank})")
        spins += 1
        backoff(50 + spins)  # the C poll already spun: yield the core from the first round on


def _meta(kind: str, ne: int, rows_in: int, out_rows: int, row_bytes: int, major_align) -> list:
    return [KINDS.index(kind), ne, rows_in, out_rows, row_bytes, -1 if major_align is None else int(major_align)]


def _agree(rows: np.ndarray, me: int) -> None:
    """Every rank called the same kind with the same row width and alignment (else: raise on all)."""
    for col, name in ((0, "op"), (1, "experts per rank"), (4, "row bytes"), (5, "major_align")):
        vals = rows[:, col]
        if (vals != vals[0]).any():
            shown = [KINDS[int(v)] for v in vals] if col == 0 else vals.tolist()
            raise ValueError(f"ep a2a: ranks disagree on the {name}: {shown} (by rank; raised on rank {me})")


def _layout(kind: str, rows: np.ndarray, me: int, R: int, ne: int):
    """From every rank's control row: this rank's send blocks [R_dst, ne] (rows, src row, dst row),
    its receive blocks (offsets, rows), its out_splits_offsets, and the checks' verdicts."""
    pay = rows[:, NMETA:]
    rows_in, out_rows = rows[:, 2], rows[:, 3].copy()
    align = None if rows[0, 5] < 0 else int(rows[0, 5])
    if kind == "dispatch":
        splits = pay[:, : R * ne]  # [R_src, R*ne]
        used, need = splits.sum(1), dispatch_rows_needed(splits, ne, align)  # [R_src], [R_dst]
        o_splits, o_offs = dispatch_layout(splits, ne, align)  # [R_dst, ne*R]
        send = (splits[me].reshape(R, ne), exclusive_cumsum(splits[me]).reshape(R, ne),
                o_offs.reshape(R, ne, R)[:, :, me])
        recv = (o_offs[me], o_splits[me])
        oso = np.stack([o_splits[me], o_offs[me]])
    else:
        so = pay.reshape(R, 2, ne * R)  # [R_p, 2, ne*R] every rank's (forward) in_splits_offsets
        o_splits, o_offs, _ = combine_layout(so, ne)  # [R_dst, R*ne]
        ends = (so[:, 0] + so[:, 1]) * (so[:, 0] > 0)  # [R_p, ne*R] end row of each block in p's input
        if kind == "combine":
            used, need = ends.max(1, initial=0), o_splits.sum(1)
            send = (so[me, 0].reshape(ne, R).T, so[me, 1].reshape(ne, R).T, o_offs[:, me * ne : (me + 1) * ne])
            recv = (o_offs[me], o_splits[me])
            oso = np.stack([o_splits[me], o_offs[me]])
        else:  # combine_t: d sends the rows at its forward outputs back to p's forward inputs
            used, need = o_splits.sum(1), ends.max(1, initial=0)
            send = (o_splits[me].reshape(R, ne), o_offs[me].reshape(R, ne), so[:, 1].reshape(R, ne, R)[:, :, me])
            recv = (so[me, 1], so[me, 0])
            oso = None
    out_rows[out_rows < 0] = need[out_rows < 0]  # window mode: exactly what arrives
    if (pay < 0).any():
        bad = int(np.nonzero((pay < 0).any(1))[0][0])
        raise ValueError(f"ep a2a: rank {bad} passed a negative split or offset (raised on rank {me})")
    for r in range(R):
        if used[r] > rows_in[r]:
            raise ValueError(f"ep a2a {kind}: rank {r}'s splits span {int(used[r])} rows of its input, which has "
                             f"{int(rows_in[r])} (raised on rank {me})")
        if need[r] > out_rows[r]:
            raise ValueError(f"ep a2a {kind}: rank {r} receives {int(need[r])} rows, its out has {int(out_rows[r])} "
                             f"(size out for R*T_max*min(K, E_local) rows + alignment; raised on rank {me})")
    return send, recv, oso, out_rows


def _rows_after_dispatch(drows: np.ndarray, st: _State, row_bytes: int) -> np.ndarray:
    """The control rows a combine of a window dispatch's rows would publish, from that dispatch's:
    each rank's input is its window (its dispatch's out_splits_offsets), each gets back what it sent."""
    R, ne = st.R, st.ne
    splits = drows[:, NMETA : NMETA + R * ne]
    align = None if drows[0, 5] < 0 else int(drows[0, 5])
    o_splits, o_offs = dispatch_layout(splits, ne, align)  # [R, ne*R]
    rows = np.zeros((R, st.W), dtype=np.int64)
    rows[:, :NMETA] = [KINDS.index("combine"), ne, 0, 0, row_bytes, -1]
    rows[:, 2] = dispatch_rows_needed(splits, ne, align)
    rows[:, 3] = splits.sum(1)
    rows[:, NMETA : NMETA + ne * R], rows[:, NMETA + ne * R : NMETA + 2 * ne * R] = o_splits, o_offs
    return rows


def exchange(kind: str, input: torch.Tensor, payload: torch.Tensor, group_name: str, out_rows: int,
             major_align=None, timeout_s: float = 60.0, window: bool = False, after=None):
    """One 2D all-to-all of ``input``'s rows on the CPU heap -> (out [out_rows, ...], out_splits_offsets
    [2, R*ne] int64, or None for ``combine_t``).  ``payload``: in_splits (dispatch) or
    in_splits_offsets (combine / combine_t).

    ``window=True`` (the fused op): ``out`` is this rank's receive window itself, exactly as many
    rows as arrive (``out_rows`` ignored), not unpacked — rows between blocks hold whatever was
    there — and valid until the second exchange after this one on the group; the third result is
    out_splits_offsets as numpy (the tiles' bounds, read from this host's memory), the fourth a
    handle for ``after``.

    ``after=handle`` (a combine of that window's rows straight after it): every rank already knows
    the combine's layout from the dispatch's counts, so the counts phase is skipped — one barrier
    less.  Safe: the dispatch's barrier already proved every peer done with the windows this
    combine writes (parity argument above), and the next exchange publishes again."""
    ctx = get_context(group_name)
    R, me = ctx.world, ctx.rank
    if payload.numel() % (R * (2 if kind != "dispatch" else 1)):
        raise ValueError(f"ep a2a {kind}: {payload.numel()} splits is not a multiple of the world size {R}")
    ne = payload.numel() // (R if kind == "dispatch" else 2 * R)
    x = input.contiguous()
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    st = _state(ctx, ne, timeout_s)
    st.epoch += 1
    ep, par = st.epoch, st.epoch % 2
    if after is not None and kind == "combine" and after[0] == ep - 1 and after[1] is st:
        rows = _rows_after_dispatch(after[2], st, row_bytes)
    else:  # 1. publish this rank's row into every peer's window, then the one barrier
        n_pay = payload.numel()
        st.row[:NMETA] = _meta(kind, ne, x.shape[0], -1 if window else out_rows, row_bytes, major_align)
        st.row[NMETA : NMETA + n_pay] = payload.reshape(-1).numpy()
        st.counts_push[par](st.row_at, st.W * 8, ep)
        _wait(st, st.counts_poll, ep, timeout_s, f"the {kind}'s counts")
        rows = st.rows_of(par)
        _agree(rows, me)
    send, recv, oso, out_rows_all = _layout(kind, rows, me, R, ne)
    st.ensure(ctx, int(out_rows_all.max()) * row_bytes, timeout_s)
    # 2. every block straight to its final rows, a DATA flag after each dest's blocks
    push = st.data_push[par]
    for i, a in enumerate((send[1], send[2], send[0])):  # src_row, dst_row, rows
        push.blk[i] = a[st.order].reshape(-1)
    push(x.data_ptr(), row_bytes, ep)
    # 3. all R sources' rows here: unpack the window into out
    _wait(st, st.data_poll, ep, timeout_s, f"the {kind}'s rows")
    if window:
        view = st.data.tensor(me, par * st.half, (int(out_rows_all[me]), *x.shape[1:]), x.dtype)
        return view, torch.from_numpy(np.ascontiguousarray(oso)), oso, (ep, st, rows.copy())
    if out_rows < out_rows_all[me]:
        raise ValueError(f"ep a2a {kind}: out has {out_rows} rows, {int(out_rows_all[me])} arrive")
    out = x.new_empty((out_rows, *x.shape[1:]))
    st.unpack.off[:], st.unpack.rows[:] = recv
    st.unpack(st.data_base[me] + par * st.half, out, row_bytes)
    return out, (None if oso is None else torch.from_numpy(np.ascontiguousarray(oso)))


__all__ = ["exchange", "KINDS"]
