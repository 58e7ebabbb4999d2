"""FX helpers shared by the matchers: node metadata, op classes, mutation-aware dependencies.

Dynamo graphs keep in-place ops (``index_add_``, ``y[idx] += ...``, ``setitem``): a later use of
a mutated tensor depends on the mutation even though no FX edge says so.  ``Deps`` adds those
implicit edges so that slices and "depends on" questions see the mutated versions.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F

# Calls that multiply activations by a weight: the GEMMs an expert FFN is made of.
_MATMUL_FUNCS = {
    torch._C._nn.linear, F.linear, torch.matmul, torch.mm, torch.bmm, torch.einsum,
    torch.functional.einsum, operator.matmul, torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
}
_MATMUL_METHODS = {"matmul", "mm", "bmm", "__matmul__"}
_GROUPED_MM_NAMES = ("_grouped_mm", "grouped_mm", "grouped_mm_fallback")

# Ops that only reshape, slice or cast: a weight traced through them is still the same weight.
_VIEW_METHODS = {"t", "transpose", "permute", "view", "reshape", "contiguous", "to", "float", "half",
                 "bfloat16", "type", "type_as", "unsqueeze", "squeeze", "expand", "mT", "__getitem__"}
_VIEW_FUNCS = {torch.transpose, torch.t, torch.permute, torch.reshape, operator.getitem}

_INPLACE_FUNCS = {operator.setitem, operator.iadd, operator.imul, operator.itruediv, operator.isub}

def meta(node) -> torch.Tensor | None:
    """The fake tensor Dynamo recorded for a node, or None."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def shape_of(node) -> tuple | None:
    value = meta(node)
    return tuple(value.shape) if value is not None else None


def dtype_of(node) -> torch.dtype | None:
    value = meta(node)
    return value.dtype if value is not None else None


def target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    return getattr(target, "__name__", str(target))


def is_grouped_mm(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and any(
        name in target_name(node) for name in _GROUPED_MM_NAMES
    ) or (node.op == "call_function" and "grouped_mm" in str(node.target))


def is_matmul(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _MATMUL_FUNCS or is_grouped_mm(node)
    if node.op == "call_method":
        return node.target in _MATMUL_METHODS
    return False


def is_inplace(node: fx.Node) -> bool:
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.startswith("__") or name in ("__setitem__", "__iadd__")
    if node.op == "call_function":
        return node.target in _INPLACE_FUNCS or target_name(node).endswith("_") and not target_name(
            node
        ).startswith("_")
    return False


def is_view_like(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    return node.op == "call_function" and node.target in _VIEW_FUNCS


def tensor_args(node: fx.Node) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: out.append(n))
    return out


def rows_gathered_from(node):
    """The per-expert table behind rows gathered by expert counts: ``bias.repeat_interleave(counts,
    dim=0)`` (torchtitan's GPT-OSS, with a zero row appended for padding: ``cat([bias, zeros])``),
    seen through casts; else ``node`` itself.  What the rows really are is left to the proof."""
    start = node
    while isinstance(node, fx.Node) and is_view_like(node):
        node = node.args[0]
    if not (isinstance(node, fx.Node) and target_name(node) == "repeat_interleave" and node.args):
        return start
    table = node.args[0]
    if isinstance(table, fx.Node) and target_name(table) in ("cat", "concat"):
        parts = table.args[0] if table.args else table.kwargs.get("tensors", ())
        table = parts[0] if parts else table
    return table


def const_int_index(node: fx.Node) -> int | None:
    """e for ``t[e]`` with a Python int e, else None."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
        return node.args[1]
    return None


# Ops whose result shares its input's storage: an in-place write to the result writes the input
# (``buf[..., :n].copy_(a)``, DeepSeek's attention filling a ``new_empty`` key buffer in halves).
_ALIAS_METHODS = {"view", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand", "unflatten", "narrow",
                  "select", "diagonal", "as_strided", "view_as", "__getitem__"}
_ALIAS_FUNCS = {torch.transpose, torch.t, torch.permute, torch.narrow, torch.select, torch.unsqueeze,
                torch.squeeze, torch.diagonal, torch.as_strided, operator.getitem}


def _basic_index(index) -> bool:
    """Whether ``t[index]`` is a view: ints, slices, Ellipsis and None only (a tensor index copies)."""
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts)


def aliased_bases(node: fx.Node) -> list[fx.Node]:
    """``node`` and the tensors it is a view of: an in-place write to ``node`` mutates them all."""
    found = [node]
    for _ in range(16):
        is_alias = (node.op == "call_method" and node.target in _ALIAS_METHODS
                    or node.op == "call_function" and node.target in _ALIAS_FUNCS)
        if not is_alias or not node.args or not isinstance(node.args[0], fx.Node):
            break
        if target_name(node) in ("getitem", "__getitem__") and not _basic_index(node.args[1]):
            break
        node = node.args[0]
        found.append(node)
    return found


class Deps:
    """Mutation-aware data dependencies of one graph.

    ``inputs(n)`` is n's FX inputs plus, for every tensor n reads that an earlier in-place node
    mutated, the latest such mutation.  ``version_of(b, n)`` is the node standing for b's value
    as seen by n (b itself or its latest mutation before n).
    """

    def __init__(self, graph: fx.Graph):
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self._mutations: dict[fx.Node, list[fx.Node]] = {}
        for node in graph.nodes:
            if is_inplace(node) and node.args and isinstance(node.args[0], fx.Node):
                for target in aliased_bases(node.args[0]):
                    self._mutations.setdefault(target, []).append(node)
        self._inputs: dict[fx.Node, list[fx.Node]] = {}
        for node in graph.nodes:
            self._inputs[node] = self._compute_inputs(node)
        self._users: dict[fx.Node, list[fx.Node]] = {n: [] for n in graph.nodes}
        for node, ins in self._inputs.items():
            for i in ins:
                self._users[i].append(node)

    def mutations_of(self, buffer: fx.Node) -> list[fx.Node]:
        return self._mutations.get(buffer, [])

    def version_of(self, buffer: fx.Node, reader: fx.Node) -> fx.Node:
        before = [m for m in self.mutations_of(buffer) if self.order[m] < self.order[reader]]
        return before[-1] if before else buffer

    def _compute_inputs(self, node: fx.Node) -> list[fx.Node]:
        ins = []
        for arg in tensor_args(node):
            ins.append(arg)
            version = self.version_of(arg, node)
            if version is not arg:
                ins.append(version)
        return list(dict.fromkeys(ins))

    def inputs(self, node: fx.Node) -> list[fx.Node]:
        return self._inputs[node]

    def users(self, node: fx.Node) -> list[fx.Node]:
        return self._users[node]

    def ancestors(self, roots: Iterable[fx.Node], stop=lambda n: False) -> set[fx.Node]:
        return self._walk(roots, self.inputs, stop)

    def descendants(self, roots: Iterable[fx.Node], stop=lambda n: False) -> set[fx.Node]:
        return self._walk(roots, self.users, stop)

    @staticmethod
    def _walk(roots, step, stop) -> set[fx.Node]:
        seen: set[fx.Node] = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            if not stop(node):
                stack.extend(step(node))
        return seen

    def first_reached_by_all(self, sources: list[fx.Node], accept) -> fx.Node | None:
        """The earliest node (graph order) that depends on every source and passes ``accept``."""
        return next(iter(self.reached_by_all(sources, accept, 1)), None)

    def reached_by_all(self, sources: list[fx.Node], accept, limit: int) -> list[fx.Node]:
        """The first ``limit`` nodes (graph order) that depend on every source and pass ``accept``.

        One forward pass with a bitset per node (bit i = depends on sources[i]): linear in the
        graph, where intersecting per-source descendant sets would be quadratic.
        """
        full = (1 << len(sources)) - 1
        bits = {src: 1 << i for i, src in enumerate(sources)}
        start = min(self.order[s] for s in sources)
        found = []
        for node, index in self.order.items():
            if index < start:
                continue
            mask = bits.get(node, 0)
            for i in self.inputs(node):
                mask |= bits.get(i, 0)
            if mask:
                bits[node] = mask
                if mask == full and accept(node):
                    found.append(node)
                    if len(found) == limit:
                        break
        return found


def source_line(node: fx.Node) -> str:
    """The user's source line that produced a node (last frame of Dynamo's stack trace)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    frames = [ln for ln in lines if ln.startswith("File ")]
    if not frames:
        return ""
    last = frames[-1]
    idx = lines.index(last)
    code = lines[idx + 1] if idx + 1 < len(lines) else ""
    return f"{last}: {code}"


def module_path(node: fx.Node) -> str:
    """Dotted module path of a parameter placeholder (``experts.0.gate_proj.weight``), or ''."""
    arg = node.meta.get("grapharg")
    source = getattr(arg, "source", None)
    if source is None:
        return ""
    name = source.name() if callable(getattr(source, "name", None)) else str(getattr(source, "name", ""))
    import re

    parts = re.findall(r"\[['\"]([^'\"]+)['\"]\]|\.([A-Za-z_]\w*)", name)
    keep = [a or b for a, b in parts if (a or b) not in ("_modules", "_parameters", "_buffers", "self")]
    return ".".join(keep)
