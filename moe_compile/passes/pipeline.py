"""The MoE pass: find candidates, let each family lift them, rewrite the proven ones.

    clusters  = find_clusters(graph)                 # expert-shaped FFNs
    candidates = group_by_topk(...)                  # routed clusters sharing a top-k
    match = FINDERS[family](candidate)               # lift + prove, or Refusal(reason)
    match.replace_with_fused_op(graph)               # one call of moe_compile::fused_moe
                                                     # (fused_moe_train where the graph will be
                                                     # differentiated: lift.emit_fused_moe)

Invariants (passes/README.md): a region is rewritten only if it is closed (reads only x, ids,
weights and expert weights; nothing outside reads its intermediates) and a hypothesis about its
FFN reproduced it on synthetic routing reaching every expert.  Everything else is left in place
and reported with its reason.
"""

from __future__ import annotations

import torch.fx as fx

from moe_compile.passes import dense, expert_parallel, gathered, loop, sorted as sorted_family
from moe_compile.passes.clusters import find_clusters, gemm_operands, group_by_topk, unrecognised_experts
from moe_compile.passes.graph import Deps
from moe_compile.passes.lift import GraphValues
from moe_compile.passes.region import Refusal
from moe_compile.report import Report, Rewritten, Skipped

# Checked in this order: the first family that claims a candidate lifts it.
FAMILIES = (
    (expert_parallel.FAMILY, expert_parallel.claims, expert_parallel.find_expert_parallel),  # collectives first
    (sorted_family.FAMILY, sorted_family.claims, sorted_family.find_sorted),
    (gathered.FAMILY, gathered.claims, gathered.find_gathered),
    (loop.FAMILY, loop.claims, loop.find_loop),
    (dense.FAMILY, dense.claims, dense.find_dense),
)


def find_matches(gm: fx.GraphModule, example_inputs, min_experts: int = 1):
    graph = gm.graph
    deps = Deps(graph)
    values = GraphValues(gm, deps, example_inputs)
    clusters = find_clusters(graph)
    candidates, unrouted = group_by_topk(graph, deps, clusters)
    matches, skipped = [], []
    for candidate in candidates:
        family = next((f for f in FAMILIES if f[1](candidate)), None)
        if family is None:
            skipped.append(Skipped("an FFN depends on a top-k but its weights fit no known MoE family"))
            continue
        try:
            match = family[2](graph, deps, candidate, values)
        except Refusal as refusal:
            skipped.append(Skipped(refusal.reason, family[0]))
            continue
        if match.spec.num_experts < min_experts:
            skipped.append(Skipped(f"only {match.spec.num_experts} expert(s), below min_experts", family[0]))
            continue
        matches.append(match)
    skipped += _unrouted_loops(unrouted)
    skipped += [Skipped(Refusal(UNRECOGNISED, gemm).reason) for gemm in unrecognised_experts(graph, deps, candidates)]
    return matches, skipped


UNRECOGNISED = ("a top-k's ids select expert weights here, but no expert FFN (FC1 GEMM -> activation -> FC2 "
                "GEMM on weights of the same experts) was recognised around this GEMM: left to the inner compiler")


def _unrouted_loops(unrouted) -> list[Skipped]:
    """Several same-shaped FFNs on one input with no routing: a loop of dense MLPs, worth a line in
    explain().  One MLP per layer (or a shared expert per MoE layer) reads each layer's own input."""
    shapes: dict[tuple, int] = {}
    for cluster in unrouted:
        key = tuple(tuple(w.param.meta["example_value"].shape) for w in (*cluster.fc1_w, cluster.down_w))
        key += (gemm_operands(cluster.fc1[0])[0],)
        shapes[key] = shapes.get(key, 0) + 1
    return [
        Skipped(f"{n} same-shaped FFNs but no top-k routing selects tokens for them: dense MLPs, left to the "
                f"inner compiler")
        for n in shapes.values() if n >= 2
    ]


def run_moe_pass(gm: fx.GraphModule, example_inputs, min_experts: int = 1, save_fc1: bool = True) -> Report:
    """``save_fc1``: training graphs get the op form that keeps FC1's output (MoEConfig.save_fc1)."""
    matches, skipped = find_matches(gm, example_inputs, min_experts)
    report = Report(skipped=skipped, graphs=1)
    for match in matches:
        match.replace_with_fused_op(gm.graph, Deps(gm.graph), save_fc1)
        s = match.spec
        a = s.attrs
        biases = tuple(role for role in ("fc1", "fc1_up", "fc2") if getattr(s, f"{role}_bias"))
        report.rewritten.append(Rewritten(s.family, s.num_experts, s.top_k, s.hidden, s.ffn, s.variant, s.source,
                                          a.gate_up, a.activation, a.weight_on, match.error,
                                          transposed=a.transposed, limit=a.limit, alpha=a.alpha, biases=biases,
                                          **getattr(match, "report_extra", {})))
    if matches:
        gm.graph.lint()
        gm.recompile()
    return report
