"""mxfp4 / mxfp8: OCP Microscaling (MX v1.0) block formats; fp32 activations.

Shapes:  E experts, N output rows, K reduction width, T rows of x; blocks of 32 along K.

Each block of 32 consecutive elements of a row shares one e8m0 scale: a uint8 code c meaning
2^(c - 127) (c = 255 would be NaN and is never written).  Elements are fp4 e2m1 (mxfp4, two codes
per byte, element 2j in the low nibble of byte j — GPT-OSS ships its experts this way) or fp8
e4m3fn (mxfp8, one byte each, the bit pattern of ``torch.float8_e4m3fn``).

    e2m1 code  bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa:
               magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7; code | 8 is the negative
    e4m3fn     bit 7 sign, bits 6-3 exponent (bias 7), bits 2-0 mantissa; max 448, no infinities

Pack:

    c        = clamp(ceil(log2(max|w| of the block / ELEMENT_MAX)) + 127, 1, 254)
               ELEMENT_MAX = 6 (e2m1) or 448 (e4m3); an all-zero block gets c = 127 (scale 1)
    element  = round_half_even(w / 2^(c - 127)) in the element format (exact division: a power
               of two), saturating at its max (never reached: the scale is rounded up)

The scale rounds up (the "RCEIL" rule NVIDIA's MXFP8 recipes use) where the OCP spec's example
conversion takes floor(log2(max|w|)) - EMAX and lets the block's largest elements saturate:
on random blocks rounding up is worth +1.4 dB (mxfp8) and +0.5 dB (mxfp4) of MoE output SQNR,
and a reader of the packed tensor needs only the element semantics, which are the spec's.  The
floor at c = 1 (the spec allows 0) keeps 2^(c - 127) an fp32 normal, so a kernel may build the
scale by shifting c into the exponent field; it matters only for blocks below ~2^-120.

    dequantize element(e, n, k) = value(code) * 2^(c - 127)
    matmul     y [T, N] = x.float() @ dequantize(W)[e]^T      (fp32 accumulation)
"""

from __future__ import annotations

import torch

from moe_compile.quant.common import MX_GROUP, QuantWeight, check_group, group_view, pack_nibbles, unpack_nibbles

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive e2m1 magnitudes; a value exactly on one goes to the even code.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
ELEMENT_MAX = {"mxfp4": E2M1_MAX, "mxfp8": E4M3_MAX}


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """float -> uint8 e2m1 codes (round half to even, saturating at +-6)."""
    a = v.float().abs()
    mids = torch.tensor(_E2M1_MIDPOINTS)
    code = torch.bucketize(a, mids)  # a == mids[i] -> i (the smaller magnitude)
    tie_to_odd = torch.isin(a, mids) & (code % 2 == 1)
    code = code + tie_to_odd.to(code.dtype)  # ties go to the even code (mantissa bit 0)
    sign = (v < 0).to(code.dtype) << 3
    return (code | sign).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes -> fp32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    return table[code.long()]


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """float -> uint8 e4m3fn bit patterns (round half to even, saturating at +-448)."""
    return v.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3fn bit patterns -> fp32 values."""
    return bits.contiguous().view(torch.float8_e4m3fn).float()


def e8m0_scales(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """W [..., K] -> uint8 e8m0 codes [..., K/32]: the smallest power of two 2^x with
    max|w| / 2^x <= the element format's max (no element saturates)."""
    amax = group_view(w.float(), MX_GROUP).abs().amax(dim=-1)  # [..., K/32]
    ratio = amax / ELEMENT_MAX[fmt]
    mant, exp = torch.frexp(ratio)  # ratio = mant * 2^exp, mant in [0.5, 1)
    x = torch.where(mant == 0.5, exp - 1, exp)  # ceil(log2(ratio)), exact for powers of two
    code = (x + 127).clamp(1, 254)
    code = torch.where(amax > 0, code, torch.full_like(code, 127))
    return code.to(torch.uint8).contiguous()


def e8m0_value(code: torch.Tensor) -> torch.Tensor:
    """uint8 e8m0 codes -> fp32 2^(code - 127) (code 0 gives the fp32 subnormal 2^-127); code 255 is
    NaN (OCP MX v1.0), as the kernels read it.  pack never writes 255."""
    value = torch.pow(2.0, code.double() - 127).float()
    return torch.where(code == 255, torch.full_like(value, float("nan")), value)


def pack(w: torch.Tensor, fmt: str) -> QuantWeight:
    """W [E, N, K] float -> QuantWeight("mxfp4" | "mxfp8")."""
    if fmt not in ELEMENT_MAX:
        raise ValueError(f"mx: fmt must be 'mxfp4' or 'mxfp8', got {fmt!r}")
    E, N, K = w.shape
    check_group(K, MX_GROUP, fmt)
    scale = e8m0_scales(w.detach(), fmt)  # [E, N, K/32]
    v = group_view(w.detach().float(), MX_GROUP) / e8m0_value(scale)[..., None]  # exact: a power of 2
    v = v.reshape(E, N, K)
    data = pack_nibbles(e2m1_encode(v)) if fmt == "mxfp4" else e4m3_encode(v).contiguous()
    return QuantWeight(fmt, data, scale, MX_GROUP, (E, N, K))


def element_values(qw: QuantWeight) -> torch.Tensor:
    """The unscaled element values [E, N, K] fp32."""
    if qw.fmt == "mxfp4":
        return e2m1_decode(unpack_nibbles(qw.data))
    return e4m3_decode(qw.data)


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """-> [E, N, K] fp32 = element * 2^(c - 127) per block."""
    v = group_view(element_values(qw), MX_GROUP)  # [E, N, K/32, 32]
    return (v * e8m0_value(qw.scale)[..., None]).reshape(qw.shape)


def matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] -> [T, N] fp32 on expert e's dequantized rows."""
    sub = QuantWeight(qw.fmt, qw.data[e : e + 1], qw.scale[e : e + 1], qw.group, (1, *qw.shape[1:]))
    return x.float() @ dequantize(sub)[0].t()
