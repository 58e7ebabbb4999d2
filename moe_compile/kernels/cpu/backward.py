"""Backward of the fused MoE op on the CPU path's sorted, contiguous-segment layout.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots,
         S' the slots whose id lies in [0, E), n the rows of one expert's segment, F2 = FC1 width
         (2F for gated layouts, F for gate_up="none").

Plan (mirrors ``kernels/cpu/forward.py``; one host sync):
  1. the same stable sort by expert (``cpu.sort_by_expert``) -> contiguous segments;
  2. consecutive experts are taken a chunk (<= CHUNK_ROWS rows) at a time: their x and grad_y rows
     are gathered once, in the compute dtype;
  3. FC1's output h [n, F2] is read from the training forward's saved buffer (``fused_moe_train``)
     or, when only the inputs were saved (``fused_moe``), recomputed expert by expert; then, with
     the elementwise steps done once per chunk and the GEMMs once per expert:
        act         a   = act(h)                 (recomputed: elementwise, cheap)
        FC2 wgrad   dW2 = do^T a                 (GEMM into the expert's gradient slot)
        FC2 dgrad   da  = dy W2
        routing     dg  = <da, a> (output, between) / <dxin, x> (input)
        act bwd     dh  = act'(h) (g da)         (aten's silu/gelu/threshold backward, clamp masks)
        FC1 wgrad   dW1 = dh^T xin
        FC1 dgrad   dxin = dh W1;
  4. one ``index_add_`` per chunk sums the input-gradient rows of each token into dx [T, H].

Gradients accumulate in fp32 (fp64 for fp64 inputs, so gradcheck sees the exact formula) and are
returned in each input's dtype.  Experts with no tokens get zero gradients; inputs that do not
need a gradient (frozen experts, frozen router) are skipped and come back as ``None``.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_compile.ir import ROLES, ExpertWeights, FFNAttrs, is_stacked
from moe_compile.kernels.cpu import grad_cache as cpu_grad_cache, memory as cpu_memory, onednn as cpu_onednn
from moe_compile.kernels.cpu.forward import (
    activation_into, chunk_workspace, expert_chunks, expert_linear, sort_by_expert,
)
from moe_compile.kernels.reference import compute_dtype, gated_activation


@dataclasses.dataclass
class Needs:
    """Which inputs need a gradient; each role holds one bool per tensor it was given."""

    x: bool
    topk_weights: bool
    roles: dict  # role name -> list[bool]

    def any_weight(self, role: str) -> bool:
        return any(self.roles[role])


class _RoleGrad:
    """Gradient buffers of one role, in the compute dtype, allocated when first written: a stacked
    role's one buffer on its first expert's write, per-expert tensors each on their expert's write
    (as eager autograd makes them appear), so the backward's peak memory does not start with
    every expert's gradient at once."""

    def __init__(self, role: tuple, needs: list, stacked_dim: int, cdt: torch.dtype, device):
        self.role, self.needs, self.cdt, self.device = role, needs, cdt, device
        self.stacked = is_stacked(role, stacked_dim)
        self.bufs: list = [None] * len(role)
        self.written: set[int] = set()

    def wants(self, e: int) -> bool:
        """Whether expert e's gradient of this role is needed (allocates nothing)."""
        if not self.role:
            return False
        return bool(self.needs[0] if self.stacked else self.needs[e])

    def of(self, e: int):
        """The [out, in] / [in, out] / [n] gradient slot of expert e, or None when not needed."""
        if not self.wants(e):
            return None
        i = 0 if self.stacked else e
        if self.bufs[i] is None:
            # Uninitialised: every slot handed out is overwritten by its expert's GEMM or sum, and
            # result() zeroes the experts never handed out (no tokens).  Zero-filling all of it
            # up front cost ~10% of a fine-grained (E=64) training step on the 2-core CI VM.
            # On ordinary pages: huge pages (madvise) for large stacked gradients faulted in faster
            # alone, but in a process doing other work the kernel compacts memory to find them:
            # fine-grained (E=64) training steps timed round-robin with other steps, 2-core CI VM,
            # T=512: 631 vs 417 ms, T=2048: 1842 vs 1183 ms (Mixtral shape, T=512: 351 vs 262).
            self.bufs[i] = self._new_buffer(self.role[i])
        self.written.add(e)
        return self.bufs[0][e] if self.stacked else self.bufs[e]

    def _new_buffer(self, weight: torch.Tensor) -> torch.Tensor:
        """A stacked gradient returned as it is (compute dtype = the weight's) reuses the last
        step's memory (``cpu_grad_cache``); anything else is a fresh tensor."""
        if self.stacked and self.cdt == weight.dtype:
            return cpu_grad_cache.GRADIENTS.take(weight)
        return torch.empty(weight.shape, dtype=self.cdt, device=self.device)

    def wgrad(self, e: int, dout, inp, transposed: bool) -> None:
        """Expert e's weight gradient, when needed: dout^T inp in the stored layout."""
        slot = self.of(e)
        if slot is not None:
            _wgrad(dout, inp, transposed, slot)

    def result(self) -> list:
        experts = (self.role[0].shape[0] if self.stacked else len(self.role)) if self.role else 0
        for e in range(experts):
            if e not in self.written and self.wants(e):
                self.of(e).zero_()
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


def gated_activation_backward(h: torch.Tensor, da: torch.Tensor, attrs: FFNAttrs,
                              ws: cpu_memory.Workspace | None = None) -> torch.Tensor:
    """d act / d h: FC1 output h [n, F2] and upstream da [n, F] -> dh [n, F2] (h's layout); the
    SwiGLU case writes into ``ws`` buffers when given."""
    if attrs.gate_up == "none":
        return _act_backward(da, h, attrs.activation)
    if attrs.activation == "silu" and attrs.limit <= 0:
        return _swiglu_backward(h, da, attrs, ws)
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


def _swiglu_backward(h: torch.Tensor, da: torch.Tensor, attrs: FFNAttrs, ws: cpu_memory.Workspace | None):
    """The common case, silu(gate) * up, written into dh's halves with two [n, F] temporaries
    (the general path holds five): with s = sigmoid(gate) and t = gate * s = silu(gate),
        d_up   = da * t
        d_gate = da * up * (s + t * (1 - s))    (aten's silu_backward formula)."""
    gate, up = _gate_up_views(h, attrs)  # [n, F] each
    n, width = gate.shape

    def scratch(name, cols):
        return ws.take(name, n, cols) if ws is not None else torch.empty(n, cols, dtype=h.dtype, device=h.device)

    dh = scratch("dh", h.shape[1])
    d_gate, d_up = _gate_up_views(dh, attrs)
    s = torch.sigmoid(gate, out=scratch("s", width))
    t = torch.mul(gate, s, out=d_up)  # silu(gate), then d_up in place
    slope = torch.mul(t, s, out=scratch("tmp", width))
    torch.sub(t, slope, out=slope).add_(s)  # s + t (1 - s): silu'(gate)
    d_up.mul_(da)
    torch.mul(da, up, out=d_gate)
    d_gate.mul_(slope)
    return dh


def _act_fwd(h, name):
    return gated_activation(h, FFNAttrs(gate_up="none", activation=name))


def _w(t: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    return t if t.dtype == cdt else t.to(cdt)


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


def _dgrad(a, w, transposed: bool, out):
    """a [n, out] times the stored weight back to [n, in] (the dgrad of ``x @ W`` / ``F.linear``),
    written into ``out``; on oneDNN for fp32 (E=64, [1024, 1024], 64 rows each: 55 vs 70 ms)."""
    w_in_out = w if transposed else w.t()  # the [in, out] operand, a view of the stored weight
    if cpu_onednn.fits(a, w_in_out):
        return out.copy_(cpu_onednn.linear(a, w_in_out))
    return torch.mm(a, w_in_out.t(), out=out)


@dataclasses.dataclass
class _Chunk:
    """Consecutive experts' rows [lo, hi) of the sorted slots, gathered in the compute dtype."""

    lo: int
    hi: int
    experts: list  # (e, lo, hi) relative to the chunk
    xs: torch.Tensor  # [n, H]
    dys: torch.Tensor  # [n, H]
    g: torch.Tensor  # [n, 1]
    ws: cpu_memory.Workspace  # the call's scratch buffers, sized for its largest chunk

    @property
    def n(self) -> int:
        return self.hi - self.lo


# Elementwise work (activation recompute, its backward, routing-weight scaling) runs once per chunk
# of consecutive experts rather than once per expert: with 64 experts of ~64 rows each, per-expert
# elementwise calls cost more than their arithmetic.  A chunk holds at most this many rows (an
# expert with more rows is a chunk of its own), so the chunk's [n, H] / [n, F2] temporaries stay a
# few MiB and peak memory does not grow with T.
CHUNK_ROWS = 512


def _fc1_rows(chunk: _Chunk, xin, w: ExpertWeights, cdt, fc1_out):
    """h [n, F2]: the forward's saved FC1 output for the chunk's rows, or FC1 recomputed."""
    if fc1_out is not None:
        return _w(fc1_out[chunk.lo : chunk.hi], cdt)
    h = chunk.ws.take("h", chunk.n, w.fc1_width())
    for e, lo, hi in chunk.experts:
        h[lo:hi] = _fc1_recompute(xin[lo:hi], w, e, cdt)
    return h


def _fc2_backward(chunk: _Chunk, a, w: ExpertWeights, on: str, grads: _Grads, cdt):
    """FC2 weight and bias gradients per expert, and da = dy W2 [n, F] (unscaled by g)."""
    needs_w = any(grads.fc2.wants(e) or grads.fc2_bias.wants(e) for e, _, _ in chunk.experts)
    ws = chunk.ws
    scaled = needs_w and on == "output"
    do = torch.mul(chunk.dys, chunk.g, out=ws.take("do", chunk.n, chunk.dys.shape[1])) if scaled else chunk.dys
    a_in = a * chunk.g if needs_w and on == "between" else a  # [n, F]
    da = ws.take("da", chunk.n, a.shape[1])  # [n, F]
    for e, lo, hi in chunk.experts:
        grads.fc2.wgrad(e, do[lo:hi], a_in[lo:hi], w.transposed)
        gb2 = grads.fc2_bias.of(e)
        if gb2 is not None:
            torch.sum(do[lo:hi], 0, out=gb2)
        _dgrad(chunk.dys[lo:hi], _w(w.fc2_of(e), cdt), w.transposed, da[lo:hi])
    return da


def _routing_grad_before_fc1(chunk: _Chunk, a, da, w: ExpertWeights, on: str, cdt):
    """dg [n] for weight_on output / between: <dy W2, a> (= <dy, a W2^T>), + <dy, b2> (output)."""
    dg = torch.mul(da, a, out=chunk.ws.take("tmp", chunk.n, a.shape[1])).sum(dim=1)
    if on == "output" and w.fc2_bias:
        for e, lo, hi in chunk.experts:
            dg[lo:hi] += chunk.dys[lo:hi] @ _w(w.fc2_bias_of(e), cdt)
    return dg


def _fc1_backward(chunk: _Chunk, xin, dh, w: ExpertWeights, grads: _Grads, cdt, dxin):
    """FC1 weight / bias gradients per expert and, into ``dxin`` [n, H] when given, dh W1."""
    if w.fc1_up:
        dh_gate, dh_up = dh.chunk(2, dim=1)  # [n, F] each
    else:
        dh_gate, dh_up = dh, None
    for e, lo, hi in chunk.experts:
        for weight_grad, bias_grad, part in ((grads.fc1, grads.fc1_bias, dh_gate), (grads.fc1_up, grads.fc1_up_bias, dh_up)):
            if part is None:
                continue
            weight_grad.wgrad(e, part[lo:hi], xin[lo:hi], w.transposed)
            bias_slot = bias_grad.of(e)
            if bias_slot is not None:
                torch.sum(part[lo:hi], 0, out=bias_slot)
        if dxin is not None:
            _dgrad(dh_gate[lo:hi], _w(w.fc1_of(e), cdt), w.transposed, dxin[lo:hi])
            if dh_up is not None:  # separate up projection: + dh_up W1_up
                up = _w(w.fc1_up_of(e), cdt)
                dxin[lo:hi].addmm_(dh_up[lo:hi], up.t() if w.transposed else up)


def _chunk_backward(chunk: _Chunk, w: ExpertWeights, attrs: FFNAttrs, grads: _Grads, want_dx: bool,
                    want_dg: bool, cdt, fc1_out):
    """(dx rows [n, H] | None, dg [n] | None) of one chunk; weight gradients go to ``grads``."""
    on = attrs.weight_on
    xin = chunk.xs * chunk.g if on == "input" else chunk.xs  # [n, H]
    h = _fc1_rows(chunk, xin, w, cdt, fc1_out)  # [n, F2]
    a = activation_into(h, attrs, chunk.ws)  # [n, F]
    da = _fc2_backward(chunk, a, w, on, grads, cdt)  # [n, F]
    dg = _routing_grad_before_fc1(chunk, a, da, w, on, cdt) if want_dg and on != "input" else None
    fc1_grads = any(getattr(grads, r).wants(e) for r in ROLES[:2] + ROLES[3:5] for e, _, _ in chunk.experts)
    need_dxin = want_dx or (want_dg and on == "input")
    if not (fc1_grads or need_dxin):
        return None, dg
    if on != "input":
        da.mul_(chunk.g)
    dh = gated_activation_backward(h, da, attrs, chunk.ws)  # [n, F2]
    del h, a, da
    dxin = chunk.ws.take("dxin", chunk.n, chunk.xs.shape[1]) if need_dxin else None  # [n, H]
    _fc1_backward(chunk, xin, dh, w, grads, cdt, dxin)
    if on == "input" and dxin is not None:
        if want_dg:
            dg = (dxin * chunk.xs).sum(dim=1)
        dxin.mul_(chunk.g)
    return (dxin if want_dx else None), dg


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


def _gather(t: torch.Tensor, rows: torch.Tensor, ws: cpu_memory.Workspace, name: str) -> torch.Tensor:
    """t[rows] in the compute dtype, into the workspace buffer ``name``."""
    out = ws.take(name, rows.shape[0], t.shape[1])
    if t.dtype == out.dtype:
        return torch.index_select(t, 0, rows, out=out)
    return out.copy_(torch.index_select(t, 0, rows))


def _run_segments(grad_y, x, topk_ids, topk_weights, w, attrs, grads, dx, dg_flat, cdt, fc1_out) -> None:
    K = topk_ids.shape[1]
    order, bounds = sort_by_expert(topk_ids, w.num_experts)
    base = bounds[0]
    valid = order[base : bounds[-1]]  # [S'] slots with an id in [0, E)
    tokens = valid // K  # [S']
    gs = _w(topk_weights.reshape(-1).index_select(0, valid), cdt)[:, None]  # [S', 1]
    chunks = expert_chunks(bounds, base, CHUNK_ROWS)
    ws = chunk_workspace(chunks, cdt, x.device)
    for lo, hi, rel in chunks:
        tok = tokens[lo:hi]
        chunk = _Chunk(lo, hi, rel, _gather(x, tok, ws, "xs"), _gather(grad_y, tok, ws, "dys"), gs[lo:hi], ws)
        dxs, dgs = _chunk_backward(chunk, w, attrs, grads, dx is not None, dg_flat is not None, cdt, fc1_out)
        if dxs is not None:
            dx.index_add_(0, tok, dxs)  # the chunk's input-gradient rows summed into their tokens
        if dgs is not None:
            dg_flat.index_copy_(0, valid[lo:hi], dgs)
