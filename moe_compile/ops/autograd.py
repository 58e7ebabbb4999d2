"""Autograd for ``torch.ops.moe_compile.fused_moe``: training through the fused op.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

* The backward is its own custom op, ``moe_compile::fused_moe_backward``, with a fake impl, so
  AOTAutograd and Inductor see one opaque node in the backward graph (like the forward) and a
  compiled training step — forward, loss, backward, optimizer step — compiles end to end.
* What is saved: the inputs (x, ids, routing weights and the weight tensors it was given —
  references, no copies).  ``fused_moe_train``, the form the passes emit where the graph will be
  differentiated, also saves FC1's output [T*K, F2] on CPU (what an eager loop keeps, in one
  buffer), so the backward does no FC1 GEMM again; only the activation is recomputed from it.
  ``fused_moe`` called directly under autograd saves no activation and the backward recomputes FC1
  per expert segment (one extra FC1 GEMM, ~1/3 of the forward FLOPs, for [T*K, F2] less memory);
  so does the Triton backward on CUDA (``kernels/triton/backward.py``, ``triton_dispatch.backward``).
* Gradients go to x, topk_weights and every weight / bias tensor in every layout; list arguments
  get a list of gradients back.  Inputs with ``requires_grad=False`` (frozen experts, a frozen
  router) are skipped: ``ctx.needs_input_grad`` has one bool per tensor of a ``Tensor[]``
  argument, and the backward op takes that mask as ``needs`` so that it computes nothing for
  them.  topk_ids are integers and get no gradient.

Registration happens when ``moe_compile.ops`` is imported (its last line imports this module).
"""

from __future__ import annotations

import torch

from moe_compile.kernels import triton_dispatch
from moe_compile.kernels.cpu import prepack as cpu_prepack
from moe_compile.kernels.cpu.backward import ROLES, Needs
from moe_compile.ops.fused_moe import OP_NAME, TRAIN_OP_NAME, op_args_schema, parse_op_args

BACKWARD_OP_NAME = "moe_compile::fused_moe_backward"


def flat_inputs(x, topk_weights, roles):
    """The differentiable inputs in the backward ops' output order."""
    return [x, topk_weights, *[t for role in roles for t in role]]


def needs_by_role(roles, needs) -> dict:
    """Split the flat ``needs`` (x, topk_weights, then every role tensor) into role -> [bool]."""
    out, i = {}, 2
    for name, role in zip(ROLES, roles):
        out[name] = list(needs[i : i + len(role)])
        i += len(role)
    return out


def flat_grads(dx, dg, role_grads: dict, x, topk_weights, roles, needs) -> list:
    """Backward-op result: one tensor per flat input; an empty [0] where none is needed or made."""
    flat = [dx, dg, *[g for name in ROLES for g in role_grads[name]]]
    inputs = flat_inputs(x, topk_weights, roles)
    return [t.new_empty(0) if (g is None or not need) else g for g, t, need in zip(flat, inputs, needs)]


def _backward_schema() -> str:
    """grad_y, then ``fused_moe``'s arguments, the per-gradient ``needs`` mask and FC1's saved output."""
    return f"(Tensor grad_y, {op_args_schema()[1:-1]}, bool[] needs, Tensor? fc1_out=None) -> Tensor[]"


def _split_backward_args(args):
    """(grad_y, the 15 op arguments, needs, fc1_out | None) from the backward op's arguments."""
    grad_y, *rest = args
    fc1_out = rest[16] if len(rest) > 16 else None
    return grad_y, tuple(rest[:15]), rest[15], fc1_out


@torch.library.custom_op(BACKWARD_OP_NAME, mutates_args=(), schema=_backward_schema())
def fused_moe_backward(*args) -> list[torch.Tensor]:
    """Gradients of [x, topk_weights, *fc1, *fc1_up, *fc2, *fc1_bias, *fc1_up_bias, *fc2_bias].

    Arguments: grad_y, ``fused_moe``'s arguments, ``needs``, ``fc1_out``.  ``needs`` has one bool
    per entry of that list; an entry not needed comes back as an empty [0] tensor (an op cannot
    return None inside a Tensor[]), which the autograd glue maps to None.  ``fc1_out``: FC1's
    output saved by ``fused_moe_train`` (None or empty: recompute it).
    """
    grad_y, op_args, needs, fc1_out = _split_backward_args(args)
    x, topk_ids, topk_weights, w, attrs = parse_op_args(op_args)
    roles = op_args[3:9]
    need_roles = needs_by_role(roles, needs)
    if x.device.type == "cpu":  # weights being trained change every step: never worth packing
        cpu_prepack.mark_trained([t for t, need in zip(flat_inputs(x, topk_weights, roles)[2:], needs[2:]) if need])
    # CUDA tensors the Triton backward supports go to it; the rest to the plain-torch segment kernel.
    # A backward run inside torch.autocast must not re-cast its GEMMs: the forward's autocast
    # kernel (ops.py) already chose the dtypes, and the gradient buffers follow them.
    with torch.autocast(x.device.type, enabled=False):
        saved = fc1_out if fc1_out is not None and fc1_out.numel() > 0 else None
        dx, dg, role_grads = triton_dispatch.backward(
            grad_y, x, topk_ids, topk_weights, w, attrs, Needs(needs[0], needs[1], need_roles), saved
        )
    return flat_grads(dx, dg, role_grads, x, topk_weights, roles, needs)


@fused_moe_backward.register_fake
def _fused_moe_backward_fake(*args):
    _, op_args, needs, _ = _split_backward_args(args)
    inputs = flat_inputs(op_args[0], op_args[2], op_args[3:9])
    return [t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip(inputs, needs)]


def save_inputs(ctx, inputs, output, fc1_out=None, kept=()) -> None:
    """setup_context shared by the fused ops (single-device and expert-parallel): save the inputs
    (references to tensors the caller holds anyway) and, from ``fused_moe_train``, FC1's output;
    without it the backward recomputes FC1.  ``kept``: more forward outputs the backward reads
    (``fused_moe_ep_train``'s kept rows), saved last (``saved_kept``)."""
    x, topk_ids, topk_weights, *rest = inputs
    roles, statics = rest[:6], rest[6:]
    ctx.lengths = [len(role) for role in roles]
    ctx.statics = tuple(statics)  # gate_up, transposed, activation, limit, alpha, weight_on, [EP options]
    ctx.saves_fc1 = fc1_out is not None
    ctx.kept_count = len(kept)
    extra = [fc1_out] if ctx.saves_fc1 else []
    ctx.save_for_backward(x, topk_ids, topk_weights, *[t for role in roles for t in role], *extra, *kept)


def _save_inputs_and_fc1(ctx, inputs, output) -> None:
    """setup_context of ``fused_moe_train``: output = (y, fc1_out); fc1_out gets no gradient, and
    autograd must not materialise a zero one (a [T*K, F2] buffer) for the backward to ignore."""
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)
    save_inputs(ctx, inputs, output, fc1_out=output[1])


def unpack_saved(ctx):
    """(x, topk_ids, topk_weights, roles, needs): ``needs`` has one bool per gradient the backward
    op returns — x, topk_weights, then every tensor of every role."""
    x, topk_ids, topk_weights, *flat_w = ctx.saved_tensors
    flat_w = flat_w[: len(flat_w) - getattr(ctx, "kept_count", 0)]  # the kept outputs are last (``saved_kept``)
    if ctx.saves_fc1:
        flat_w = flat_w[:-1]  # the last one is fc1_out (``saved_fc1``)
    roles, i = [], 0
    for n in ctx.lengths:
        roles.append(list(flat_w[i : i + n]))
        i += n
    ni = ctx.needs_input_grad  # (x, ids, weights, [per tensor of fc1], ..., statics...)
    needs = [bool(ni[0]), bool(ni[2]), *[bool(b) for k in range(6) for b in ni[3 + k]]]
    return x, topk_ids, topk_weights, roles, needs


def pack_grads(ctx, flat, needs) -> tuple:
    """The backward op's flat gradient list -> autograd's per-input tuple (None where not needed)."""
    flat = [g if need else None for g, need in zip(flat, needs)]
    dx, dg, i, role_grads = flat[0], flat[1], 2, []
    for n in ctx.lengths:
        role_grads.append(flat[i : i + n])
        i += n
    return (dx, None, dg, *role_grads, *([None] * len(ctx.statics)))


def saved_kept(ctx) -> tuple:
    """The forward outputs ``save_inputs(kept=...)`` saved, in their order."""
    n = getattr(ctx, "kept_count", 0)
    return tuple(ctx.saved_tensors[len(ctx.saved_tensors) - n :]) if n else ()


def saved_fc1(ctx):
    """FC1's output saved by ``fused_moe_train``'s forward, or None."""
    return ctx.saved_tensors[-1 - getattr(ctx, "kept_count", 0)] if ctx.saves_fc1 else None


def _backward(ctx, grad_y, grad_fc1_out=None):
    x, topk_ids, topk_weights, roles, needs = unpack_saved(ctx)
    if grad_y is None or not any(needs):  # None: y unused (grads are not materialised for the train op)
        return pack_grads(ctx, [None] * len(needs), needs)
    flat = torch.ops.moe_compile.fused_moe_backward(
        grad_y, x, topk_ids, topk_weights, *roles, *ctx.statics, needs, saved_fc1(ctx)
    )
    return pack_grads(ctx, flat, needs)


torch.library.register_autograd(OP_NAME, _backward, setup_context=save_inputs)
torch.library.register_autograd(TRAIN_OP_NAME, _backward, setup_context=_save_inputs_and_fc1)
