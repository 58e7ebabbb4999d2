"""a8w8-int: int8 activations per token, int8 weights per output channel, int32 accumulation.

Shapes:  E experts, N output rows, K reduction width, T rows of x.

    weights      s_w[e, n] = max_k |w[e, n, k]| / 127 (fp32; 1 for an all-zero row)
                 q_w = clamp(round_half_even(w / s_w), -127, 127)        int8 [E, N, K], fp32 [E, N, 1]
    activations  (q_x [T, K] int8, s_x [T, 1]) = quantize_per_token_int8(x)   (``common.py``:
                 s_x = max|x| / 127 per row, round half to even, [-127, 127])
    matmul       acc [T, N] = q_x @ q_w[e]^T in int32 (exact: |acc| <= 127^2 K < 2^31 for K < 2^17)
                 y = (acc * s_x) * s_w[e]^T            fp32, in that order

In the MoE, FC2's input (the fp32 SwiGLU output) is re-quantized per row the same way.
"""

from __future__ import annotations

import torch

from moe_compile.quant.common import INT8_QMAX, QuantWeight, quantize_per_token_int8

MAX_K = 1 << 17  # 127 * 127 * K must fit int32


def channel_scales(w: torch.Tensor, qmax: float) -> torch.Tensor:
    """W [E, N, K] -> fp32 [E, N, 1]: max|w| / qmax per output channel (1 for a zero row)."""
    amax = w.detach().float().abs().amax(dim=-1, keepdim=True)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).contiguous()


def pack(w: torch.Tensor) -> QuantWeight:
    """W [E, N, K] float -> QuantWeight("a8w8-int")."""
    E, N, K = w.shape
    if K >= MAX_K:
        raise ValueError(f"a8w8-int: K={K} could overflow the int32 accumulator (K < {MAX_K})")
    s = channel_scales(w, INT8_QMAX)
    q = torch.round(w.detach().float() / s).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return QuantWeight("a8w8-int", q.contiguous(), s, K, (E, N, K))


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """-> [E, N, K] fp32 = q * s."""
    return qw.data.float() * qw.scale


def int_matmul(qx: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """int8 [T, K] x int [N, K] -> exact int32 [T, N] (int64 inside, then checked narrowing)."""
    acc = qx.long() @ q.long().t()
    return acc.to(torch.int32)


def matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] float -> [T, N] fp32: per-token int8 x per-channel int8, int32 accumulation."""
    qx, sx = quantize_per_token_int8(x)
    acc = int_matmul(qx, qw.data[e])  # [T, N] int32
    return acc.float() * sx * qw.scale[e].reshape(1, -1)
