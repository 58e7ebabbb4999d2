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
is called with PackedWeight weights, ``PackedWeight.__torch_dispatch__`` asks ``route`` here, which
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


# ---- routing from PackedWeight.__torch_dispatch__ ----

def _moe_ops() -> dict:
    """The fused MoE op overloads -> the index of their ``quant`` argument (None: no quant argument)."""
    from moe_compile import ops  # noqa: F401  (registers them)

    m = torch.ops.moe_compile
    return {m.fused_moe_infer.default: None, m.fused_moe.default: None, m.fused_moe_quant.default: 15}


def route(func, args, kwargs):
    """The packed op for ``func`` called on PackedWeight weights, or NotImplemented (the caller then
    runs ``func`` on the dequantized weights)."""
    if kwargs or getattr(func, "namespace", None) != "moe_compile":
        return NotImplemented
    if func is torch.ops.moe_compile.dense_linear.default:
        return _route_linear(*args)
    quant_at = _moe_ops().get(func, NotImplemented)
    if quant_at is NotImplemented:
        return NotImplemented
    return _route_moe(args, args[quant_at] if quant_at is not None else "none")


def _route_linear(x, weight, bias, fmt, group):
    from moe_compile.quant.packed import is_packed

    if not is_packed(weight) or is_packed(bias) or is_packed(x) or weight.dim() != 2:
        return NotImplemented
    return torch.ops.moe_compile.dense_linear_packed(x, weight.qdata, weight.qscale, bias,
                                                     run_format(weight.fmt, fmt), weight.group, list(weight.shape),
                                                     weight.packing)


def packed_layout_refusal(fc1, fc1_up, fc2, biases, gate_up, transposed, activation, weight_on) -> str | None:
    """Why packed experts cannot run on the packed kernels as the op is called, or None."""
    from moe_compile.quant.packed import is_packed

    if len(fc1) != 1 or len(fc2) != 1 or fc1_up or not (is_packed(fc1[0]) and is_packed(fc2[0])):
        return "the packed kernels take one stacked packed FC1 [E, 2F, H] and FC2 [E, H, F]"
    if any(biases) or gate_up != "concat" or transposed or activation != "silu" or weight_on == "input":
        return "the packed kernels run SwiGLU experts without biases, gate and up concatenated, [out, in]"
    if fc1[0].fmt != fc2[0].fmt or fc1[0].packing != fc2[0].packing:
        return f"FC1 is packed in {fc1[0].fmt} ({fc1[0].packing}) and FC2 in {fc2[0].fmt} ({fc2[0].packing})"
    return None


def _route_moe(args, asked: str):
    x, ids, weights, fc1, fc1_up, fc2, b1, b1u, b2, gate_up, transposed, activation, limit, _alpha, weight_on = args[:15]
    if packed_layout_refusal(fc1, fc1_up, fc2, (b1, b1u, b2), gate_up, transposed, activation, weight_on):
        return NotImplemented
    w1, w2 = fc1[0], fc2[0]
    E, F2, H = w1.shape
    return torch.ops.moe_compile.fused_moe_packed(x, ids, weights, w1.qdata, w1.qscale, w2.qdata, w2.qscale,
                                                  run_format(w1.fmt, asked), [w1.group, w2.group], [E, H, F2 // 2],
                                                  weight_on, float(limit), w1.packing)
