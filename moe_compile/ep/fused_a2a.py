"""The "a2a" transport of ``fused_moe_ep``: dispatch, local experts, combine — one 2D all-to-all each
way in torch's ``all_to_all_vdev_2d`` contract (``ep/a2a_cpu``), with no torch scalar read.

Shapes:  T tokens (this rank), K top-k, S = T*K slots, H hidden, E global experts, R ranks,
         ne = E // R local experts, N rows this rank receives (expert-major, all sources).

Forward (each peer row copied once, into its expert's window; ``in_place``):
  1. slots sorted by global expert id (invalid ids last): ``tokens`` [S] (slot -> token) and
     ``in_splits`` [E] (a scatter-add, static shape) — rank-major already, since expert
     g = d * ne + e lives on rank d; no row is moved here;
  2. ``a2a_cpu.dispatch_rows``: one C call copies [x[token] | g] of every slot (fp32: the gate in
     the row's last 4 bytes) straight into slab ``me`` of its expert's rank's window, one wait;
  3. the local experts, once per expert across all sources: expert e's rows are
     ``idx[bounds[e] : bounds[e+1]]`` (from the shared headers in C, no ``.tolist()`` /
     ``.item()`` on a tensor).  Prepacked fp32 SwiGLU weights ("FC2 into", ``experts_into_windows``)
     run the packed kernel (``kernels/cpu/experts.run``) over every expert in one C call on rows by
     address: a peer's row read in the window and its FC2 row, times its gate, stored straight into
     its source's return window (``a2a_cpu.expert_rows``); this rank's own rows read in x (never
     copied) and added, weighted, into their token's row of y.  Other FFNs (and the calls before
     the weights are packed) get x's T rows copied into the own window and gather the rows for one
     GEMM chain per expert, their outputs in a local buffer;
  4. ``a2a_cpu.combine_sum``: "FC2 into" sends its flags alone (the rows are there); the loop's
     peer rows are copied back to the row of their source's window they were sent from; one C pass
     on each source adds its peers' rows into its tokens (g * row where the peer did not weight
     them: each peer's header says) — the routing weight at the output, which is exact for
     ``weight_on="output"`` and for ``"between"`` without an FC2 bias (what ``supports`` accepts).
  Without the C copy kernel (or with fp64) the copying path runs instead: a sorted copy of the
  rows, the compact receive window (``a2a_cpu.exchange(window=True)``), the combine to the source.
Backward: the training op (``fused_moe_ep_train``, what autograd records: ``ep/op.py``) hands
the forward buffers (``ep/keep.py``), and the forward copies the rows it received into them
([N, H], expert-major) on each rank whose buffer holds its rows; they are forward outputs, so
eager autograd and AOTAutograd alike save them for the backward, which then sends only [dy | g]
rows by token index (H * itemsize + 4 bytes, where the forward's rows were sent again as
[x | dy | g]); the local experts' vjp on the kept rows (dg = dy . FFN(x) computed there too), and
one combine of [dx | dg] rows back (no counts phase: the dispatch's layout) — two exchanges.  A
rank whose buffer was too small (T = 0, or fewer tokens than its peers, without ``max_tokens``)
gets its x rows again in a third exchange (``_x_again``; the other ranks get no row of it).  A
call whose forward kept nothing anywhere (the plain op, the copying path, the int8 transport)
sends [x | dy | g] byte rows of the sorted slots instead; every rank takes the same branch (the
verdicts come from every rank's header; the row width is in the headers: a mismatch raises on
every rank).
The a2a forward is one exchange each way (no chunks), and so is its backward.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from moe_compile.ep import a2a_cpu, keep as keep_mod
from moe_compile.ep.context import get_context
from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu import ep as cpu_ep
from moe_compile.kernels.cpu.backward import ROLES
from moe_compile.kernels.reference import compute_dtype, expert_fc1, gated_activation

TIMEOUT_S = 60.0


def supports(x, w: ExpertWeights, attrs: FFNAttrs) -> str | None:
    """Why this call cannot take the a2a transport (None when it can)."""
    if x.device.type != "cpu":
        return "the a2a transport runs on CPU tensors (the CUDA form is unverified)"
    if attrs.weight_on == "input" or (attrs.weight_on == "between" and w.fc2_bias):
        return f"weight_on={attrs.weight_on!r} needs the routing weight at the expert (not sent by a2a)"
    return None


@dataclasses.dataclass(frozen=True)
class _Route:
    order: torch.Tensor  # [S] slot index t*K + k, sorted by global expert id, invalid ids last
    tokens: torch.Tensor  # [S] token of each sorted slot
    gates: torch.Tensor  # [S] routing weight of each sorted slot (compute dtype), 0 for invalid ids
    in_splits: torch.Tensor  # [E] int64 rows to each global expert


def _route(topk_ids, topk_weights, num_experts: int, dtype) -> _Route:
    K = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()  # [S]
    valid = (flat >= 0) & (flat < num_experts)
    key = torch.where(valid, flat, torch.full_like(flat, num_experts))  # invalid -> E (sorted last)
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(num_experts + 1, dtype=torch.long).scatter_add_(0, key, torch.ones_like(key))
    gates = (topk_weights.reshape(-1).to(dtype) * valid.to(dtype)).index_select(0, order)
    return _Route(order, order // max(K, 1), gates, counts[:num_experts])


def _tiles(oso: np.ndarray, R: int, ne: int) -> list:
    """[(lo, hi)] rows of each local expert's tile in the window (oso [2, ne*R], index e*R + s)."""
    n = oso[0].reshape(ne, R).sum(1)
    lo = oso[1].reshape(ne, R)[:, 0]
    return [(int(a), int(a + b)) for a, b in zip(lo, n)]


def _columns(window, widths_dtypes):
    """Contiguous copies of the received byte rows' fields: one [N, n] tensor per (n, dtype)."""
    out, at = [], 0
    for n, dtype in widths_dtypes:
        nb = n * dtype.itemsize
        out.append(window[:, at : at + nb].contiguous().view(dtype))
        at += nb
    return out


def _linear(x, weight, bias, transposed: bool):
    out = x @ weight if transposed else x @ weight.t()
    return out if bias is None else out + bias


def _expert(xe, e: int, w: ExpertWeights, attrs: FFNAttrs, dtype):
    """FFN_e(xe) [n, H] in ``dtype`` (the reference's steps; the weight applied by the caller)."""
    h = gated_activation(expert_fc1(w, e, xe, dtype), attrs)
    fc2, bias = w.fc2_of(e).to(dtype), w.fc2_bias_of(e)
    return _linear(h, fc2, None if bias is None else bias.to(dtype), w.transposed)


def _experts_loop(rows, tiles, w: ExpertWeights, attrs: FFNAttrs, dtype):
    """[N, H] outputs of every tile's expert on its rows (zero elsewhere); differentiable."""
    parts, at = [], 0
    N, H = rows.shape
    for e, (lo, hi) in enumerate(tiles):
        if hi <= lo:
            continue
        if lo > at:
            parts.append(rows.new_zeros(lo - at, H, dtype=dtype))
        parts.append(_expert(rows[lo:hi].to(dtype), e, w, attrs, dtype))
        at = hi
    if N > at:
        parts.append(rows.new_zeros(N - at, H, dtype=dtype))
    return torch.cat(parts) if parts else rows.new_zeros(0, H, dtype=dtype)


def _experts_fast(rows, tiles, w: ExpertWeights, attrs: FFNAttrs, dtype):
    """The forward's experts: the packed kernel over every tile in one call where the weights are
    prepacked fp32 panels, else the loop."""
    from moe_compile.kernels.cpu import experts as cpu_experts, prepack as cpu_prepack

    packed = cpu_prepack.lookup(rows, w, attrs) if rows.dtype == torch.float32 and rows.shape[0] else None
    if packed is None or not packed.fused:
        return _experts_loop(rows, tiles, w, attrs, dtype)
    tokens, bounds = tile_rows(tiles)
    scale = torch.ones(tokens.shape[0], dtype=torch.float32)
    return cpu_experts.run(rows, tokens, scale, packed, w, attrs, bounds, torch.get_num_threads())


def tile_rows(tiles) -> tuple[torch.Tensor, list]:
    """(rows int64 [S'], bounds: E + 1 host ints) of the receive window's expert tiles [(lo, hi)],
    in the experts kernels' (tokens, segment bounds) form, from host numbers: no tensor read."""
    spans = [np.arange(lo, hi, dtype=np.int64) for lo, hi in tiles]
    rows = torch.from_numpy(np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64))
    return rows, [0] + np.cumsum([hi - lo for lo, hi in tiles]).tolist()


def combine_to_tokens(out: torch.Tensor, route, oso, handle, group_name: str, T: int, cdt: torch.dtype,
                      timeout_s: float) -> torch.Tensor:
    """y [T, H] (cdt) = each token's K expert rows, sent back by the combine right after the window
    dispatch ``handle`` (no counts phase: the dispatch's layout), weighted by their gates."""
    back = a2a_cpu.exchange("combine", out.to(cdt), oso, group_name, route.order.shape[0], None, timeout_s,
                            after=handle)[0]  # [S, H]
    y = torch.zeros(T, out.shape[1], dtype=cdt)
    return y.index_add_(0, route.tokens, back * route.gates[:, None])  # the K rows of each token


def _dispatch(route, x, group_name: str, timeout_s: float):
    """Each token's row of x (x [T, H], or any [T, B] row form) to the ranks of its K experts, into
    their receive windows: (window, out_splits_offsets, its host copy, the handle a combine follows)."""
    send = x.index_select(0, route.tokens)  # [S, .] rank-major (sorted by global id)
    return a2a_cpu.exchange("dispatch", send, route.in_splits, group_name, 0, None, timeout_s, window=True)


def ranks_and_local_experts(group_name: str, w: ExpertWeights, num_experts: int) -> tuple[int, int]:
    """(R ranks, ne local experts) of an EP call, checked: the ranks' experts make up num_experts."""
    R, ne = get_context(group_name).world, w.num_experts
    if ne * R != num_experts:
        raise ValueError(f"fused_moe_ep: {ne} local experts x {R} ranks != num_experts={num_experts}")
    return R, ne


def in_place(cdt: torch.dtype) -> bool:
    """Whether this call takes the in-place path (the C copy kernel; fp32 accumulation)."""
    return cdt == torch.float32 and cpu_ep.fast_lib() is not None


def packed_experts(x, w: ExpertWeights, attrs: FFNAttrs):
    """The prepacked fp32 panels of the packed experts kernel for this call, or None (asked once a
    call, before the dispatch: the answer decides how the dispatch is sent)."""
    from moe_compile.kernels.cpu import prepack as cpu_prepack

    packed = cpu_prepack.lookup(x, w, attrs) if x.dtype == torch.float32 else None
    return packed if packed is not None and packed.fused else None


def experts_into_windows(rcv: a2a_cpu.Received, x, route, packed, w: ExpertWeights, attrs: FFNAttrs,
                         kept_out: torch.Tensor | None = None) -> torch.Tensor:
    """y_own [T, H] fp32: the packed kernel once over every expert's rows, reading the peers' rows in
    the receive window and this rank's own in x (no copy of them), FC2's epilogue multiplying each
    row by its gate and storing a peer's row straight into its source's return window (one slot,
    one row: ``a2a_cpu.expert_rows``), adding the own rows into their token's row of y_own.  The
    rows read are gathered into ``kept_out`` [N, H] when given (the training op's kept rows)."""
    from moe_compile.kernels.cpu import experts as cpu_experts

    rows = a2a_cpu.expert_rows(rcv, route.tokens, route.gates)
    if kept_out is not None:
        a2a_cpu.gather_rows(rows, x, kept_out)
    if rows.tokens.shape[0] == 0:
        return x.new_zeros(x.shape, dtype=torch.float32)
    return cpu_experts.run(x.contiguous(), rows.tokens, rows.scale, packed, w, attrs, rcv.bounds,
                           torch.get_num_threads(), x_at=rows.x_at, y_at=rows.y_at)


def experts_in_place(rcv: a2a_cpu.Received, dtype, w: ExpertWeights, attrs: FFNAttrs, cdt,
                     kept_out: torch.Tensor | None = None, packed=None):
    """(out [L, H] (cdt): every received row's expert output times ``rcv.scale``, added into its
    layout row of ``rcv`` (own rows by token: a token's local outputs summed, weighted), zero
    elsewhere; the received rows [N, H] expert-major, gathered into ``kept_out`` when given, else
    None where the experts read them in place).  ``packed`` (fp32 panels) runs the packed kernel
    once over every expert's rows where they lie in the window (``rcv.idx``: its row list,
    expert-major); other FFNs gather the rows and run the loop."""
    from moe_compile.kernels.cpu import experts as cpu_experts

    used = rcv.handle[5]
    win = rcv.window[:used, : rcv.x_bytes].view(dtype)  # [L, H] the window's rows (not their gate), read in place
    N = rcv.idx.shape[0]
    rows = None if kept_out is None else torch.index_select(win, 0, rcv.idx, out=kept_out)  # [N, H]
    if packed is not None and N:  # rcv.scale: 1 for the peers' rows (weighted at their source)
        out = cpu_experts.run(win, rcv.idx, rcv.scale, packed, w, attrs, rcv.bounds, torch.get_num_threads())
        return out, rows
    rows = win.index_select(0, rcv.idx) if rows is None else rows  # [N, H] expert-major
    out = _experts_loop(rows, list(zip(rcv.bounds[:-1], rcv.bounds[1:])), w, attrs, cdt)  # [N, H]
    return out.new_zeros(used, out.shape[1]).index_add_(0, rcv.idx, out * rcv.scale.to(cdt)[:, None]), rows


def _verdicts(rcv: a2a_cpu.Received, kept: keep_mod.Buffers | None, R: int, ne: int) -> np.ndarray:
    """[R] bool: which ranks keep their received rows in this call — the training op gave buffers
    and that rank's holds what it received (from every rank's header: its splits and its T; the
    same verdicts on every rank, so that every source knows which destinations need x again)."""
    if kept is None:
        return np.zeros(R, dtype=bool)
    hdrs = rcv.handle[2]  # [R, W]: every rank's header of this dispatch
    splits = hdrs[:, a2a_cpu.NMETA : a2a_cpu.NMETA + R * ne].reshape(R, R, ne)  # [R_src, R_dst, ne]
    return kept.fits(splits.sum(axis=(0, 2)), hdrs[:, 3])  # hdrs[:, 3]: T (own rows by token)


def forward(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, group_name: str, num_experts: int,
            timeout_s: float = TIMEOUT_S, kept: keep_mod.Buffers | None = None) -> torch.Tensor:
    """y [T, H] = sum_k g_{t,k} FFN_{e_{t,k}}(x_t) over the experts of every rank.  ``kept``: the
    training op's buffers, filled with the received rows where every rank's holds them."""
    R, ne = ranks_and_local_experts(group_name, w, num_experts)
    T = x.shape[0]
    cdt = compute_dtype(x.dtype)
    route = _route(topk_ids, topk_weights, num_experts, cdt)
    if not in_place(cdt):  # no C copy kernel: the sorted copy, the compact window, the combine's copies
        window, oso, oso_np, handle = _dispatch(route, x, group_name, timeout_s)
        out = _experts_fast(window, _tiles(oso_np, R, ne), w, attrs, cdt)  # [N, H]
        return combine_to_tokens(out, route, oso, handle, group_name, T, cdt, timeout_s).to(x.dtype)
    # each peer's row copied once, x[token] into its expert's window, where the experts read it; with
    # the packed kernel ("FC2 into") the own rows stay in x and the outputs go straight back weighted
    packed = packed_experts(x, w, attrs)
    rcv = a2a_cpu.dispatch_rows(x, route.tokens, route.in_splits, group_name, timeout_s, gates=route.gates,
                                gate_rows=x.dtype == torch.float32, fc2_into=packed is not None)
    verdicts = _verdicts(rcv, kept, R, ne)
    keep = bool(verdicts[get_context(group_name).rank])
    N = rcv.idx.shape[0]
    kept_out = kept.rows[:N] if keep else None
    if packed is not None:
        out = experts_into_windows(rcv, x, route, packed, w, attrs, kept_out)  # [T, H] fp32: the own outputs
    else:  # the loop (not prepacked fp32 SwiGLU): outputs in a local buffer, sent back by the combine
        out, _ = experts_in_place(rcv, x.dtype, w, attrs, cdt, kept_out)  # [L, H] fp32
    if verdicts.any():  # which ranks' backward rows need no x
        kept.record_verdicts(verdicts)
    if keep:  # the received rows, for a backward that then sends this rank only dy
        kept.record(N, rcv.oso[0], rcv.bounds)
    return a2a_cpu.combine_sum(out, rcv, route.tokens, route.gates, T, group_name, timeout_s).to(x.dtype)


def _autograd_here():
    """Autograd inside this backward: the backward op's body runs below autograd (the custom-op
    machinery excludes the autograd keys), so ``enable_grad`` alone would record nothing.  Only the
    autograd keys come back; the local experts' vjp is then torch autograd on the reference's steps."""
    keys, ks = torch._C.DispatchKey, torch._C.DispatchKeySet
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for k in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        excluded = excluded - ks(k)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def _leaf_weights(w: ExpertWeights, need_roles: dict):
    """A copy of ``w`` whose tensors are fresh autograd leaves where their gradient is needed."""
    roles = {}
    for name in ROLES:
        roles[name] = tuple(t.detach().requires_grad_(need) for t, need in zip(getattr(w, name), need_roles[name]))
    return dataclasses.replace(w, **roles), roles


def _received_for_backward(route, x, grad_y, group_name: str, timeout_s: float, R: int, ne: int,
                           kept: keep_mod.KeptRows | None):
    """(x rows [N, H], dy rows [N, H], g [N, 1] fp32, tiles, out_splits_offsets, the combine's handle)
    on the experts' rank: [dy | g] rows sent by token index when some rank's forward kept its
    received rows (``kept``: then they are x's there), and x's rows again, in a second exchange,
    to each rank that kept nothing (``KeptRows.ranks_kept``: the same verdicts on every rank); when
    no rank kept, [x | dy | g] byte rows of the sorted slots (the forward's rows sent again)."""
    H, S = x.shape[1], route.order.shape[0]
    if kept is not None and in_place(compute_dtype(x.dtype)):
        g = route.gates.float()[:, None]  # [S, 1]
        rcv = a2a_cpu.dispatch_rows(grad_y.to(x.dtype), route.tokens, route.in_splits, group_name, timeout_s,
                                    extra=g)
        if kept.rows is not None:
            _same_layout(rcv, kept.bounds, kept.splits)
        # copied out before the next exchange: the window is reused by the one after it
        dyw, gw = _columns(rcv.window.index_select(0, rcv.idx), ((H, x.dtype), (1, torch.float32)))
        xw = kept.rows
        if not kept.ranks_kept.all():
            again = _x_again(route, x, group_name, timeout_s, kept.ranks_kept, ne)
            if xw is None:  # this rank kept nothing: its x rows came again, in the same layout as dy's
                _same_layout(again, rcv.bounds, rcv.oso[0])
                xw = _columns(again.window.index_select(0, again.idx), ((H, x.dtype),))[0]
        ep, st, drows, oso, sent, _ = rcv.handle
        oso = np.stack([oso[0], np.cumsum(oso[0]) - oso[0]])  # [2, ne*R]: blocks of the expert-major rows
        handle = (ep, st, drows, oso, sent, int(oso[0].sum()))
        return xw, dyw, gw, list(zip(rcv.bounds[:-1], rcv.bounds[1:])), torch.from_numpy(oso), handle
    parts = (x.index_select(0, route.tokens), grad_y.to(x.dtype).index_select(0, route.tokens),
             route.gates.float()[:, None])
    send = torch.cat([p.contiguous().view(torch.uint8).reshape(S, p.shape[1] * p.element_size()) for p in parts],
                     dim=1)  # [S, B]
    window, oso, oso_np, handle = a2a_cpu.exchange("dispatch", send, route.in_splits, group_name, 0, None,
                                                   timeout_s, window=True)
    xw, dyw, gw = _columns(window, ((H, x.dtype), (H, x.dtype), (1, torch.float32)))  # copies
    return xw, dyw, gw, _tiles(oso_np, R, ne), oso, handle


def _same_layout(rcv: a2a_cpu.Received, bounds: list, splits: np.ndarray) -> None:
    """The backward's rows arrive in the layout of the rows they meet: else a row would meet
    another row's x."""
    if rcv.bounds != list(bounds) or not np.array_equal(rcv.oso[0], splits):
        raise RuntimeError("fused_moe_ep a2a backward: the rows arrived in another layout than the forward's")


def _x_again(route, x, group_name: str, timeout_s: float, ranks_kept: np.ndarray, ne: int) -> a2a_cpu.Received:
    """The backward's second exchange, where some rank kept nothing in the forward: x[token] of
    every slot whose expert lives on such a rank (the others get no row).  Every rank takes part
    (the verdicts are the same everywhere); host numbers only, no torch scalar read."""
    splits = route.in_splits.numpy()  # [E], rank-major: expert g lives on rank g // ne
    again = np.repeat(~ranks_kept, ne)  # [E]: its rank kept nothing
    slots = np.repeat(again, splits)  # [sum(splits)]: the slots sorted by expert, valid ones first
    tokens = np.ascontiguousarray(route.tokens.numpy()[: slots.size][slots], dtype=np.int64)
    return a2a_cpu.dispatch_rows(x, torch.from_numpy(tokens), torch.from_numpy(splits * again), group_name,
                                 timeout_s)


def backward(grad_y, x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, need_roles: dict,
             group_name: str, num_experts: int, timeout_s: float = TIMEOUT_S, kept: keep_mod.KeptRows | None = None):
    """(dx [T, H], dg [T, K], {role: [grad or None]}) — every rank takes part (it serves its peers).
    ``kept``: what the training op's forward kept (``ep/keep.py``), or None."""
    R, ne = ranks_and_local_experts(group_name, w, num_experts)
    T, H = x.shape
    K = topk_ids.shape[1]
    cdt = compute_dtype(x.dtype)
    route = _route(topk_ids, topk_weights, num_experts, cdt)
    S = route.order.shape[0]
    xw, dyw, gw, tiles, oso, handle = _received_for_backward(route, x, grad_y, group_name, timeout_s, R, ne, kept)
    with _autograd_here(), torch.enable_grad():
        rows = xw.detach().to(cdt).requires_grad_()  # [N, H] (a leaf of its own: the kept rows stay as they are)
        wl, leaves = _leaf_weights(w, need_roles)
        out = _experts_loop(rows, tiles, wl, attrs, cdt)  # [N, H]; rows between tiles: zero, no grad
    d_out = dyw.to(cdt) * gw.to(cdt)  # [N, H] = dL/d out (y = sum g * out)
    dg_rows = (dyw.to(cdt) * out.detach()).sum(1, keepdim=True)  # [N, 1] = dL/dg of each row's slot
    inputs = [rows] + [t for name in ROLES for t in leaves[name] if t.requires_grad]
    with _autograd_here():
        grads = (torch.autograd.grad(out, inputs, d_out, allow_unused=True) if out.requires_grad
                 else [None] * len(inputs))
    d_rows = grads[0] if grads[0] is not None else torch.zeros_like(rows)
    # [dx | dg] rows back, no counts phase (the dispatch's layout)
    back = a2a_cpu.exchange("combine", torch.cat([d_rows.detach(), dg_rows], 1), oso,
                            group_name, S, None, timeout_s, after=handle)[0]  # [S, H + 1]
    d_send, dg_sorted = back[:, :H], back[:, H]
    dx = torch.zeros(T, H, dtype=cdt).index_add_(0, route.tokens, d_send)
    dg = torch.zeros(T * K, dtype=cdt).index_copy_(0, route.order, dg_sorted)
    valid = ((topk_ids >= 0) & (topk_ids < num_experts)).reshape(-1)
    dg = dg * valid.to(cdt)
    role_grads, it = {}, iter(grads[1:])
    for name in ROLES:
        role_grads[name] = []
        for t, leaf in zip(getattr(w, name), leaves[name]):
            g = next(it) if leaf.requires_grad else None
            role_grads[name].append(torch.zeros_like(t) if (leaf.requires_grad and g is None) else g)
    return dx.to(x.dtype), dg.view(T, K).to(topk_weights.dtype), role_grads


def backward_row_bytes(H: int, itemsize: int, kept: bool) -> tuple[int, int]:
    """(dispatch, combine) bytes of one backward row: [dy | g] out when the forward kept its rows
    (else [x | dy | g]), [dx | dg] fp32 back."""
    return (H * itemsize + 4 if kept else 2 * H * itemsize + 4), (H + 1) * 4


__all__ = ["backward", "backward_row_bytes", "forward", "supports"]
