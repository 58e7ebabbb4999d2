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
    params = [w.param for w in (*cluster.fc1_w, cluster.down_w)]
    sizes = {p.meta["example_value"].shape[0] for p in params if p.meta["example_value"].dim() == 3}
    if len(sizes) != 1 or any(p.meta["example_value"].dim() != 3 for p in params):
        raise Refusal("stacked expert weights must be 3-D with one expert count", cluster.down)
    fc1_biases = cluster.fc1_b or (None,) * len(cluster.fc1)
    if len(cluster.fc1) == 2:
        swap = _is_gate(cluster.fc1[1]) and not _is_gate(cluster.fc1[0])
        (gate, gate_b), (up, up_b) = _ordered(zip(cluster.fc1_w, fc1_biases), swap)
        known = _is_gate(cluster.fc1[0]) != _is_gate(cluster.fc1[1])
        return Roles((gate.param,), (up.param,), (cluster.down_w.param,), known, _bias(gate_b), _bias(up_b),
                     _bias(cluster.down_b)), sizes.pop()
    return Roles((cluster.fc1_w[0].param,), (), (cluster.down_w.param,), True, _bias(fc1_biases[0]),
                 (), _bias(cluster.down_b)), sizes.pop()


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
