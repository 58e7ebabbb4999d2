"""The operators that read ``PackedWeight`` bytes, and the routing of the fused ops to them.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token; a linear
x [..., Kin] with weight [N, Kin].

    fused_moe_packed(x [T, H], topk_ids [T, K], topk_weights [T, K],
                     fc1_data, fc1_scale, fc2_data, fc2_scale,      # FC1 [E, 2F, H], FC2 [E, H, F] packed
                     fmt, groups [g1, g2], dims [E, H, F], weight_on, limit) -> y [T, H] (x's dtype)
    dense_linear_packed(x [..., Kin], data, scale, bias, fmt, group, dims [N, Kin]) -> y [..., N]

``fmt`` is the format the kernel runs the bytes in: the weight's own, or its twin that reads the
same bytes with int8 activations (``w4-int`` <-> ``a8w4-int``, ``w8-int`` <-> ``a8w8-int``
group-wise: the data and the fp16 group scales are one layout).

When the fused MoE op (``fused_moe_infer`` / ``fused_moe_quant`` / ``fused_moe``) or ``dense_linear``
is called with PackedWeight weights, ``PackedWeight.__torch_dispatch__`` asks ``quant/packed.py``'s ``route``, which
calls these ops on the weights' inner tensors.  Inside ``torch.compile`` that happens while
AOTAutograd traces the subclass away, so the compiled graph calls these ops on the packed bytes:
no weight is ever dequantized whole.  The kernels are the quantized CPU kernels every packed layer
runs (``kernels/cpu/qdecode.py`` for decode, ``qgemm.py`` for prefill, ``dense.py`` for linears).
"""

from __future__ import annotations

import weakref

import torch

from moe_compile.ir import FFNAttrs
from moe_compile.quant.common import FOUR_BIT, QuantWeight

_LIB = torch.library.Library("moe_compile", "FRAGMENT")
_LIB.define("fused_moe_packed(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor fc1_data, Tensor fc1_scale, "
            "Tensor fc2_data, Tensor fc2_scale, str fmt, int[] groups, int[] dims, str weight_on, float limit, "
            "str layout) -> Tensor")
_LIB.define("dense_linear_packed(Tensor x, Tensor data, Tensor scale, Tensor? bias, str fmt, int group, int[] dims, "
            "str layout) -> Tensor")

# Formats that read the same bytes: weight-only and int8-activation forms of one packing.
TWINS = {"w4-int": "a8w4-int", "a8w4-int": "w4-int", "w8-int": "a8w8-int", "a8w8-int": "w8-int"}


def run_format(weight_fmt: str, asked: str) -> str:
    """The format packed ``weight_fmt`` bytes run in when ``asked`` ("none"/"auto": their own)."""
    if asked in ("none", "auto", "", weight_fmt):
        return weight_fmt
    if TWINS.get(weight_fmt) == asked:
        return asked
    raise ValueError(f"moe_compile: the weights were loaded packed in {weight_fmt}, which cannot run as {asked!r}; "
                     f"ask for {weight_fmt!r}" + (f" or {TWINS[weight_fmt]!r}" if weight_fmt in TWINS else "")
                     + " (or 'none': the loaded format), or load the model again with quant=" + repr(asked))


def _quant(fmt: str, data, scale, group: int, shape, layout: str = "rows") -> QuantWeight:
    """The QuantWeight the kernels are called with: the canonical bytes, or (panels) a view of the
    panels with the canonical shapes, which only the kernels that read panels are given."""
    shape = tuple(int(d) for d in shape)
    if layout == "panels":
        E, N, K = shape
        kb = K // 2 if fmt in FOUR_BIT else K
        data = data.view(torch.int8 if fmt in ("w8-int", "a8w8-int") else torch.uint8).view(E, N, kb)
        scale = scale.view(E, N, -1)
    return QuantWeight(fmt, data, scale, group, shape)


def _panels(w: QuantWeight, data, scale):
    from moe_compile.kernels.cpu import qgemm

    return qgemm.QGemmPack(w.fmt, qgemm._code(w), data, scale, None, w.group, tuple(w.shape))


# ---- the fused MoE op on packed experts ----

_CACHES: dict = {}  # (data pointers, fmt) -> (weakref to FC1's data, the kernels' pack cache)


def _kernel_cache(d1: torch.Tensor, d2: torch.Tensor, fmt: str) -> dict:
    """The kernels' own repacked tiles of one packed layer, kept while its bytes live."""
    key = (d1.data_ptr(), d2.data_ptr(), fmt)
    hit = _CACHES.get(key)
    if hit is not None and hit[0]() is d1:
        return hit[1]
    cache: dict = {}
    _CACHES[key] = (weakref.ref(d1, lambda _ref, key=key, caches=_CACHES: caches.pop(key, None)), cache)
    return cache


def _fused_moe_packed(x, ids, weights, d1, s1, d2, s2, fmt, groups, dims, weight_on, limit, layout):
    from moe_compile.kernels.cpu import qdecode, qgemm, quant as cpu_quant

    E, H, F = dims
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    reg = cpu_quant.regime(x.shape[0])
    mod, why = cpu_quant.kernel_for(fmt, reg, E, H, F)
    if mod is None:
        raise ValueError(f"moe_compile: no native kernel runs the packed {fmt} experts in the {reg} regime here "
                         f"(T={x.shape[0]}): {why}")
    attrs = FFNAttrs("concat", False, "silu", limit, 1.702, weight_on)
    cache = _kernel_cache(d1, d2, fmt)
    w1, w2, rows16 = cache.get("roles") or _roles(cache, fmt, d1, s1, d2, s2, groups, (E, H, F), layout)
    args = (x.float().contiguous(), ids.long().contiguous(), weights.float().contiguous(), w1, w2, attrs, cache)
    if layout == "rows":
        return mod.run(*args).to(x.dtype)
    # panels alone: qgemm reads them at any T, qdecode's rows16 loops where both roles have them
    if mod is qdecode and rows16:
        return qdecode.run(*args, canonical=False).to(x.dtype)
    return qgemm.run(*args).to(x.dtype)


def _roles(cache: dict, fmt, d1, s1, d2, s2, groups, dims, layout) -> tuple:
    """(FC1, FC2 QuantWeights, whether qdecode's rows16 loops read both), made once per layer: its
    panels (layout "panels") put in the layer's cache as the kernels' own."""
    from moe_compile.kernels.cpu import qdecode, qgemm

    E, H, F = dims
    w1 = _quant(fmt, d1, s1, groups[0], (E, 2 * F, H), layout)
    w2 = _quant(fmt, d2, s2, groups[1], (E, H, F), layout)
    if layout == "panels":
        qgemm.adopt(w1, _panels(w1, d1, s1), cache)
        qgemm.adopt(w2, _panels(w2, d2, s2), cache)
    rows16 = qdecode.rows16_runs(w1) and qdecode.rows16_runs(w2) and F % qdecode.ROWS16 == 0
    cache["roles"] = (w1, w2, rows16)
    return cache["roles"]


def _fused_moe_packed_fake(x, ids, weights, d1, s1, d2, s2, fmt, groups, dims, weight_on, limit, layout):
    return x.new_empty(x.shape)


_LIB.impl("fused_moe_packed", _fused_moe_packed, "CPU")
torch.library.register_fake("moe_compile::fused_moe_packed", lib=_LIB)(_fused_moe_packed_fake)


# ---- the dense linear on a packed weight ----

def _dense_linear_packed(x, data, scale, bias, fmt, group, dims, layout):
    from moe_compile.kernels.cpu import dense

    w = _quant(fmt, data, scale, group, (1, *dims), layout)
    return dense.linear_packed(x, w, bias, data, _panels(w, data, scale) if layout == "panels" else None)


def _dense_linear_packed_fake(x, data, scale, bias, fmt, group, dims, layout):
    return x.new_empty(*x.shape[:-1], dims[0])


_LIB.impl("dense_linear_packed", _dense_linear_packed, "CPU")
torch.library.register_fake("moe_compile::dense_linear_packed", lib=_LIB)(_dense_linear_packed_fake)
