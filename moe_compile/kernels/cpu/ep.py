"""CPU compute of the expert-parallel op on received rows (the local experts of one rank).

Shapes:  H hidden, F expert FFN width, El local experts, n received rows of one chunk, src-major
         and sorted by local expert inside each source block; ``counts [r, El]`` gives the blocks.

Reuses the single-device kernels: ``kernels/cpu.fused_moe_cpu`` with K = 1 (its result copied into
``out``, which on the heap transport is a view of the source rank's return window) and ``kernels/cpu_backward.fused_moe_backward_cpu`` (with K = 1 and
the local expert ids of the rows).
"""

from __future__ import annotations

import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu.forward import fused_moe_cpu
from moe_compile.kernels.cpu.backward import ROLES, Needs, fused_moe_backward_cpu


def _local_ids(counts, n_rows: int, device) -> torch.Tensor:
    """[n, 1] local expert of each received row, from counts [R, El] (src-major blocks)."""
    el = len(counts[0]) if len(counts) else 0
    return torch.repeat_interleave(
        torch.arange(el, dtype=torch.long, device=device).repeat(len(counts)),
        torch.as_tensor(counts, dtype=torch.long, device=device).reshape(-1),
    )[:n_rows, None]


def experts_on_rows(rows, g, counts, w: ExpertWeights, attrs: FFNAttrs, out) -> None:
    """rows [n, H] (x dtype), g [n] fp32, counts [r, El] host list/tensor -> out [n, H] (weighted).

    The rows come src-major, so one expert's rows lie in r blocks; the single-device path with
    K = 1 regroups them by expert (one sort) so that each expert runs one GEMM on all its rows,
    and picks the decode / packed / grouped GEMM / chunked path like any other call."""
    n = int(torch.as_tensor(counts).sum()) if len(counts) else 0
    if n == 0:
        return
    ids = _local_ids(counts, n, rows.device)  # [n, 1]
    out[:n].copy_(fused_moe_cpu(rows[:n], ids, g[:n, None].to(rows.dtype), w, attrs))


def experts_backward_on_rows(x_rows, dy_rows, g, counts, w: ExpertWeights, attrs: FFNAttrs, need_roles: dict):
    """Backward of the local experts on all received rows at once.

    x_rows, dy_rows [n, H], g [n] fp32, counts [R, El] -> (dx rows [n, H], dg [n], {role: grads}).
    The weight gradients sum over every received row: they are this rank's experts' gradients.
    """
    ids = _local_ids(counts, x_rows.shape[0], x_rows.device)  # [n, 1]
    gw = g.to(x_rows.dtype)[:, None]  # [n, 1]
    dx, dg, roles = fused_moe_backward_cpu(dy_rows, x_rows, ids, gw, w, attrs, Needs(True, True, need_roles))
    return dx, dg.reshape(-1), roles


__all__ = ["experts_on_rows", "experts_backward_on_rows", "ROLES"]
