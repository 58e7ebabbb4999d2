"""Family D — every expert on every token with a dense routing mask (Llama4).

Shapes:  T tokens, E experts; scores [T, E] or [E, T]; stacked weights used by bmm directly.

The region reads a dense score matrix instead of [T, K] weights.  It equals the sparse op with
weight on the input only if (a) the scores are zero outside the top-k (checked here: they come
from a scatter of the top-k into a -inf fill followed by sigmoid, or into a zero fill) and (b)
FFN_e(0) = 0 (no biases; the proof runs the region on exactly such masks).  The rewrite gathers
the K non-zero scores per token from the matrix.
"""

from __future__ import annotations

import math

from moe_compile.passes.clusters import Candidate, weight_refs
from moe_compile.passes.graph import is_view_like, target_name
from moe_compile.passes.lift import Match
from moe_compile.passes.region import Refusal, topk_indices
from moe_compile.passes.stacked import find_stacked

FAMILY = "dense"


def claims(candidate: Candidate) -> bool:
    refs = weight_refs(candidate)
    return all(w.indexed_by is None and w.expert is None for w in refs) and all(
        w.param.meta["example_value"].dim() == 3 or w.unflat is not None for w in refs
    )  # stacked [E, out, in], or [E*n, in] Linears whose output is viewed [T, E, n]


def _zero_outside_topk(scores, ids) -> bool:
    """scores = [sigmoid](scatter(fill, 1, ids, values)) with sigmoid(fill) == 0 or fill == 0."""
    node, squashed = scores, False
    for _ in range(12):
        name = target_name(node)
        if name in ("sigmoid", "sigmoid_"):
            squashed = True
        elif name in ("scatter", "scatter_"):
            if node.args[2] is not ids:
                return False
            fill = node.args[0]
            value = fill.args[1] if target_name(fill) in ("full_like", "full") and len(fill.args) > 1 else None
            if target_name(fill) in ("zeros_like", "zeros"):
                value = 0.0
            if value is None:
                return False
            return (squashed and value == -math.inf) or (not squashed and value == 0)
        elif not (is_view_like(node) or name in ("float", "to", "contiguous")):
            return False
        node = node.args[0]
    return False


def find_dense(graph, deps, candidate: Candidate, example_inputs) -> Match:
    match = find_stacked(FAMILY, graph, deps, candidate, example_inputs)
    if not match.region.dense:
        return match
    if not _zero_outside_topk(match.region.weights, topk_indices(candidate.topk)):
        raise Refusal("the dense routing mask is not provably zero outside the top-k experts", match.region.weights)
    return match
