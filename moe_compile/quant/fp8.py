"""a8w8-fp8: fp8 e4m3fn activations per token, fp8 e4m3fn weights per output channel.

Shapes:  E experts, N output rows, K reduction width, T rows of x.

    weights      s_w[e, n] = max_k |w[e, n, k]| / 448 (fp32; 1 for an all-zero row)
                 code = e4m3fn(w / s_w)   round half to even (``torch.float8_e4m3fn``), saturating
                 at +-448: uint8 bit patterns [E, N, K], fp32 [E, N, 1]
    activations  s_x[t] = max_k |x[t, k]| / 448 (1 for an all-zero row); x / s_x cast to e4m3fn
    matmul       acc [T, N] = e4m3(x) @ e4m3(w[e])^T with fp32 accumulation (each product of two
                 e4m3 values is exact in fp32; only the sums round)
                 y = (acc * s_x) * s_w[e]^T             fp32, in that order

In the MoE, FC2's input is re-quantized per row the same way.
"""

from __future__ import annotations

import torch

from moe_compile.quant.a8w8_int import channel_scales
from moe_compile.quant.common import QuantWeight
from moe_compile.quant.mx import E4M3_MAX, e4m3_decode, e4m3_encode


def pack(w: torch.Tensor) -> QuantWeight:
    """W [E, N, K] float -> QuantWeight("a8w8-fp8")."""
    E, N, K = w.shape
    s = channel_scales(w, E4M3_MAX)
    data = e4m3_encode(w.detach().float() / s).contiguous()
    return QuantWeight("a8w8-fp8", data, s, K, (E, N, K))


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """-> [E, N, K] fp32 = e4m3(code) * s."""
    return e4m3_decode(qw.data) * qw.scale


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (uint8 e4m3fn bits [T, K], s fp32 [T, 1]); s = max|x| / 448 (1 for zeros)."""
    xf = x.float()
    s = xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    return e4m3_encode(xf / s), s


def matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] float -> [T, N] fp32: e4m3 x e4m3, fp32 accumulation, both scales after."""
    bits, sx = quantize_per_token_fp8(x)
    acc = e4m3_decode(bits) @ e4m3_decode(qw.data[e]).t()  # [T, N] fp32
    return acc * sx * qw.scale[e].reshape(1, -1)
