"""CPU compute of the expert-parallel op on received rows (the local experts of one rank).

Shapes:  H hidden, F expert FFN width, El local experts, n received rows of one chunk, src-major
         and sorted by local expert inside each source block; ``counts [r, El]`` gives the blocks.

Reuses the single-device kernels: ``kernels/cpu.experts_on_segments`` (FC1 + activation + FC2 on
each expert's own weights, written straight into ``out`` — which on the heap transport is a view of
the source rank's return window) and ``kernels/cpu_backward.fused_moe_backward_cpu`` (with K = 1 and
the local expert ids of the rows).
"""

from __future__ import annotations

import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu import experts_on_segments
from moe_compile.kernels.cpu_backward import ROLES, Needs, fused_moe_backward_cpu


def experts_on_rows(rows, g, counts, w: ExpertWeights, attrs: FFNAttrs, out) -> None:
    """rows [n, H] (x dtype), g [n] fp32, counts [r, El] host list/tensor -> out [n, H] (weighted)."""
    segments, lo = [], 0
    for block in counts:
        for e, c in enumerate(block):
            c = int(c)
            if c:
                segments.append((e, lo, lo + c))
                lo += c
    experts_on_segments(rows[:lo], g.to(rows.dtype)[:lo, None], w, attrs, segments, out[:lo])


def experts_backward_on_rows(x_rows, dy_rows, g, counts, w: ExpertWeights, attrs: FFNAttrs, need_roles: dict):
    """Backward of the local experts on all received rows at once.

    x_rows, dy_rows [n, H], g [n] fp32, counts [R, El] -> (dx rows [n, H], dg [n], {role: grads}).
    The weight gradients sum over every received row: they are this rank's experts' gradients.
    """
    el = w.num_experts
    ids = torch.repeat_interleave(
        torch.arange(el, dtype=torch.long, device=x_rows.device).repeat(len(counts)),
        torch.as_tensor(counts, dtype=torch.long, device=x_rows.device).reshape(-1),
    )[:, None]  # [n, 1] local expert of each row
    gw = g.to(x_rows.dtype)[:, None]  # [n, 1]
    dx, dg, roles = fused_moe_backward_cpu(dy_rows, x_rows, ids, gw, w, attrs, Needs(True, True, need_roles))
    return dx, dg.reshape(-1), roles


__all__ = ["experts_on_rows", "experts_backward_on_rows", "ROLES"]
