"""A model weight kept packed: ``PackedWeight``, a tensor subclass holding one ``QuantWeight``.

Shapes:  E experts, N output rows, K reduction (input) width.  A PackedWeight is logically an
expert stack [E, N, K] (what HF keeps as ``gate_up_proj`` / ``down_proj``) or a linear's weight
[N, K], in the model's dtype; physically it is the format's packed bytes and scales
(``quant/common.py``'s table), never a full-precision copy.

Why a tensor subclass (torchao's approach for quantized weights): the packed tensor *is* the
model's parameter, so ``state_dict``, ``named_parameters``, ``explain()`` and the graph dump see
it under its own name, and ``torch.compile`` traces it like any parameter.  What each operation
does with it:

  operation                                      result
  detach / alias / clone                         the same packed bytes (what ``nn.Parameter`` needs)
  ``w[e]`` (select on the expert dim)            expert e's [N, K] PackedWeight, no copy
  ``w[ids]`` (an integer index tensor)           those experts' PackedWeight (their bytes copied)
  ``.to(dtype)``                                 the same bytes, another logical dtype
  ``w.transpose(-2, -1)`` / ``w.t()``            the same bytes as a transposed view (flagged)
  ``F.embedding(ids, w)``                        only the rows asked for, dequantized
  transformers' ``grouped_mm_fallback``          each expert with tokens dequantized alone
  the fused MoE ops / ``dense_linear``           the packed kernels on the bytes themselves
                                                 (``ops/packed.py``; ``route`` below), also inside compiled graphs
  anything else                                  run on the dequantized weight: the format's exact
                                                 meaning (``quant.dequantize``), the reference path

The last row is what eager runs and what the backend's proof runs on, so a model loaded packed
gives in eager exactly the logits of the same model with the dequantized weights, and the compiled
model is compared against that.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from moe_compile.quant.common import QuantWeight

aten = torch.ops.aten
# rows:   the canonical QuantWeight's data and scale (quant/common.py's table)
# panels: qgemm's panels of them (kernels/cpu/qgemm.py, ``panels_only``: 16 rows interleaved), the
#         bytes both the prefill tiles and the decode rows16 loops read, so a 4- or 8-bit weight is
#         held once; the canonical form is made per call for the reference path only
PACKINGS = ("rows", "panels")
_SAME_BYTES = (aten.detach.default, aten.alias.default, aten.clone.default)


class PackedWeight(torch.Tensor):
    """One weight in a ``moe_compile.quant`` format; see the module docstring."""

    qdata: torch.Tensor  # rows: the QuantWeight's data, [E, N, K'] (3-D) or [1, N, K'] (a linear);
    qscale: torch.Tensor  # its scale (shape per format).  panels: qgemm's panels of both (PACKINGS)

    @staticmethod
    def __new__(cls, qdata, qscale, fmt: str, group: int, shape: tuple, dtype: torch.dtype, packing: str = "rows",
                transposed: bool = False):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata, qscale, fmt: str, group: int, shape: tuple, dtype: torch.dtype, packing: str = "rows",
                 transposed: bool = False):
        if len(shape) not in (2, 3):
            raise ValueError(f"PackedWeight: a [E, N, K] expert stack or an [N, K] weight, got shape {tuple(shape)}")
        if packing not in PACKINGS:
            raise ValueError(f"PackedWeight: packing must be one of {PACKINGS}, got {packing!r}")
        self.qdata, self.qscale, self.fmt, self.group, self.packing = qdata, qscale, fmt, int(group), packing
        self.transposed = bool(transposed)  # a view with the last two dims swapped (what a graph's .t() makes)

    @classmethod
    def of(cls, qw: QuantWeight, dtype: torch.dtype = torch.float32, linear: bool = False,
           packing: str = "rows") -> "PackedWeight":
        """``qw`` as a weight of logical dtype ``dtype``: [E, N, K], or [N, K] with ``linear`` (E = 1);
        ``packing="panels"`` keeps qgemm's panels of it instead of its canonical bytes."""
        if qw.bias is not None:
            raise ValueError("PackedWeight: per-channel a8w4-int (with its MSD bias) is not kept packed; "
                             "use the group-wise form (group 32)")
        if linear and qw.shape[0] != 1:
            raise ValueError(f"PackedWeight.of(linear=True) takes one [1, N, K] weight, got {qw.shape}")
        shape = tuple(qw.shape[1:]) if linear else tuple(qw.shape)
        if packing == "panels":
            from moe_compile.kernels.cpu import qgemm

            p = qgemm.panels_only(qw)
            return cls(p.data, p.scale, qw.fmt, qw.group, shape, dtype, "panels")
        return cls(qw.data, qw.scale, qw.fmt, qw.group, shape, dtype)

    @property
    def logical_shape(self) -> tuple:
        """[E, N, K] ([1, N, K] for a linear): the QuantWeight's shape."""
        shape = (*self.shape[:-2], self.shape[-1], self.shape[-2]) if self.transposed else tuple(self.shape)
        return shape if self.dim() == 3 else (1, *shape)

    def quant_weight(self) -> QuantWeight:
        """The canonical QuantWeight [E, N, K] ([1, N, K] for a linear): sharing these bytes (rows), a
        new tensor (panels: the reference path's only).  Of the weight under a transposed view."""
        if self.packing == "panels":
            from moe_compile.kernels.cpu import qgemm

            return qgemm.canonical_from_panels(self.fmt, self.qdata, self.qscale, self.group, self.logical_shape)
        return QuantWeight(self.fmt, self.qdata, self.qscale, self.group, self.logical_shape)

    def dequantize(self) -> torch.Tensor:
        """The weight as a plain tensor of its logical shape and dtype (the format's exact meaning)."""
        from moe_compile.quant.formats import dequantize

        w = dequantize(self.quant_weight()).reshape(self.logical_shape[-self.dim():]).to(self.dtype)
        return w.transpose(-2, -1) if self.transposed else w

    @property
    def packed_nbytes(self) -> int:
        return self.qdata.nbytes + self.qscale.nbytes

    def __repr__(self) -> str:  # never the dequantized values: printing a 60 GB stack must not build it
        return (f"PackedWeight({self.fmt}, group={self.group}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"packing={self.packing}{', transposed' if self.transposed else ''})")

    def __tensor_flatten__(self):
        return ["qdata", "qscale"], (self.fmt, self.group, tuple(self.shape), self.dtype, self.packing, self.transposed)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return PackedWeight(inner["qdata"], inner["qscale"], *meta)

    def _like(self, qdata, qscale, shape=None, dtype=None, transposed=None) -> "PackedWeight":
        return PackedWeight(qdata, qscale, self.fmt, self.group, tuple(shape or self.shape), dtype or self.dtype,
                            self.packing, self.transposed if transposed is None else transposed)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        special = _SPECIAL.get(func) or _BY_NAME.get(func.name())
        if special is not None:
            out = special(*args, **kwargs)
            if out is not NotImplemented:
                return out
        routed = route(func, args, kwargs)
        if routed is not NotImplemented:
            return routed
        return func(*tree_map(_plain, args), **tree_map(_plain, kwargs))


def _plain(t):
    return t.dequantize() if isinstance(t, PackedWeight) else t


def _same_bytes(func):
    def run(w, *rest, **kwargs):
        return w._like(func(w.qdata), func(w.qscale))
    return run


def _select(w, dim, index):
    """``w[e]`` of an expert stack: expert e's bytes, a PackedWeight [N, K] (what a loop over the
    experts, and the backend's proof, index)."""
    if w.dim() != 3 or dim != 0:
        return NotImplemented
    return w._like(w.qdata[index:index + 1], w.qscale[index:index + 1], shape=w.shape[1:])


def _index(w, indices):
    """``w[ids]`` of an expert stack with one integer index tensor (``stack[expert_idx]`` in an
    experts loop): those experts' bytes, a PackedWeight [N, K] (0-d ids) or [n, N, K]."""
    if w.dim() != 3 or len(indices) != 1 or indices[0] is None or indices[0].dtype not in (torch.int64, torch.int32) \
            or indices[0].dim() > 1:
        return NotImplemented
    ids = indices[0].reshape(-1).to(torch.int64)
    data, scale = w.qdata.index_select(0, ids), w.qscale.index_select(0, ids)
    shape = tuple(w.shape[1:]) if indices[0].dim() == 0 else (ids.numel(), *w.shape[1:])
    return w._like(data, scale, shape=shape)


def _transpose(w, dim0, dim1):
    """``w.transpose(-2, -1)``: the same bytes, the view flagged (any other pair: NotImplemented)."""
    pair = {dim0 % w.dim(), dim1 % w.dim()}
    if pair != {w.dim() - 2, w.dim() - 1}:
        return NotImplemented
    shape = (*w.shape[:-2], w.shape[-1], w.shape[-2])
    return w._like(w.qdata, w.qscale, shape=shape, transposed=not w.transposed)


def _to_copy(w, *, dtype=None, device=None, layout=None, pin_memory=None, non_blocking=False, memory_format=None):
    """``.to(dtype)``: the same packed bytes under another logical dtype (a float dtype only)."""
    if (device is not None and torch.device(device) != w.device) or not (dtype is None or dtype.is_floating_point):
        return NotImplemented
    return w._like(w.qdata, w.qscale, dtype=dtype or w.dtype)


def _embedding(w, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Rows ``ids`` of an [N, K] weight, dequantized (an embedding table is never built whole)."""
    if w.dim() != 2 or w.packing != "rows" or w.transposed:
        return NotImplemented
    from moe_compile.quant.formats import dequantize

    flat = ids.reshape(-1)
    qw = w.quant_weight()
    scale = qw.scale[0, flat][None] if qw.scale.dim() == 3 else qw.scale  # w16 has no scales
    rows = QuantWeight(qw.fmt, qw.data[0, flat][None], scale, qw.group,
                       (1, flat.numel(), qw.shape[2]))
    return dequantize(rows)[0].to(w.dtype).reshape(*ids.shape, w.shape[1])


_SPECIAL = {
    **{f: _same_bytes(f) for f in _SAME_BYTES},
    aten.select.int: _select,
    aten.index.Tensor: _index,
    aten.transpose.int: _transpose,
    aten.t.default: lambda w: _transpose(w, 0, 1) if w.dim() == 2 else NotImplemented,
    aten._to_copy.default: _to_copy,
    aten.embedding.default: _embedding,
}


def _grouped_mm(x, w, offs):
    """transformers' ``grouped_mm_fallback`` (its experts' loop as one op: x [S, K] sorted by
    expert, w [E, K, N], offs [E] cumulative rows) on a packed stack: each expert with rows
    dequantized alone, the op's own mm on it (what it computes on the plain weight)."""
    if not isinstance(w, PackedWeight) or isinstance(x, PackedWeight) or w.dim() != 3 or _traced(offs):
        return NotImplemented
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e].dequantize(), out=out[start:end])
        start = end
    return out


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tracer's stand-in (a fake tensor under Dynamo / AOTAutograd): its values
    are unknown, so the op's own fake kernel must answer."""
    return isinstance(t, torch._subclasses.FakeTensor) or torch._C._get_dispatch_mode(
        torch._C._TorchDispatchModeKey.FAKE) is not None


# ops of other libraries, by name (they exist only once the library is imported)
_BY_NAME = {"transformers::grouped_mm_fallback": _grouped_mm}


def is_packed(t) -> bool:
    return isinstance(t, PackedWeight)


# ---- routing of the fused ops called on PackedWeight weights to the ops that read the bytes ----

def _moe_ops() -> dict:
    """The fused MoE op overloads -> the index of their ``quant`` argument (None: no quant argument)."""
    import moe_compile.ops  # noqa: F401  registers them

    m = torch.ops.moe_compile
    return {m.fused_moe_infer.default: None, m.fused_moe.default: None, m.fused_moe_quant.default: 15}


def route(func, args, kwargs):
    """The packed op for ``func`` called on PackedWeight weights, or NotImplemented (the caller then
    runs ``func`` on the dequantized weights)."""
    if kwargs or getattr(func, "namespace", None) != "moe_compile":
        return NotImplemented
    import moe_compile.ops.packed  # noqa: F401  registers the packed ops

    if func is torch.ops.moe_compile.dense_linear.default:
        return _route_linear(*args)
    quant_at = _moe_ops().get(func, NotImplemented)
    if quant_at is NotImplemented:
        return NotImplemented
    return _route_moe(args, args[quant_at] if quant_at is not None else "none")


def _route_linear(x, weight, bias, fmt, group):
    from moe_compile.ops import packed as packed_ops

    if not is_packed(weight) or is_packed(bias) or is_packed(x) or weight.dim() != 2:
        return NotImplemented
    return torch.ops.moe_compile.dense_linear_packed(x, weight.qdata, weight.qscale, bias,
                                                     packed_ops.run_format(weight.fmt, fmt), weight.group, list(weight.shape),
                                                     weight.packing)


def packed_layout_refusal(fc1, fc1_up, fc2, biases, gate_up, transposed, activation, weight_on) -> str | None:
    """Why packed experts cannot run on the packed kernels as the op is called, or None."""
    if len(fc1) != 1 or len(fc2) != 1 or fc1_up or not (is_packed(fc1[0]) and is_packed(fc2[0])):
        return "the packed kernels take one stacked packed FC1 [E, 2F, H] and FC2 [E, H, F]"
    if any(biases) or gate_up != "concat" or transposed or activation != "silu" or weight_on == "input":
        return "the packed kernels run SwiGLU experts without biases, gate and up concatenated, [out, in]"
    if fc1[0].fmt != fc2[0].fmt or fc1[0].packing != fc2[0].packing:
        return f"FC1 is packed in {fc1[0].fmt} ({fc1[0].packing}) and FC2 in {fc2[0].fmt} ({fc2[0].packing})"
    return None


def _route_moe(args, asked: str):
    from moe_compile.ops import packed as packed_ops

    x, ids, weights, fc1, fc1_up, fc2, b1, b1u, b2, gate_up, transposed, activation, limit, _alpha, weight_on = args[:15]
    if packed_layout_refusal(fc1, fc1_up, fc2, (b1, b1u, b2), gate_up, transposed, activation, weight_on):
        return NotImplemented
    w1, w2 = fc1[0], fc2[0]
    E, F2, H = w1.shape
    return torch.ops.moe_compile.fused_moe_packed(x, ids, weights, w1.qdata, w1.qscale, w2.qdata, w2.qscale,
                                                  packed_ops.run_format(w1.fmt, asked), [w1.group, w2.group], [E, H, F2 // 2],
                                                  weight_on, float(limit), w1.packing)
