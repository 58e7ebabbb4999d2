"""w8-int / w4-int: weight-only integers with group-wise fp16 scales along K; fp32 activations.

Shapes:  E experts, N output rows, K reduction width, G group (elements of K sharing one scale),
         T rows of x.

For each group of G consecutive elements of a row (k = g*G .. g*G + G - 1):

    s = fp16(max|w| / 127)         w8-int
    s = fp16(max|w| / d)           w4-int: d in 7, 7.25, .. 12 chosen per group for the least squared
                                   error (``common.search_scales``; clips a few outliers to 7 or -8
                                   when that buys a finer step: +1 dB at G = 32 on Gaussian rows)
                                   s = 1 for an all-zero group, and at least 2^-24 (fp16's step)
    q = clamp(round_half_even(w / s), QMIN, QMAX)   QMIN = -127 (w8-int) or -8 (w4-int);
                                   s is the fp16 value, so q * s is what the kernels compute
    element = q * s

w8-int stores q as int8 [E, N, K]; w4-int stores u = q + 8 in [0, 15] as nibbles, two per byte,
element 2j in the low nibble of byte j ([E, N, K/2] uint8).  Scales are fp16 [E, N, K/G].

    matmul   y [T, N] = x.float() @ dequantize(W)[e]^T      (fp32 accumulation)

Default group: 32.  It is ggml's q8_0 / q4_0 block, so the format's error and bytes compare with
llama.cpp's directly (4.5 bits per weight for w4-int, 8.5 for w8-int), a SIMD register of AVX2
holds one group of int8 (32 bytes), and the finer scale pays: Mixtral-like MoE output with
Gaussian weights keeps 16.5 dB at w4-int G = 32 against 14.6 dB for per-channel int4 (a8w4-int).
K must be a multiple of G.
"""

from __future__ import annotations

import torch

from moe_compile.quant.common import QuantWeight, check_group, group_view, pack_nibbles, search_scales, unpack_nibbles

DEFAULT_GROUP = 32
QMAX = {"w8-int": 127, "w4-int": 7}
QMIN = {"w8-int": -127, "w4-int": -8}  # int8 keeps the symmetric range; a nibble holds -8
FP16_TINY = 2.0**-24


def _fmt(bits: int) -> str:
    if bits not in (8, 4):
        raise ValueError(f"w-int: bits must be 8 or 4, got {bits}")
    return f"w{bits}-int"


def group_scales(w: torch.Tensor, group: int, fmt: str) -> torch.Tensor:
    """W [E, N, K] -> fp16 [E, N, K/G]: w8-int max|w| / 127 per group; w4-int the least-squares
    choice of ``common.search_scales`` (1 for an all-zero group either way)."""
    wg = group_view(w.float(), group)  # [E, N, K/G, G]
    if fmt == "w4-int":
        s = search_scales(wg, QMIN[fmt], QMAX[fmt])[..., 0]
    else:
        amax = wg.abs().amax(dim=-1)  # [E, N, K/G]
        s = torch.where(amax > 0, amax / QMAX[fmt], torch.ones_like(amax))
    return s.to(torch.float16).clamp_min(FP16_TINY).contiguous()


def quantize_groups(w: torch.Tensor, s16: torch.Tensor, group: int, fmt: str) -> torch.Tensor:
    """W [E, N, K], scales fp16 [E, N, K/G] -> integer q [E, N, K] (int16) in [QMIN, QMAX]."""
    wg = group_view(w.float(), group)  # [E, N, K/G, G]
    q = torch.round(wg / s16.float()[..., None]).clamp_(QMIN[fmt], QMAX[fmt])
    return q.reshape(w.shape).to(torch.int16)


def pack(w: torch.Tensor, bits: int, group: int = DEFAULT_GROUP) -> QuantWeight:
    """W [E, N, K] float -> QuantWeight("w8-int" | "w4-int")."""
    fmt = _fmt(bits)
    E, N, K = w.shape
    check_group(K, group, fmt)
    s16 = group_scales(w.detach(), group, fmt)
    q = quantize_groups(w.detach(), s16, group, fmt)
    data = q.to(torch.int8).contiguous() if bits == 8 else pack_nibbles(q + 8)
    return QuantWeight(fmt, data, s16, group, (E, N, K))


def integers(qw: QuantWeight) -> torch.Tensor:
    """The signed integers q [E, N, K] (int16) of a w8-int / w4-int weight."""
    if qw.fmt == "w8-int":
        return qw.data.to(torch.int16)
    return unpack_nibbles(qw.data).to(torch.int16) - 8


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """-> [E, N, K] fp32 = q * s per group."""
    q = group_view(integers(qw).float(), qw.group)  # [E, N, K/G, G]
    return (q * qw.scale.float()[..., None]).reshape(qw.shape)


def matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] -> [T, N] fp32 on expert e's dequantized rows."""
    q = group_view(integers(qw)[e].float(), qw.group)  # [N, K/G, G]
    w = (q * qw.scale[e].float()[..., None]).reshape(qw.shape[1:])  # [N, K]
    return x.float() @ w.t()
