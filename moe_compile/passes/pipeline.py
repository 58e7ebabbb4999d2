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

The pass never raises: an exception while finding, lifting or proving a candidate makes that
candidate a skip with the exception named (traceback at DEBUG on the ``moe_compile`` logger); one
while rewriting puts the whole graph back as it was.
"""

from __future__ import annotations

import itertools
import logging
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from moe_compile.passes import dense, expert_parallel, gathered, loop, sorted as sorted_family
from moe_compile.passes.clusters import (find_clusters, gemm_operands, group_by_topk, is_id_source, is_topk,
                                        inside_router, unrecognised_experts, why_no_experts)
from moe_compile.passes.dead_code import live_before, remove_dead_splits
from moe_compile.passes.graph import Deps, is_view_like, source_line, target_name
from moe_compile.passes.lift import GraphValues
from moe_compile.passes.region import Refusal
from moe_compile.report import Report, Rewritten, Skipped

log = logging.getLogger("moe_compile")

# Checked in this order: the first family that claims a candidate lifts it.
FAMILIES = (
    (expert_parallel.FAMILY, expert_parallel.claims, expert_parallel.find_expert_parallel),  # collectives first
    (sorted_family.FAMILY, sorted_family.claims, sorted_family.find_sorted),
    (gathered.FAMILY, gathered.claims, gathered.find_gathered),
    (loop.FAMILY, loop.claims, loop.find_loop),
    (dense.FAMILY, dense.claims, dense.find_dense),
)


NO_TOKENS = ("no tokens to prove on (this call's batch is empty); proved at the next call (a batch with tokens "
             "recompiles this graph)")


def find_matches(gm: fx.GraphModule, example_inputs, min_experts: int = 1):
    graph = gm.graph
    deps = Deps(graph)
    values = GraphValues(gm, deps, concrete_inputs(example_inputs))
    clusters = find_clusters(graph)
    candidates, unrouted = group_by_topk(graph, deps, clusters)
    # One outcome per top-k: a proven Match, or a Skipped naming the step that refused it.
    outcomes: dict[fx.Node, object] = {}
    for candidate in candidates:
        outcomes[candidate.topk] = lift_candidate(graph, deps, candidate, values, min_experts)
    for topk, gemm in unrecognised_experts(graph, deps, candidates):
        outcomes.setdefault(topk, Skipped(Refusal(UNRECOGNISED, gemm).reason))
    for topk, skip in _split_after_topk(graph, set(outcomes)):
        outcomes.setdefault(topk, skip)
    for topk in (n for n in graph.nodes if is_id_source(n) and n not in outcomes and not inside_router(n)):
        outcomes[topk] = Skipped(no_experts_reason(topk, why_no_experts(graph, deps, topk, clusters)))
    matches = [o for o in outcomes.values() if not isinstance(o, Skipped)]
    skipped = [o for o in outcomes.values() if isinstance(o, Skipped)] + _unrouted_loops(unrouted)
    return matches, skipped


def no_experts_reason(topk: fx.Node, why: str) -> str:
    where = source_line(topk)
    return (f"the top-k at {where}" if where else "a top-k") + f" routes no MoE this pass recognised: {why}"


def _split_after_topk(graph: fx.Graph, routed: set) -> list[tuple[fx.Node, Skipped]]:
    """Top-ks with no experts in this graph whose ids are among its outputs: Dynamo ended the graph
    there, so an MoE block they route runs in another graph or eagerly, unfused."""
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    out = []
    for node in graph.nodes:
        if not is_id_source(node) or node in routed:
            continue
        ids = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1] if is_topk(node) else [node]
        if any(_returned(i, output) for i in ids):
            where = source_line(node)
            out.append((node, Skipped(SPLIT_AFTER_TOPK + (f" (top-k at {where})" if where else "") + "; " + capture_hint())))
    return out


def _returned(node: fx.Node, output: fx.Node, depth: int = 0) -> bool:
    """Whether the graph returns node itself or a view/cast of it (not a value computed from it)."""
    if output in node.users:
        return True
    return depth < 4 and any(_returned(u, output, depth + 1) for u in node.users
                             if is_view_like(u) or target_name(u) in ("to", "long", "int", "contiguous", "flatten"))


SPLIT_AFTER_TOPK = ("a top-k's ids leave this graph with no experts after them: if they route an MoE block, Dynamo "
                    "split the block here and its experts run elsewhere, unfused")


def capture_hint() -> str:
    """What to change so Dynamo keeps a per-expert loop in one graph."""
    flags = torch._dynamo.config
    if not (flags.capture_dynamic_output_shape_ops and flags.capture_scalar_outputs):
        return ("per-expert loops need torch._dynamo.config.capture_dynamic_output_shape_ops = True and "
                "capture_scalar_outputs = True (@moe_compile.optimize sets both); moe_compile.explain(model, x) "
                "names the line that split it")
    return "moe_compile.explain(model, x) names the line that split it"


def lift_candidate(graph, deps, candidate, values, min_experts: int):
    """The candidate's proven Match, or a Skipped with the reason — never an exception."""
    family = next((f for f in FAMILIES if f[1](candidate)), None)
    if family is None:
        return Skipped("an FFN depends on a top-k but its weights fit no known MoE family")
    if has_no_tokens(candidate.topk):
        return Skipped(NO_TOKENS, family[0])
    try:
        match = family[2](graph, deps, candidate, values)
    except Refusal as refusal:
        return Skipped(refusal.reason, family[0])
    except Exception as exc:  # noqa: BLE001 — a matcher's bug must not become the user's error
        where = source_line(candidate.topk)
        log.debug("the %s matcher failed on the top-k at %s", family[0], where or "?", exc_info=True)
        return Skipped(f"the {family[0]} matcher failed on this candidate ({describe(exc)}); left to the inner "
                       f"compiler" + (f" (top-k at {where})" if where else ""), family[0])
    if match.spec.num_experts < min_experts:
        return Skipped(f"only {match.spec.num_experts} expert(s), below min_experts", family[0])
    return match


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters)."""
    text = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def concrete_inputs(example_inputs) -> list:
    """Example inputs with symbolic sizes replaced by the values they stand for (a dynamic graph's
    size placeholders): the proof runs the graph on real tensors, which take only concrete sizes."""
    out = []
    for value in example_inputs:
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            hint = value.node.hint
            value = hint if hint is not None else value
        out.append(value)
    return out


def has_no_tokens(topk: fx.Node) -> bool:
    """Whether the routing's example value is known empty (T = 0): nothing to prove a rewrite on."""
    value = topk.meta.get("example_value", topk.meta.get("val"))
    if isinstance(value, (tuple, list)):
        value = value[0] if value else None
    return isinstance(value, torch.Tensor) and bool(statically_known_true(value.numel() == 0))


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


_layer_tags = itertools.count()


def _quant_plan(spec, quant: str, budget_db: float):
    """The quantization of one layer (``quant/plan.py``); the tag names it in explain()."""
    from moe_compile.passes.lift import will_be_differentiated
    from moe_compile.quant.plan import plan_layer

    if quant == "none":
        return plan_layer(spec, quant, budget_db, False, "cpu", "")
    nodes = (spec.x, spec.topk_weights, *spec.fc1, *spec.fc1_up, *spec.fc2)
    device = getattr(spec.x.meta.get("example_value"), "device", None)
    tag = f"{spec.source or 'moe'}#{next(_layer_tags)}"
    return plan_layer(spec, quant, budget_db, will_be_differentiated(nodes), getattr(device, "type", "cpu"), tag)


def run_moe_pass(gm: fx.GraphModule, example_inputs, min_experts: int = 1, save_fc1: bool = True,
                 quant: str = "none", budget_db: float = 30.0) -> Report:
    """Rewrite gm in place and report; never raises (a failure leaves gm as it was, with the reason).

    ``save_fc1``: training graphs get the op form that keeps FC1's output (MoEConfig.save_fc1);
    ``quant`` / ``budget_db``: MoEConfig.quant and auto's budget (``quant/plan.py`` decides per layer)."""
    try:
        matches, skipped = find_matches(gm, example_inputs, min_experts)
    except Exception as exc:  # noqa: BLE001 — finding touches only metadata and example values
        log.debug("finding MoE candidates failed", exc_info=True)
        return Report(skipped=[Skipped(f"finding MoE candidates in this graph failed ({describe(exc)}); the graph "
                                       f"is left to the inner compiler")], graphs=1)
    report = Report(skipped=skipped, graphs=1)
    if not matches:
        return report
    # Planned before rewriting, outside the net below: an explicit variant this device cannot run is
    # the user's error to see (quant/plan.py names the variants it runs), not a skip.
    plans = [_quant_plan(match.spec, quant, budget_db) for match in matches]
    backup, was_live = _copy_graph(gm.graph), live_before(gm.graph)
    try:
        for match, plan in zip(matches, plans):
            if plan.policy:
                match.replace_with_fused_op(gm.graph, Deps(gm.graph), save_fc1, quant=plan)
            else:
                match.replace_with_fused_op(gm.graph, Deps(gm.graph), save_fc1)
            report.rewritten.append(_rewritten_entry(match, plan))
        remove_dead_splits(gm.graph, was_live)
        gm.graph.lint()
        gm.recompile()
    except Exception as exc:  # noqa: BLE001 — put the graph back: a half-rewritten graph is never run
        log.debug("rewriting failed; the graph is restored", exc_info=True)
        gm.graph = backup
        gm.recompile()
        report.rewritten.clear()
        report.skipped += [Skipped(f"rewriting failed ({describe(exc)}); the graph is left as it was", m.spec.family)
                           for m in matches]
    return report


def _rewritten_entry(match, plan) -> Rewritten:
    s = match.spec
    a = s.attrs
    biases = tuple(role for role in ("fc1", "fc1_up", "fc2") if getattr(s, f"{role}_bias"))
    return Rewritten(s.family, s.num_experts, s.top_k, s.hidden, s.ffn, _variant(s, plan), s.source, a.gate_up,
                     a.activation, a.weight_on, match.error, transposed=a.transposed, limit=a.limit, alpha=a.alpha,
                     biases=biases, flipped=tuple(s.flipped), unflattened=tuple(role for role, _ in s.unflattened),
                     quant_tag=plan.tag, quant_note=plan.note, **getattr(match, "report_extra", {}))


def _variant(spec, plan) -> str:
    """What the op runs: the plan's format, or the format experts loaded packed (PackedWeight) run in."""
    from moe_compile.ops.packed import run_format
    from moe_compile.quant.packed import is_packed

    w = spec.fc1[0].meta.get("example_value") if spec.fc1 else None
    if is_packed(w):
        return f"{run_format(w.fmt, plan.policy or 'none')} (loaded packed)"
    return plan.policy or spec.variant


def _copy_graph(graph: fx.Graph) -> fx.Graph:
    copy = fx.Graph(owning_module=graph.owning_module, tracer_cls=graph._tracer_cls)
    copy.output(copy.graph_copy(graph, {}))
    return copy
