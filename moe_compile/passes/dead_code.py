"""Remove what a rewrite left dead: split sizes read to the host and the checks on them.

A region's split sizes (``counts.tolist()``, ``n.item()``) are often computed outside the region
and read only by it.  Once the region is one fused-op call they are dead, but Dynamo's graph still
holds the host reads and the ``torch._check`` / ``_check_is_size`` calls it added for the unbacked
sizes they produce; the inner compiler then reasons about sizes nothing uses and can fail on them
(``GuardOnDataDependentSymNode: u0 < 0``).  This pass erases, to a fixed point, among the
nodes the rewrite left without their readers:

* a check (``torch._check``, ``_check_is_size``, ``sym_constrain_range*``, ``_assert_scalar``)
  whose inputs are scalars read by checks only (and by arithmetic feeding checks only);
* a node without users that has no side effect: neither in-place, nor a collective, nor random (the
  generator must advance as in eager), nor impure for fx (asserts, ``setitem``).

Everything else stays: a dead collective in particular, since every rank must issue the same ones.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from moe_compile.passes.graph import is_inplace, target_name

_CHECK_NAMES = ("_check", "_check_is_size", "_check_with", "sym_constrain_range", "sym_constrain_range_for_size",
                "_constrain_as_size", "_assert_scalar")
_COLLECTIVE_HINTS = ("c10d", "distributed", "all_to_all", "all_reduce", "all_gather", "reduce_scatter",
                     "broadcast", "wait_tensor", "symm_mem", "fused_moe")
_RANDOM_HINTS = ("rand", "bernoulli", "normal", "multinomial", "dropout", "poisson", "exponential")


def live_before(graph: fx.Graph) -> set[fx.Node]:
    """The nodes read by something other than a check: taken before a rewrite, so that
    ``remove_dead_splits`` erases only what the rewrite made dead, never what the graph held
    already (grad-mode switches, a user's own unused values)."""
    return {n for n in graph.nodes if any(not _is_check(u) for u in n.users)}


def remove_dead_splits(graph: fx.Graph, was_live: set[fx.Node]) -> int:
    """Erase the host reads, checks and pure nodes that were live before the rewrite and are dead
    now (``was_live``: ``live_before(graph)`` then); returns how many."""
    removed = 0
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            inputs = node.all_input_nodes
            if _is_check(node) and inputs and all(_from_live(i, was_live) and _feeds_only_checks(i) for i in inputs):
                graph.erase_node(node)
            elif not node.users and _is_pure(node) and _from_live(node, was_live):
                graph.erase_node(node)
            else:
                continue
            removed += 1
            changed = True
    return removed


def _from_live(node: fx.Node, was_live: set[fx.Node], depth: int = 0) -> bool:
    """Live before the rewrite, or scalar arithmetic on such values (``u0 >= 0`` for a check)."""
    if node in was_live:
        return True
    inputs = node.all_input_nodes
    return (depth < 8 and node.op == "call_function" and _is_scalar(node) and bool(inputs)
            and all(_from_live(i, was_live, depth + 1) for i in inputs))


def _is_check(node: fx.Node) -> bool:
    return node.op == "call_function" and target_name(node).split(".")[0] in _CHECK_NAMES


def _is_scalar(node: fx.Node) -> bool:
    value = node.meta.get("example_value", node.meta.get("val"))
    return isinstance(value, (int, bool, float, torch.SymInt, torch.SymBool, torch.SymFloat))


def _feeds_only_checks(node: fx.Node, depth: int = 0) -> bool:
    """Whether a scalar node's every use is a check, or arithmetic whose every use is."""
    if not _is_scalar(node) or depth > 8:
        return False
    for user in node.users:
        if _is_check(user):
            continue
        if user.op == "call_function" and _is_scalar(user) and _feeds_only_checks(user, depth + 1):
            continue
        return False
    return True


def _is_pure(node: fx.Node) -> bool:
    if node.op not in ("call_function", "call_method") or is_inplace(node) or _is_check(node):
        return False
    if node.op == "call_function" and node.target is not operator.getitem and node.is_impure():
        return False
    text = f"{getattr(node.target, '__module__', '')}.{target_name(node)}"
    return not any(hint in text for hint in (*_COLLECTIVE_HINTS, *_RANDOM_HINTS))  # RNG state must advance
