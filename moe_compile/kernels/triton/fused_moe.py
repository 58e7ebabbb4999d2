"""The fused MoE forward on the GPU: align -> FC1 (+activation) -> FC2 (+routing weight) -> combine.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots,
         P_max the bound on padded rows (align.py).

    align     topk_ids [T, K]                  -> sorted_slots [P_max], block_expert, total [1]
    FC1       x [T, H] gathered by slot // K    -> h [S, F]   (SwiGLU etc. in the epilogue)
    FC2       h [S, F] gathered by slot         -> o [S, H]   (routing weight in the epilogue)
    combine   o [T, K, H]                       -> y [T, H]   (fp32 sum over K, invalid ids skipped)

Combine choice.  FC2 writes each slot's row at its slot index and a small kernel sums the K rows
of each token in fp32.  The alternative, fp32 ``atomic_add`` straight from the FC2 epilogue into a
zeroed [T, H] buffer, saves the [S, H] round trip but needs a memset, an fp32 buffer and a final
cast, and is not deterministic.  The slot buffer + combine (vLLM's moe_sum) is deterministic and
skips ids outside [0, E) without zero-filling anything.  No GPU was available when this was
written: benchmarks/bench_gpu_moe.py reports the combine's share; revisit if it is large.

Everything runs on the device with no host synchronisation: the GEMM grids are sized from shapes
(P_max), and programs past the device-side ``total`` exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.triton import autotune
from moe_compile.kernels.triton.align import align_by_expert
from moe_compile.kernels.triton.grouped_gemm import (
    ACT_NONE,
    ACTIVATION_CODES,
    SCALE_BEFORE_BIAS,
    SCALE_LAST,
    SCALE_NONE,
    grouped_gemm_kernel,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_TABLE_CACHE: dict[tuple, torch.Tensor] = {}
_TABLE_CACHE_SIZE = 256


# -- combine -------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(o_ptr, ids_ptr, y_ptr, H, E, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """y[t, :] = sum_k o[t*K + k, :] over the k whose id is in [0, E); one program per (t, H tile)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(K):
        e = tl.load(ids_ptr + t * K + k)
        ok = (e >= 0) & (e < E)
        acc += tl.load(o_ptr + (t * K + k) * H + offs, mask=(offs < H) & ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * H + offs, acc.to(y_ptr.dtype.element_ty), mask=offs < H)


def combine(o: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """o [S, H] in slot order -> y [T, H]."""
    T, K = topk_ids.shape
    H = o.shape[1]
    y = o.new_empty(T, H)
    block_h = min(1024, triton.next_power_of_2(H))
    _combine_kernel[(T, triton.cdiv(H, block_h))](o, topk_ids, y, H, num_experts, K=K, BLOCK_H=block_h)
    return y


# -- weight operands: stacked tensor or table of per-expert pointers ----------------------------


def _is_stacked(role, dims: int) -> bool:
    return len(role) == 1 and role[0].dim() == dims


def _pointer_table(tensors, device) -> torch.Tensor:
    """int64 [E] device tensor: each expert tensor's address relative to the first one's, in
    elements (grouped_gemm._expert_base adds it to the first tensor's pointer).  Cached: the same
    addresses give the same table, so a model's weights cost one small copy, once."""
    ptrs = tuple(t.data_ptr() for t in tensors)
    item = tensors[0].element_size()
    key = (str(device), item, ptrs)
    table = _TABLE_CACHE.get(key)
    if table is None:
        if len(_TABLE_CACHE) >= _TABLE_CACHE_SIZE:
            _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
        offsets = [(p - ptrs[0]) // item for p in ptrs]  # exact: every address is 16-byte aligned
        table = torch.tensor(offsets, dtype=torch.int64, device=device)
        _TABLE_CACHE[key] = table
    return table


def _weight_operand(role, transposed: bool, device):
    """-> (first tensor, table or None, stride_e, stride_out, stride_in) of a weight role."""
    if _is_stacked(role, 3):
        t = role[0]
        stride_e, s_out, s_in, table = t.stride(0), t.stride(1), t.stride(2), None
    else:
        t = role[0]
        stride_e, s_out, s_in, table = 0, t.stride(0), t.stride(1), _pointer_table(role, device)
    if transposed:
        s_out, s_in = s_in, s_out
    return t, table, stride_e, s_out, s_in


def _bias_operand(role, device):
    """-> (first tensor, table or None, stride_e, stride_n) of a bias role ([E, n] or E x [n])."""
    if _is_stacked(role, 2):
        t = role[0]
        return t, None, t.stride(0), t.stride(1)
    return role[0], _pointer_table(role, device), 0, role[0].stride(0)


def _uniform(role) -> bool:
    first = role[0]
    return all(
        t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype and t.device == first.device
        for t in role
    )


def unsupported_reason(x, topk_ids, w: ExpertWeights, attrs: FFNAttrs) -> str | None:
    """Why this Triton kernel cannot run these inputs, or None when it can."""
    if not x.is_cuda and not autotune.interpreting():
        return "x is not a CUDA tensor (set TRITON_INTERPRET=1 to run on CPU)"
    if x.dtype not in _DTYPES:
        return f"dtype {x.dtype} (supported: fp16, bf16, fp32)"
    if w.transposed != attrs.transposed:
        return "ExpertWeights.transposed and FFNAttrs.transposed disagree"
    if attrs.gate_up == "separate" and not w.fc1_up:
        return "gate_up='separate' without fc1_up tensors"
    if attrs.gate_up != "separate" and w.fc1_up:
        return f"fc1_up tensors given with gate_up={attrs.gate_up!r}"
    for name in ("fc1", "fc1_up", "fc2", "fc1_bias", "fc1_up_bias", "fc2_bias"):
        role = getattr(w, name)
        if not role:
            continue
        if not _uniform(role):
            return f"{name}: per-expert tensors differ in shape, stride, dtype or device"
        if len(role) > 1 and any(t.data_ptr() % 16 for t in role):
            return f"{name}: a per-expert tensor is not 16-byte aligned"
        if role[0].device != x.device:
            return f"{name} is on {role[0].device}, x on {x.device}"
        if name in ("fc1", "fc1_up", "fc2") and role[0].dtype != x.dtype:
            return f"{name} dtype {role[0].dtype} differs from x dtype {x.dtype}"
    if attrs.gate_up in ("concat", "interleaved") and w.fc1_bias and w.fc1_up_bias:
        return "fc1_up_bias with a fused gate/up weight"
    fc1 = w.fc1_of(0)
    fc1_out = fc1.shape[1] if w.transposed else fc1.shape[0]
    expected = 2 * w.ffn() if attrs.gate_up in ("concat", "interleaved") else w.ffn()
    if fc1_out != expected:
        return f"fc1 has {fc1_out} outputs, expected {expected} for gate_up={attrs.gate_up!r}"
    return None


# -- the two GEMM launches -----------------------------------------------------------------------


def _launch_gemm(a, c, b_role, u_role, bias_role, ubias_role, g, align, N, D, S, a_row_div, cfg, *,
                 transposed, gated, activation, clamp, scale, row_step, up_row_off, limit, alpha):
    sorted_slots, block_expert, total = align
    dev = a.device
    b, b_table, b_se, b_sn, b_sk = _weight_operand(b_role, transposed, dev)
    u, u_table, u_se, u_sn, u_sk = _weight_operand(u_role, transposed, dev) if u_role else (b, b_table, b_se, b_sn, b_sk)
    bias, bias_table, bias_se, bias_sn = _bias_operand(bias_role, dev) if bias_role else (b, None, 0, 0)
    ubias, ubias_table, ubias_se, ubias_sn = _bias_operand(ubias_role, dev) if ubias_role else (bias, bias_table, bias_se, bias_sn)
    grid = (block_expert.numel() * triton.cdiv(N, cfg.BLOCK_N),)
    grouped_gemm_kernel[grid](
        a, c, b, b_table if b_table is not None else b, u, u_table if u_table is not None else u,
        bias, bias_table if bias_table is not None else bias, ubias, ubias_table if ubias_table is not None else ubias,
        g, sorted_slots, block_expert, total,
        N, D, S,
        a.stride(0), a.stride(1), c.stride(0), c.stride(1),
        b_se, b_sn, b_sk, u_se, u_sn, u_sk, bias_se, bias_sn, ubias_se, ubias_sn,
        up_row_off, float(limit), float(alpha),
        ROW_STEP=row_step, A_ROW_DIV=a_row_div, GATED=gated, ACTIVATION=activation, CLAMP=clamp, SCALE=scale,
        HAS_BIAS=bool(bias_role), HAS_UP_BIAS=bool(ubias_role),
        B_TABLE=b_table is not None, U_TABLE=u_table is not None,
        BIAS_TABLE=bias_table is not None, UBIAS_TABLE=ubias_table is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **cfg.launch_kwargs(),
    )


def _forward(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, cfg: autotune.TileConfig,
             fc2_cfg: autotune.TileConfig | None = None):
    """FC1 runs with ``cfg``, FC2 with ``fc2_cfg`` (same BLOCK_M: one align serves both)."""
    T, H = x.shape
    K = topk_ids.shape[1]
    E, F, S = w.num_experts, w.ffn(), T * K
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()  # [T, K]
    g = topk_weights.reshape(-1).contiguous()  # [S]
    align = align_by_expert(ids, E, cfg.BLOCK_M)
    gated = attrs.gate_up != "none"
    fused_up = attrs.gate_up in ("concat", "interleaved")

    h = x.new_empty(S, F)  # [S, F] activation, slot order
    _launch_gemm(
        x, h, w.fc1, w.fc1_up, w.fc1_bias, w.fc1_bias if fused_up else w.fc1_up_bias, g, align, F, H, S, K, cfg,
        transposed=w.transposed, gated=gated, activation=ACTIVATION_CODES[attrs.activation],
        clamp=attrs.limit > 0, scale={"input": SCALE_BEFORE_BIAS, "between": SCALE_LAST}.get(attrs.weight_on, SCALE_NONE),
        row_step=2 if attrs.gate_up == "interleaved" else 1,
        up_row_off={"concat": F, "interleaved": 1}.get(attrs.gate_up, 0),
        limit=attrs.limit, alpha=attrs.alpha,
    )
    o = x.new_empty(S, H)  # [S, H] expert outputs, slot order
    _launch_gemm(
        h, o, w.fc2, (), w.fc2_bias, (), g, align, H, F, S, 1, fc2_cfg or cfg,
        transposed=w.transposed, gated=False, activation=ACT_NONE, clamp=False,
        scale=SCALE_LAST if attrs.weight_on == "output" else SCALE_NONE,
        row_step=1, up_row_off=0, limit=0.0, alpha=0.0,
    )
    return combine(o, ids, E)  # [T, H]


def fused_moe_triton(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    w: ExpertWeights,
    attrs: FFNAttrs,
    config: autotune.TileConfig | None = None,
) -> torch.Tensor:
    """Same result as ``kernels.reference.fused_moe_reference``; raises NotImplementedError on
    inputs it does not handle (``unsupported_reason``) so the caller can fall back."""
    reason = unsupported_reason(x, topk_ids, w, attrs)
    if reason is not None:
        raise NotImplementedError(f"fused_moe_triton: {reason}")
    T, H = x.shape
    K = topk_ids.shape[1]
    if T == 0 or K == 0:
        return x.new_zeros(T, H)
    if config is None:
        layout = f"{attrs.gate_up}|{'T' if w.transposed else 'N'}|{'list' if len(w.fc1) > 1 else 'stacked'}"
        key = autotune.shape_key(x, w.num_experts, H, w.ffn(), K, layout)
        choices = autotune.candidates(T, K, w.num_experts, x.dtype, x.device)
        config = autotune.pick_config(key, choices, lambda cfg: _forward(x, topk_ids, topk_weights, w, attrs, cfg))
        # FC2 has one accumulator and N = H: wider tiles than the gated FC1 fit; tuned second,
        # with FC1's BLOCK_M (the first candidate is FC1's own config, so untuned runs share it).
        fc2_choices = autotune.fc2_candidates(config, T, K, w.num_experts, x.dtype, x.device)
        fc2_config = autotune.pick_config(
            "fc2|" + key, fc2_choices, lambda cfg: _forward(x, topk_ids, topk_weights, w, attrs, config, cfg)
        )
        if fc2_config.BLOCK_M != config.BLOCK_M:  # a cache entry from another FC1 pick
            fc2_config = config
        return _forward(x, topk_ids, topk_weights, w, attrs, config, fc2_config)
    return _forward(x, topk_ids, topk_weights, w, attrs, config)
