"""Roles of families whose experts are one stacked tensor per role (sorted, gathered, dense).

Shapes:  E experts; stacked weights [E, out, in] (or [E, in, out] when transposed).
"""

from __future__ import annotations

from moe_compile.passes.clusters import Candidate
from moe_compile.passes.lift import Roles, lift
from moe_compile.passes.loop import _is_gate, candidate_top_k
from moe_compile.passes.region import Refusal


def stacked_roles(candidate: Candidate) -> tuple[Roles, int]:
    if len(candidate.clusters) != 1:
        raise Refusal(f"expected one stacked expert FFN, found {len(candidate.clusters)}", candidate.topk)
    cluster = candidate.clusters[0]
    refs = (*cluster.fc1_w, cluster.down_w)
    shapes = [_stacked_shape(w) for w in refs]
    sizes = {s[0] for s in shapes if s is not None}
    if len(sizes) != 1 or any(s is None for s in shapes):
        raise Refusal("stacked expert weights must be 3-D with one expert count", cluster.down)
    fc1_biases = cluster.fc1_b or (None,) * len(cluster.fc1)
    if len(cluster.fc1) == 2:
        swap = _is_gate(cluster.fc1[1]) and not _is_gate(cluster.fc1[0])
        (gate, gate_b), (up, up_b) = _ordered(zip(cluster.fc1_w, fc1_biases), swap)
        known = _is_gate(cluster.fc1[0]) != _is_gate(cluster.fc1[1])
        return Roles((gate.param,), (up.param,), (cluster.down_w.param,), known, _bias(gate_b), _bias(up_b),
                     _bias(cluster.down_b), unflattened=_unflattened(gate, up, cluster.down_w)), sizes.pop()
    return Roles((cluster.fc1_w[0].param,), (), (cluster.down_w.param,), True, _bias(fc1_biases[0]),
                 (), _bias(cluster.down_b), unflattened=_unflattened(cluster.fc1_w[0], None, cluster.down_w)), sizes.pop()


def _stacked_shape(ref) -> tuple | None:
    """[E, out, in] of a stacked role: the parameter's, or ``param.view(E, n, in)`` for a [E*n, in]
    Linear whose output is viewed [T, E, n] (``WeightRef.unflat``); None when it is neither."""
    shape = tuple(ref.param.meta["example_value"].shape)
    if ref.unflat is not None:
        return (*ref.unflat, shape[1])
    return shape if len(shape) == 3 else None


def _unflattened(gate, up, down) -> tuple:
    """Roles' (name, [E, out, in]) for the roles the op reads as ``param.view(E, out, in)``."""
    refs = (("fc1", gate), ("fc1_up", up), ("fc2", down))
    return tuple((name, _stacked_shape(ref)) for name, ref in refs if ref is not None and ref.unflat is not None)


def _ordered(pairs, swap: bool) -> list:
    pairs = list(pairs)
    return pairs[::-1] if swap else pairs


def _bias(ref) -> tuple:
    """A stacked [E, n] bias role from the parameter added to a GEMM's output (indexed per token or
    by the sorted ids); the proof rejects anything that does not act as that bias."""
    return (ref.param,) if ref is not None and ref.param.meta["example_value"].dim() == 2 else ()


def find_stacked(family, graph, deps, candidate: Candidate, example_inputs):
    roles, num_experts = stacked_roles(candidate)
    return lift(family, graph, deps, candidate, roles, example_inputs, candidate_top_k(candidate), num_experts)
