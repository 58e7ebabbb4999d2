"""Family C — per-(token, k) gathered weights (gpt-fast, HF v5 ``batched_mm``).

Shapes:  T tokens, K top-k; ``W[ids]`` is [T, K, out, in] (or [T*K, out, in] for flat ids).

The graph indexes the stacked expert weights by the top-k ids and contracts with bmm/einsum, then
sums over K with the routing weights.  The fused op reads each expert's weights once instead of
materialising T*K copies of them.
"""

from __future__ import annotations

from moe_compile.passes.clusters import Candidate, weight_refs
from moe_compile.passes.stacked import find_stacked

FAMILY = "gathered"


def claims(candidate: Candidate) -> bool:
    refs = weight_refs(candidate)
    return bool(refs) and all(w.indexed_by is not None for w in refs)


def find_gathered(graph, deps, candidate: Candidate, example_inputs):
    return find_stacked(FAMILY, graph, deps, candidate, example_inputs)
