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
    else:
        (gate, gate_b), (up, up_b), known = (cluster.fc1_w[0], fc1_biases[0]), (None, None), True
    pairs = {"fc1": (gate, gate_b), "fc1_up": (up, up_b), "fc2": (cluster.down_w, cluster.down_b)}
    biases = {name: _bias(b, w) for name, (w, b) in pairs.items()}
    views = tuple((name, _stacked_shape(w)) for name, (w, _) in pairs.items() if w is not None and w.unflat)
    views += tuple((f"{name}_bias", w.unflat) for name, (w, b) in pairs.items()
                   if biases[name] and w.unflat and _ndim(b.param) == 1)
    return Roles((gate.param,), (up.param,) if up is not None else (), (cluster.down_w.param,), known,
                 biases["fc1"], biases["fc1_up"], biases["fc2"], unflattened=views), sizes.pop()


def _ndim(node) -> int:
    return node.meta["example_value"].dim()


def _stacked_shape(ref) -> tuple | None:
    """[E, out, in] of a stacked role: the parameter's, or ``param.view(E, n, in)`` for a [E*n, in]
    Linear whose output is viewed [T, E, n] (``WeightRef.unflat``); None when it is neither."""
    shape = tuple(ref.param.meta["example_value"].shape)
    if ref.unflat is not None:
        return (*ref.unflat, shape[1])
    return shape if len(shape) == 3 else None


def _ordered(pairs, swap: bool) -> list:
    pairs = list(pairs)
    return pairs[::-1] if swap else pairs


def _bias(ref, weight) -> tuple:
    """A stacked [E, n] bias role from the parameter added to a GEMM's output (indexed per token or
    by the sorted ids), or a Linear's [E*n] bias where its [E*n, in] weight is an unflattened stack
    (read as ``bias.view(E, n)``); the proof rejects anything that does not act as that bias."""
    if ref is None:
        return ()
    unflat = weight.unflat if weight is not None else None
    if _ndim(ref.param) == 2 or unflat is not None and tuple(ref.param.meta["example_value"].shape) == (
            unflat[0] * unflat[1],):
        return (ref.param,)
    return ()


def find_stacked(family, graph, deps, candidate: Candidate, example_inputs):
    roles, num_experts = stacked_roles(candidate)
    return lift(family, graph, deps, candidate, roles, example_inputs, candidate_top_k(candidate), num_experts)
