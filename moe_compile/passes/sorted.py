"""Family B — sort by expert + grouped GEMM (HF v5 ``grouped_mm``, torchtitan, Megatron).

Shapes:  S = T*K slots; stacked weights [E, ...].

The graph sorts the flat ids, gathers rows, counts per expert (histc/bincount), takes cumsum
offsets and runs ``_grouped_mm`` / ``F.grouped_mm`` / ``transformers::grouped_mm_fallback`` for
FC1 and FC2, then undoes the permutation and sums over K (or scatter/index-adds).  The whole chain
from the ids to the combine is the region; the proof checks the offsets really come from the ids.
"""

from __future__ import annotations

from moe_compile.passes.clusters import Candidate, uses_grouped_mm
from moe_compile.passes.stacked import find_stacked

FAMILY = "sorted"


def claims(candidate: Candidate) -> bool:
    return uses_grouped_mm(candidate)


def find_sorted(graph, deps, candidate: Candidate, example_inputs):
    return find_stacked(FAMILY, graph, deps, candidate, example_inputs)
