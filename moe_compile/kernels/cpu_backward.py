"""Backward of the fused MoE op on the CPU path's sorted, contiguous-segment layout.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots,
         S' the slots whose id lies in [0, E), n the rows of one expert's segment, F2 = FC1 width
         (2F for gated layouts, F for gate_up="none").

Plan (mirrors ``kernels/cpu.py``; one host sync):
  1. the same stable sort by expert (``cpu.sort_by_expert``) -> contiguous segments;
  2. gather x rows and grad_y rows of the S' valid slots once, in the compute dtype;
  3. per expert with tokens: FC1's output h [n, F2] is read from the training forward's saved
     buffer (``fused_moe_train``) or, when only the inputs were saved (``fused_moe``), recomputed
     on the segment; the activation is recomputed from h (elementwise, cheap), then
        FC2 wgrad   dW2 = do^T a            (GEMM on the expert's own weight; no stacking copy)
        FC2 dgrad   da  = dy W2
        routing     dg  = <dy, FFN_e(x)> (output) / <da, a> (between) / <dxin, x> (input)
        act bwd     dh  = act'(h) da        (aten's silu/gelu/threshold backward, clamp masks)
        FC1 wgrad   dW1 = dh^T xin
        FC1 dgrad   dxin = dh W1            written into its rows of one [S', H] buffer;
  4. one ``index_add_`` sums the K input-gradient rows of each token into dx [T, H].

Gradients accumulate in fp32 (fp64 for fp64 inputs, so gradcheck sees the exact formula) and are
returned in each input's dtype.  Experts with no tokens get zero gradients; inputs that do not
need a gradient (frozen experts, frozen router) are skipped and come back as ``None``.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels import cpu_memory
from moe_compile.kernels.cpu import expert_linear, gather_rows, sort_by_expert
from moe_compile.kernels.reference import compute_dtype, gated_activation

ROLES = ("fc1", "fc1_up", "fc2", "fc1_bias", "fc1_up_bias", "fc2_bias")


@dataclasses.dataclass
class Needs:
    """Which inputs need a gradient; each role holds one bool per tensor it was given."""

    x: bool
    topk_weights: bool
    roles: dict  # role name -> list[bool]

    def any_weight(self, role: str) -> bool:
        return any(self.roles[role])


class _RoleGrad:
    """Gradient buffers of one role, in the compute dtype; a stacked role gets one buffer."""

    def __init__(self, role: tuple, needs: list, stacked_dim: int, cdt: torch.dtype, device):
        self.role, self.needs = role, needs
        self.stacked = len(role) == 1 and role[0].dim() == stacked_dim
        # Uninitialised: every slot handed out by of() is overwritten by its expert's GEMM or sum;
        # result() zeroes the rest (experts without tokens).  Zero-filling all of it up front cost
        # ~10% of a fine-grained (E=64) training step on the 2-core CI VM.
        self.bufs = [
            cpu_memory.empty(t.shape, cdt, device) if need else None for t, need in zip(role, needs)
        ]
        self.written: set[int] = set()

    def _slot(self, e: int):
        if self.stacked:
            return None if self.bufs[0] is None else self.bufs[0][e]
        return self.bufs[e]

    def of(self, e: int):
        """The [out, in] / [in, out] / [n] gradient slot of expert e, or None when not needed."""
        if not self.role:
            return None
        slot = self._slot(e)
        if slot is not None:
            self.written.add(e)
        return slot

    def result(self) -> list:
        experts = self.bufs[0].shape[0] if self.stacked and self.bufs[0] is not None else len(self.bufs)
        for e in range(experts if self.role else 0):
            slot = self._slot(e)
            if e not in self.written and slot is not None:
                slot.zero_()
        return [None if b is None else b.to(t.dtype) for b, t in zip(self.bufs, self.role)]


def _gate_up_views(t: torch.Tensor, attrs: FFNAttrs):
    if attrs.gate_up == "interleaved":
        return t[:, 0::2], t[:, 1::2]
    return t.chunk(2, dim=-1)


def _act_backward(grad: torch.Tensor, h: torch.Tensor, name: str) -> torch.Tensor:
    if name == "silu":
        return torch.ops.aten.silu_backward(grad, h)
    if name == "relu":
        return torch.ops.aten.threshold_backward(grad, torch.relu(h), 0)
    if name == "gelu":
        return torch.ops.aten.gelu_backward(grad, h)
    if name == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, h, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}")


def gated_activation_backward(h: torch.Tensor, da: torch.Tensor, attrs: FFNAttrs) -> torch.Tensor:
    """d act / d h: FC1 output h [n, F2] and upstream da [n, F] -> dh [n, F2] (h's layout)."""
    if attrs.gate_up == "none":
        return _act_backward(da, h, attrs.activation)
    gate, up = _gate_up_views(h, attrs)  # [n, F] each
    clamp = attrs.limit > 0
    gc = gate.clamp(max=attrs.limit) if clamp else gate
    uc = up.clamp(-attrs.limit, attrs.limit) if clamp else up
    if attrs.activation == "gptoss":
        s = torch.sigmoid(gc * attrs.alpha)
        d_up = da * (gc * s)
        d_gate = da * (uc + 1) * (s + gc * attrs.alpha * s * (1 - s))
    else:
        d_up = da * _act_fwd(gc, attrs.activation)
        d_gate = _act_backward(da * uc, gc, attrs.activation)
    if clamp:  # clamp passes the gradient where min <= v <= max (torch's convention)
        d_gate = d_gate * (gate <= attrs.limit)
        d_up = d_up * ((up >= -attrs.limit) & (up <= attrs.limit))
    dh = torch.empty_like(h)
    dg_view, du_view = _gate_up_views(dh, attrs)
    dg_view.copy_(d_gate)
    du_view.copy_(d_up)
    return dh


def _act_fwd(h, name):
    return gated_activation(h, FFNAttrs(gate_up="none", activation=name))


def _w(t: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    return t if t.dtype == cdt else t.to(cdt)


def _mm_t(a, w, transposed: bool):
    """a [n, out] times the stored weight back to [n, in] (the dgrad of ``x @ W`` / ``F.linear``)."""
    return a @ w.t() if transposed else a @ w


def _wgrad(dout, inp, transposed: bool, out) -> None:
    """Weight gradient into ``out`` in the stored layout: [out, in] = dout^T inp, or its transpose."""
    if transposed:
        torch.mm(inp.t(), dout, out=out)
    else:
        torch.mm(dout.t(), inp, out=out)


def _fwd(x, w, transposed: bool):
    """x [n, in] times the stored weight -> [n, out]: the forward's own GEMM (same orientation
    choice for skinny segments, so the recompute costs what the forward did)."""
    return expert_linear(x, w, transposed)


def _fc1_recompute(xin, w: ExpertWeights, e: int, cdt):
    """FC1 of expert e recomputed on its segment -> h [n, F2] (gate|up halves for "separate")."""
    h = _fwd(xin, _w(w.fc1_of(e), cdt), w.transposed)
    if w.fc1_bias:
        h = h + _w(w.fc1_bias_of(e), cdt)
    if w.fc1_up:
        up = _fwd(xin, _w(w.fc1_up_of(e), cdt), w.transposed)
        if w.fc1_up_bias:
            up = up + _w(w.fc1_up_bias_of(e), cdt)
        h = torch.cat([h, up], dim=1)  # [n, 2F]
    return h


@dataclasses.dataclass
class _Grads:
    fc1: _RoleGrad
    fc1_up: _RoleGrad
    fc2: _RoleGrad
    fc1_bias: _RoleGrad
    fc1_up_bias: _RoleGrad
    fc2_bias: _RoleGrad


def _segment_backward(xs, dys, g, w: ExpertWeights, attrs: FFNAttrs, e: int, grads: _Grads,
                      dxs_out, dg_out, cdt, h_saved=None) -> None:
    """Expert e's rows: xs, dys [n, H], g [n, 1], FC1's saved output h_saved [n, F2] or None;
    writes dx rows [n, H] and dg [n] when asked."""
    on = attrs.weight_on
    per_expert = [getattr(grads, r).of(e) for r in ROLES]
    if dxs_out is None and dg_out is None and all(t is None for t in per_expert):
        return  # frozen expert and nothing else asked of it
    xin = xs * g if on == "input" else xs  # [n, H]
    h = _fc1_recompute(xin, w, e, cdt) if h_saved is None else _w(h_saved, cdt)  # [n, F2]
    a = gated_activation(h, attrs)  # [n, F]
    w2 = _w(w.fc2_of(e), cdt)
    gw2, gb2 = grads.fc2.of(e), grads.fc2_bias.of(e)
    if gw2 is not None or gb2 is not None:
        do = dys * g if on == "output" else dys  # [n, H]
        if gw2 is not None:
            _wgrad(do, a * g if on == "between" else a, w.transposed, gw2)
        if gb2 is not None:
            torch.sum(do, 0, out=gb2)
    g1, g1u, gb1, gb1u = (grads.fc1.of(e), grads.fc1_up.of(e), grads.fc1_bias.of(e), grads.fc1_up_bias.of(e))
    need_dh = dxs_out is not None or any(t is not None for t in (g1, g1u, gb1, gb1u))
    need_dh = need_dh or (dg_out is not None and on == "input")
    if not need_dh and dg_out is None:
        return
    da = _mm_t(dys, w2, w.transposed)  # [n, F]  = dy W2 (unscaled by g)
    if dg_out is not None and on != "input":
        torch.sum(da * a, dim=1, out=dg_out)  # <dy W2, a> = <dy, a W2^T>
        if on == "output" and w.fc2_bias:
            dg_out.add_(dys @ _w(w.fc2_bias_of(e), cdt))  # + <dy, b2>
    if not need_dh:
        return
    if on != "input":
        da = da * g
    dh = gated_activation_backward(h, da, attrs)  # [n, F2]
    del h, a
    if w.fc1_up:
        dh_gate, dh_up = dh.chunk(2, dim=1)  # [n, F] each
    else:
        dh_gate, dh_up = dh, None
    if g1 is not None:
        _wgrad(dh_gate, xin, w.transposed, g1)
    if gb1 is not None:
        torch.sum(dh_gate, 0, out=gb1)
    if g1u is not None:
        _wgrad(dh_up, xin, w.transposed, g1u)
    if gb1u is not None:
        torch.sum(dh_up, 0, out=gb1u)
    if dxs_out is None and not (dg_out is not None and on == "input"):
        return
    dxin = _mm_t(dh_gate, _w(w.fc1_of(e), cdt), w.transposed)  # [n, H]
    if dh_up is not None:
        dxin = dxin + _mm_t(dh_up, _w(w.fc1_up_of(e), cdt), w.transposed)
    if on == "input":
        if dg_out is not None:
            torch.sum(dxin * xs, dim=1, out=dg_out)
        dxin = dxin * g
    if dxs_out is not None:
        dxs_out.copy_(dxin)


def fused_moe_backward_cpu(
    grad_y: torch.Tensor,  # [T, H]
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    w: ExpertWeights,
    attrs: FFNAttrs,
    needs: Needs,
    fc1_out: torch.Tensor | None = None,  # [T*K, F2] saved by fused_moe_train, or None: recompute
):
    """Gradients of ``fused_moe``: (dx | None, dtopk_weights | None, {role: [grad | None, ...]})."""
    T, H = x.shape
    K = topk_ids.shape[1]
    cdt = compute_dtype(x.dtype)
    dev = x.device
    grads = _Grads(**{
        r: _RoleGrad(getattr(w, r), needs.roles[r], 2 if r.endswith("bias") else 3, cdt, dev) for r in ROLES
    })
    dx = torch.zeros(T, H, dtype=cdt, device=dev) if needs.x else None
    dg_flat = torch.zeros(T * K, dtype=cdt, device=dev) if needs.topk_weights else None  # [S]
    if T > 0 and K > 0:
        _run_segments(grad_y, x, topk_ids, topk_weights, w, attrs, grads, dx, dg_flat, cdt, fc1_out)
    roles = {r: getattr(grads, r).result() for r in ROLES}
    dx = None if dx is None else dx.to(x.dtype)
    dg = None if dg_flat is None else dg_flat.view(T, K).to(topk_weights.dtype)
    return dx, dg, roles


def _run_segments(grad_y, x, topk_ids, topk_weights, w, attrs, grads, dx, dg_flat, cdt, fc1_out) -> None:
    K = topk_ids.shape[1]
    order, bounds = sort_by_expert(topk_ids, w.num_experts)
    valid = order[bounds[0] : bounds[-1]]  # [S'] slots with an id in [0, E)
    tokens = valid // K  # [S']
    xs = _w(gather_rows(x, tokens), cdt)  # [S', H]
    dys = _w(gather_rows(grad_y, tokens), cdt)  # [S', H]
    gs = _w(topk_weights.reshape(-1).index_select(0, valid), cdt)[:, None]  # [S', 1]
    dxs = cpu_memory.empty(xs.shape, xs.dtype, xs.device) if dx is not None else None  # [S', H]
    dgs = torch.empty(xs.shape[0], dtype=cdt, device=x.device) if dg_flat is not None else None  # [S']
    base = bounds[0]
    for e in range(w.num_experts):
        lo, hi = bounds[e] - base, bounds[e + 1] - base
        if hi == lo:
            continue  # no tokens: its gradient buffers stay zero
        _segment_backward(
            xs[lo:hi], dys[lo:hi], gs[lo:hi], w, attrs, e, grads,
            None if dxs is None else dxs[lo:hi], None if dgs is None else dgs[lo:hi], cdt,
            None if fc1_out is None else fc1_out[lo:hi],  # rows in the forward's (same) sorted order
        )
    if dx is not None:
        dx.index_add_(0, tokens, dxs)  # the K input-gradient rows of each token summed at once
    if dg_flat is not None:
        dg_flat.index_copy_(0, valid, dgs)
