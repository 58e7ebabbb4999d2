"""The expert-parallel fused MoE op: ``torch.ops.moe_compile.fused_moe_ep``.

Shapes:  T tokens (this rank), H hidden, E global experts, El = E // R local experts, K experts per
         token, R ranks, S' slots routed to a valid expert.

Contract (the graph matcher rewrites expert-parallel regions into exactly this call):

    fused_moe_ep(x [T, H], topk_ids [T, K] (GLOBAL ids in [0, E)), topk_weights [T, K],
                 fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias,   # this rank's El LOCAL experts
                 gate_up, transposed, activation, limit, alpha, weight_on,   # as fused_moe
                 group_name, num_experts, max_tokens, transport, chunks, timeout_s) -> y [T, H]

    y_t = sum_k g_{t,k} FFN_{e_{t,k}}(x_t) over all experts of all ranks (kernels/reference.py).

* Rank r owns experts [r*El, (r+1)*El).  ``group_name`` is ``ProcessGroup.group_name``.
* ``max_tokens``: rows one rank may receive per call (T_max*K*R when 0 — see ``plan.receive_bound``);
  more raises ``ValueError`` naming the bound and ``max_tokens`` on every rank (never a silent drop).
* ``transport``: "symm" (shared-memory heap among the ranks of one host, ``ep/dispatch.py``),
  "symm-int8" (the same with int8 rows + per-token scales on the dispatch), "collectives"
  (chunked async all_to_all, ``ep/overlap.py``), "a2a" (one ``ep_dispatch`` / ``ep_combine`` each
  way in torch's ``all_to_all_vdev_2d`` contract, no torch scalar read: ``ep/fused_a2a.py``; CPU,
  routing weight on the output), "a2a-dedup" (the same exchange with each token sent once to
  each rank owning any of its experts and expanded there: ``ep/fused_dedup.py``), "a2a-int8" (int8
  rows + per-token scales dispatched straight into a8w8-int experts: ``ep/fused_int8.py``), "auto" (a2a
  where ``resolve_auto`` says it takes the call, else symm when every rank is on this host and the
  tensors are on CPU, else collectives).
* ``chunks``: pieces per destination block for the compute/transfer overlap; 0 = auto
  (``plan.auto_chunks``).  ``timeout_s``: a missing peer raises ``TimeoutError`` naming it.
* Backward (``register_autograd``): dispatch and combine are each other's transpose — the backward
  sends dy rows (+ g) to the experts' ranks, runs the single-device backward
  (``kernels/cpu/backward.py``) on them, and returns [dx | dg] rows; local weight gradients stay
  on their rank.  ``fused_moe_ep`` itself keeps nothing, so its backward sends [x | dy] again;
  ``fused_moe_ep_train`` (same arguments -> (y, kept rows, kept meta), static shapes: ``ep/keep.py``)
  is what autograd should record — the passes emit it where the graph will be differentiated and
  ``call_fused_moe_ep`` calls it when autograd records the call — and its forward keeps the rows it
  received as outputs, so eager autograd and AOTAutograd alike hand them to the backward, which
  then sends only dy (+ g), chunked like the forward (symm / collectives).
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_compile.ep import keep as keep_mod
from moe_compile.ep.context import config_tuple, get_context
from moe_compile.ep.plan import make_plan
from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu.backward import ROLES
from moe_compile.kernels.cpu.ep import experts_backward_on_rows, experts_on_rows
from moe_compile.kernels.reference import compute_dtype
from moe_compile.ops.fused_moe import attrs_from_args, check_inputs, weights_from_args
from moe_compile.ops.autograd import (flat_grads, flat_inputs, needs_by_role, pack_grads, save_inputs, saved_kept,
                                  unpack_saved)

OP_NAME = "moe_compile::fused_moe_ep"
TRAIN_OP_NAME = "moe_compile::fused_moe_ep_train"
BACKWARD_OP_NAME = "moe_compile::fused_moe_ep_backward"
TRANSPORTS = ("auto", "symm", "symm-int8", "collectives", "a2a", "a2a-dedup", "a2a-int8")
A2A_TRANSPORTS = ("a2a", "a2a-dedup", "a2a-int8")


def _check(x, topk_ids, topk_weights, w, num_experts, transport, max_tokens, chunks, timeout_s):
    check_inputs(x, topk_ids, topk_weights, w)
    if transport not in TRANSPORTS:
        raise ValueError(f"fused_moe_ep: transport must be one of {TRANSPORTS}, got {transport!r}")
    if num_experts < 1 or max_tokens < 0 or chunks < 0 or timeout_s <= 0:
        raise ValueError(
            f"fused_moe_ep: need num_experts >= 1, max_tokens >= 0, chunks >= 0, timeout_s > 0; got "
            f"{num_experts}, {max_tokens}, {chunks}, {timeout_s}"
        )


def _transport(ctx, transport: str, x):
    """The exchange module for this call (module with ``exchange(...)``) and whether to quantize."""
    if transport == "auto":
        try:
            from moe_compile.ep import dispatch
        except ImportError:  # heap transport not built yet
            return _collectives(), False
        transport = "symm" if (not x.is_cuda and dispatch.same_host(ctx)) else "collectives"
    if transport in ("symm", "symm-int8"):
        from moe_compile.ep import dispatch

        return dispatch, transport == "symm-int8"
    return _collectives(), False


def resolve_auto(group_name: str, transport: str, x, w, attrs, max_tokens: int, chunks: int) -> str:
    """"auto" -> "a2a" (one sync-free 2D all-to-all each way) where it takes the call: CPU tensors,
    every rank on this host, the routing weight applicable at the source, and neither an explicit
    receive bound (``max_tokens``) nor chunking asked for (the heap transport's options).  The
    same verdict on every rank (the configuration check made their arguments agree); otherwise
    "auto" stays as it was (``_transport``: symm or collectives)."""
    if transport != "auto" or x.is_cuda or max_tokens or chunks:
        return transport
    from moe_compile.ep import dispatch, fused_a2a

    if fused_a2a.supports(x, w, attrs) is None and dispatch.same_host(get_context(group_name)):
        return "a2a"
    return transport


def _a2a(x, w, attrs, transport: str):
    from moe_compile.ep import fused_a2a, fused_dedup, fused_int8

    mod = {"a2a": fused_a2a, "a2a-dedup": fused_dedup, "a2a-int8": fused_int8}[transport]
    why = mod.supports(x, w, attrs)
    if why is not None:
        raise ValueError(f"fused_moe_ep: transport={transport!r} cannot take this call: {why}")
    return mod


def _collectives():
    from moe_compile.ep import overlap

    return overlap


def ep_forward(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, group_name: str,
               num_experts: int, max_tokens: int, transport: str, chunks: int, timeout_s: float,
               kept: keep_mod.Buffers | None = None):
    """y [T, H]; ``kept``: the training op's buffers, which the forward fills with the rows it
    received where the transport keeps them ("a2a", "symm", "collectives"; not the int8 and dedup
    forms, whose backward sends its own rows)."""
    ctx = get_context(group_name)
    ctx.check_config(config_tuple(x, topk_ids, w, attrs, num_experts, transport, max_tokens, chunks), timeout_s)
    if w.num_experts * ctx.world != num_experts:
        raise ValueError(
            f"fused_moe_ep: {w.num_experts} local experts x {ctx.world} ranks != num_experts={num_experts}"
        )
    transport = resolve_auto(group_name, transport, x, w, attrs, max_tokens, chunks)
    if transport in A2A_TRANSPORTS:
        mod = _a2a(x, w, attrs, transport)
        extra = {"kept": kept} if transport == "a2a" else {}
        return mod.forward(x, topk_ids, topk_weights, w, attrs, group_name, num_experts, timeout_s, **extra)
    plan = make_plan(topk_ids, num_experts, ctx.world)  # [S'] order, [R, El] counts
    gpay = topk_weights.reshape(-1).index_select(0, plan.order).float()  # [S']
    mod, quant = _transport(ctx, transport, x)

    def compute(rows, g, counts, out, at):
        experts_on_rows(rows, g, counts, w, attrs, out)

    ret = mod.exchange(ctx, plan, x, gpay, compute, x.shape[1], x.dtype, chunks=chunks, timeout_s=timeout_s,
                       quant=quant, max_tokens=max_tokens, top_k=topk_ids.shape[1],
                       keep=None if quant else kept)  # int8 rows are no backward's x
    y = torch.zeros(x.shape, dtype=compute_dtype(x.dtype), device=x.device)  # [T, H] fp32 accumulator
    y.index_add_(0, plan.tokens, ret.to(y.dtype))  # weighted combine: the K rows of each token
    return y.to(x.dtype)


@torch.library.custom_op(OP_NAME, mutates_args=())
def fused_moe_ep(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    fc1: list[torch.Tensor], fc1_up: list[torch.Tensor], fc2: list[torch.Tensor],
    fc1_bias: list[torch.Tensor], fc1_up_bias: list[torch.Tensor], fc2_bias: list[torch.Tensor],
    gate_up: str, transposed: bool, activation: str, limit: float, alpha: float, weight_on: str,
    group_name: str, num_experts: int, max_tokens: int, transport: str, chunks: int, timeout_s: float,
) -> torch.Tensor:
    w = weights_from_args(fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias, transposed)
    attrs = attrs_from_args(gate_up, transposed, activation, limit, alpha, weight_on)
    _check(x, topk_ids, topk_weights, w, num_experts, transport, max_tokens, chunks, timeout_s)
    return ep_forward(x, topk_ids, topk_weights, w, attrs, group_name, num_experts, max_tokens, transport,
                      chunks, timeout_s)


@fused_moe_ep.register_fake
def _fused_moe_ep_fake(*args):
    x = _parsed(args)[0]  # the same checks as the op
    return x.new_empty(x.shape)


def _kept_buffers(x, topk_ids, w: ExpertWeights, num_experts: int, max_tokens: int):
    """(rows [CAP, H], meta [M]) of the training op (``ep/keep.py``), in the op and its fake alike."""
    ne = w.num_experts
    return keep_mod.buffers(x, topk_ids, max(num_experts // max(ne, 1), 1), ne, max_tokens)


def _ep_args_schema() -> str:
    """``fused_moe_ep``'s argument list as schema text: the training op takes the same arguments."""
    schema = str(torch.ops.moe_compile.fused_moe_ep.default._schema)
    return schema[schema.index("(") : schema.rindex(" -> ")]


def _parsed(args):
    """(x, topk_ids, topk_weights, w, attrs, EP options...) of ``fused_moe_ep``'s arguments, checked."""
    x, topk_ids, topk_weights, *roles = args[:9]
    w = weights_from_args(*roles, args[10])
    attrs = attrs_from_args(*args[9:15])
    group_name, num_experts, max_tokens, transport, chunks, timeout_s = args[15:21]
    _check(x, topk_ids, topk_weights, w, num_experts, transport, max_tokens, chunks, timeout_s)
    return x, topk_ids, topk_weights, w, attrs, group_name, num_experts, max_tokens, transport, chunks, timeout_s


@torch.library.custom_op(TRAIN_OP_NAME, mutates_args=(), schema=_ep_args_schema() + " -> (Tensor, Tensor, Tensor)")
def fused_moe_ep_train(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_moe_ep`` for a forward whose backward will run: (y [T, H], kept rows [CAP, H], kept
    meta [M] int64) — the rows this rank received, so that the backward sends only dy.  Arguments:
    ``fused_moe_ep``'s."""
    parsed = _parsed(args)  # ep_forward's arguments, in its order
    x, topk_ids, _, w, _, _, num_experts, max_tokens, *_ = parsed
    rows, meta = _kept_buffers(x, topk_ids, w, num_experts, max_tokens)
    kept = keep_mod.Buffers(rows, meta, w.num_experts, topk_ids.shape[1], max_tokens)
    return ep_forward(*parsed, kept), rows, meta


@fused_moe_ep_train.register_fake
def _fused_moe_ep_train_fake(*args):
    x, topk_ids, _, w, _, _, num_experts, max_tokens, *_ = _parsed(args)
    return (x.new_empty(x.shape), *_kept_buffers(x, topk_ids, w, num_experts, max_tokens))


@torch.library.custom_op(BACKWARD_OP_NAME, mutates_args=())
def fused_moe_ep_backward(
    grad_y: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    fc1: list[torch.Tensor], fc1_up: list[torch.Tensor], fc2: list[torch.Tensor],
    fc1_bias: list[torch.Tensor], fc1_up_bias: list[torch.Tensor], fc2_bias: list[torch.Tensor],
    gate_up: str, transposed: bool, activation: str, limit: float, alpha: float, weight_on: str,
    group_name: str, num_experts: int, max_tokens: int, transport: str, chunks: int, timeout_s: float,
    needs: list[bool], kept_rows: Optional[torch.Tensor] = None, kept_meta: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    """Gradients of [x, topk_weights, *fc1, ..., *fc2_bias]; an entry not needed is an empty [0].
    ``kept_rows`` / ``kept_meta``: ``fused_moe_ep_train``'s kept outputs (None: resend x)."""
    roles = (fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias)
    w = weights_from_args(*roles, transposed)
    attrs = attrs_from_args(gate_up, transposed, activation, limit, alpha, weight_on)
    need_roles = needs_by_role(roles, needs)
    transport = resolve_auto(group_name, transport, x, w, attrs, max_tokens, chunks)
    kept = keep_mod.KeptRows.from_tensors(kept_rows, kept_meta, w.num_experts)
    dx, dg, role_grads = ep_backward(grad_y, x, topk_ids, topk_weights, w, attrs, need_roles, group_name,
                                     num_experts, max_tokens, transport, timeout_s, chunks, kept)
    return flat_grads(dx, dg, role_grads, x, topk_weights, roles, needs)


@fused_moe_ep_backward.register_fake
def _fused_moe_ep_backward_fake(grad_y, x, topk_ids, topk_weights, fc1, fc1_up, fc2, fc1_bias, fc1_up_bias,
                                fc2_bias, gate_up, transposed, activation, limit, alpha, weight_on,
                                group_name, num_experts, max_tokens, transport, chunks, timeout_s, needs,
                                kept_rows=None, kept_meta=None):
    inputs = flat_inputs(x, topk_weights, (fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias))
    return [t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip(inputs, needs)]


def ep_backward(grad_y, x, topk_ids, topk_weights, w, attrs, need_roles, group_name, num_experts,
                max_tokens, transport, timeout_s, chunks=0, kept: keep_mod.KeptRows | None = None):
    """Transpose of dispatch/experts/combine.  Every rank takes part (it serves other ranks' rows).
    ``kept``: the rows the training op's forward received; with them (on every rank) only dy rows
    travel, else [x | dy]; symm / collectives pieces as many as their forward's."""
    if transport in A2A_TRANSPORTS:
        mod = _a2a(x, w, attrs, transport)
        extra = {"kept": kept} if transport == "a2a" else {}
        return mod.backward(grad_y, x, topk_ids, topk_weights, w, attrs, need_roles, group_name, num_experts,
                            timeout_s, **extra)
    ctx = get_context(group_name)
    plan = make_plan(topk_ids, num_experts, ctx.world)
    T, H = x.shape
    K = topk_ids.shape[1]
    cdt = compute_dtype(x.dtype)
    gpay = topk_weights.reshape(-1).index_select(0, plan.order).float()  # [S']
    acc = {}

    def compute(rows, g, counts, out, at):
        """rows [n, H] dy (the forward kept x: rows [at, at + n) of ``kept``) or [n, 2H] [x | dy]."""
        n = rows.shape[0]
        if n == 0:
            return
        xr, dyr = (rows[:, :H], rows[:, H:]) if rows.shape[1] == 2 * H else (kept.rows[at : at + n], rows)
        dxr, dgr, roles = experts_backward_on_rows(xr.to(cdt), dyr.to(cdt), g, counts, w, attrs, need_roles)
        out[:, :H] = dxr
        out[:, H] = dgr
        _accumulate(acc, roles)  # the weight gradients sum over every piece

    mod, _ = _transport(ctx, "symm" if transport == "symm-int8" else transport, x)  # backward rows unquantized
    ret = mod.exchange(ctx, plan, grad_y.to(x.dtype), gpay, compute, H + 1, cdt, chunks=chunks, timeout_s=timeout_s,
                       backward=True, kept=kept, resend=x, quant=False, max_tokens=max_tokens, top_k=K)  # [S', H+1]
    dx = torch.zeros(T, H, dtype=cdt, device=x.device)
    dx.index_add_(0, plan.tokens, ret[:, :H])
    dg = torch.zeros(T * K, dtype=cdt, device=x.device)
    dg.index_copy_(0, plan.order, ret[:, H])
    for r in ROLES:  # zero gradients for the local experts that need one and saw no row
        grads = acc.setdefault(r, [None] * len(getattr(w, r)))
        acc[r] = [torch.zeros_like(t) if (need and g is None) else g
                  for t, need, g in zip(getattr(w, r), need_roles[r], grads)]
    return dx.to(x.dtype), dg.view(T, K).to(topk_weights.dtype), acc


def _accumulate(acc: dict, roles: dict) -> None:
    """acc[role][i] += roles[role][i] (None: no gradient yet / none computed)."""
    for name, grads in roles.items():
        have = acc.setdefault(name, [None] * len(grads))
        for i, g in enumerate(grads):
            if g is not None:
                have[i] = g if have[i] is None else have[i] + g


def _backward(ctx, grad_y, *_kept_grads):
    """Both ops' backward: every rank must join the backward exchange (it serves its peers' rows)
    even if it needs nothing.  The training op's kept outputs (non-differentiable) come last."""
    x, topk_ids, topk_weights, roles, needs = unpack_saved(ctx)
    if grad_y is None:  # y unused by the loss on this rank: it still serves its peers
        grad_y = torch.zeros_like(x)
    flat = torch.ops.moe_compile.fused_moe_ep_backward(grad_y, x, topk_ids, topk_weights, *roles, *ctx.statics,
                                                       needs, *saved_kept(ctx))
    return pack_grads(ctx, flat, needs)


def _save_train(ctx, inputs, output):
    """setup_context of the training op: its inputs and its kept outputs (no gradient of their own,
    and none materialised for them)."""
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.set_materialize_grads(False)
    save_inputs(ctx, inputs, output, kept=(output[1], output[2]))


torch.library.register_autograd(OP_NAME, _backward, setup_context=save_inputs)
torch.library.register_autograd(TRAIN_OP_NAME, _backward, setup_context=_save_train)


def records_autograd(*tensors) -> bool:
    """Whether autograd will record a call on these tensors (grad mode on — off in inference mode
    too — and some input requiring grad): then ``call_fused_moe_ep`` calls the training op."""
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def call_fused_moe_ep(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, group, num_experts: int, *,
                      max_tokens: int = 0, transport: str = "auto", chunks: int = 0, timeout_s: float = 60.0):
    """Python-friendly entry: the op from ``ExpertWeights`` (this rank's experts) and ``FFNAttrs``."""
    group_name = group if isinstance(group, str) else group.group_name
    args = (x, topk_ids, topk_weights,
            list(w.fc1), list(w.fc1_up), list(w.fc2), list(w.fc1_bias), list(w.fc1_up_bias), list(w.fc2_bias),
            attrs.gate_up, attrs.transposed, attrs.activation, attrs.limit, attrs.alpha, attrs.weight_on,
            group_name, int(num_experts), int(max_tokens), transport, int(chunks), float(timeout_s))
    if records_autograd(x, topk_weights, *[t for name in ROLES for t in getattr(w, name)]):
        return torch.ops.moe_compile.fused_moe_ep_train(*args)[0]  # its backward sends only dy
    return torch.ops.moe_compile.fused_moe_ep(*args)
