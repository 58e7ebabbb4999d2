"""Attention at decode: grouped-query attention without the copies, then few-row SDPA calls onto
``moe_compile::decode_attention``.

1. SDPA on K/V heads repeated in the graph -> SDPA with ``enable_gqa=True`` on the K/V as they are.

Shapes:  B batch, H query heads, G key/value heads, R = H / G, S key length, D head dim.
         x [B, G, S, D] --unsqueeze(2)--> [B, G, 1, S, D] --expand--> [B, G, R, S, D]
           --reshape--> [B, G*R, S, D]   (HF's ``repeat_kv``; or ``repeat_interleave(x, R, dim=1)``)

Why: at decode, a model whose attention mask is not None (a static KV cache always masks its
unused positions) repeats every K/V head R times before SDPA: a copy of the whole cache per layer
and step.  For a Qwen3-30B-A3B-shaped model (G = 4, R = 8, D = 128) at 576 positions that is
75 MB written and read again per decode step over 4 layers, ~5 ms at 30 GB/s — most of a 4-bit
step.  ``enable_gqa=True`` (torch >= 2.5) maps query head h to K/V head h // R, exactly what the
repeat's layout does, so the result is the same (bit for bit on CPU: the same kernel, the same
order of sums).

    matches = find_repeated_kv(graph)      # SDPA calls whose K and V are both repeats
    for m in matches: m.replace()          # SDPA(q, k0, v0, ..., enable_gqa=True)

2. An SDPA call of at most ``MAX_ROWS`` fp32 query rows (a decode step), no dropout, not causal,
   mask None / bool / fp32 -> ``moe_compile::decode_attention(q, k, v, mask, scale)``
   (``ops/decode_attention.py``, the same result): torch's CPU flash kernel blocks over query rows, of which
   decode has one, and takes ~0.3 ms a layer for what reading the cache costs ~0.1 ms (576 cached
   positions, 32/4 heads of 128).

    for m in find_decode_attention(graph): m.replace()

Only CPU inference graphs (the pipeline's choice: ``torch.is_grad_enabled()`` False while tracing);
the repeat's nodes are erased where nothing else reads them.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.fx as fx

from moe_compile.passes.graph import target_name

from moe_compile.passes.linears import ENV  # MOE_COMPILE_DENSE=0 leaves attention alone too

MAX_ROWS = 16  # query rows the decode kernel serves (kernels/cpu/attention.py: MAX_ROWS)
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)


@dataclasses.dataclass(frozen=True)
class RepeatedKV:
    sdpa: fx.Node
    key: fx.Node  # [B, G, S, D], before the repeat
    value: fx.Node

    def replace(self) -> None:
        graph = self.sdpa.graph
        q, k, v = self.sdpa.args[:3]
        kwargs = {**self.sdpa.kwargs, "enable_gqa": True}
        with graph.inserting_before(self.sdpa):
            new = graph.call_function(self.sdpa.target, (q, self.key, self.value, *self.sdpa.args[3:]), kwargs)
        new.meta.update(self.sdpa.meta)
        self.sdpa.replace_all_uses_with(new)
        graph.erase_node(self.sdpa)
        for repeated, base in ((k, self.key), (v, self.value)):
            _erase_dead_chain(graph, repeated, base)


def _erase_dead_chain(graph: fx.Graph, node: fx.Node, base: fx.Node) -> None:
    """Erase the repeat's own nodes (reshape, expand, the inserted dim) that nothing reads now.
    Not a graph-wide dead-code pass: that would drop in-place method calls (a static cache's
    ``index_copy_``) whose results nobody reads."""
    while isinstance(node, fx.Node) and node is not base and not node.users:
        parent = node.args[0]
        graph.erase_node(node)
        node = parent


def _value(node) -> torch.Tensor | None:
    """The node's traced example tensor, or None (not a node, or not a tensor)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _shape(node) -> tuple | None:
    value = _value(node)
    return tuple(value.shape) if value is not None else None


def unrepeated(node: fx.Node) -> tuple[fx.Node, int] | None:
    """(x, R) when node is x [B, G, S, D] with each head repeated R times along dim 1, else None."""
    out = _shape(node)
    if out is None or len(out) != 4:
        return None
    if node.op in ("call_function", "call_method") and target_name(node) == "repeat_interleave":
        return _interleaved(node, out)
    if not (node.op == "call_method" and node.target in ("reshape", "view")):
        return None
    expand = node.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_method" and expand.target == "expand"):
        return None
    inserted = expand.args[0]
    x = _inserted_dim2(inserted)
    xs, es = _shape(x), _shape(expand)
    if xs is None or es is None or len(xs) != 4 or len(es) != 5:
        return None
    B, G, S, D = xs
    R = es[2]
    if es != (B, G, R, S, D) or out != (B, G * R, S, D):
        return None
    return x, R


def _inserted_dim2(node) -> fx.Node | None:
    """x when node is x[:, :, None] (any trailing full slices) or x.unsqueeze(2)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method" and node.target == "unsqueeze" and tuple(node.args[1:]) in ((2,), (-3,)):
        return node.args[0]
    if node.op == "call_function" and target_name(node) == "getitem" and isinstance(node.args[1], tuple):
        index = node.args[1]
        full = slice(None, None, None)
        if len(index) >= 3 and index[0] == full and index[1] == full and index[2] is None \
                and all(i == full or i is Ellipsis for i in index[3:]):
            return node.args[0]
    return None


def _interleaved(node: fx.Node, out: tuple) -> tuple[fx.Node, int] | None:
    x = node.args[0]
    repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    xs = _shape(x)
    if not isinstance(repeats, int) or dim not in (1, -3) or xs is None or len(xs) != 4:
        return None
    B, G, S, D = xs
    return (x, repeats) if out == (B, G * repeats, S, D) else None


def find_repeated_kv(graph: fx.Graph) -> list[RepeatedKV]:
    out = []
    for node in graph.nodes:
        if not (node.op == "call_function" and node.target in _SDPA) or len(node.args) < 3:
            continue
        if node.kwargs.get("enable_gqa") or len(node.args) > 7:
            continue
        q, k, v = node.args[:3]
        qs, ks, vs = _shape(q), unrepeated(k), unrepeated(v)
        value = _value(q)
        if qs is None or ks is None or vs is None or value is None or value.device.type != "cpu":
            continue
        (k0, rk), (v0, rv) = ks, vs
        if rk == rv and rk > 1 and len(qs) == 4 and qs[1] == _shape(k0)[1] * rk:
            out.append(RepeatedKV(node, k0, v0))
    return out


@dataclasses.dataclass(frozen=True)
class DecodeAttention:
    sdpa: fx.Node
    args: tuple  # (q, k, v, mask or None, scale)

    def replace(self) -> None:
        graph = self.sdpa.graph
        with graph.inserting_before(self.sdpa):
            new = graph.call_function(torch.ops.moe_compile.decode_attention.default, self.args)
        new.meta.update(self.sdpa.meta)
        self.sdpa.replace_all_uses_with(new)
        graph.erase_node(self.sdpa)


def _sdpa_arguments(node: fx.Node) -> dict | None:
    """SDPA's arguments by name (defaults filled in), or None for an argument it does not take."""
    if len(node.args) > len(_SDPA_PARAMS) or any(k not in _SDPA_PARAMS for k in node.kwargs):
        return None
    named = dict(zip(_SDPA_PARAMS, node.args)) | dict(node.kwargs)
    return {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False} | named


def decode_attention_of(node: fx.Node) -> DecodeAttention | None:
    """The decode-attention call for one SDPA node, or None where it is not one (a literal no-dropout,
    non-causal call of <= MAX_ROWS fp32 CPU query rows and a None / bool / fp32 mask)."""
    named = _sdpa_arguments(node)
    if named is None or named["dropout_p"] != 0.0 or named["is_causal"] is not False:
        return None
    q, k, v, mask = (_value(named[n]) for n in ("query", "key", "value", "attn_mask"))
    # heads, rows and head dim static; the batch and the cache length may be symbolic (a cache of
    # another length on the next generate call recompiles with a dynamic S)
    if q is None or k is None or v is None or q.dim() != 4 or k.dim() != 4 or \
            not all(isinstance(d, int) for d in (*q.shape[1:], k.shape[1], k.shape[3])):
        return None
    if q.device.type != "cpu" or q.dtype != torch.float32 or k.dtype != q.dtype or v.dtype != q.dtype:
        return None
    if v.dim() != 4 or tuple(k.shape) != tuple(v.shape) or q.shape[0] != k.shape[0]:
        return None
    (B, H, L, D), G = q.shape, k.shape[1]
    if L > MAX_ROWS or k.shape[3] != D or D % 16 or G == 0 or H % G or (H != G and named["enable_gqa"] is not True):
        return None
    if named["attn_mask"] is not None and (mask is None or mask.dtype not in (torch.bool, torch.float32)):
        return None
    scale = named["scale"]
    if scale is not None and not isinstance(scale, (int, float)):
        return None
    scale = float(scale) if scale is not None else D ** -0.5  # SDPA's default
    return DecodeAttention(node, (named["query"], named["key"], named["value"], named["attn_mask"], scale))


def find_decode_attention(graph: fx.Graph) -> list[DecodeAttention]:
    found = (decode_attention_of(n) for n in graph.nodes if n.op == "call_function" and n.target in _SDPA)
    return [m for m in found if m is not None]


def run_attention_pass(gm: fx.GraphModule) -> str | None:
    """Rewrite the graph's repeated-K/V and decode attention; the report's line about it (None when none)."""
    if os.environ.get(ENV) == "0" or torch.is_grad_enabled():
        return None
    repeated = find_repeated_kv(gm.graph)
    for match in repeated:
        match.replace()
    import moe_compile.ops.decode_attention  # noqa: F401  registers moe_compile::decode_attention

    decode = find_decode_attention(gm.graph)
    for match in decode:
        match.replace()
    if not repeated and not decode:
        return None
    gm.recompile()
    said = []
    if repeated:
        said.append(f"{len(repeated)} SDPA call(s) on repeated K/V heads run with enable_gqa=True (no K/V copies)")
    if decode:
        said.append(f"{len(decode)} decode SDPA call(s) (<= {MAX_ROWS} query rows) run on moe_compile::decode_attention")
    return "attention: " + "; ".join(said)
