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
  (``dispatch.auto_chunks``).  ``timeout_s``: a missing peer raises ``TimeoutError`` naming it.
* Backward (``register_autograd``): dispatch and combine are each other's transpose — the backward
  sends [x | dy] rows to the experts' ranks ("a2a": only [dy | g], the forward's received rows
  kept on the autograd node, ``fused_a2a.Kept``), runs the single-device backward
  (``kernels/cpu/backward.py``) on them, and returns [dx | dg] rows; local weight gradients stay
  on their rank.
"""

from __future__ import annotations

import torch

from moe_compile.ep.context import config_tuple, get_context
from moe_compile.ep.plan import make_plan
from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu.backward import ROLES
from moe_compile.kernels.cpu.ep import experts_backward_on_rows, experts_on_rows
from moe_compile.kernels.reference import compute_dtype
from moe_compile.ops import attrs_from_args, check_inputs, weights_from_args
from moe_compile.autograd import flat_grads, flat_inputs, needs_by_role, pack_grads, save_inputs, unpack_saved

OP_NAME = "moe_compile::fused_moe_ep"
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
               num_experts: int, max_tokens: int, transport: str, chunks: int, timeout_s: float):
    ctx = get_context(group_name)
    ctx.check_config(config_tuple(x, topk_ids, w, attrs, num_experts, transport, max_tokens, chunks), timeout_s)
    if w.num_experts * ctx.world != num_experts:
        raise ValueError(
            f"fused_moe_ep: {w.num_experts} local experts x {ctx.world} ranks != num_experts={num_experts}"
        )
    transport = resolve_auto(group_name, transport, x, w, attrs, max_tokens, chunks)
    if transport in A2A_TRANSPORTS:
        mod = _a2a(x, w, attrs, transport)
        return mod.forward(x, topk_ids, topk_weights, w, attrs, group_name, num_experts, timeout_s)
    plan = make_plan(topk_ids, num_experts, ctx.world)  # [S'] order, [R, El] counts
    gpay = topk_weights.reshape(-1).index_select(0, plan.order).float()  # [S']
    mod, quant = _transport(ctx, transport, x)

    def compute(rows, g, counts, out):
        experts_on_rows(rows, g, counts, w, attrs, out)

    ret = mod.exchange(ctx, plan, x, gpay, compute, x.shape[1], x.dtype, chunks=chunks, timeout_s=timeout_s,
                       quant=quant, max_tokens=max_tokens, top_k=topk_ids.shape[1])
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
def _fused_moe_ep_fake(x, topk_ids, topk_weights, fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias,
                       gate_up, transposed, activation, limit, alpha, weight_on,
                       group_name, num_experts, max_tokens, transport, chunks, timeout_s):
    w = weights_from_args(fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias, transposed)
    attrs_from_args(gate_up, transposed, activation, limit, alpha, weight_on)
    _check(x, topk_ids, topk_weights, w, num_experts, transport, max_tokens, chunks, timeout_s)
    return x.new_empty(x.shape)


@torch.library.custom_op(BACKWARD_OP_NAME, mutates_args=())
def fused_moe_ep_backward(
    grad_y: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
    fc1: list[torch.Tensor], fc1_up: list[torch.Tensor], fc2: list[torch.Tensor],
    fc1_bias: list[torch.Tensor], fc1_up_bias: list[torch.Tensor], fc2_bias: list[torch.Tensor],
    gate_up: str, transposed: bool, activation: str, limit: float, alpha: float, weight_on: str,
    group_name: str, num_experts: int, max_tokens: int, transport: str, chunks: int, timeout_s: float,
    needs: list[bool],
) -> list[torch.Tensor]:
    """Gradients of [x, topk_weights, *fc1, ..., *fc2_bias]; an entry not needed is an empty [0]."""
    roles = (fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias)
    w = weights_from_args(*roles, transposed)
    attrs = attrs_from_args(gate_up, transposed, activation, limit, alpha, weight_on)
    need_roles = needs_by_role(roles, needs)
    transport = resolve_auto(group_name, transport, x, w, attrs, max_tokens, chunks)
    dx, dg, role_grads = ep_backward(grad_y, x, topk_ids, topk_weights, w, attrs, need_roles, group_name,
                                     num_experts, max_tokens, transport, timeout_s)
    return flat_grads(dx, dg, role_grads, x, topk_weights, roles, needs)


@fused_moe_ep_backward.register_fake
def _fused_moe_ep_backward_fake(grad_y, x, topk_ids, topk_weights, fc1, fc1_up, fc2, fc1_bias, fc1_up_bias,
                                fc2_bias, gate_up, transposed, activation, limit, alpha, weight_on,
                                group_name, num_experts, max_tokens, transport, chunks, timeout_s, needs):
    inputs = flat_inputs(x, topk_weights, (fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias))
    return [t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip(inputs, needs)]


def ep_backward(grad_y, x, topk_ids, topk_weights, w, attrs, need_roles, group_name, num_experts,
                max_tokens, transport, timeout_s):
    """Transpose of dispatch/experts/combine.  Every rank takes part (it serves other ranks' rows)."""
    if transport in A2A_TRANSPORTS:
        mod = _a2a(x, w, attrs, transport)
        return mod.backward(grad_y, x, topk_ids, topk_weights, w, attrs, need_roles, group_name, num_experts, timeout_s)
    ctx = get_context(group_name)
    plan = make_plan(topk_ids, num_experts, ctx.world)
    T, H = x.shape
    K = topk_ids.shape[1]
    cdt = compute_dtype(x.dtype)
    gpay = topk_weights.reshape(-1).index_select(0, plan.order).float()  # [S']
    base = torch.cat([x.to(cdt), grad_y.to(cdt)], dim=1)  # [T, 2H]: rows [x_t | dy_t]
    acc = {}

    def compute(rows, g, counts, out):
        dxr, dgr, roles = experts_backward_on_rows(rows[:, :H], rows[:, H:], g, counts, w, attrs, need_roles)
        out[:, :H] = dxr
        out[:, H] = dgr
        acc.update(roles)

    mod, _ = _transport(ctx, "symm" if transport == "symm-int8" else transport, x)  # backward rows unquantized
    ret = mod.exchange(ctx, plan, base, gpay, compute, H + 1, cdt, chunks=1, timeout_s=timeout_s, whole=True,
                       quant=False, max_tokens=max_tokens, top_k=K)  # [S', H+1]
    dx = torch.zeros(T, H, dtype=cdt, device=x.device)
    dx.index_add_(0, plan.tokens, ret[:, :H])
    dg = torch.zeros(T * K, dtype=cdt, device=x.device)
    dg.index_copy_(0, plan.order, ret[:, H])
    if not acc:  # no row arrived: zero gradients for the local experts that need one
        acc = {r: [torch.zeros_like(t) if need else None for t, need in zip(getattr(w, r), need_roles[r])]
               for r in ROLES}
    return dx.to(x.dtype), dg.view(T, K).to(topk_weights.dtype), acc


def _backward(ctx, grad_y):
    from moe_compile.ep import fused_a2a

    x, topk_ids, topk_weights, roles, needs = unpack_saved(ctx)
    # Every rank must join the backward exchange (it serves its peers' rows) even if it needs nothing.
    with fused_a2a.handed(ctx.ep_kept):  # the a2a forward's received rows: its backward then sends only dy
        flat = torch.ops.moe_compile.fused_moe_ep_backward(grad_y, x, topk_ids, topk_weights, *roles, *ctx.statics,
                                                           needs)
    return pack_grads(ctx, flat, needs)


def _save(ctx, inputs, output):
    """save_inputs, and the rows an "a2a" forward received (``fused_a2a.Kept``; None for any other
    call): kept on the autograd node, so they live exactly as long as the graph that needs them."""
    from moe_compile.ep import fused_a2a

    save_inputs(ctx, inputs, output)
    ctx.ep_kept = fused_a2a.take_kept(inputs[0], inputs[1])


torch.library.register_autograd(OP_NAME, _backward, setup_context=_save)


def call_fused_moe_ep(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, group, num_experts: int, *,
                      max_tokens: int = 0, transport: str = "auto", chunks: int = 0, timeout_s: float = 60.0):
    """Python-friendly entry: the op from ``ExpertWeights`` (this rank's experts) and ``FFNAttrs``."""
    group_name = group if isinstance(group, str) else group.group_name
    return torch.ops.moe_compile.fused_moe_ep(
        x, topk_ids, topk_weights,
        list(w.fc1), list(w.fc1_up), list(w.fc2), list(w.fc1_bias), list(w.fc1_up_bias), list(w.fc2_bias),
        attrs.gate_up, attrs.transposed, attrs.activation, attrs.limit, attrs.alpha, attrs.weight_on,
        group_name, int(num_experts), int(max_tokens), transport, int(chunks), float(timeout_s),
    )
