"""``moe_compile::ep_dispatch`` / ``moe_compile::ep_combine``: torch's 2D all-to-all contract, as
functional ops with fake kernels and autograd, on CPU shared memory and (unverified) CUDA.

Shapes:  R ranks, ne = El experts per rank, N rows of ``input``, M = ``out_rows`` (static), H the
         row's trailing shape.

    ep_dispatch(input [N, *H], in_splits [R*ne] int64, group_name, out_rows, major_align=None)
        -> (out [M, *H], out_splits_offsets [2, ne*R] int64)
    ep_combine(input [N, *H], in_splits_offsets [2, ne*R] int64, group_name, out_rows)
        -> (out [M, *H], out_splits_offsets [2, R*ne] int64)

are ``torch.ops.symm_mem.all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group,
major_align)`` and ``all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets,
group)`` with their two ``out`` tensors returned instead of written (the layout: ``a2a_layout``;
the model: ``a2a_reference``).  The differences, all deliberate: rows of ``out`` no block covers
are zero (torch leaves them), and a split that does not fit raises ``ValueError`` on every rank
(torch asserts on the device).  ``all_to_all_vdev_2d`` / ``all_to_all_vdev_2d_offset`` below take
torch's exact arguments and write its ``out`` tensors, for code written against torch's ops.

For a MoE layer, size ``out_rows`` of the dispatch as R * T_max * min(K, ne) + ne * major_align:
every source sends each token at most min(K, ne) times to one rank, and each expert's tile
rounds up by less than major_align (or takes major_align when empty).

Autograd: dispatch and combine are each other's transpose.  The gradient of a dispatch is the
combine of the gradient with the dispatch's ``out_splits_offsets``; the gradient of a combine is
``ep_combine_t`` (the rows of the combine's outputs sent back to its inputs' positions), whose
gradient is the combine again.  The split tensors get no gradient.

Every call is collective over the group: each rank calls the same ops in the same order.
"""

from __future__ import annotations

from typing import Optional

import torch

DISPATCH = "moe_compile::ep_dispatch"
COMBINE = "moe_compile::ep_combine"
COMBINE_T = "moe_compile::ep_combine_t"
TIMEOUT_S = 60.0


def _exchange(kind, input, payload, group_name, out_rows, major_align=None):
    if out_rows < 0 or (major_align is not None and major_align < 1):
        raise ValueError(f"ep a2a {kind}: need out_rows >= 0 and major_align >= 1 or None, got {out_rows}, "
                         f"{major_align}")
    if payload.dtype != torch.int64:
        raise ValueError(f"ep a2a {kind}: splits and offsets must be int64, got {payload.dtype}")
    if input.device.type == "cuda":
        from moe_compile.ep import a2a_cuda

        return a2a_cuda.exchange(kind, input, payload, group_name, out_rows, major_align)
    from moe_compile.ep import a2a_cpu

    return a2a_cpu.exchange(kind, input, payload, group_name, out_rows, major_align, TIMEOUT_S)


@torch.library.custom_op(DISPATCH, mutates_args=())
def ep_dispatch(input: torch.Tensor, in_splits: torch.Tensor, group_name: str, out_rows: int,
                major_align: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    out, oso = _exchange("dispatch", input, in_splits, group_name, out_rows, major_align)
    return out, oso.to(in_splits.device)


@ep_dispatch.register_fake
def _dispatch_fake(input, in_splits, group_name, out_rows, major_align=None):
    return input.new_empty((out_rows, *input.shape[1:])), in_splits.new_empty((2, in_splits.numel()))


@torch.library.custom_op(COMBINE, mutates_args=())
def ep_combine(input: torch.Tensor, in_splits_offsets: torch.Tensor, group_name: str,
               out_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    out, oso = _exchange("combine", input, in_splits_offsets, group_name, out_rows)
    return out, oso.to(in_splits_offsets.device)


@ep_combine.register_fake
def _combine_fake(input, in_splits_offsets, group_name, out_rows):
    return input.new_empty((out_rows, *input.shape[1:])), in_splits_offsets.new_empty(in_splits_offsets.shape)


@torch.library.custom_op(COMBINE_T, mutates_args=())
def ep_combine_t(input: torch.Tensor, in_splits_offsets: torch.Tensor, group_name: str,
                 out_rows: int) -> torch.Tensor:
    """Transpose of ``ep_combine(., in_splits_offsets)``: ``input`` laid out as that combine's
    ``out`` goes back to the rows of that combine's ``input`` ([out_rows, *H], the rest zero)."""
    return _exchange("combine_t", input, in_splits_offsets, group_name, out_rows)[0]


@ep_combine_t.register_fake
def _combine_t_fake(input, in_splits_offsets, group_name, out_rows):
    return input.new_empty((out_rows, *input.shape[1:]))


# -- autograd: each op's backward is the other -------------------------------------------------
def _save_dispatch(ctx, inputs, output):
    ctx.group_name, ctx.rows = inputs[2], inputs[0].shape[0]
    ctx.save_for_backward(output[1])


def _dispatch_backward(ctx, grad_out, _grad_oso):
    (oso,) = ctx.saved_tensors
    grad = torch.ops.moe_compile.ep_combine(grad_out.contiguous(), oso, ctx.group_name, ctx.rows)[0]
    return grad, None, None, None, None


def _save_combine(ctx, inputs, output):
    ctx.group_name, ctx.rows = inputs[2], inputs[0].shape[0]
    ctx.save_for_backward(inputs[1])


def _combine_backward(ctx, grad_out, _grad_oso):
    (iso,) = ctx.saved_tensors
    return torch.ops.moe_compile.ep_combine_t(grad_out.contiguous(), iso, ctx.group_name, ctx.rows), None, None, None


def _combine_t_backward(ctx, grad_out):
    (iso,) = ctx.saved_tensors
    return torch.ops.moe_compile.ep_combine(grad_out.contiguous(), iso, ctx.group_name, ctx.rows)[0], None, None, None


def _save_combine_t(ctx, inputs, output):
    ctx.group_name, ctx.rows = inputs[2], inputs[0].shape[0]
    ctx.save_for_backward(inputs[1])


torch.library.register_autograd(DISPATCH, _dispatch_backward, setup_context=_save_dispatch)
torch.library.register_autograd(COMBINE, _combine_backward, setup_context=_save_combine)
torch.library.register_autograd(COMBINE_T, _combine_t_backward, setup_context=_save_combine_t)


# -- torch's signatures -------------------------------------------------------------------------
def all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, group_name: str, major_align=None) -> None:
    """``torch.ops.symm_mem.all_to_all_vdev_2d``'s arguments: writes ``out`` and ``out_splits_offsets``."""
    got, oso = torch.ops.moe_compile.ep_dispatch(input, in_splits, group_name, out.shape[0], major_align)
    out.copy_(got)
    out_splits_offsets.copy_(oso)


def all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets, group_name: str) -> None:
    """``torch.ops.symm_mem.all_to_all_vdev_2d_offset``'s arguments: writes ``out`` and ``out_splits_offsets``."""
    got, oso = torch.ops.moe_compile.ep_combine(input, in_splits_offsets, group_name, out.shape[0])
    out.copy_(got)
    out_splits_offsets.copy_(oso)


def dispatch_rows(world: int, max_tokens: int, top_k: int, local_experts: int, major_align=None) -> int:
    """``out_rows`` of a MoE layer's dispatch that no routing can exceed (see the module docstring)."""
    a = 1 if major_align is None else int(major_align)
    return world * max_tokens * min(top_k, local_experts) + local_experts * a


__all__ = ["all_to_all_vdev_2d", "all_to_all_vdev_2d_offset", "dispatch_rows", "ep_combine", "ep_combine_t",
           "ep_dispatch"]
