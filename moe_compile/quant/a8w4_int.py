"""a8w4-int: int8 activations, int4 weights, int32 sums — group-wise (the default) or per channel (MSD).

Shapes:  E experts, N output rows, K reduction width, G weight group, B = K / 32 activation blocks,
         T rows of x.

Group-wise, ``pack(w, group_size=G)``, G in 32 (the default: ggml's q4_0 block), 64, or a
multiple of 128 (torchao's "8da4w" semantics):

    weights      s_w[e, n, g] = fp16(+-max|w| / d) per group of G along K, d in 7, 7.25, .. 12 chosen
                 for the least squared error (``signed_group_scales``: the sign puts the largest
                 element on the -8 side, as q4_0 does), |s_w| at least 2^-24;
                 q_w = clamp(round_half_even(w / s_w), -8, 7), nibbles u = q_w + 8 as w4-int:
                 uint8 [E, N, K/2], fp16 [E, N, K/G], no bias.  The same bytes as w4-int.
    activations  (q_x [T, K] int8, s_x [T, B] fp32) = quantize_per_block_int8(x): per token and
                 block of 32 along K, s = max|x_block| / 127, q = round_half_even(x / s)
    matmul       acc[t, n, b] = sum over block b of q_x q_w     int32, exact (|acc| <= 32 * 127 * 8)
                 y[t, n] = sum_b (acc[t, n, b] * s_x[t, b]) * s_w[n, 32 b / G]     fp32
                 (a block's sum scaled once, as ggml's q4_0 x q8_0 dot does per block)

Per channel, ``pack(w, group_size=None)`` (the seed operator's form, ``QuantWeight.scale`` fp32):

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

from moe_compile.quant import wint
from moe_compile.quant.common import (ACT_BLOCK, MAX_K, QuantWeight, block_scales, block_sums,  # noqa: F401
                                      check_a8_group, check_group, group_view, grouped_int_matmul, int_matmul,
                                      pack_nibbles, quantize_per_block_int8, quantize_per_token_int8, search_scales,
                                      unpack_nibbles)

QMAX, QMIN = 7, -8
DEFAULT_GROUP = 32  # the CPU default: q4_0's block, 4.5 bits per weight


def check_group_size(K: int, group: int) -> None:
    """Grouped a8w4-int: a group the kernels tile dividing K (``common.check_a8_group``)."""
    check_a8_group(K, group, "a8w4-int")


def pack(w: torch.Tensor, group_size: int | None = DEFAULT_GROUP) -> QuantWeight:
    """W [E, N, K] float -> QuantWeight("a8w4-int"): group-wise fp16 scales (``group_size`` G),
    or, ``group_size=None``, per channel with the MSD bias (the seed's form)."""
    if group_size is not None:
        return _pack_grouped(w, group_size)
    E, N, K = w.shape
    check_group(K, K, "a8w4-int")  # even K
    if K >= MAX_K:
        raise ValueError(f"a8w4-int: K={K} could overflow the int32 accumulator (K < {MAX_K})")
    s = search_scales(w.detach().float(), QMIN, QMAX).contiguous()  # [E, N, 1]
    q = torch.round(w.detach().float() / s).clamp_(QMIN, QMAX).to(torch.int32)  # [E, N, K]
    bias = (8 * q.sum(dim=-1)).to(torch.int32).contiguous()  # [E, N]
    return QuantWeight("a8w4-int", pack_nibbles(q + 8), s, K, (E, N, K), bias)


def signed_group_scales(w: torch.Tensor, group: int) -> torch.Tensor:
    """W [E, N, K] -> fp16 [E, N, K/G]: per group, the least-squares s = amax / d of
    ``common.search_scales`` with the sign that puts the group's largest-magnitude element on the
    grid's -8 side (q4_0's d = max / -8 does the same), so d in (7, 8.5] keeps it unclipped:
    +0.3-0.4 dB over positive scales on Gaussian groups of 32.  |s| >= 2^-24 (fp16's step)."""
    wg = group_view(w.float(), group)  # [E, N, K/G, G]
    m = wg.gather(-1, wg.abs().argmax(dim=-1, keepdim=True))  # [E, N, K/G, 1]
    sign = torch.where(m > 0, -torch.ones_like(m), torch.ones_like(m))
    s = search_scales(wg * sign, QMIN, QMAX) * sign  # the search sees the extreme negative
    s16 = s[..., 0].to(torch.float16)
    return (torch.sign(s16) * s16.abs().clamp_min(wint.FP16_TINY)).contiguous()


def _pack_grouped(w: torch.Tensor, group: int) -> QuantWeight:
    E, N, K = w.shape
    check_group_size(K, group)
    if K >= MAX_K:
        raise ValueError(f"a8w4-int: K={K} could overflow the int32 accumulator (K < {MAX_K})")
    s16 = signed_group_scales(w.detach(), group)  # [E, N, K/G] fp16
    q = wint.quantize_groups(w.detach(), s16, group, "w4-int")  # [E, N, K] in [-8, 7]
    return QuantWeight("a8w4-int", pack_nibbles(q + 8), s16, group, (E, N, K))


def integers(qw: QuantWeight) -> torch.Tensor:
    """q_w [E, N, K] int32 in [-8, 7]."""
    return unpack_nibbles(qw.data).to(torch.int32) - 8


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """-> [E, N, K] fp32 = q * s (per group, or per channel)."""
    if qw.grouped_activations:
        E, N, K = qw.shape
        q = integers(qw).float().reshape(E, N, K // qw.group, qw.group)
        return (q * qw.scale.float()[..., None]).reshape(E, N, K)
    return integers(qw).float() * qw.scale


def grouped_matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] float -> [T, N] fp32: activations per block of 32, int32 block sums, each scaled
    once: y = sum_b (acc_b * s_x_b) * s_w."""
    return grouped_int_matmul(x, integers(qw)[e], block_scales(qw, e))


def msd_digits(qx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [T, K] -> (hi, lo) int8 [T, K], both in [-8, 7], q = 16 hi + lo + 8."""
    q = qx.to(torch.int32)
    hi = torch.div(q, 16, rounding_mode="floor")
    lo = (q & 0xF) - 8  # two's complement: the low 4 bits of q
    return hi.to(torch.int8), lo.to(torch.int8)


def msd_matmul(qx: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """int8 [T, K] x expert e -> int32 [T, N] by the MSD identity (two int4 x int4 products + bias);
    per-channel weights only (the grouped form has no bias)."""
    if qw.bias is None:
        raise ValueError("a8w4-int: the MSD identity needs the per-channel form (pack(w, group_size=None))")
    hi, lo = msd_digits(qx)
    q = integers(qw)[e]  # [N, K]
    return 16 * int_matmul(hi, q) + int_matmul(lo, q) + qw.bias[e].reshape(1, -1)


def matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] float -> [T, N] fp32: the grouped form's ``grouped_matmul``, or per-token int8 x
    per-channel int4 with int32 accumulation."""
    if qw.grouped_activations:
        return grouped_matmul(x, qw, e)
    qx, sx = quantize_per_token_int8(x)
    acc = int_matmul(qx, integers(qw)[e])  # [T, N] int32
    return acc.float() * sx * qw.scale[e].reshape(1, -1)
