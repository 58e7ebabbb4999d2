"""One entry per format: pack / dequantize / matmul by name (``quant.pack("w4-int", w)``).

Shapes:  E experts, N output rows, K reduction width, T rows of x.
"""

from __future__ import annotations

import torch

from moe_compile.quant import a8w4_int, a8w8_int, fp8, mx, w16, wint
from moe_compile.quant.common import FORMATS, MX_GROUP, QuantWeight

_MODULES = {
    "w16": w16, "w8-int": wint, "w4-int": wint, "mxfp4": mx, "mxfp8": mx,
    "a8w8-int": a8w8_int, "a8w4-int": a8w4_int, "a8w8-fp8": fp8,
}
GROUPED = ("w8-int", "w4-int", "a8w4-int", "a8w8-int")  # the formats whose group is a parameter


def module_of(fmt: str):
    if fmt not in _MODULES:
        raise ValueError(f"unknown quantized format {fmt!r}; choose one of {FORMATS}")
    return _MODULES[fmt]


def default_group(fmt: str, K: int) -> int:
    """The group a format uses when none is given: wint's default, a8w4-int's (32), a8w8-int's (K,
    per channel, unless ``MOE_COMPILE_A8W8_GROUP`` names one), 32 for MX, K per channel."""
    if fmt == "a8w4-int":
        return a8w4_int.DEFAULT_GROUP
    if fmt == "a8w8-int":
        return a8w8_int.default_group() or K
    if fmt in GROUPED:
        return wint.DEFAULT_GROUP
    if fmt in ("mxfp4", "mxfp8"):
        return MX_GROUP
    return K


def pack(fmt: str, w: torch.Tensor, group: int | None = None) -> QuantWeight:
    """W [E, N, K] float -> QuantWeight in ``fmt``; ``group`` only for w8-int / w4-int / a8w4-int /
    a8w8-int (the per-channel forms of the last two: ``a8w4_int.pack(w, group_size=None)``,
    ``a8w8_int.pack(w, group_size=None)``)."""
    mod = module_of(fmt)
    if group is not None and fmt not in GROUPED and group != default_group(fmt, w.shape[-1]):
        raise ValueError(f"{fmt}: the group is fixed ({default_group(fmt, w.shape[-1])}), got {group}")
    if fmt == "a8w4-int":
        return mod.pack(w, group_size=group or a8w4_int.DEFAULT_GROUP)
    if fmt == "a8w8-int":
        return mod.pack(w, group_size=group or a8w8_int.default_group())
    if fmt in GROUPED:
        return mod.pack(w, bits=8 if fmt == "w8-int" else 4, group=group or wint.DEFAULT_GROUP)
    if fmt in ("mxfp4", "mxfp8"):
        return mod.pack(w, fmt)
    return mod.pack(w)


def dequantize(qw: QuantWeight) -> torch.Tensor:
    """-> [E, N, K] fp32."""
    return module_of(qw.fmt).dequantize(qw)


def matmul(x: torch.Tensor, qw: QuantWeight, e: int) -> torch.Tensor:
    """x [T, K] float -> [T, N] fp32: the format's reference matmul on expert e."""
    return module_of(qw.fmt).matmul(x, qw, e)


def concat(parts: list[QuantWeight]) -> QuantWeight:
    """QuantWeights of consecutive experts (same fmt, N, K, group) -> one over all of them."""
    first = parts[0]
    E = sum(p.shape[0] for p in parts)
    bias = torch.cat([p.bias for p in parts]) if first.bias is not None else None
    scale = first.scale if first.fmt == "w16" else torch.cat([p.scale for p in parts])
    data = torch.cat([p.data for p in parts])
    return QuantWeight(first.fmt, data, scale, first.group, (E, *first.shape[1:]), bias)
