"""a8w4-int: int8 activations per token, int4 weights per output channel, and the MSD identity.

Shapes:  E experts, N output rows, K reduction width, T rows of x.

    weights      s_w[e, n] = max_k |w[e, n, k]| / d (fp32; 1 for an all-zero row), d in 7, 7.25, .. 12
                 chosen per channel for the least squared error (``common.search_scales``:
                 +2.4 dB over d = 7 on Gaussian rows of 1024, whose few largest elements clip)
                 q_w = clamp(round_half_even(w / s_w), -8, 7), stored as nibbles u = q_w + 8, two per
                 byte (element 2j in the low nibble of byte j): uint8 [E, N, K/2], fp32 [E, N, 1]
                 bias[e, n] = 8 * sum_k q_w[e, n, k]     int32 [E, N], computed once at pack time
    activations  (q_x, s_x) = quantize_per_token_int8(x)  as a8w8-int
    matmul       acc = q_x @ q_w[e]^T in int32;  y = (acc * s_x) * s_w[e]^T   fp32, in that order

MSD (the seed operator's decomposition, for hardware whose matrix unit multiplies int4 x int4):
split each activation q in [-127, 127] into two signed 4-bit digits

    hi = floor(q / 16)  in [-8, 7]        lo = (q & 0xF) - 8  in [-8, 7]      q = 16 hi + lo + 8

so   q_x . W  =  16 (hi . W)  +  (lo . W)  +  8 (1^T W)   and the last term is ``bias``.  The
identity is exact in int32; ``msd_matmul`` computes it and must equal ``int_matmul`` bit for bit.
A CPU kernel may multiply int8 x int4 directly (the same integers).
"""

from __future__ import annotations

import torch

from moe_compile.quant.a8w8_int import MAX_K, int_matmul
from moe_compile.quant.common import QuantWeight, check_group, pack_nibbles, quantize_per_token_int8, search_scales, unpack_nibbles

QMAX, QMIN = 7, -8


def pack(w: torch.Tensor) -> QuantWeight:
    """W [E, N, K] float -> QuantWeight("a8w4-int") with its MSD bias."""
    E, N, K = w.shape
    check_group(K, K, "a8w4-int")  # even K
    if K >= MAX_K:
        raise ValueError(f"a8w4-int: K={K} could overflow the int32 accumulator (K < {MAX_K})")
    s = search_scales(w.detach().float(), QMIN, QMAX).contiguous()  # [E, N, 1]
    q = torch.round(w.detach().float() / s).clamp_(QMIN, QMAX).to(torch.int32)  # [E, N, K]
    bias = (8 * q.sum(dim=-1)).to(torch.int32).contiguous()  # [E, N]
    return QuantWeight("a8w4-int", pack_nibbles(q + 8), s, K, (E, N, K), bias)


def integers(qw: QuantWeight) -> torch.Tensor:
    """q_w [E, N, K] int32 in [-8, 7]."""
    return unpack_nibbles(qw.data).to(torch.int32) - 8


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """-> [E, N, K] fp32 = q * s."""
    return integers(qw).float() * qw.scale


def msd_digits(qx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [T, K] -> (hi, lo) int8 [T, K], both in [-8, 7], q = 16 hi + lo + 8."""
    q = qx.to(torch.int32)
    hi = torch.div(q, 16, rounding_mode="floor")
    lo = (q & 0xF) - 8  # two's complement: the low 4 bits of q
    return hi.to(torch.int8), lo.to(torch.int8)


def msd_matmul(qx: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """int8 [T, K] x expert e -> int32 [T, N] by the MSD identity (two int4 x int4 products + bias)."""
    hi, lo = msd_digits(qx)
    q = integers(qw)[e]  # [N, K]
    return 16 * int_matmul(hi, q) + int_matmul(lo, q) + qw.bias[e].reshape(1, -1)


def matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] float -> [T, N] fp32: per-token int8 x per-channel int4, int32 accumulation."""
    qx, sx = quantize_per_token_int8(x)
    acc = int_matmul(qx, integers(qw)[e])  # [T, N] int32
    return acc.float() * sx * qw.scale[e].reshape(1, -1)
