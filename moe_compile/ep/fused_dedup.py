"""The "a2a-dedup" transport of ``fused_moe_ep``: each token sent once to each rank that owns any of
its K experts, expanded there — the dispatch in torch's 2D all-to-all contract with one "expert"
per rank (ne = 1), over the same CPU heap as "a2a".

Shapes:  T tokens, K top-k, H hidden, R ranks, ne local experts, P <= T*R (token, rank) pairs that
         carry at least one of the token's experts, B = H * itemsize + 8K bytes a row.

A row is bytes: [x_t (H elements) | K int32 local ids (ne where the expert is elsewhere) | K fp32
routing weights (0 there)].  On the expert's rank the received rows are a single-device MoE call:
``fused_moe_cpu(x_rows, ids, g)`` gives each row's sum over its local experts (any ``weight_on``:
the weight travels with the row); one row per pair returns by a combine and the source adds its
R partial sums.  At K=8, E=64, R=2 a token reaches both ranks: 2 rows instead of 8.

Backward: [x | dy | ids | g] rows out, the single-device backward on them, [dx | dg (K)] rows back.
The single-device kernels read their expert bounds on the host (a ``.tolist()``), so unlike "a2a"
this transport is not free of scalar reads.
"""

from __future__ import annotations

import math

import torch

from moe_compile.ep import a2a_cpu
from moe_compile.ep.fused_a2a import _columns as _split  # the received byte rows' fields, one tensor each
from moe_compile.ep.fused_a2a import ranks_and_local_experts
from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu.backward import Needs, fused_moe_backward_cpu
from moe_compile.kernels.cpu.forward import fused_moe_cpu
from moe_compile.kernels.reference import compute_dtype

TIMEOUT_S = 60.0


def supports(x, w: ExpertWeights, attrs: FFNAttrs) -> str | None:
    if x.device.type != "cpu":
        return "the a2a-dedup transport runs on CPU tensors"
    if (x.shape[1] * x.element_size()) % 4:
        return "a row's bytes must be a multiple of 4 (H * itemsize)"
    return None


def _pairs(topk_ids, topk_weights, R: int, ne: int):
    """(order [T*R] pair index t*R + r sorted by (r, t), carried pairs first; in_splits [R];
    local ids [T*R, K] int32; weights [T*R, K] fp32)."""
    T, K = topk_ids.shape
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < R * ne)
    owner = torch.where(valid, ids // ne, torch.full_like(ids, R))  # [T, K], R = nowhere
    ranks = torch.arange(R)
    on = owner[:, None, :] == ranks[None, :, None]  # [T, R, K]
    local = torch.where(on, ids[:, None, :] - (ranks * ne)[None, :, None], torch.full_like(on, ne, dtype=torch.long))
    gates = torch.where(on, topk_weights.float()[:, None, :], torch.zeros((), dtype=torch.float32))
    carried = on.any(2)  # [T, R]
    key = torch.where(carried, ranks[None, :] * T + torch.arange(T)[:, None], torch.full_like(carried, R * T,
                                                                                        dtype=torch.long))
    order = torch.sort(key.reshape(-1), stable=True).indices  # [T*R]
    in_splits = carried.sum(0)  # [R] int64
    return order, in_splits, local.reshape(T * R, K).int(), gates.reshape(T * R, K)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[n, m] -> [n, m * itemsize] uint8 (a view)."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], math.prod(t.shape[1:]) * t.element_size())


def _rows(parts, order):
    """The pair rows, bytes side by side, in send order: [P_all, B] uint8."""
    return torch.cat([_bytes(p) for p in parts], dim=1).index_select(0, order)


def _dispatch(send, in_splits, group_name: str, timeout_s: float):
    """The pair rows into the receive window -> (the received rows [N, B], out_splits_offsets).
    One tile (ne = 1) from row 0; an empty one still takes a row (the contract's alignment), cut off."""
    window, oso, oso_np, handle = a2a_cpu.exchange("dispatch", send, in_splits, group_name, 0, None, timeout_s,
                                                   window=True)
    return window[: int(oso_np[0].sum())], oso, handle


def forward(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, group_name: str, num_experts: int,
            timeout_s: float = TIMEOUT_S) -> torch.Tensor:
    R, ne = ranks_and_local_experts(group_name, w, num_experts)
    T, H = x.shape
    K = topk_ids.shape[1]
    order, in_splits, local, gates = _pairs(topk_ids, topk_weights, R, ne)
    xr = x.repeat_interleave(R, dim=0)  # [T*R, H] pair t*R + r
    send = _rows((xr, local, gates), order)
    window, oso, handle = _dispatch(send, in_splits, group_name, timeout_s)
    xw, ids, g = _split(window, ((H, x.dtype), (K, torch.int32), (K, torch.float32)))
    cdt = compute_dtype(x.dtype)
    part = fused_moe_cpu(xw, ids.long(), g.to(x.dtype), w, attrs) if xw.shape[0] else xw.new_zeros(0, H)
    back = a2a_cpu.exchange("combine", part.to(cdt), oso, group_name, T * R, None, timeout_s, after=handle)[0]
    y = torch.zeros(T, H, dtype=cdt).index_add_(0, order // R, back)  # the R partial sums of each token
    return y.to(x.dtype)


def backward(grad_y, x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, need_roles: dict,
             group_name: str, num_experts: int, timeout_s: float = TIMEOUT_S):
    R, ne = ranks_and_local_experts(group_name, w, num_experts)
    T, H = x.shape
    K = topk_ids.shape[1]
    cdt = compute_dtype(x.dtype)
    order, in_splits, local, gates = _pairs(topk_ids, topk_weights, R, ne)
    xr, dyr = x.repeat_interleave(R, dim=0), grad_y.to(x.dtype).repeat_interleave(R, dim=0)
    send = _rows((xr, dyr, local, gates), order)
    window, oso, handle = _dispatch(send, in_splits, group_name, timeout_s)
    xw, dyw, ids, g = _split(window, ((H, x.dtype), (H, x.dtype), (K, torch.int32), (K, torch.float32)))
    n = xw.shape[0]
    if n:
        dxr, dgr, roles = fused_moe_backward_cpu(dyw, xw, ids.long(), g.to(x.dtype), w, attrs,
                                                 Needs(True, True, need_roles))
    else:
        dxr, dgr = xw.new_zeros(0, H), xw.new_zeros(0, K)
        roles = {r: [torch.zeros_like(t) if need else None for t, need in zip(getattr(w, r), need_roles[r])]
                 for r in need_roles}
    ret = torch.cat([dxr.to(cdt), dgr.reshape(n, K).to(cdt)], dim=1)  # [N, H + K]
    back = a2a_cpu.exchange("combine", ret, oso, group_name, T * R, None, timeout_s, after=handle)[0]  # [T*R, H+K]
    tok = order // R
    dx = torch.zeros(T, H, dtype=cdt).index_add_(0, tok, back[:, :H])
    dg = torch.zeros(T, K, dtype=cdt).index_add_(0, tok, back[:, H:])
    return dx.to(x.dtype), dg.to(topk_weights.dtype), roles


def dispatch_bytes(topk_ids, R: int, ne: int, row_bytes: int) -> tuple[int, int]:
    """(bytes this rank's dispatch sends with dedup, bytes without): rows x their width."""
    K = topk_ids.shape[1]
    valid = ((topk_ids >= 0) & (topk_ids < R * ne)).sum()
    _, in_splits, _, _ = _pairs(topk_ids, torch.ones_like(topk_ids, dtype=torch.float32), R, ne)
    return int(in_splits.sum()) * (row_bytes + 8 * K), int(valid) * row_bytes


__all__ = ["backward", "dispatch_bytes", "forward", "supports"]
