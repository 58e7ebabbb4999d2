"""Quantized grouped GEMMs of the fused MoE op on canonical packed weights (``moe_compile.quant``).

UNVERIFIED on a GPU: tested only under ``TRITON_INTERPRET=1`` (fp32 activations) against
``quant.reference_moe``; ``devices.py`` lists the GPU quantized variants as not verified, and
``quant="auto"`` never picks them.  Nothing dispatches to this file yet.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots,
         P padded rows (align.py), N the GEMM's output width, D its reduction width (K of the
         QuantWeight), G the scale group along D.

    FC1:  h[s, :F] = silu(A[s // K] . W1[e, n]) * (A[s // K] . W1[e, F + n])    N = F, D = H
    FC2:  o[s, :H] = g_s * (h[s] . W2[e, n])                                   N = H, D = F

Rows are aligned by expert exactly as the bf16 kernel does (``align.py``: BLOCK_M rows of one
expert per tile).  Each program walks D in BLOCK_K steps; the weight tile [BLOCK_K, BLOCK_N] is
loaded from the packed bytes and decoded in registers ("dequantize in the load path"):

    FMT_W8     int8 * fp16 group scale                       -> fp32 tile, fp32 dot
    FMT_W4     (nibble - 8) * fp16 group scale               -> fp32 tile, fp32 dot
    FMT_MXFP4  e2m1(nibble) * 2^(e8m0 - 127)                 -> fp32 tile, fp32 dot
    FMT_A8W8   int8 weights, int8 activations (quantized per token by the host), int32 dot;
               y = acc * s_x * s_w in the epilogue
    FMT_A8W4   nibble - 8 as int8, otherwise as FMT_A8W8

BLOCK_K divides the group (32) so that one tile row uses one scale.  The 4-bit tile loads each
byte once per pair of K rows (row k reads byte k // 2 and picks its nibble by k's parity).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_compile.ir import FFNAttrs
from moe_compile.kernels.triton.align import align_by_expert
from moe_compile.kernels.triton.fused_moe import combine
from moe_compile.quant.common import QuantWeight, quantize_per_token_int8

FMT_W8, FMT_W4, FMT_MXFP4, FMT_A8W8, FMT_A8W4 = range(5)
FORMAT_CODES = {"w8-int": FMT_W8, "w4-int": FMT_W4, "mxfp4": FMT_MXFP4, "a8w8-int": FMT_A8W8, "a8w4-int": FMT_A8W4}
BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 32


@triton.jit
def _e2m1(code):
    """uint8 e2m1 codes (low 4 bits) -> fp32: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    c = code.to(tl.int32)
    exp = (c >> 1) & 3
    man = (c & 1).to(tl.float32)
    mag = tl.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * tl.exp2((exp - 1).to(tl.float32)))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _weight_tile(w_ptr, s_ptr, e, rows, offs_k, k0, N, D, G, col_ok, FMT: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] tile of expert e's rows ``rows`` at reduction offset k0, decoded:
    fp32 values (weight-only formats) or int8 integers (a8 formats)."""
    k = k0 + offs_k  # [BK]
    ok = (k < D)[:, None] & col_ok[None, :]
    row_base = (e.to(tl.int64) * N + rows.to(tl.int64))[None, :]  # [1, BN]
    if FMT == 0 or FMT == 3:  # int8 bytes, one per element
        q = tl.load(w_ptr + row_base * D + k[:, None], mask=ok, other=0)
    else:  # two elements per byte: element 2j low nibble, 2j + 1 high
        byte = tl.load(w_ptr + row_base * (D // 2) + (k // 2)[:, None], mask=ok, other=0).to(tl.int32)
        nib = tl.where((k % 2 == 0)[:, None], byte & 0xF, byte >> 4)
        if FMT == 2:
            q = nib
        else:
            q = (nib - 8).to(tl.int8)
    if FMT >= 3:
        return q.to(tl.int8)
    s = tl.load(s_ptr + row_base * (D // G) + (k // G)[:, None], mask=ok, other=0)
    if FMT == 2:
        return _e2m1(q) * tl.exp2(s.to(tl.float32) - 127.0)
    return q.to(tl.float32) * s.to(tl.float32)


@triton.jit
def quant_grouped_gemm_kernel(
    a_ptr, sa_ptr, c_ptr,  # A [rows, D] fp32 or int8 (+ per-row fp32 scale); C [S, N] fp32
    w_ptr, s_ptr, g_ptr,  # packed weight [E, N_w, D'] and its scales; g [S] routing weight
    sorted_ptr, block_expert_ptr, total_ptr,
    N, D, S, G, up_row_off, limit,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr, SCALE_OUT: tl.constexpr,
    FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + offs_m)  # [BM], sentinel S in padding rows
    row_ok = slots < S
    e = tl.load(block_expert_ptr + pid_m)
    a_rows = (slots // A_ROW_DIV).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    N_w = N * 2 if GATED else N  # rows of the packed weight
    if FMT >= 3:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_ok = offs_k < D - k0
        a = tl.load(a_ptr + a_rows[:, None] * D + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0)
        b = _weight_tile(w_ptr, s_ptr, e, offs_n, offs_k, k0, N_w, D, G, col_ok, FMT)
        if FMT >= 3:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        if GATED:
            u = _weight_tile(w_ptr, s_ptr, e, offs_n + up_row_off, offs_k, k0, N_w, D, G, col_ok, FMT)
            if FMT >= 3:
                acc_up = tl.dot(a, u, acc_up, out_dtype=tl.int32)
            else:
                acc_up = tl.dot(a, u, acc_up, input_precision="ieee")
    # -- epilogue (fp32): integer scales, SwiGLU, routing weight --------------------------------
    if FMT >= 3:
        sx = tl.load(sa_ptr + a_rows, mask=row_ok, other=0.0)[:, None]
        sw = tl.load(s_ptr + e.to(tl.int64) * N_w + offs_n, mask=col_ok, other=0.0)[None, :]
        out = acc.to(tl.float32) * sx * sw
        if GATED:
            swu = tl.load(s_ptr + e.to(tl.int64) * N_w + offs_n + up_row_off, mask=col_ok, other=0.0)[None, :]
            out_up = acc_up.to(tl.float32) * sx * swu
    else:
        out = acc
        out_up = acc_up
    if GATED:
        if CLAMP:
            out = tl.minimum(out, limit)
            out_up = tl.minimum(tl.maximum(out_up, -limit), limit)
        out = out / (1.0 + tl.exp(-out)) * out_up
    if SCALE_OUT:
        out = out * tl.load(g_ptr + slots, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


def unsupported_reason(w1: QuantWeight, w2: QuantWeight, attrs: FFNAttrs) -> str | None:
    if w1.fmt != w2.fmt or w1.fmt not in FORMAT_CODES:
        return f"Triton quantized GEMMs run {tuple(FORMAT_CODES)}, got {w1.fmt} / {w2.fmt}"
    if any(q.grouped_activations for q in (w1, w2)):
        return ("group-wise a8w4-int (activations per block of 32) has no Triton kernel yet; "
                "quant.a8w4_int.pack(w, group_size=None) is the per-channel form it runs")
    if any(q.group % BLOCK_K for q in (w1, w2)):
        return f"the group must be a multiple of {BLOCK_K}"
    if attrs.activation != "silu" or attrs.weight_on not in ("output", "between"):
        return "SwiGLU experts weighted on the output or between only"
    return None


def _gemm(a, sa, w: QuantWeight, g, align, N, S, a_row_div, gated, attrs, scale_out):
    c = torch.empty(S, N, dtype=torch.float32, device=a.device)
    sorted_slots, block_expert, total = align
    grid = (sorted_slots.numel() // BLOCK_M, triton.cdiv(N, BLOCK_N))
    quant_grouped_gemm_kernel[grid](
        a, sa, c, w.data, w.scale, g, sorted_slots, block_expert, total,
        N, w.shape[2], S, w.group, N if gated else 0, attrs.limit,
        A_ROW_DIV=a_row_div, GATED=gated, CLAMP=attrs.limit > 0, SCALE_OUT=scale_out, FMT=FORMAT_CODES[w.fmt],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )
    return c


def quant_moe_triton(x, topk_ids, topk_weights, w1: QuantWeight, w2: QuantWeight, attrs: FFNAttrs) -> torch.Tensor:
    """y [T, H] fp32 of the MoE in w1's format (``quant.reference_moe``'s meaning)."""
    reason = unsupported_reason(w1, w2, attrs)
    if reason:
        raise ValueError(f"quant_moe_triton: {reason}")
    T, H = x.shape
    E, F = w1.shape[0], w1.shape[1] // 2
    S = topk_ids.numel()
    if S == 0:
        return x.new_zeros(T, H, dtype=torch.float32)
    align = align_by_expert(topk_ids, E, BLOCK_M)
    g = topk_weights.reshape(-1).float().contiguous()  # [S]
    integer = w1.fmt in ("a8w8-int", "a8w4-int")
    xa, sx = quantize_per_token_int8(x) if integer else (x.float().contiguous(), g)
    h = _gemm(xa, sx.reshape(-1).contiguous() if integer else g, w1, g, align, F, S, topk_ids.shape[1], True, attrs,
              attrs.weight_on == "between")  # [S, F]
    ha, sh = quantize_per_token_int8(h) if integer else (h, g)  # FC2's input re-quantized per row
    o = _gemm(ha, sh.reshape(-1).contiguous() if integer else g, w2, g, align, H, S, 1, False, attrs,
              attrs.weight_on == "output")  # [S, H]
    return combine(o, topk_ids, E)
