"""The dense-linear pass: every other linear of an inference graph -> ``moe_compile::dense_linear``.

Shapes:  T rows, K input width, N output width.  x [..., K], weight [N, K] -> [..., N].

    matches = find_linears(gm, example_inputs, fmt)    # F.linear calls on model weights
    for m in matches: m.replace()                       # one dense_linear call each

Runs after the MoE pass (the experts it fused are gone from the graph), on CPU inference graphs
only (``torch.is_grad_enabled()`` is False while Dynamo traces: the graph is never
differentiated).  A linear is taken when its weight is a 2-D fp32 / bf16 CPU tensor the graph
receives as an input (a model parameter or buffer); only parameters are packed in a format
(one pack per weight, kept between calls), other weights keep their dtype.
A router — a linear whose output reaches a top-k through elementwise ops — keeps its weight's
dtype whatever ``fmt`` says: its bytes are a rounding error of the step, and quantizing it changes
which experts run.  Every linear left as it is is counted in the report's note with its reason.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter

import torch
import torch.fx as fx

from moe_compile.ops.packed import run_format
from moe_compile.passes.clusters import is_topk
from moe_compile.quant.packed import is_packed

log = logging.getLogger("moe_compile")
ENV = "MOE_COMPILE_DENSE"  # "0": leave every dense linear to the inner compiler
_LINEAR_TARGETS = (torch._C._nn.linear, torch.nn.functional.linear)
_DTYPES = (torch.float32, torch.bfloat16)
# Ops between a router's linear and its top-k (scores: softmax / sigmoid, casts, bias, scale).
_ROUTER_PATH_DEPTH = 6


@dataclasses.dataclass(frozen=True)
class LinearMatch:
    node: fx.Node
    fmt: str  # what the weight is read in: "none" or a format name
    weight_bytes: int  # bytes one call reads in that format
    router: bool  # its output picks experts (kept in its own dtype)
    group: int = 0  # the format's weight group; 0: the format's default (dense_group says which)
    loaded: str = ""  # the format a weight loaded packed (a PackedWeight) runs in; "" for the others

    def replace(self) -> None:
        x, weight, bias = _operands(self.node)
        graph = self.node.graph
        with graph.inserting_before(self.node):
            new = graph.call_function(torch.ops.moe_compile.dense_linear.default, (x, weight, bias, self.fmt, self.group))
        new.meta.update(self.node.meta)
        self.node.replace_all_uses_with(new)
        graph.erase_node(self.node)


def _operands(node: fx.Node):
    args = list(node.args) + [None] * (3 - len(node.args))
    x, weight, bias = args[:3]
    return x, node.kwargs.get("weight", weight), node.kwargs.get("bias", bias)


def find_linears(gm: fx.GraphModule, example_inputs, fmt: str) -> tuple[list[LinearMatch], Counter]:
    """(matches, why each other linear is left: reason -> count)."""
    inputs = _graph_inputs(gm, example_inputs)
    matches, left = [], Counter()
    for node in gm.graph.nodes:
        if not (node.op == "call_function" and node.target in _LINEAR_TARGETS):
            continue
        weight = inputs.get(_operands(node)[1])
        reason = _refusal(node, weight)
        if reason:
            left[reason] += 1
            continue
        router = _is_router(node)
        if is_packed(weight):  # loaded packed: read in its own format (or its int8-activation twin)
            use = "none" if fmt == "none" else run_format(weight.fmt, fmt)
            matches.append(LinearMatch(node, use, weight.packed_nbytes, router, weight.group,
                                       loaded=run_format(weight.fmt, use)))
            continue
        # only a model's parameters are packed: a weight handed in per call would be packed per call
        use = "none" if router or not isinstance(weight, torch.nn.Parameter) else fmt
        matches.append(LinearMatch(node, use, _bytes(weight, use), router, dense_group(use, weight.shape[1])))
    return matches, left


def _graph_inputs(gm: fx.GraphModule, example_inputs) -> dict:
    """Node -> the real tensor for placeholders (by position) and get_attr weights."""
    out = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        out[node] = value
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part, None)
            out[node] = value
    return out


def _refusal(node: fx.Node, weight) -> str | None:
    if not isinstance(weight, torch.Tensor) or isinstance(weight, torch._subclasses.FakeTensor):
        return "weight is computed in the graph, not a model weight"
    if weight.dim() != 2 or weight.dtype not in _DTYPES or weight.device.type != "cpu":
        return f"weight {weight.dtype} {tuple(weight.shape)} on {weight.device} (the kernels take 2-D fp32 / bf16 CPU)"
    x = _operands(node)[0].meta.get("example_value")
    if not isinstance(x, torch.Tensor) or x.dtype != weight.dtype or x.device.type != "cpu":
        return "input not a CPU tensor of the weight's dtype"
    return None


def _is_router(node: fx.Node) -> bool:
    """Whether the linear's output reaches a top-k through at most a few single-input ops."""
    frontier = [node]
    for _ in range(_ROUTER_PATH_DEPTH):
        frontier = [u for n in frontier for u in n.users]
        if any(is_topk(u) for u in frontier):
            return True
    return False


def dense_group(fmt: str, K: int) -> int:
    """The weight group a dense linear packs ``fmt`` with; 0 is the format's own default.  Only
    a8w8-int differs from its experts' default (``a8w8_int.dense_group`` says why)."""
    if fmt != "a8w8-int":
        return 0
    from moe_compile.quant import a8w8_int

    return a8w8_int.dense_group(K)


def _bytes(weight: torch.Tensor, fmt: str) -> int:
    if fmt == "none":
        return weight.numel() * weight.element_size()
    from moe_compile.quant.common import FOUR_BIT

    bits = 16 if fmt == "w16" else 4 if fmt in FOUR_BIT else 8  # data only (scales: a few % more)
    return weight.numel() * bits // 8


def run_linear_pass(gm: fx.GraphModule, example_inputs, fmt: str) -> str | None:
    """Rewrite the graph's dense linears; the report's line about them (None when it has none)."""
    if os.environ.get(ENV) == "0" or torch.is_grad_enabled():
        return None
    if fmt != "none":
        from moe_compile.kernels.cpu import dense

        reason = dense.unavailable_reason(fmt)
        if reason is not None:
            raise ValueError(f"moe_compile: quant_dense={fmt!r} has no native kernel on this machine ({reason}); "
                             f"choose one of {dense.FORMATS} that `moe-compile devices` lists, or quant_dense='none'")
    try:
        matches, left = find_linears(gm, example_inputs, fmt)
        for match in matches:  # each replacement leaves a valid graph: a failure stops, never corrupts
            match.replace()
    except Exception as exc:  # noqa: BLE001 — a bug here must not become the user's error
        log.debug("the dense-linear pass failed", exc_info=True)
        return f"dense linears: the pass stopped ({type(exc).__name__}: {exc}); the rest run on the inner compiler"
    finally:
        gm.recompile()
    return _summary(matches, left) if matches or left else None


def _summary(matches: list[LinearMatch], left: Counter) -> str:
    by_fmt = Counter(f"{m.loaded} as loaded" if m.loaded else m.fmt + (f" group-wise ({m.group})" if m.group else "")
                     for m in matches)
    mib = sum(m.weight_bytes for m in matches) / 2**20
    parts = [f"{n} in {'their own dtype' if f == 'none' else f}" for f, n in sorted(by_fmt.items())]
    line = f"dense linears: {len(matches)} on moe_compile's kernels ({', '.join(parts) or 'none'}; {mib:.1f} MiB of weights a call)"
    routers = sum(m.router for m in matches)
    if routers:
        line += f"; {routers} router(s) among them kept in their own dtype"
    if left:
        line += "; left to the inner compiler: " + "; ".join(f"{n} ({why})" for why, n in left.items())
    return line

