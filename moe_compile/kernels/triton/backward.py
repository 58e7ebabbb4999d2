"""Backward of the fused MoE op on the GPU, on the forward's sorted / padded layout (align.py).

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots,
         F2 = 2F (the gated FC1 width), P_max the bound on padded rows (align.py).

Supported: gate_up concat / interleaved / separate, activation silu without clamp, weight_on
"output" or "between", no biases, stacked or per-expert (pointer table) weights, [out, in] or
transposed storage, fp16 / bf16 / fp32.  Everything else (``unsupported_reason``) goes to the
plain-torch segment backward (kernels/cpu/backward.py), which also runs on CUDA tensors.

For both supported weight placements the formulas coincide (a = silu(gate) * up, g the routing
weight of the slot, dy the gradient of y at the slot's token):

    dA_raw = dy W2                       [S, F]   FC2 dgrad (W2 of the slot's expert)
    dg     = <dA_raw, a>                 [S]      routing-weight gradient, = <dy, FFN_e(x)> for "output"
    dA     = g * dA_raw                           (g multiplies either FC2's input or its output)
    dH     = SwiGLU'(gate, up) dA        [S, F2]  d gate = dA up s (1 + gate (1 - s)), d up = dA silu(gate)
    dx     = sum_k dH W1                 [T, H]   FC1 dgrad, combined over K like the forward
    dW2[e] = sum_{s in e} dy_s^T (g a)_s          FC2 wgrad
    dW1[e] = sum_{s in e} dH_s^T x_s              FC1 wgrad

Kernels (4 launches + the forward's align and combine):

  1. ``_dgrad_fc2_kernel``  one output tile [BLOCK_M slots, BLOCK_N of F] per program, walking H:
     three accumulators — dy·W2 (FC2 dgrad) and x·W1_gate, x·W1_up (FC1 *recomputed*: nothing of
     the forward is saved; the recompute shares the gathered-row loop over H, costing two more B
     tiles per step and 2·S·H·F FLOPs, against saving [S, 2F] activations per layer).  The
     epilogue forms a, writes g·a [S, F] (for dW2), dH [S, F2] in FC1's own column layout, and the
     row-wise dot <dA_raw, a> of its F columns into a [S, F / BLOCK_N] fp32 partial buffer that is
     summed afterwards (deterministic: no atomics).
  2. FC1 dgrad: the forward's grouped GEMM (grouped_gemm.py) with A = dH and B = W1 read the other
     way round (the ``transposed`` flag flipped) -> [S, H] rows at the slot, then the forward's
     combine sums the K rows of each token in fp32 (deterministic).  gate_up="separate" runs it
     for gate and up and adds the two [S, H] results.
  3. ``_wgrad_kernel``  per (expert, output tile): walks that expert's padded segment of sorted
     slots in BLOCK_K-row steps, [BLOCK_M, rows] x [rows, BLOCK_N] with rows gathered from
     dy / x (by slot // K) or g·a / dH (by slot), fp32 accumulation over the whole segment in
     registers, cast once into the gradient in the weight's stored layout (stacked buffer or one
     tensor per expert through a pointer table).  Experts with no rows get zeros; no atomics.

Intermediates are kept in the input dtype (like the forward's activation), accumulation in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_compile.ir import ROLES, ExpertWeights, FFNAttrs
from moe_compile.kernels.triton import autotune
from moe_compile.kernels.triton.align import align_by_expert
from moe_compile.kernels.triton.fused_moe import _launch_gemm, _weight_operand, combine, unsupported_reason as _fwd_reason
from moe_compile.kernels.triton.grouped_gemm import ACT_NONE, SCALE_NONE, _expert_base, _sigmoid, tile_of_program


# -- kernels -------------------------------------------------------------------------------------


@triton.jit
def _dgrad_fc2_kernel(
    dy_ptr, x_ptr,  # [T, H] each, gathered by slot // K
    w2_ptr, w2_table, w1_ptr, w1_table, wu_ptr, wu_table,  # W2, W1 (gate / fused), W1 up
    g_ptr,  # [S] routing weights
    sorted_ptr, block_expert_ptr, total_ptr,  # align.py
    dh_ptr, ag_ptr, dgp_ptr,  # out: dH [S, F2], g*a [S, F], dg partials [S, cdiv(F, BLOCK_N)] fp32
    F, H, S, K,
    stride_dym, stride_dyk, stride_xm, stride_xk,
    stride_w2e, stride_w2n, stride_w2k,  # W2 element (n = f, k = h)
    stride_w1e, stride_w1n, stride_w1k,  # W1 element (n = f, k = h)
    stride_wue, stride_wun, stride_wuk,
    stride_dhm, stride_agm, stride_dgpm,
    up_row_off, dh_up_off,  # W1 row of up column n: n*ROW_STEP + up_row_off; dH column likewise
    ROW_STEP: tl.constexpr,
    W2_TABLE: tl.constexpr, W1_TABLE: tl.constexpr, WU_TABLE: tl.constexpr,
    NEED_DH: tl.constexpr, NEED_AG: tl.constexpr, NEED_DG: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = tile_of_program(F, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + offs_m)  # [BM]
    row_ok = slots < S
    e = tl.load(block_expert_ptr + pid_m)
    tok = (slots // K).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    dy_ptrs = dy_ptr + tok[:, None] * stride_dym + offs_k[None, :] * stride_dyk  # [BM, BK]
    x_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :] * stride_xk

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < F
    n64 = offs_n.to(tl.int64)
    gate_rows = n64 * ROW_STEP
    up_rows = gate_rows + up_row_off
    w2_ptrs = _expert_base(w2_ptr, w2_table, e, stride_w2e, W2_TABLE) + n64[None, :] * stride_w2n + offs_k[:, None] * stride_w2k
    w1_ptrs = _expert_base(w1_ptr, w1_table, e, stride_w1e, W1_TABLE) + gate_rows[None, :] * stride_w1n + offs_k[:, None] * stride_w1k
    wu_ptrs = _expert_base(wu_ptr, wu_table, e, stride_wue, WU_TABLE) + up_rows[None, :] * stride_wun + offs_k[:, None] * stride_wuk
    acc_da = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < H - k0
        a_mask = row_ok[:, None] & k_ok[None, :]
        b_mask = k_ok[:, None] & col_ok[None, :]
        dy = tl.load(dy_ptrs, mask=a_mask, other=0.0)
        xa = tl.load(x_ptrs, mask=a_mask, other=0.0)
        acc_da = tl.dot(dy, tl.load(w2_ptrs, mask=b_mask, other=0.0), acc_da, input_precision=DOT_PRECISION)
        acc_g = tl.dot(xa, tl.load(w1_ptrs, mask=b_mask, other=0.0), acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(xa, tl.load(wu_ptrs, mask=b_mask, other=0.0), acc_u, input_precision=DOT_PRECISION)
        dy_ptrs += BLOCK_K * stride_dyk
        x_ptrs += BLOCK_K * stride_xk
        w2_ptrs += BLOCK_K * stride_w2k
        w1_ptrs += BLOCK_K * stride_w1k
        wu_ptrs += BLOCK_K * stride_wuk

    # -- epilogue: SwiGLU forward (recomputed) and backward, routing-weight dot ------------------
    s = _sigmoid(acc_g)
    silu = acc_g * s
    act = silu * acc_u  # [BM, BN]
    g = tl.load(g_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    slots64 = slots.to(tl.int64)
    out_mask = row_ok[:, None] & col_ok[None, :]
    if NEED_DG:
        part = tl.sum(acc_da * act, axis=1)  # [BM]  (masked columns are 0 in both)
        tl.store(dgp_ptr + slots64 * stride_dgpm + pid_n, part, mask=row_ok)
    if NEED_AG:
        tl.store(ag_ptr + slots64[:, None] * stride_agm + offs_n[None, :], (act * g).to(ag_ptr.dtype.element_ty), mask=out_mask)
    if NEED_DH:
        da = acc_da * g
        d_up = da * silu
        d_gate = da * acc_u * s * (1.0 + acc_g * (1.0 - s))
        dh_row = dh_ptr + slots64[:, None] * stride_dhm
        tl.store(dh_row + gate_rows[None, :], d_gate.to(dh_ptr.dtype.element_ty), mask=out_mask)
        tl.store(dh_row + (gate_rows + dh_up_off)[None, :], d_up.to(dh_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _wgrad_kernel(
    l_ptr, r_ptr,  # L rows [*, N] (gathered by slot // L_ROW_DIV), R rows [*, M] (slot // R_ROW_DIV)
    out_ptr, out_table,  # gradient: out[e][n, m] = sum over e's slots of L[row, n] * R[row, m]
    sorted_ptr, segments_ptr,  # align.py (with_segments): starts [E], then padded rows [E]
    N, M, S, E,
    stride_lm, stride_ln, stride_rm, stride_rk,
    stride_oe, stride_on, stride_om,
    L_ROW_DIV: tl.constexpr, R_ROW_DIV: tl.constexpr, OUT_TABLE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # BLOCK_M covers N (the gradient's rows), BLOCK_N covers M, BLOCK_K the expert's slots.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_M)
    tiles_m = tl.cdiv(M, BLOCK_N)
    e = pid // (tiles_n * tiles_m)  # expert-major: an expert's tiles run together (rows stay in L2)
    t = pid % (tiles_n * tiles_m)
    pid_n = t // tiles_m
    pid_m = t % tiles_m
    start = tl.load(segments_ptr + e)
    rows = tl.load(segments_ptr + E + e)

    offs_n = pid_n * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m = pid_m * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    m_ok = offs_m < M
    offs_r = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_K):
        slots = tl.load(sorted_ptr + start + r0 + offs_r, mask=offs_r < rows - r0, other=S)
        ok = slots < S
        lrow = (slots // L_ROW_DIV).to(tl.int64)
        rrow = (slots // R_ROW_DIV).to(tl.int64)
        lt = tl.load(l_ptr + lrow[None, :] * stride_lm + offs_n[:, None] * stride_ln, mask=ok[None, :] & n_ok[:, None], other=0.0)
        rt = tl.load(r_ptr + rrow[:, None] * stride_rm + offs_m[None, :] * stride_rk, mask=ok[:, None] & m_ok[None, :], other=0.0)
        acc = tl.dot(lt, rt, acc, input_precision=DOT_PRECISION)  # [BM, BK] x [BK, BN]
    base = _expert_base(out_ptr, out_table, e, stride_oe, OUT_TABLE)
    ptrs = base + offs_n.to(tl.int64)[:, None] * stride_on + offs_m.to(tl.int64)[None, :] * stride_om
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


# -- host side -----------------------------------------------------------------------------------


def unsupported_reason(grad_y, x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs) -> str | None:
    """Why the Triton backward cannot run these inputs (the torch segment backward then does)."""
    reason = _fwd_reason(x, topk_ids, w, attrs)
    if reason is not None:
        return reason
    if attrs.gate_up not in ("concat", "interleaved", "separate"):
        return f"gate_up={attrs.gate_up!r} (backward kernels: concat, interleaved, separate)"
    if attrs.activation != "silu" or attrs.limit > 0:
        return f"activation {attrs.activation!r} with limit {attrs.limit} (backward kernels: silu, no clamp)"
    if attrs.weight_on not in ("output", "between"):
        return f"weight_on={attrs.weight_on!r} (backward kernels: output, between)"
    if w.fc1_bias or w.fc1_up_bias or w.fc2_bias:
        return "biases (backward kernels: none)"
    if grad_y.shape != x.shape or grad_y.dtype != x.dtype or grad_y.device != x.device:
        return "grad_y differs from x in shape, dtype or device"
    return None


def _grad_role(role, need: list, device):
    """-> (list of output tensors or None per tensor, (first, table, stride_e, s0, s1)) for a weight
    role's gradient in its stored layout; None when no tensor of the role needs a gradient."""
    if not role or not any(need):
        return None
    if len(role) == 1 and role[0].dim() == 3:
        out = torch.empty(role[0].shape, dtype=role[0].dtype, device=device)
        return [out], (out, None, out.stride(0), out.stride(1), out.stride(2))
    outs = [torch.empty(t.shape, dtype=t.dtype, device=device) for t in role]
    item = outs[0].element_size()
    offsets = [(o.data_ptr() - outs[0].data_ptr()) // item for o in outs]
    table = torch.tensor(offsets, dtype=torch.int64, device=device)
    return outs, (outs[0], table, 0, outs[0].stride(0), outs[0].stride(1))


def _launch_wgrad(l, r, n, m, grad, align, E, S, l_div, r_div, transposed, cfg):
    """out[e] (stored [n, m], or [m, n] when transposed) = L^T R over expert e's slots."""
    sorted_slots, _, _, segments = align
    out, table, s_e, s0, s1 = grad
    s_n, s_m = (s1, s0) if transposed else (s0, s1)
    grid = (E * triton.cdiv(n, cfg.BLOCK_M) * triton.cdiv(m, cfg.BLOCK_N),)
    _wgrad_kernel[grid](
        l, r, out, table if table is not None else out, sorted_slots, segments,
        n, m, S, E,
        l.stride(0), l.stride(1), r.stride(0), r.stride(1), s_e, s_n, s_m,
        L_ROW_DIV=l_div, R_ROW_DIV=r_div, OUT_TABLE=table is not None,
        DOT_PRECISION="ieee" if l.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


class _Plan:
    """Buffers and launches of one backward call; each stage can be rerun with another tile config
    (the autotuner times the stages one by one)."""

    def __init__(self, grad_y, x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, needs):
        self.T, self.H = x.shape
        self.K = topk_ids.shape[1]
        self.E, self.F, self.S = w.num_experts, w.ffn(), self.T * self.K
        self.x, self.w, self.attrs, self.needs = x, w, attrs, needs
        self.dy = grad_y if grad_y.is_contiguous() else grad_y.contiguous()
        self.ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        self.g = topk_weights.reshape(-1).contiguous()
        dev = x.device
        self.grad_fc1 = _grad_role(w.fc1, needs.roles["fc1"], dev)
        self.grad_up = _grad_role(w.fc1_up, needs.roles["fc1_up"], dev)
        self.grad_fc2 = _grad_role(w.fc2, needs.roles["fc2"], dev)
        self.need_dh = needs.x or self.grad_fc1 is not None or self.grad_up is not None
        self.need_ag = self.grad_fc2 is not None
        self.need_dg = needs.topk_weights
        S, F = self.S, self.F
        self.dh = x.new_empty(S, 2 * F) if self.need_dh else x.new_empty(1, 1)
        self.ag = x.new_empty(S, F) if self.need_ag else x.new_empty(1, 1)
        self.dgp = None
        self.dxs = None
        self.align = None

    # stage 1: align (its BLOCK_M is the dgrad tiles') + FC2 dgrad with FC1 recompute
    def dgrad(self, cfg):
        w, attrs, S, F, H = self.w, self.attrs, self.S, self.F, self.H
        self.align = align_by_expert(self.ids, self.E, cfg.BLOCK_M, with_segments=True)
        sorted_slots, block_expert, total, _ = self.align
        n_tiles = triton.cdiv(F, cfg.BLOCK_N)
        if self.need_dg:
            self.dgp = torch.zeros(S, n_tiles, dtype=torch.float32, device=self.x.device)
        dgp = self.dgp if self.need_dg else self.ag
        dev = self.x.device
        # W2 [H, F] (or [F, H] transposed) read as B[h, f]: n = f is the stored "in" dim.
        w2, w2t, w2e, w2_out, w2_in = _weight_operand(w.fc2, w.transposed, dev)
        w1, w1t, w1e, w1_out, w1_in = _weight_operand(w.fc1, w.transposed, dev)
        if attrs.gate_up == "separate":
            wu, wut, wue, wu_out, wu_in = _weight_operand(w.fc1_up, w.transposed, dev)
            up_row_off, dh_up_off, row_step = 0, F, 1
        else:
            wu, wut, wue, wu_out, wu_in = w1, w1t, w1e, w1_out, w1_in
            interleaved = attrs.gate_up == "interleaved"
            up_row_off = dh_up_off = 1 if interleaved else F
            row_step = 2 if interleaved else 1
        grid = (block_expert.numel() * n_tiles,)
        _dgrad_fc2_kernel[grid](
            self.dy, self.x, w2, w2t if w2t is not None else w2, w1, w1t if w1t is not None else w1,
            wu, wut if wut is not None else wu, self.g, sorted_slots, block_expert, total,
            self.dh, self.ag, dgp, F, H, S, self.K,
            self.dy.stride(0), self.dy.stride(1), self.x.stride(0), self.x.stride(1),
            w2e, w2_in, w2_out, w1e, w1_out, w1_in, wue, wu_out, wu_in,
            self.dh.stride(0), self.ag.stride(0), dgp.stride(0),
            up_row_off, dh_up_off,
            ROW_STEP=row_step, W2_TABLE=w2t is not None, W1_TABLE=w1t is not None, WU_TABLE=wut is not None,
            NEED_DH=self.need_dh, NEED_AG=self.need_ag, NEED_DG=self.need_dg,
            DOT_PRECISION="ieee" if self.x.dtype == torch.float32 else "tf32",
            **cfg.launch_kwargs(),
        )

    # stage 2: FC1 dgrad dH W1 -> [S, H] slot rows (combined over K in result())
    def dx_rows(self, cfg):
        if not self.needs.x:
            return
        w, F, H, S = self.w, self.F, self.H, self.S
        kw = dict(transposed=not w.transposed, gated=False, activation=ACT_NONE, clamp=False, scale=SCALE_NONE,
                  row_step=1, up_row_off=0, limit=0.0, alpha=0.0)
        self.dxs = self.x.new_empty(S, H)
        if self.attrs.gate_up == "separate":
            _launch_gemm(self.dh[:, :F], self.dxs, w.fc1, (), (), (), self.g, self.align[:3], H, F, S, 1, cfg, **kw)
            up = self.x.new_empty(S, H)
            _launch_gemm(self.dh[:, F:], up, w.fc1_up, (), (), (), self.g, self.align[:3], H, F, S, 1, cfg, **kw)
            self.dxs += up
        else:
            _launch_gemm(self.dh, self.dxs, w.fc1, (), (), (), self.g, self.align[:3], H, 2 * F, S, 1, cfg, **kw)

    # stage 3: weight gradients per expert
    def wgrad(self, cfg):
        w, F, H, S, E, K = self.w, self.F, self.H, self.S, self.E, self.K
        if self.grad_fc2 is not None:  # dW2[h, f] = sum dy[t, h] (g a)[s, f]
            _launch_wgrad(self.dy, self.ag, H, F, self.grad_fc2[1], self.align, E, S, K, 1, w.transposed, cfg)
        if self.attrs.gate_up == "separate":
            if self.grad_fc1 is not None:
                _launch_wgrad(self.dh[:, :F], self.x, F, H, self.grad_fc1[1], self.align, E, S, 1, K, w.transposed, cfg)
            if self.grad_up is not None:
                _launch_wgrad(self.dh[:, F:], self.x, F, H, self.grad_up[1], self.align, E, S, 1, K, w.transposed, cfg)
        elif self.grad_fc1 is not None:  # dH is in FC1's own column layout: one GEMM of width 2F
            _launch_wgrad(self.dh, self.x, 2 * F, H, self.grad_fc1[1], self.align, E, S, 1, K, w.transposed, cfg)

    def result(self):
        needs, T, K = self.needs, self.T, self.K
        dx = combine(self.dxs, self.ids, self.E) if needs.x else None
        dg = None
        if needs.topk_weights:
            dg = self.dgp.sum(dim=1).view(T, K).to(self.g.dtype)
        roles = {}
        for name, grad in (("fc1", self.grad_fc1), ("fc1_up", self.grad_up), ("fc2", self.grad_fc2)):
            role = getattr(self.w, name)
            need = needs.roles[name]
            outs = grad[0] if grad is not None else [None] * len(role)
            if len(outs) == 1 and len(role) == 1:
                roles[name] = outs if need[0] else [None]
            else:
                roles[name] = [o if n else None for o, n in zip(outs, need)]
        for name in ("fc1_bias", "fc1_up_bias", "fc2_bias"):
            roles[name] = [None] * len(getattr(self.w, name))
        return dx, dg, roles


# -- tile configs --------------------------------------------------------------------------------

# dgrad (3 accumulators, 2 A + 3 B tiles per stage): at most 64 x 128 per 8 warps on sm90.
DGRAD_PREFILL = (
    autotune.TileConfig(64, 128, 64, 8, num_warps=8, num_stages=3),
    autotune.TileConfig(128, 64, 64, 8, num_warps=8, num_stages=3),
)
DGRAD_DECODE = (
    autotune.TileConfig(16, 64, 128, 1, num_warps=4, num_stages=3),
    autotune.TileConfig(16, 128, 64, 1, num_warps=4, num_stages=3),
)
# FC1 dgrad (one accumulator): BLOCK_M is replaced by the dgrad stage's (same align).
DX_CONFIGS = (
    autotune.TileConfig(128, 128, 64, 8, num_warps=8, num_stages=4),
    autotune.TileConfig(128, 256, 64, 8, num_warps=8, num_stages=3),
)
# wgrad: BLOCK_M x BLOCK_N output tile of the weight gradient, BLOCK_K slots per step.
WGRAD_CONFIGS = (
    autotune.TileConfig(128, 128, 64, 1, num_warps=8, num_stages=3),
    autotune.TileConfig(128, 256, 64, 1, num_warps=8, num_stages=3),
)
INTERPRETER_CONFIG = autotune.INTERPRETER_CONFIG


def _fit(configs, item, limit, a_tiles, b_tiles, block_m=None):
    out = []
    for cfg in configs:
        if block_m is not None:
            cfg = autotune.TileConfig(block_m, cfg.BLOCK_N, cfg.BLOCK_K, cfg.GROUP_M, cfg.num_warps, cfg.num_stages)
        while (a_tiles * cfg.BLOCK_M * cfg.BLOCK_K + b_tiles * cfg.BLOCK_K * cfg.BLOCK_N) * item * cfg.num_stages > limit:
            if cfg.num_stages > 2:
                cfg = autotune.TileConfig(cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.GROUP_M, cfg.num_warps, cfg.num_stages - 1)
            elif cfg.BLOCK_K > 16:
                cfg = autotune.TileConfig(cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K // 2, cfg.GROUP_M, cfg.num_warps, cfg.num_stages)
            else:
                break
        out.append(cfg)
    return tuple(dict.fromkeys(out))


def fused_moe_backward_triton(grad_y, x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, needs, configs=None):
    """Gradients like ``cpu_backward.fused_moe_backward_cpu``: (dx | None, dg | None, {role: [grad | None]}).

    ``needs`` is a ``cpu_backward.Needs``; ``configs`` an optional (dgrad, dx, wgrad) TileConfig
    triple (default: tuned per shape and cached, like the forward).  Raises NotImplementedError on
    inputs ``unsupported_reason`` refuses."""
    reason = unsupported_reason(grad_y, x, topk_ids, topk_weights, w, attrs)
    if reason is not None:
        raise NotImplementedError(f"fused_moe_backward_triton: {reason}")
    T, H = x.shape
    K = topk_ids.shape[1]
    plan = _Plan(grad_y, x, topk_ids, topk_weights, w, attrs, needs)
    if T == 0 or K == 0:
        return _empty_result(plan)
    if configs is None:
        _tune_and_run(plan)
    else:
        cd, cx, cw = configs
        plan.dgrad(cd)
        plan.dx_rows(_with_block_m(cx, cd.BLOCK_M))
        plan.wgrad(cw)
    return plan.result()


def _empty_result(plan):
    needs, T, K = plan.needs, plan.T, plan.K
    dx = plan.x.new_zeros(T, plan.H) if needs.x else None
    dg = plan.g.new_zeros(T, K) if needs.topk_weights else None
    roles = {}
    for name, grad in (("fc1", plan.grad_fc1), ("fc1_up", plan.grad_up), ("fc2", plan.grad_fc2)):
        role = getattr(plan.w, name)
        roles[name] = [t.new_zeros(t.shape) if n else None for t, n in zip(role, plan.needs.roles[name])]
    for name in ("fc1_bias", "fc1_up_bias", "fc2_bias"):
        roles[name] = [None] * len(getattr(plan.w, name))
    return dx, dg, roles


def _with_block_m(cfg, block_m):
    return autotune.TileConfig(block_m, cfg.BLOCK_N, cfg.BLOCK_K, cfg.GROUP_M, cfg.num_warps, cfg.num_stages)


def _tune_and_run(plan) -> None:
    """Pick each stage's config (cached per shape like the forward's; timed on a miss) and run it.
    The stages are tuned one after another: dx and wgrad need the dgrad stage's align and dH."""
    if autotune.interpreting():
        cfg = INTERPRETER_CONFIG
        plan.dgrad(cfg)
        plan.dx_rows(cfg)
        plan.wgrad(cfg)
        return
    x, w, attrs = plan.x, plan.w, plan.attrs
    layout = f"{attrs.gate_up}|{'T' if w.transposed else 'N'}|{'list' if len(w.fc1) > 1 else 'stacked'}"
    key = autotune.shape_key(x, plan.E, plan.H, plan.F, plan.K, layout)
    item = x.element_size()
    limit = autotune.shared_memory_limit(x.device)
    decode = plan.S / max(plan.E, 1) <= autotune.DECODE_ROWS_PER_EXPERT
    cd = autotune.pick_config("bwd_dgrad|" + key, _fit(DGRAD_DECODE if decode else DGRAD_PREFILL, item, limit, 2, 3), plan.dgrad)
    plan.dgrad(cd)
    cx = autotune.pick_config("bwd_dx|" + key, _fit(DX_CONFIGS, item, limit, 1, 1, block_m=cd.BLOCK_M), plan.dx_rows)
    plan.dx_rows(_with_block_m(cx, cd.BLOCK_M))
    cw = autotune.pick_config("bwd_wgrad|" + key, _fit(WGRAD_CONFIGS, item, limit, 1, 1), plan.wgrad)
    plan.wgrad(cw)
