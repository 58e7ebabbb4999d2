"""a8w8-int: int8 activations, int8 weights, int32 sums — group-wise or per channel.

Shapes:  E experts, N output rows, K reduction width, G weight group, B = K / 32 activation blocks,
         T rows of x.

Group-wise, ``pack(w, group_size=G)``, G in 32 (ggml's q8_0 block), 64, or a multiple of 128:

    weights      s_w[e, n, g] = fp16(max|w| / 127) per group of G along K (1 for an all-zero group,
                 at least 2^-24), q_w = clamp(round_half_even(w / s_w), -127, 127): the bytes of
                 w8-int at that group (``wint.group_scales`` / ``quantize_groups``), int8 [E, N, K],
                 fp16 [E, N, K/G]
    activations  (q_x [T, K] int8, s_x [T, B] fp32) = quantize_per_block_int8(x), as group-wise
                 a8w4-int: per token and block of 32 along K
    matmul       acc[t, n, b] = sum over block b of q_x q_w     int32, exact (|acc| <= 32 * 127^2)
                 y[t, n] = sum_b (acc[t, n, b] * s_x[t, b]) * s_w[n, 32 b / G]     fp32
                 (ggml's q8_0 x q8_0 dot: a block's sum scaled once)

Per channel, ``pack(w, group_size=None)`` (the seed operator's form, ``QuantWeight.scale`` fp32):

    weights      s_w[e, n] = max_k |w[e, n, k]| / 127 (fp32; 1 for an all-zero row)
                 q_w = clamp(round_half_even(w / s_w), -127, 127)        int8 [E, N, K], fp32 [E, N, 1]
    activations  (q_x [T, K] int8, s_x [T, 1]) = quantize_per_token_int8(x)   (``common.py``:
                 s_x = max|x| / 127 per row, round half to even, [-127, 127])
    matmul       acc [T, N] = q_x @ q_w[e]^T in int32 (exact: |acc| <= 127^2 K < 2^31 for K < 2^17)
                 y = (acc * s_x) * s_w[e]^T            fp32, in that order

The two forms are told apart by the scale's dtype (``QuantWeight.grouped_activations``).
``quant.pack("a8w8-int", w)`` and the op make the per-channel form unless ``MOE_COMPILE_A8W8_GROUP``
names a group (``default_group``; docs/quantization.md says why per channel stays the default).
In the MoE, FC2's input (the fp32 SwiGLU output) is re-quantized per row the same way.
"""

from __future__ import annotations

import os

import torch

from moe_compile.quant import wint
from moe_compile.quant.common import (INT8_QMAX, MAX_K, QuantWeight, block_scales, check_a8_group,  # noqa: F401
                                      group_view, grouped_int_matmul, int_matmul, quantize_per_block_int8,
                                      quantize_per_token_int8)

GROUP = 32  # the group-wise form's group on CPU: q8_0's block, 8.5 bits per weight
GROUP_ENV = "MOE_COMPILE_A8W8_GROUP"  # "32" / "64" / a multiple of 128 / "grouped" (= GROUP); unset: per channel


def default_group() -> int | None:
    """The group ``quant.pack("a8w8-int", w)`` and the op pack a8w8-int with: None (per channel)
    unless ``MOE_COMPILE_A8W8_GROUP`` names one (read at each pack: set it before the first compile,
    packs already made are kept).  Group-wise logits are 3-4 dB closer to fp32 on the e2e model;
    its prefill runs w8-int's fp32 tiles (docs/quantization.md)."""
    value = os.environ.get(GROUP_ENV, "").strip().lower()
    if value in ("", "none", "0"):
        return None
    if value == "grouped":
        return GROUP
    if not value.isdigit():
        raise ValueError(f"{GROUP_ENV}={value!r}: a group (32, 64 or a multiple of 128), 'grouped' ({GROUP}) "
                         f"or unset (per channel)")
    return int(value)


def dense_group(K: int) -> int:
    """The group a dense linear's a8w8-int weight packs with, 0 for per channel: what
    ``MOE_COMPILE_A8W8_GROUP`` names when it is set (``none``: per channel), else GROUP where it
    divides K.  Unlike the experts' (``default_group``), group-wise is the dense default: the
    dense weights decide a whole model's logits (per channel they lose 3 dB to llama.cpp's q8_0 on
    the benchmark model), and a dense prefill dequantizes the weight either way, so the form costs
    no prefill speed there, only its scales' bytes at decode."""
    if os.environ.get(GROUP_ENV, "").strip():
        return default_group() or 0
    return GROUP if K % GROUP == 0 else 0


def check_group_size(K: int, group: int) -> None:
    """Grouped a8w8-int: a group the kernels tile dividing K (``common.check_a8_group``)."""
    check_a8_group(K, group, "a8w8-int")


def channel_scales(w: torch.Tensor, qmax: float) -> torch.Tensor:
    """W [E, N, K] -> fp32 [E, N, 1]: max|w| / qmax per output channel (1 for a zero row)."""
    amax = w.detach().float().abs().amax(dim=-1, keepdim=True)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax)).contiguous()


def pack(w: torch.Tensor, group_size: int | None = None) -> QuantWeight:
    """W [E, N, K] float -> QuantWeight("a8w8-int"): group-wise fp16 scales (``group_size`` G), or,
    ``group_size=None``, one fp32 scale per output channel (the seed's form)."""
    E, N, K = w.shape
    if K >= MAX_K:
        raise ValueError(f"a8w8-int: K={K} could overflow the int32 accumulator (K < {MAX_K})")
    if group_size is not None:
        check_group_size(K, group_size)
        s16 = wint.group_scales(w.detach(), group_size, "w8-int")  # [E, N, K/G] fp16
        q = wint.quantize_groups(w.detach(), s16, group_size, "w8-int").to(torch.int8)
        return QuantWeight("a8w8-int", q.contiguous(), s16, group_size, (E, N, K))
    s = channel_scales(w, INT8_QMAX)
    q = torch.round(w.detach().float() / s).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return QuantWeight("a8w8-int", q.contiguous(), s, K, (E, N, K))


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """-> [E, N, K] fp32 = q * s (per group, or per channel)."""
    if qw.grouped_activations:
        q = group_view(qw.data.float(), qw.group)  # [E, N, K/G, G]
        return (q * qw.scale.float()[..., None]).reshape(qw.shape)
    return qw.data.float() * qw.scale


def grouped_matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] float -> [T, N] fp32 of a group-wise weight: the block sums and block scales of
    group-wise a8w4-int (``common.grouped_int_matmul``: exact in fp32 for int8 weights too, every
    partial sum an integer below 32 * 127^2 < 2^24)."""
    return grouped_int_matmul(x, qw.data[e], block_scales(qw, e))


def matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] float -> [T, N] fp32: activations per block of 32 against group-wise weights (each
    block's int32 sum scaled once, as group-wise a8w4-int), or per-token int8 x per-channel int8."""
    if qw.grouped_activations:
        return grouped_matmul(x, qw, e)
    qx, sx = quantize_per_token_int8(x)
    acc = int_matmul(qx, qw.data[e])  # [T, N] int32
    return acc.float() * sx * qw.scale[e].reshape(1, -1)
