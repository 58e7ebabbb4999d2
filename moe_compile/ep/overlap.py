"""The "collectives" transport: the EP exchange on torch.distributed all_to_all_single (gloo/NCCL).

Shapes:  S' slots this rank sends, P payload width, Q result width, R ranks, El local experts,
         C chunks.

Plan (the same as the heap transport, on collectives):
  1. one all_gather of the per-(dest, local expert) counts [R, El] and a kept flag (every rank sees the whole
     [R, R, El] matrix, so an overflow of ``max_tokens`` raises on every rank alike); the split
     sizes are read on the host (``.tolist()``) — collectives need host split sizes;
  2. every dest block is cut into C row pieces (``piece_bounds``); the all_to_all of all C chunks
     is issued at once with ``async_op=True``: gloo's worker thread moves chunk j+1 while this
     thread runs the local experts on chunk j;
  3. each computed chunk goes back with its own async all_to_all; rows land in the send order, so
     the combine is one ``index_add_``.
The backward runs the same plan, chunked like the forward; when every rank's forward kept the
rows it received (``ep/keep.py``, the flag gathered with the counts) only dy rows travel, else
[x | dy].  Every wait has a deadline (``timeout_s``); on expiry the ranks that are behind are named from a
per-call "alive" key in the group's store.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_compile.ep import keep as keep_mod
from moe_compile.ep.context import EPContext, timedelta
from moe_compile.ep.plan import auto_chunks, check_bound, piece_bounds, piece_counts


class _Deadline:
    def __init__(self, ctx: EPContext, call: int, timeout_s: float):
        self.ctx, self.call, self.timeout_s = ctx, call, timeout_s

    def wait(self, work, what: str) -> None:
        try:
            ok = work.wait(timedelta(self.timeout_s))
        except Exception as exc:  # gloo raises on a timeout or a closed peer connection
            raise self._error(what) from exc
        if ok is False:
            raise self._error(what)

    def _error(self, what: str) -> TimeoutError:
        ctx, behind = self.ctx, []
        for r in range(ctx.world):
            key = ctx.key("alive", ctx.group_name, r)
            if r != ctx.rank and (not ctx.store.check([key]) or int(ctx.store.get(key)) < self.call):
                behind.append(r)
        return TimeoutError(
            f"fused_moe_ep: rank(s) {behind or 'unknown'} of group {ctx.group_name!r} did not complete "
            f"{what} within timeout_s={self.timeout_s:g}s (collectives transport; this is rank {ctx.rank})"
        )


def exchange(ctx: EPContext, plan, base, gpay, compute, q_width: int, q_dtype, *, chunks: int,
             timeout_s: float, max_tokens: int = 0, top_k: int = 1, quant: bool = False, keep=None,
             backward: bool = False, kept=None, resend=None):
    """Send rows ``base[plan.tokens]`` (+ fp32 ``gpay`` [S']) to their experts' ranks, run
    ``compute(rows, g, counts, out, at)`` there on each piece (``at``: its first row among this
    rank's received rows, source-major), and return the [S', Q] results in send order.

    ``keep`` / ``backward`` / ``kept`` / ``resend``: as ``dispatch.exchange``'s (the received rows
    kept in the forward; the backward sends ``base`` alone when every rank kept, a flag gathered
    with the counts, else ``[resend | base]``)."""
    ctx.calls += 1
    ctx.store.set(ctx.key("alive", ctx.group_name, ctx.rank), str(ctx.calls))
    dl = _Deadline(ctx, ctx.calls, timeout_s)
    R, g = ctx.world, ctx.group
    el = plan.counts.shape[1]
    mine = torch.cat([plan.counts.reshape(-1), plan.counts.new_tensor([int(kept is not None)])])  # [R*El + 1]
    allc = [torch.empty_like(mine) for _ in range(R)]  # every rank's counts and kept flag
    dl.wait(dist.all_gather(allc, mine, group=g, async_op=True), "the counts exchange")
    matrix = torch.stack([c[:-1].view(R, el) for c in allc])  # [R_src, R_dst, El]
    check_bound(matrix, max_tokens, top_k, ctx.rank)  # the same verdict on every rank
    send_c, recv_c = matrix[ctx.rank].tolist(), matrix[:, ctx.rank].tolist()  # host split sizes
    if backward:  # dy alone where every rank kept its forward rows, else [x | dy]
        base, kept = keep_mod.backward_rows(base, kept, resend, all(int(c[-1]) == 1 for c in allc), recv_c,
                                            ctx.rank)
    if chunks <= 0:  # auto: the heap transport's rule (the same sweep), from the same matrix
        chunks = auto_chunks(matrix)
    C = max(1, chunks)
    send_off, recv_off = [0], [0]
    for d in range(R):
        send_off.append(send_off[-1] + sum(send_c[d]))
        recv_off.append(recv_off[-1] + sum(recv_c[d]))
    keep = keep if keep is not None and recv_off[-1] <= keep.cap else None
    P, dev = base.shape[1], base.device
    ctx.sent["backward" if backward else "forward"] = (P * base.element_size() + 4,
                                                       send_off[-1] - sum(send_c[ctx.rank]), C)
    pending = []
    for j in range(C):
        idx = torch.cat([
            torch.arange(send_off[d] + a, send_off[d] + b, device=dev)
            for d in range(R)
            for a, b in [piece_bounds(sum(send_c[d]), C)[j : j + 2]]
        ])  # [s_j] sorted-slot positions of chunk j
        in_split = [piece_bounds(sum(send_c[d]), C)[j + 1] - piece_bounds(sum(send_c[d]), C)[j] for d in range(R)]
        out_split = [piece_bounds(sum(recv_c[s]), C)[j + 1] - piece_bounds(sum(recv_c[s]), C)[j] for s in range(R)]
        rows = base.index_select(0, plan.tokens.index_select(0, idx))  # [s_j, P]
        rrows = base.new_empty(sum(out_split), P)
        rg = torch.empty(sum(out_split), dtype=torch.float32, device=dev)
        w1 = dist.all_to_all_single(rrows, rows, out_split, in_split, group=g, async_op=True)
        w2 = dist.all_to_all_single(rg, gpay.index_select(0, idx), out_split, in_split, group=g, async_op=True)
        pending.append((idx, in_split, out_split, rrows, rg, w1, w2))
    ret = torch.empty(plan.rows, q_width, dtype=q_dtype, device=dev)
    returns = []
    for j, (idx, in_split, out_split, rrows, rg, w1, w2) in enumerate(pending):
        dl.wait(w1, f"the dispatch of chunk {j}")
        dl.wait(w2, f"the dispatch of chunk {j}")
        out = torch.empty(rrows.shape[0], q_width, dtype=q_dtype, device=dev)
        lo = 0
        for s in range(R):
            a, b = piece_bounds(sum(recv_c[s]), C)[j : j + 2]
            at = recv_off[s] + a  # source-major row of this piece among all received rows
            if keep is not None:
                keep.rows[at : at + b - a].copy_(rrows[lo : lo + b - a])
            compute(rrows[lo : lo + b - a], rg[lo : lo + b - a], [piece_counts(recv_c[s], a, b)], out[lo : lo + b - a],
                    at)
            lo += b - a
        back = torch.empty(idx.numel(), q_width, dtype=q_dtype, device=dev)
        returns.append((idx, back, dist.all_to_all_single(back, out, in_split, out_split, group=g, async_op=True)))
    if keep is not None:
        keep.record(recv_off[-1], recv_c)
    for j, (idx, back, work) in enumerate(returns):
        dl.wait(work, f"the combine of chunk {j}")
        ret.index_copy_(0, idx, back)
    return ret
