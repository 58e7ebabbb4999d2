"""Family E — expert parallelism (torchtitan / Megatron all-to-all; DeepSeek official all_reduce;
Megatron's all-gather dispatcher; expert tensor parallel).

Shapes:  T tokens per rank, H hidden, F expert FFN width, E experts (global), R ranks,
         E_l = E / R local experts, K top-k, S_k = T*K routed slots, N rows one rank receives.

What Dynamo makes of EP code on torch 2.13 (checked with gloo, 2 and 4 ranks): both
``funcol.all_to_all_single`` and the legacy in-place ``dist.all_to_all_single(out, inp, ...)``
become ``_c10d_functional.all_to_all_single(inp, out_splits, in_splits, group_name)`` +
``wait_tensor`` (the legacy form adds ``out.copy_(wait)`` into a ``new_empty`` buffer);
``dist.all_reduce(y)`` becomes ``_c10d_functional.all_reduce(y, "sum", group_name)`` + ``wait_tensor``
+ ``y.copy_``.  ``.tolist()`` split sizes become ``item()`` unbacked SymInts with ``_assert_scalar``
range checks (only with ``api.capture_flags()`` or ``fullgraph=True``).  The process group is the
collective's ``group_name`` argument, resolved with ``_resolve_process_group``.

Three styles, two rewrites (``style`` names them; explain() prints it as ``ep_style``):

(a) **all-to-all** — routed FFN clusters (the local experts) downstream of an
    ``all_to_all_single`` that is itself downstream of their top-k.  The region runs from
    (x, ids, weights, local expert weights) to the first [T, H] value that combines every local
    expert's output with the [T, K] routing weights; it must hold exactly three all-to-alls on one
    group: the count exchange (integer, equal splits), the token dispatch and the reverse combine
    whose split lists are the dispatch's, swapped.  It is replaced by one call of
    ``torch.ops.moe_compile.fused_moe_ep`` with the region's global ids and this rank's local experts
    (``fused_moe_ep_train``'s y where the graph will be differentiated: its forward keeps the rows
    it received as outputs, so the backward sends only dy).

(b) **all_reduce** — a per-expert loop over a slice [lo, lo + E_l) of the router's E experts
    (``ids == i``) whose accumulated output is read by an ``all_reduce``.  The region (the loop,
    without the all_reduce) becomes ``fused_moe(x, ids - lo, weights, local experts)`` and the
    model's all_reduce stays.  Why not the EP op: the all_reduce form is only equal to an
    all-to-all dispatch when every rank holds the same x (DeepSeek's replicated activations), which
    no graph shows; ``fused_moe`` on shifted ids (out-of-range ids contribute nothing) plus the
    model's own all_reduce is equal for any inputs, and moves the same bytes the model chose.
    A ``reduce_scatter_tensor`` in the all_reduce's place is the same (style "reduce_scatter"), and
    so is a loop over *every* expert that a reduction reads directly (no GEMM between): expert
    tensor parallel on replicated tokens, each rank's experts an F-shard.

(c) **all_gather** — the local experts read all-gathered tokens, top-k ids and weights (Megatron's
    all-gather dispatcher; ETP on sequence-parallel tokens; EP x ETP over one tp_ep group): the
    region between the gathers and the reduction becomes ``fused_moe(x_g, ids_g - lo, w_g, ...)``,
    every collective stays (``expert_parallel_gathered.py`` says why not the EP op).

EP x ETP through the all-to-all (dispatch over the EP group, F-sharded local experts, the partial
outputs ``all_reduce``d over the ETP group — or, on sequence-parallel tokens, all-gathered over it
before the router and reduce-scattered after) is style (a) on narrower experts: the ETP collectives
lie outside the region and stay.  An ETP all-gather / reduce-scatter *inside* an all-to-all region
(Megatron's alltoall dispatcher with sequence-parallel ETP, uneven gathers of the received rows) is
not rewritten: ``_skeleton`` refuses any collective but the three all-to-alls, naming it.

What is proven, and how (nothing here runs a collective at compile time — a rank that refused
earlier, or compiled another graph, would deadlock the others):

* (b), (c) numerically, exactly like the single-device families: the extracted region runs on
  synthetic routing over all E global ids (local and non-local), with ids mapped so that the
  local slice lands on [0, E_l); ``kernels/reference.py`` on the local experts must match for one
  FFN hypothesis.  This also proves non-local ids contribute nothing.  A region input computed
  after a collective (gathered rows) gets a stand-in of its shape (``gathered.proof_values``).
* (a) numerically, in a single process: the extracted region (collectives included) runs for R
  simulated ranks in lockstep — node by node in graph order, each collective replaced by the
  in-memory exchange it denotes (``all_to_all_single`` by split lists, ``all_gather_into_tensor``
  as a rank-major concatenation, ``reduce_scatter_tensor`` / ``all_reduce`` as sums, ``wait_tensor``
  as the identity) — on synthetic routing that reaches every global expert, plus a skewed round
  that sends every slot to rank 0's experts (a rank that receives nothing) when K <= E_l.  Simulated rank r
  uses this rank's expert weights scaled by (1 + r/4), so a token served by the wrong rank or the
  wrong local expert changes the result.  Every simulated rank's output must match the reference
  MoE over all R*E_l experts for one FFN hypothesis.  Structurally: exactly three all-to-alls on
  one group, dispatch/combine split lists swapped, E = R * E_l, split lists of length R.
  Assumption stated: the ranks run the same graph up to parameter values (SPMD); a graph that bakes
  its own rank into constants may be proven for a world it does not run in.  ``verify=True`` runs
  the original region beside the op on the first real call (all ranks in lockstep) and catches that.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import weakref

import torch
import torch.fx as fx

from moe_compile.ir import ExpertWeights, MoESpec
from moe_compile.passes import expert_parallel_gathered as gathered, lift as lift_mod, prove, region as region_mod
from moe_compile.passes.clusters import Candidate, Cluster, gemm_operands
from moe_compile.passes.graph import Deps, dtype_of, is_view_like, meta, module_path, shape_of
from moe_compile.passes.lift import Match, Roles
from moe_compile.passes.loop import _role, _split_fc1, candidate_top_k
from moe_compile.passes.region import Refusal, Region, topk_indices
from moe_compile.passes.stacked import stacked_roles

FAMILY = "expert_parallel"
EP_TIMEOUT_S = 120.0  # a peer that never arrives raises after this (the op's timeout_s)
A2A, ALL_REDUCE, WAIT = "all_to_all_single", "all_reduce", "wait_tensor"
ALL_GATHER, REDUCE_SCATTER = gathered.AG, gathered.RS
REDUCING = (ALL_REDUCE, REDUCE_SCATTER)
_GROUP_ARG = {A2A: 3, REDUCE_SCATTER: 3, ALL_REDUCE: 2, ALL_GATHER: 2}  # group_name's position

_deps_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# ----------------------------------------------------------------------------- graph helpers


collective = gathered.collective  # the c10d functional op's name, or None


def group_name_of(node: fx.Node) -> str:
    if "group_name" in node.kwargs:
        return node.kwargs["group_name"]
    return node.args[_GROUP_ARG.get(collective(node), 2)]


def resolve_group(name: str, at: fx.Node):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise Refusal("the graph has collectives but torch.distributed is not initialised", at)
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)
    except Exception as exc:  # noqa: BLE001
        raise Refusal(f"process group '{name}' named by the collective is unknown here ({exc})", at) from exc


def _deps(graph: fx.Graph) -> Deps:
    cached = _deps_cache.get(graph)
    if cached is None or cached[0] != len(graph.nodes):
        cached = (len(graph.nodes), Deps(graph))
        _deps_cache[graph] = cached
    return cached[1]


def router_width(topk: fx.Node) -> int | None:
    scores = shape_of(topk.args[0]) if topk.args and isinstance(topk.args[0], fx.Node) else None
    return int(scores[-1]) if scores and isinstance(scores[-1], int) else None


def style(candidate: Candidate) -> str | None:
    """"all_to_all", "all_gather", "all_reduce", "reduce_scatter" or None: is this candidate an
    expert-parallel MoE, and how are its tokens dispatched and its outputs reduced?"""
    if not any(gathered.runs_collective(n) for n in candidate.topk.graph.nodes):
        return None
    deps = _deps(candidate.topk.graph)
    downs = [c.down for c in candidate.clusters]
    between = deps.ancestors(downs) & deps.descendants([candidate.topk])
    if any(collective(n) == A2A for n in between):
        return "all_to_all"
    if any(gathered.gathered_at(n) is not None for n in between):
        return "all_gather"  # Megatron's all-gather dispatcher, ETP on sequence-parallel tokens
    # Styles (b): experts selected by ``ids == i`` masks (a local slice, or with ETP every expert
    # F-sharded) whose sum a collective reduces.  Experts in other spellings (grouped or gathered
    # GEMMs) are left to the single-device families, which rewrite them and keep the collective.
    if not _keyed_by_masks(deps, candidate):
        return None
    after = deps.descendants(downs)
    direct = [n for n in after if gathered.reduced_directly(deps, downs, n)]
    if direct:
        return collective(direct[0])
    if len(candidate.clusters) < (router_width(candidate.topk) or 0) and any(
        collective(n) == ALL_REDUCE for n in after
    ):
        return "all_reduce"
    return None


def _keyed_by_masks(deps: Deps, candidate: Candidate) -> bool:
    try:
        ids = topk_indices(candidate.topk)
    except Refusal:
        return False
    from_ids = deps.descendants([ids])
    return all(lift_mod.expert_constant(deps, c, ids, from_ids) is not None for c in candidate.clusters)


def claims(candidate: Candidate) -> bool:
    return style(candidate) is not None


# ----------------------------------------------------------------------------- the match


@dataclasses.dataclass
class EPMatch(Match):
    """A proven expert-parallel region; ``replace_with_fused_op`` writes the EP op or the shifted op."""

    world_size: int = 1
    local_experts: int = 0
    group_name: str = ""
    id_offset: int | None = None  # styles (b), (c): fused_moe on ids - offset; None: style (a), the EP op
    ep_style: str = "all_to_all"  # ``style``: how the tokens are dispatched / the outputs reduced
    dense_local: int = 0  # style (c) on a [N, E] routing map: E_l, the columns [id_offset, + E_l) it reads

    @property
    def report_extra(self) -> dict:
        return {"world_size": self.world_size, "local_experts": self.local_experts, "ep_style": self.ep_style}

    def replace_with_fused_op(self, graph: fx.Graph, deps: Deps, save_fc1: bool = True) -> fx.Node:
        spec, region = self.spec, self.region
        a = spec.attrs
        statics = (a.gate_up, a.transposed, a.activation, a.limit, a.alpha, a.weight_on)
        if self.id_offset is None:
            from moe_compile import ep

            ep.register()

        def make_call(g: fx.Graph) -> fx.Node:
            ids, weights = region_mod.flat_routing(g, region) if not self.dense_local else self._dense_routing(g)
            x, roles = lift_mod.cast_operands(g, region.x, lift_mod.spec_roles(spec), self.op_dtype)
            roles = lift_mod.op_views(g, spec, roles)
            if self.id_offset is not None:
                local_ids = g.call_function(torch.sub, (ids, self.id_offset))  # [T, K]
                out = lift_mod.emit_fused_moe(g, (x, local_ids, weights, *roles, *statics), save_fc1)
            else:
                args = (x, ids, weights, *roles, *statics, self.group_name, spec.num_experts, 0, "auto", 0,
                        EP_TIMEOUT_S)
                if lift_mod.will_be_differentiated(args):  # (y, kept rows, meta): the backward sends only dy
                    both = g.call_function(torch.ops.moe_compile.fused_moe_ep_train.default, args)
                    out = g.call_function(operator.getitem, (both, 0))
                else:
                    out = g.call_function(torch.ops.moe_compile.fused_moe_ep.default, args)
            return lift_mod.cast_result(g, out, region, self.op_dtype)

        return region_mod.replace_region(graph, deps, region, make_call)

    def _dense_routing(self, g: fx.Graph) -> tuple[fx.Node, fx.Node]:
        """(global ids, weights) [N, E_l] from a gathered routing map and probs [N, E]: slot e of a
        row is global expert lo + e where the map routes the row to it, else an id past the local
        slice (contributes nothing); its weight is the probs' column."""
        lo, n = self.id_offset, self.dense_local
        cols = (slice(None), slice(lo, lo + n))
        picked = g.call_function(operator.getitem, (self.region.ids, cols))  # [N, E_l] bool
        picked = g.call_method("to", (picked, torch.int64))  # 0 / 1
        device = meta(self.region.x).device
        offsets = g.call_function(torch.arange, (-n, 0), {"device": device})  # [E_l]: (lo + e) - (lo + n)
        # lo + n + picked * (e - n): arithmetic, not torch.where — Inductor's C++ vectorizer asserts on a
        # where over a bool loaded from a collective's buffer (torch 2.13, CPU)
        ids = g.call_function(torch.add, (g.call_function(torch.mul, (picked, offsets)), lo + n))  # [N, E_l]
        return ids, g.call_function(operator.getitem, (self.region.weights, cols))  # [N, E_l]


def find_expert_parallel(graph: fx.Graph, deps: Deps, candidate: Candidate, values) -> EPMatch:
    """``values``: the pipeline's ``lift.GraphValues`` (real values on the example inputs)."""
    kind = style(candidate)
    if kind == "all_to_all":
        return _find_all_to_all(graph, deps, candidate, values)
    if kind == "all_gather":
        return _find_all_gather(graph, deps, candidate, values)
    if kind in REDUCING:
        return _find_all_reduce(graph, deps, candidate, values)
    raise Refusal("no expert-parallel collective around these experts", candidate.topk)


def _local_roles(deps: Deps, candidate: Candidate, ordered: list[Cluster]) -> tuple[Roles, int]:
    """Roles of the local experts: one stacked grouped FFN, or one cluster per local expert."""
    if len(ordered) == 1 and all(meta(w.param) is not None and meta(w.param).dim() == 3
                                 for w in (*ordered[0].fc1_w, ordered[0].down_w)):
        return stacked_roles(candidate)
    splits = [_split_fc1(c) for c in ordered]
    if len({s[1] is None for s in splits}) != 1:
        raise Refusal("local experts differ in their gate/up structure", candidate.topk)
    if any(w.indexed_by is not None for c in ordered for w in (*c.fc1_w, c.down_w)):
        raise Refusal("local experts read weights gathered per token; only per-expert or stacked weights "
                      "are supported under expert parallelism", candidate.topk)
    by = dict(zip(map(id, ordered), splits))
    fc1 = _role(ordered, lambda c: by[id(c)][0])
    up = () if splits[0][1] is None else _role(ordered, lambda c: by[id(c)][1])
    fc2 = _role(ordered, lambda c: c.down_w)
    return Roles(fc1, up, fc2, gate_first_known=all(s[2] for s in splits)), len(ordered)


def _params(roles: Roles) -> list[fx.Node]:
    return roles.nodes()


def _spec(region: Region, roles_nodes, best: prove.Hypothesis, num_experts: int, top_k: int) -> MoESpec:
    fc1, up, fc2, b1, b1u, b2 = roles_nodes
    return MoESpec(
        family=FAMILY, x=region.x, topk_ids=region.ids, topk_weights=region.weights, output=region.output,
        fc1=tuple(fc1), fc1_up=tuple(up), fc2=tuple(fc2), fc1_bias=tuple(b1), fc1_up_bias=tuple(b1u),
        fc2_bias=tuple(b2),
        attrs=best.attrs, num_experts=num_experts, top_k=top_k, hidden=best.weights.hidden(),
        ffn=best.weights.ffn(), region=tuple(region.nodes),
        source=lift_mod._source_of(fc2) or module_path(fc2[0]),
    )


def _not_proven(err: float, tol: float, at: fx.Node) -> Refusal:
    return Refusal(f"could not prove the expert-parallel region computes a supported MoE (closest hypothesis "
                   f"erred by {err:.2e}, tolerance {tol:.0e})", at)


# ----------------------------------------------------------------------------- style (b): all_reduce


def _keyed_slice(deps: Deps, candidate: Candidate, ids: fx.Node, E: int):
    """(lo, the clusters in global-id order) of a local slice selected by ``ids == i`` masks."""
    from_ids = deps.descendants([ids])
    keyed = [(lift_mod.expert_constant(deps, c, ids, from_ids), c) for c in candidate.clusters]
    if any(k is None for k, _ in keyed):
        raise Refusal("could not tell which global expert each local expert serves (no `ids == i` mask)",
                      candidate.topk)
    keyed.sort(key=lambda kc: kc[0])
    lo, _ = gathered.local_slice(deps, [k for k, _ in keyed], E, candidate.topk)
    return lo, [c for _, c in keyed]


def _find_all_reduce(graph, deps: Deps, candidate: Candidate, values) -> EPMatch:
    ids = topk_indices(candidate.topk)
    E = router_width(candidate.topk)
    lo, ordered = _keyed_slice(deps, candidate, ids, E)
    roles, n = _local_roles(deps, candidate, ordered)
    params = _params(roles)
    hidden_sizes = tuple(values[roles.fc2[0]].shape[-2:])
    K = candidate_top_k(candidate)
    region = region_mod.cut_region(graph, deps, candidate.topk, [c.down for c in ordered], params, K, E,
                                   hidden_sizes)
    if region.dense and K == E and not region.dense_transposed:
        region.dense = False  # K == E: [T, K] and [T, E] look alike; the proof decides on [T, K]
    if region.dense:
        raise Refusal("expert-parallel loops must be routed by [T, K] weights, not a dense score matrix", ids)
    _drop_absorbed_collectives(deps, region)
    reduce = _reducing_collective(deps, region)
    return _prove_local(deps, region, candidate, ordered, roles, values, K, E, lo, n, reduce, collective(reduce))


def _find_all_gather(graph, deps: Deps, candidate: Candidate, values) -> EPMatch:
    """Style (c): local experts on gathered tokens and routing (expert_parallel_gathered.py)."""
    E = router_width(candidate.topk)
    if E is None:
        raise Refusal("the router's expert count is not static", candidate.topk)
    probe = values[candidate.clusters[0].down_w.param]  # [.., H, F] or [.., F, H]: the widths tokens may have
    hidden_sizes = tuple(probe.shape[-2:])
    downs = [c.down for c in candidate.clusters]
    first_refusal = None
    for output in region_mod.find_outputs(deps, downs, gathered.gathered_rows(deps, candidate), hidden_sizes):
        try:
            x_g, ids_g, w_g, dense, writers, gathers = gathered.gathered_routing(deps, candidate, output,
                                                                                 hidden_sizes, E)
            if dense:  # Megatron's routing map: experts in split (or graph) order, the proof checks it
                ordered = _order_local(deps, candidate.clusters)
                lo = gathered.dense_slice(ids_g, w_g, len(ordered), candidate.topk)
            else:
                lo, ordered = _keyed_slice(deps, candidate, ids_g, E)
            roles, n = _local_roles(deps, candidate, ordered)
            region = gathered.cut_gathered(graph, deps, x_g, ids_g, w_g, writers, output, _params(roles))
            break
        except Refusal as refusal:
            first_refusal = first_refusal or refusal
    else:
        raise first_refusal
    return _prove_local(deps, region, candidate, ordered, roles, values, candidate_top_k(candidate), E, lo, n,
                        gathers[0], "all_gather", dense)


def _prove_local(deps, region, candidate, ordered, roles, values, K, E, lo, n, group_node, kind,
                 dense=False) -> EPMatch:
    """Styles (b), (c): the local region proven numerically; the model's collectives stay."""
    params = _params(roles)
    world = resolve_group(group_name_of(group_node), group_node).size()
    inputs = gathered.proof_values(values, deps, [region.x, region.ids, region.weights, *region.extra_inputs])
    op_dtype = lift_mod.op_dtype_of(ordered, region.x, params)
    hyps = lift_mod.uniform_hypotheses(deps, region, ordered, roles, values, op_dtype)
    if not hyps:
        raise Refusal("the expert weight shapes fit no supported gate/up layout", ordered[0].down)
    try:
        best, err, tol = gathered.run_local_proof(region, inputs, [values[p] for p in params], hyps, K, E, lo,
                                                  op_dtype, dense)
    except Exception as exc:  # noqa: BLE001
        raise Refusal(f"running the region on synthetic routing failed ({type(exc).__name__}: {exc})",
                      ordered[0].down) from exc
    if best is None:
        raise _not_proven(err, tol, ordered[0].down)
    spec = _spec(region, best.roles, best, E, K)
    return EPMatch(spec, region, err, op_dtype, world_size=world, local_experts=n,
                   group_name=group_name_of(group_node), id_offset=lo, ep_style=kind, dense_local=n if dense else 0)


def _drop_absorbed_collectives(deps: Deps, region: Region) -> None:
    """The cut absorbs dead-end chains such as ``all_reduce(y)`` + ``y.copy_``: they stay in the graph."""
    colls = [n for n in region.nodes if collective(n) is not None]
    result = region.buffer if region.buffer is not None else region.output
    needed = deps.ancestors([region.output, result])
    if any(c in needed for c in colls):
        raise Refusal("a collective runs inside the local experts' loop", colls[0])
    after = deps.descendants(colls)
    region.nodes = [n for n in region.nodes if n not in after]


def _reducing_collective(deps: Deps, region: Region) -> fx.Node:
    """The all_reduce (or reduce_scatter) that reads the region's accumulated output (the model keeps it)."""
    result = region.buffer if region.buffer is not None else region.output
    readers, seen = list(result.users), set()
    while readers:  # the result itself, or a view of it (``y.view(shape)``)
        user = readers.pop(0)
        if user in seen or (region.buffer is not None and deps.order[user] < deps.order[region.output]):
            continue
        seen.add(user)
        if collective(user) in REDUCING:
            return user
        if is_view_like(user) and user.args and user.args[0] in (result, *seen):
            readers += list(user.users)
    raise Refusal("the local experts' output is not what the all_reduce (or reduce_scatter) sums", region.output)


# ----------------------------------------------------------------------------- style (a): all-to-all


def _split_index(cluster: Cluster) -> int | None:
    """e when the cluster's rows are ``split(rows, counts)[e]`` (torchtitan's for-loop experts)."""
    node = gemm_operands(cluster.fc1[0])[0]
    for _ in range(8):
        if not isinstance(node, fx.Node):
            return None
        if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
            src = node.args[0]
            if isinstance(src, fx.Node) and str(getattr(src.target, "__name__", src.target)) in (
                    "split", "tensor_split", "chunk", "split_with_sizes"):
                return node.args[1]
            return None
        if not is_view_like(node):
            return None
        node = node.args[0]
    return None


def _order_local(deps: Deps, clusters: list[Cluster]) -> list[Cluster]:
    keys = [_split_index(c) for c in clusters]
    if all(k is not None for k in keys) and sorted(keys) == list(range(len(keys))):
        return [c for _, c in sorted(zip(keys, clusters), key=lambda kc: kc[0])]
    return sorted(clusters, key=lambda c: deps.order[c.down])  # graph order; the proof checks it


def _outputs_and_weights(deps: Deps, ids: fx.Node, downs, hidden_sizes, params) -> list[tuple[fx.Node, fx.Node]]:
    """[T, H] values combining every expert with [T, K] float routing weights, in graph order.

    With K = 1 the slot rows are [T, H] too (the reverse all-to-all, the weighted rows), so the
    caller takes the first candidate whose region is closed: the combine into token order.
    """
    id_shape = shape_of(ids)  # [T, K], or [B, S, K] when the top-k ran on 3-D scores
    T, K = region_mod.tokens_of(id_shape), id_shape[-1]
    router = deps.ancestors([ids])
    # routing weights come from the router: not from the experts, nor permuted by the ids' order
    not_routing = deps.descendants(params) | region_mod._permutations(deps, ids)
    common = None
    for down in downs:
        desc = deps.descendants([down])
        common = desc if common is None else common & desc
    found = []
    for node in sorted(common or (), key=deps.order.get):
        shape = region_mod.value_shape(node)
        if not (shape and len(shape) == 2 and region_mod._same(shape[0], T)
                and any(region_mod._same(shape[1], h) for h in hidden_sizes)):
            continue
        weights = [w for w in deps.ancestors([node]) if w not in router and w not in not_routing
                   and dtype_of(w) is not None and dtype_of(w).is_floating_point
                   and region_mod.is_slot_shaped(shape_of(w), T, K)]
        if weights:
            found.append((node, max(weights, key=deps.order.get)))
    if not found:
        raise Refusal("no [T, H] value combines the local experts' outputs with [T, K] routing weights", downs[0])
    return found


def _cut_first_closed(graph, deps: Deps, ids, downs, hidden_sizes, params) -> Region:
    first_refusal = None
    for output, weights in _outputs_and_weights(deps, ids, downs, hidden_sizes, params)[:8]:
        try:
            return _cut_all_to_all(graph, deps, ids, output, weights, params)
        except Refusal as refusal:
            first_refusal = first_refusal or refusal
    raise first_refusal


def _cut_all_to_all(graph, deps: Deps, ids, output, weights, params) -> Region:
    """cut_region with this family's output and weights (see ``region.cut_between``)."""
    return region_mod.cut_between(graph, deps, ids, weights, output, params, what="the EP region's experts")


@dataclasses.dataclass
class Skeleton:
    group_name: str
    world: int
    counts: fx.Node
    dispatch: fx.Node
    combine: fx.Node


def _skeleton(deps: Deps, region: Region, downs, E: int, local: int) -> Skeleton:
    """Exactly three all-to-alls on one group: counts (integer), dispatch and its reverse, splits swapped."""
    a2a = [n for n in region.nodes if collective(n) == A2A]
    others = [n for n in region.nodes if collective(n) not in (None, A2A, WAIT)]
    if others:
        raise Refusal(f"the EP region holds a collective other than all_to_all_single ({others[0].target})",
                      others[0])
    if len(a2a) != 3:
        raise Refusal(f"expected three all_to_all_single (counts, dispatch, combine) in the EP region, found "
                      f"{len(a2a)}", a2a[0] if a2a else region.output)
    names = {group_name_of(n) for n in a2a}
    if len(names) != 1:
        raise Refusal(f"the EP region's all-to-alls use several process groups {sorted(names)}", a2a[0])
    name = names.pop()
    world = resolve_group(name, a2a[0]).size()
    floating = [n for n in a2a if dtype_of(n.args[0]) is not None and dtype_of(n.args[0]).is_floating_point]
    counts = [n for n in a2a if n not in floating]
    if len(counts) != 1 or len(floating) != 2:
        raise Refusal("expected one integer all-to-all (the per-expert counts) and two of token rows", a2a[0])
    first, second = sorted(floating, key=deps.order.get)
    down_anc = deps.ancestors(downs)
    if first not in down_anc or any(second not in deps.descendants([d]) for d in downs):
        raise Refusal("the token all-to-alls are not a dispatch before the experts and a combine after them",
                      first)
    out_a, in_a = _splits(first)
    out_b, in_b = _splits(second)
    if not (_same_list(out_a, in_b) and _same_list(in_a, out_b)) or len(out_a or ()) != world:
        raise Refusal("the combine all-to-all does not use the dispatch's split sizes swapped (one per rank)",
                      second)
    if E % world or local * world != E:
        raise Refusal(f"{local} local experts x {world} ranks != the router's {E} experts", a2a[0])
    return Skeleton(name, world, counts[0], first, second)


def _splits(node: fx.Node):
    out = node.kwargs.get("output_split_sizes", node.args[1] if len(node.args) > 1 else None)
    inp = node.kwargs.get("input_split_sizes", node.args[2] if len(node.args) > 2 else None)
    return out, inp


def _same_list(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(x is y or x == y for x, y in zip(a, b))


def _find_all_to_all(graph, deps: Deps, candidate: Candidate, values) -> EPMatch:
    ids = topk_indices(candidate.topk)
    E = router_width(candidate.topk)
    if E is None:
        raise Refusal("the router's expert count is not static", candidate.topk)
    K = candidate_top_k(candidate)
    ordered = _order_local(deps, candidate.clusters)
    roles, local = _local_roles(deps, candidate, ordered)
    params = _params(roles)
    hidden_sizes = tuple(values[roles.fc2[0]].shape[-2:])
    downs = [c.down for c in ordered]
    region = _cut_first_closed(graph, deps, ids, downs, hidden_sizes, params)
    skeleton = _skeleton(deps, region, downs, E, local)
    # x may come after a collective (EP x ETP tokens gathered over the ETP group before the router):
    # stand-ins, never a collective run at compile time
    inputs = [region.x, region.ids, region.weights, *region.extra_inputs]
    known = dict(zip(inputs, gathered.proof_values(values, deps, inputs)))
    known.update((p, values[p]) for p in params)
    op_dtype = lift_mod.op_dtype_of(ordered, region.x, params)
    hyps = lift_mod.uniform_hypotheses(deps, region, ordered, roles, values, op_dtype)
    hyps.sort(key=lambda h: h.attrs.weight_on != "output")  # the combine weights after the reverse all-to-all
    if not hyps:
        raise Refusal("the expert weight shapes fit no supported gate/up layout", downs[0])
    try:
        best, err, tol = prove_simulated(region, known, params, hyps, K, E, skeleton.world, local, op_dtype)
    except Refusal:
        raise
    except Exception as exc:  # noqa: BLE001
        raise Refusal(f"simulating the EP region on {skeleton.world} ranks failed ({type(exc).__name__}: {exc})",
                      downs[0]) from exc
    if best is None:
        raise _not_proven(err, tol, downs[0])
    spec = _spec(region, best.roles, best, E, K)
    return EPMatch(spec, region, err, op_dtype, world_size=skeleton.world, local_experts=local,
                   group_name=skeleton.group_name)


# ----------------------------------------------------------------------------- lockstep simulation


def simulate(gm: fx.GraphModule, per_rank_inputs: list[list]) -> list:
    """Run gm for R ranks in one process, node by node; collectives exchange in memory."""
    world = len(per_rank_inputs)
    interps = [fx.Interpreter(gm, garbage_collect_values=False) for _ in range(world)]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for interp, inputs in zip(interps, per_rank_inputs):
        interp.env = dict(zip(placeholders, inputs))
    outputs = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            outputs = [interp.env[node.args[0]] for interp in interps]
            break
        kind = collective(node)
        if kind is None:
            for interp in interps:
                interp.env[node] = interp.run_node(node)
        elif kind == WAIT:
            for interp in interps:
                interp.env[node] = interp.env[node.args[0]]
        else:
            args = [interp.map_nodes_to_values(node.args, node) for interp in interps]
            if kind not in _EXCHANGES:
                raise ValueError(f"the lockstep simulation has no in-memory form of {node.target}")
            for interp, value in zip(interps, _EXCHANGES[kind](args)):
                interp.env[node] = value
    return outputs


def _exchange_all_to_all(args: list) -> list[torch.Tensor]:
    world = len(args)
    chunks = []
    for tensor, _, in_splits, *_ in args:
        sizes = list(in_splits) if in_splits is not None else [tensor.shape[0] // world] * world
        chunks.append(torch.split(tensor, [int(s) for s in sizes], dim=0))
    results = []
    for dst, (_, out_splits, *_) in enumerate(args):
        got = [chunks[src][dst] for src in range(world)]
        if out_splits is not None and [c.shape[0] for c in got] != [int(s) for s in out_splits]:
            raise ValueError(f"simulated rank {dst} expects {list(out_splits)} rows but receives "
                             f"{[c.shape[0] for c in got]}")
        results.append(torch.cat(got, dim=0))
    return results


def _sum_all_reduce(args: list) -> list[torch.Tensor]:
    if any(a[1] != "sum" for a in args):
        raise ValueError(f"only all_reduce 'sum' is simulated, got {args[0][1]!r}")
    total = torch.stack([a[0] for a in args]).sum(0)
    return [total.clone() for _ in args]


def _all_gather(args: list) -> list[torch.Tensor]:
    """``all_gather_into_tensor(inp, group_size, group)``: every rank gets the inputs, rank-major."""
    _group_size(args)
    gathered = torch.cat([a[0] for a in args], dim=0)
    return [gathered.clone() for _ in args]


def _reduce_scatter(args: list) -> list[torch.Tensor]:
    """``reduce_scatter_tensor(inp, "sum", group_size, group)``: rank r gets row block r of the sum."""
    if any(a[1] != "sum" for a in args):
        raise ValueError(f"only reduce_scatter 'sum' is simulated, got {args[0][1]!r}")
    world = _group_size(args, at=2)
    total = torch.stack([a[0] for a in args]).sum(0)
    if total.shape[0] % world:
        raise ValueError(f"reduce_scatter of {total.shape[0]} rows over {world} ranks")
    return [part.clone() for part in total.chunk(world, dim=0)]


def _group_size(args: list, at: int = 1) -> int:
    """The collective's group size, which must be the simulated world (one group per simulation)."""
    sizes = {int(a[at]) for a in args}
    if sizes != {len(args)}:
        raise ValueError(f"a collective over {sorted(sizes)} ranks in a simulation of {len(args)}")
    return len(args)


_EXCHANGES = {A2A: _exchange_all_to_all, ALL_REDUCE: _sum_all_reduce, ALL_GATHER: _all_gather,
              REDUCE_SCATTER: _reduce_scatter}


def _rank_scale(r: int) -> float:
    return 1.0 + 0.25 * r


def _global_weights(w: ExpertWeights, world: int) -> ExpertWeights:
    """R ranks' experts: rank r's local expert e is this rank's e scaled by (1 + r/4)."""

    def role(pick, present):
        if not present:
            return ()
        return tuple(pick(e) * _rank_scale(r) for r in range(world) for e in range(w.num_experts))

    return ExpertWeights(role(w.fc1_of, w.fc1), role(w.fc1_up_of, w.fc1_up), role(w.fc2_of, w.fc2),
                         transposed=w.transposed)


def _routing_rounds(T, K, E, world, local, w_dtype, ids_dtype, device):
    """Per round, per rank (ids [T, K], weights [T, K]): every global expert reached, then a skewed round."""
    gen = torch.Generator().manual_seed(0)
    rounds = min(-(-E // (world * T * K)), 64)
    out = []
    for r in range(rounds):
        out.append([prove.synthetic_routing(T, K, E, r * world + s, w_dtype, device, gen) for s in range(world)])
    if K <= local:  # every slot of every rank to rank 0's experts: the other ranks receive nothing
        skew = []
        for s in range(world):
            _, g = prove.synthetic_routing(T, K, E, 0, w_dtype, device, gen)
            skew.append(((torch.arange(T * K, device=device).view(T, K) + s) % local, g))
        out.append(skew)
    return [[(ids.to(ids_dtype), g) for ids, g in rnd] for rnd in out]


def prove_simulated(region: Region, values, params, hyps, K, E, world, local, op_dtype=None):
    """(best hypothesis, worst error, tolerance) of the EP region simulated on ``world`` ranks.
    ``op_dtype``: as in ``prove.run_proof`` (the region casts x / its weights for its GEMMs)."""
    x_real = values[region.x]
    T = x_real.shape[0]
    if T == 0:
        return None, math.inf, 0.0
    tol = prove.PROOF_TOLERANCE.get(op_dtype or x_real.dtype, 3e-2)
    region_fn = region_mod.extract(region)
    weights_like = values[region.weights]
    ids_shape = values[region.ids].shape  # [T, K] or [B, S, K]
    sizes = [values[s] for s in region.extra_inputs]
    rank_params = [[values[p] * _rank_scale(r) for p in params] for r in range(world)]
    xs = [x_real if r == 0 else x_real.roll(r, dims=0).flip(1) for r in range(world)]
    xs_op = xs if op_dtype is None else [x.to(op_dtype) for x in xs]
    globals_ = {id(h): prove.Hypothesis(_global_weights(h.weights, world), h.attrs, h.roles) for h in hyps}
    worst = {id(h): 0.0 for h in hyps}
    alive = list(hyps)
    with torch.no_grad():
        for rnd in _routing_rounds(T, K, E, world, local, weights_like.dtype, values[region.ids].dtype,
                                   x_real.device):
            inputs = [[xs[r], ids.reshape(ids_shape), g.reshape(weights_like.shape), *rank_params[r], *sizes]
                      for r, (ids, g) in enumerate(rnd)]
            wants = simulate(region_fn, inputs)
            for hyp in list(alive):
                err = max(prove._hypothesis_error(globals_[id(hyp)], xs_op[r], ids, g, wants[r])
                          for r, (ids, g) in enumerate(rnd))
                worst[id(hyp)] = max(worst[id(hyp)], err)
                if err > tol and len(alive) > 1:
                    alive = [h for h in alive if h is not hyp]  # by identity: == compares tensors
    # The first fitting hypothesis in the given order, not the least error: equal hypotheses
    # ("output" / "between") differ by rounding, and every rank must pick the same one (the EP op
    # checks that the ranks agree on their attributes).
    fitting = [h for h in alive if worst[id(h)] <= tol]
    best = fitting[0] if fitting else min(alive, key=lambda h: worst[id(h)])
    err = worst[id(best)]
    return (best if err <= tol else None), err, tol
