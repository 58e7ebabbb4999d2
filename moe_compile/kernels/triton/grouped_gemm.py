"""Grouped GEMM over expert-sorted rows: the FC1 and FC2 of the fused MoE op.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots,
         P padded rows (see align.py), N the GEMM's output width, D its reduction width.

    FC1:  h[s, :F]  = epilogue( x[s // K, :H] @ W_gate[e]ᵀ,  x[s // K, :H] @ W_up[e]ᵀ )   N=F, D=H
    FC2:  o[s, :H]  = epilogue( h[s, :F] @ W_down[e]ᵀ )                                N=H, D=F

for every slot s routed to expert e.  Rows of A are *gathered* by the sorted slot ids (FC1 reads x
directly: no permuted copy of x is ever written); rows of C are written back at the slot index, so
h and o are in slot order and the combine (fused_moe.py) is a plain [T, K, H] -> [T, H] reduction.

Tiling.  The program grid covers (P_max / BLOCK_M) x (N / BLOCK_N) output tiles, grouped along M
by GROUP_M (as in the Triton matmul tutorial) so that programs running together share B tiles in
L2.  align.py guarantees that the BLOCK_M rows of one tile belong to one expert, so each program
reads one expert id and walks D in BLOCK_K steps with a [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]
``tl.dot``, accumulating in fp32.  Programs whose tile starts past the padded row count P (known
only on the device) exit immediately.

Weights.  Each weight role is either one stacked tensor (expert e at ``ptr + e * stride_e``) or E
separate tensors the model holds (expert e at ``ptr + table[e]``, an int64 device table of the
experts' data pointers, stored relative to the first expert's so alignment stays provable).  Strides are generic, so [out, in] (F.linear) and transposed
[in, out] storage are the same code.  The gated FC1 computes the gate and up tiles of the same
output columns side by side (two accumulators) so that SwiGLU runs in the epilogue and only the
[S, F] activation is ever written:

    concat:      gate row n,      up row F + n      of the fused [2F, H] weight
    interleaved: gate row 2n,     up row 2n + 1     (GPT-OSS)
    separate:    gate row n of W_gate, up row n of W_up

Epilogue order, which mirrors kernels/reference.py: scale by the routing weight g (weight_on
"input": (g x) W = g (x W), applied before the bias), + bias, clamp, activation, gate * up, scale
by g (weight_on "between" on FC1, "output" on FC2), cast to the output dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Activation codes (constexpr ACTIVATION).
ACT_NONE, ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_RELU, ACT_GPTOSS = range(6)
ACTIVATION_CODES = {
    "silu": ACT_SILU, "gelu": ACT_GELU, "gelu_tanh": ACT_GELU_TANH, "relu": ACT_RELU, "gptoss": ACT_GPTOSS,
}
# Where the routing weight multiplies inside this GEMM (constexpr SCALE).
SCALE_NONE, SCALE_BEFORE_BIAS, SCALE_LAST = range(3)


@triton.jit
def _expert_base(ptr, table, e, stride_e, USE_TABLE: tl.constexpr):
    """Pointer to expert e's tensor: ptr + table[e] (per-expert tensors) or ptr + e * stride_e.

    For per-expert tensors the table holds each tensor's address *relative to ptr* (the first
    expert's tensor), in elements: ``ptr + table[e]`` keeps ptr's known 16-byte alignment, and the
    host only builds tables whose entries are multiples of 16 bytes, so the compiler can still
    vectorise and software-pipeline the B loads exactly as in the stacked case (a raw address cast
    back with ``.to(tl.pointer_type(...))`` loses the alignment and with it the pipelining).
    """
    if USE_TABLE:
        ALIGN: tl.constexpr = 128 // ptr.dtype.element_ty.primitive_bitwidth  # 16 bytes, in elements
        return ptr + tl.multiple_of(tl.load(table + e), ALIGN)
    else:
        return ptr + e.to(tl.int64) * stride_e


@triton.jit
def _sigmoid(v):
    return 1.0 / (1.0 + tl.exp(-v))


@triton.jit
def _activate(v, ACTIVATION: tl.constexpr):
    """Elementwise activation of an fp32 tile (gptoss is handled by the caller)."""
    if ACTIVATION == 1:  # silu
        v = v * _sigmoid(v)
    elif ACTIVATION == 2:  # gelu (erf)
        v = 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))
    elif ACTIVATION == 3:  # gelu_tanh; tanh(z) = 2 sigmoid(2z) - 1 (portable to the interpreter)
        z = 0.7978845608028654 * (v + 0.044715 * v * v * v)
        v = 0.5 * v * (1.0 + (2.0 * _sigmoid(2.0 * z) - 1.0))
    elif ACTIVATION == 4:  # relu
        v = tl.maximum(v, 0.0)
    return v


@triton.jit
def _load_bias(ptr, table, e, rows, mask, stride_e, stride_n, USE_TABLE: tl.constexpr):
    base = _expert_base(ptr, table, e, stride_e, USE_TABLE)
    return tl.load(base + rows.to(tl.int64) * stride_n, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def tile_of_program(N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n): this program's output tile of a 1-D grid over [rows, N] tiles, GROUP_M row
    blocks at a time so that consecutive programs reuse the same weight columns from L2."""
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_m = tl.num_programs(0) // num_pid_n
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_m
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_m
    return pid_m, pid_n


@triton.jit
def grouped_gemm_kernel(
    a_ptr, c_ptr,  # A [rows, D] gathered by slot // A_ROW_DIV; C [S, N] written at the slot
    b_ptr, b_table, u_ptr, u_table,  # B (gate / only) and U (up) weights: stacked or via table
    bias_ptr, bias_table, ubias_ptr, ubias_table,  # biases of B and U (when HAS_BIAS)
    g_ptr,  # [S] routing weight of each slot (when SCALE != 0)
    sorted_ptr, block_expert_ptr, total_ptr,  # from align.py
    N, D, S,
    stride_am, stride_ak, stride_cm, stride_cn,
    stride_be, stride_bn, stride_bk,
    stride_ue, stride_un, stride_uk,
    stride_biase, stride_biasn, stride_ubiase, stride_ubiasn,
    up_row_off,  # weight row of output column n: gate n * ROW_STEP, up n * ROW_STEP + up_row_off
    limit, alpha,
    ROW_STEP: tl.constexpr,  # 2 for interleaved gate/up, else 1 (constexpr: keeps B contiguity known)
    A_ROW_DIV: tl.constexpr,  # K for FC1 (A = x, one row per token), 1 for FC2 (A = h, per slot)
    GATED: tl.constexpr,  # two accumulators (gate, up) and gate*up in the epilogue
    ACTIVATION: tl.constexpr,
    CLAMP: tl.constexpr,  # clamp gate (max) and up (both sides) by `limit` before the activation
    SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,  # bias of B (gate / only weight)
    HAS_UP_BIAS: tl.constexpr,  # bias of U (up)
    B_TABLE: tl.constexpr, U_TABLE: tl.constexpr, BIAS_TABLE: tl.constexpr, UBIAS_TABLE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no TF32), ignored for 16-bit inputs
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # -- which output tile: grouped ordering along M (Triton matmul tutorial) --------------------
    pid_m, pid_n = tile_of_program(N, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return  # past the padded rows actually used this call

    # -- rows: BLOCK_M slots of one expert (padding rows carry the sentinel S) -------------------
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + offs_m)  # [BM]
    row_ok = slots < S
    e = tl.load(block_expert_ptr + pid_m)
    a_rows = (slots // A_ROW_DIV).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]

    # -- columns: output n -> weight rows (gate, up) of expert e ---------------------------------
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    gate_rows = offs_n.to(tl.int64) * ROW_STEP
    b_base = _expert_base(b_ptr, b_table, e, stride_be, B_TABLE)
    b_ptrs = b_base + gate_rows[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        up_rows = gate_rows + up_row_off
        u_base = _expert_base(u_ptr, u_table, e, stride_ue, U_TABLE)
        u_ptrs = u_base + up_rows[None, :] * stride_un + offs_k[:, None] * stride_uk
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    # -- main loop over the reduction dim D ------------------------------------------------------
    for k0 in range(0, D, BLOCK_K):
        k_ok = offs_k < D - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        b_ptrs += BLOCK_K * stride_bk
        if GATED:
            u = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PRECISION)
            u_ptrs += BLOCK_K * stride_uk
        a_ptrs += BLOCK_K * stride_ak

    # -- epilogue (fp32): routing weight, bias, activation, gate * up ----------------------------
    if SCALE != 0:
        g = tl.load(g_ptr + slots, mask=row_ok, other=0.0).to(tl.float32)[:, None]  # [BM, 1]
    if SCALE == 1:
        acc = acc * g
        if GATED:
            acc_up = acc_up * g
    if HAS_BIAS:
        acc += _load_bias(bias_ptr, bias_table, e, gate_rows, col_ok, stride_biase, stride_biasn, BIAS_TABLE)[None, :]
    if GATED:
        if HAS_UP_BIAS:
            acc_up += _load_bias(
                ubias_ptr, ubias_table, e, up_rows, col_ok, stride_ubiase, stride_ubiasn, UBIAS_TABLE
            )[None, :]
    if CLAMP:
        acc = tl.minimum(acc, limit)
        if GATED:
            acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
    if ACTIVATION == 5:  # gptoss: (up + 1) * gate * sigmoid(alpha * gate)
        acc = (acc_up + 1.0) * (acc * _sigmoid(alpha * acc))
    else:
        acc = _activate(acc, ACTIVATION)
        if GATED:
            acc = acc * acc_up
    if SCALE == 2:
        acc = acc * g

    c_ptrs = c_ptr + slots.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
