"""Family E, gathered routing: Megatron's all-gather dispatcher and expert tensor parallel (ETP).

Shapes:  T tokens per rank, H hidden, F_s an expert's (possibly F-sharded) FFN width, E experts
         (global), E_l local experts, K top-k, R ranks of the gathering group, N = R*T gathered rows.

What Dynamo records on torch 2.13 (gloo, 2 and 4 ranks) for ``funcol.all_gather_single`` /
``reduce_scatter_single`` (``*_tensor`` before 2.13, their ``_autograd`` forms alike) and for the
legacy in-place ``dist.all_gather_into_tensor(out, inp)`` / ``dist.reduce_scatter_tensor(out, inp)``:

    weights, ids = router(x)                                # [T, K] each, this rank's own tokens
    x_g   = wait_tensor(all_gather_into_tensor(x, R, g))   # [N, H]  (legacy: out = x.new_empty(N, H);
    ids_g = wait_tensor(all_gather_into_tensor(ids, R, g)) # [N, K]   out.copy_(wait): x_g is ``out``)
    w_g   = wait_tensor(all_gather_into_tensor(weights, ..)) # [N, K]
    y = zeros_like(x_g); per local expert e in [lo, lo + E_l): rows of ids_g == e -> y   # [N, H]
    out = wait_tensor(reduce_scatter_tensor(y, "sum", R, g))  # [T, H]  (or all_reduce(y))

Megatron's own spelling gathers a [T, E] boolean routing map and [T, E] probs instead of the
top-k ids and weights, permutes with ``masked_select`` and splits by the map's counts: the op then
gets ids ``lo + e`` where the map routes a row to local expert e (an id past the slice elsewhere) and
the probs' columns [N, E_l].  Megatron's gathers are custom autograd.Functions around the in-place
collectives; traced for training, Dynamo records each as ``autograd_function_apply(fwd_body, ...)``,
whose forward body (one all_gather_into_tensor of its input) is read here (``gathered_at``).

With ETP the local experts are F-shards (Megatron's tp_ep group: rank r serves the experts of EP
rank r // tp, F-shard r % tp) and the reduce-scatter sums the shards as well: SwiGLU is elementwise
in F, so an F-shard's partial output is ``fused_moe`` on the sharded weights, exactly.

The rewrite keeps every collective and replaces the local region between them (from x_g, ids_g,
w_g and the local experts to y) with ``fused_moe(x_g, ids_g - lo, w_g, local experts)``: equal for
any inputs (ids outside [lo, lo + E_l) contribute nothing), the model's bytes move as it chose, and
a rank that refuses while its peers rewrite still issues the same collectives (no deadlock).
Why not the EP op: gathered tokens + local slice + reduce-scatter is the EP op's function only
when the slices of the group's ranks partition the E experts in rank order, a fact about the
other ranks' graphs that this rank cannot see (each graph bakes its own lo); the all-to-all style
needs no such fact (its graph is rank-agnostic) and is proven by the lockstep simulation instead.

Proof: numerical, as style (b) (``expert_parallel._find_all_reduce``): the extracted region runs
on synthetic routing over all E global ids, mapped so the local slice lands on [0, E_l), against
``kernels/reference.py`` on the local experts.  Nothing runs a collective at compile time: the
gathered tokens are stand-ins built from this rank's tokens (``proof_values``).
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from moe_compile.passes import prove, region as region_mod
from moe_compile.passes.clusters import Candidate
from moe_compile.passes.graph import Deps, dtype_of, is_grouped_mm, is_matmul, meta, shape_of, target_name
from moe_compile.passes.loop import candidate_top_k
from moe_compile.passes.region import Refusal, Region, topk_indices

AG, RS, AR, WAIT = "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "wait_tensor"
REDUCING = (AR, RS)


def collective(node: fx.Node) -> str | None:
    """``all_to_all_single`` / ``all_reduce`` / ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` /
    ``wait_tensor`` for c10d functional ops (their ``_autograd`` forms alike), else None."""
    if node.op != "call_function":
        return None
    text = str(node.target)
    if not text.startswith("_c10d_functional"):
        return None
    name = text.split(".")[1]
    return name[: -len("_autograd")] if name.endswith("_autograd") else name


def gathered_value(wait: fx.Node) -> tuple[fx.Node, list[fx.Node]]:
    """(the value readers see, the nodes writing it) of an all-gather's ``wait_tensor``: the wait
    itself, or the legacy form's ``out`` buffer with its ``out.copy_(wait)``."""
    copies = [u for u in wait.users if target_name(u) == "copy_" and len(u.args) > 1 and u.args[1] is wait]
    if len(copies) == 1 and isinstance(copies[0].args[0], fx.Node):
        return copies[0].args[0], copies
    return wait, []


@dataclasses.dataclass(frozen=True)
class Gathered:
    """One all-gathered tensor the experts may read."""

    value: fx.Node  # what readers see: the wait, the legacy ``out`` buffer, a custom Function's output
    source: fx.Node  # this rank's tensor that was gathered
    gather: fx.Node  # the all_gather_into_tensor (in a custom autograd.Function's body for those)
    node: fx.Node  # the node of this graph that gathers: the collective, or the Function's call
    writers: tuple = ()  # the wait / copy_ nodes writing value (the region stops at them)


# What the forward of a custom autograd.Function that only all-gathers its input holds
# (Megatron's ``_GatherFromSequenceParallelRegion``: new_empty + all_gather_into_tensor + copy_).
_GATHER_BODY = {"new_empty", "contiguous", "copy_", "_set_grad_enabled", "view", "reshape"}


def gathered_at(node: fx.Node) -> Gathered | None:
    """The gathered tensor ``node`` produces: an all_gather_into_tensor (functional or legacy), or
    output 0 of a custom autograd.Function (Dynamo's ``autograd_function_apply``, when the graph is
    traced for training) whose forward is one all-gather of its input."""
    if collective(node) == AG:
        waits = [u for u in node.users if collective(u) == WAIT]
        if len(waits) != 1:
            return None
        value, copies = gathered_value(waits[0])
        return Gathered(value, node.args[0], node, node, (waits[0], *copies))
    if not (node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0):
        return None
    call = node.args[0]
    body = _function_forward(call)
    if body is None or len(call.args) < 3 or not isinstance(call.args[2], fx.Node):
        return None
    calls = [n for n in body.graph.nodes if n.op in ("call_function", "call_method")]
    gathers = [n for n in calls if collective(n) == AG]
    if len(gathers) != 1 or any(collective(n) not in (AG, WAIT) and target_name(n) not in _GATHER_BODY
                                for n in calls):
        return None
    return Gathered(node, call.args[2], gathers[0], call)


def _function_forward(call) -> fx.GraphModule | None:
    """The forward body of an ``autograd_function_apply`` call (a submodule of the graph's module)."""
    if not (isinstance(call, fx.Node) and call.op == "call_function" and "autograd_function_apply" in str(call.target)):
        return None
    ref = call.args[0] if call.args else None
    if not (isinstance(ref, fx.Node) and ref.op == "get_attr"):
        return None
    body = getattr(call.graph.owning_module, ref.target, None)
    return body if isinstance(body, fx.GraphModule) else None


def runs_collective(node: fx.Node) -> bool:
    """A collective, or a custom autograd.Function call whose forward runs one."""
    if collective(node) is not None:
        return True
    body = _function_forward(node)
    return body is not None and any(collective(n) is not None for n in body.graph.nodes)


def gathered_rows(deps: Deps, candidate: Candidate):
    """N: the row count of the gathered top-k ids (or routing map) the experts' masks read."""
    downs = [c.down for c in candidate.clusters]
    between = deps.ancestors(downs) & deps.descendants([candidate.topk])
    found = [g for g in map(gathered_at, between) if g is not None and dtype_of(g.value) is not None
             and not dtype_of(g.value).is_floating_point]
    if len(found) != 1 or shape_of(found[0].value) is None:
        raise Refusal("expected one all-gather of the top-k ids (or routing map) before the experts", candidate.topk)
    return shape_of(found[0].value)[0]


def latest_gathers(deps: Deps, output: fx.Node) -> list[Gathered]:
    """The gathered tensors output depends on that no other gathered tensor feeds (an earlier
    layer's gathers reach this layer's through its tokens), in graph order."""
    found = [g for g in map(gathered_at, deps.ancestors([output])) if g is not None]
    earlier = deps.ancestors([g.source for g in found])
    return sorted((g for g in found if g.node not in earlier), key=lambda g: deps.order[g.node])


def gathered_routing(deps: Deps, candidate: Candidate, output: fx.Node, hidden_sizes, E: int):
    """(x_g, ids_g, w_g, dense, the nodes writing them, the gathers) the region ending at output
    reads, or a Refusal.  ``dense``: ids_g is Megatron's [N, E] boolean routing map and w_g its
    [N, E] probs (zero outside the top-k) instead of [N, K] top-k ids and weights."""
    ids = topk_indices(candidate.topk)
    K = candidate_top_k(candidate)
    from_ids, from_router = deps.descendants([ids]), deps.descendants([candidate.topk])
    found: dict[str, fx.Node] = {}
    writers, gathers = [], latest_gathers(deps, output)
    for item in gathers:
        value = item.value
        role = _gathered_role(value, item.source, K, E, hidden_sizes, from_ids, from_router)
        if role is None or role in found:
            why = f"a second gathered {role}" if role else f"a gathered tensor of shape {shape_of(value)} " \
                f"({dtype_of(value)}) that is neither tokens nor routing from the top-k (ids and weights [N, K], or " \
                f"a routing map and probs [N, E] zero outside it)"
            raise Refusal(f"the experts read {why}", item.node)
        found[role] = value
        writers += item.writers
    dense = ("routing map" in found or "routing probs" in found) and "top-k ids" not in found
    roles = ("tokens", "routing map", "routing probs") if dense else ("tokens", "top-k ids", "routing weights")
    x_g, ids_g, w_g = (found.get(r) for r in roles)
    missing = [r for r in roles if r not in found]
    at = gathers[0].node if gathers else output
    if missing:
        raise Refusal(f"the experts read gathered rows but no gathered {', '.join(missing)} in this graph", at)
    if not (region_mod._same(shape_of(x_g)[0], shape_of(ids_g)[0])
            and region_mod._same(shape_of(ids_g)[0], shape_of(w_g)[0])):
        raise Refusal("the gathered tokens, ids and weights have different row counts", at)
    return x_g, ids_g, w_g, dense, writers, [g.gather for g in gathers]


def _gathered_role(value, source, K, E, hidden_sizes, from_ids, from_router) -> str | None:
    """"tokens" ([N, H], not from the router), "top-k ids" (integer [N, K] of the ids), "routing
    weights" (floating [N, K] from the router), Megatron's "routing map" (boolean [N, E] from the
    router) or "routing probs" (its floating [N, E] probs): what an all-gather's result is to the experts."""
    shape, dtype = shape_of(value), dtype_of(value)
    if shape is None or dtype is None or len(shape) != 2:
        return None
    per_slot, per_expert = region_mod._same(shape[1], K), region_mod._same(shape[1], E) and K != E
    if not dtype.is_floating_point:
        if per_slot and source in from_ids:
            return "top-k ids"
        return "routing map" if per_expert and source in from_router else None  # bool, or int 0 / 1
    if per_slot and source in from_router:
        return "routing weights"
    if per_expert and source in from_router:
        return "routing probs"
    if any(region_mod._same(shape[1], h) for h in hidden_sizes) and source not in from_router:
        return "tokens"
    return None


def cut_gathered(graph: fx.Graph, deps: Deps, x_g, ids_g, w_g, writers, output, params) -> Region:
    """The closed region from (x_g, ids_g, w_g, params) to output (``region.cut_between``'s checks,
    with the gathered values as the region's inputs instead of the router's)."""
    stop = set(params) | {x_g, ids_g, w_g, *writers}
    outside = deps.ancestors([x_g, ids_g, w_g, *writers])  # router, gathers, the layers before
    _, frontier, nodes = region_mod._slice(deps, output, stop, outside)
    shape_only = region_mod._shape_only_reads(frontier, nodes)
    tensors = [n for n in frontier if meta(n) is not None and n not in shape_only]
    if tensors:
        names = ", ".join(sorted(n.name for n in tensors))
        raise Refusal(f"the local experts read tensors other than the gathered tokens and routing and their own "
                      f"weights: {names}", output)
    extra = [n for n in frontier if n not in tensors]
    capped = region_mod._capacity_cut(deps, nodes, ids_g)
    if capped is not None:
        raise Refusal("capacity-limited routing: an expert's tokens are cut to a fixed count and the rest "
                      "dropped; the fused op keeps every routed token — not rewritten", capped)
    buffer = region_mod._root_buffer(output)
    sizes = region_mod._absorb_dead_ends(graph, deps, nodes, stop | set(frontier))
    shared = region_mod._sizes_used_outside(nodes, deps)
    nodes -= shared
    extra += sorted((n for n in shared | sizes if any(u in nodes for u in n.users)), key=deps.order.get)
    if any(collective(n) is not None for n in nodes):
        coll = next(n for n in nodes if collective(n) is not None)
        raise Refusal("a collective runs inside the local experts' region", coll)
    region_mod._check_closed(deps, nodes, output, buffer)
    ordered = sorted(nodes, key=deps.order.get)
    return Region(x_g, ids_g, w_g, False, False, output, buffer, ordered, list(params), extra)


def reduced_directly(deps: Deps, downs, node: fx.Node) -> bool:
    """Whether a reducing collective sums the experts' outputs themselves: it depends on every
    expert and no GEMM lies between them (a later layer's TP all_reduce has its own linears)."""
    if collective(node) not in REDUCING:
        return False
    before = deps.ancestors([node]) - {node}  # with mutation edges: a buffer's writes before the read
    if not all(d in before for d in downs):
        return False
    path = before & deps.descendants(downs)
    return not any((is_matmul(n) or is_grouped_mm(n)) and n not in downs for n in path)


# ----------------------------------------------------------------------------- proof inputs


def _has_collective_ancestor(deps: Deps, node: fx.Node) -> bool:
    """Whether node's value (a buffer's: after its in-place writes) is computed from a collective."""
    return any(runs_collective(n) for n in deps.ancestors([node, *deps.mutations_of(node)]))


def _concrete(shape) -> list[int]:
    out = []
    for d in shape:
        if isinstance(d, torch.SymInt):
            hint = d.node.hint
            if hint is None:
                raise Refusal(f"a gathered tensor's size {d} has no example value to prove on")
            d = hint
        out.append(int(d))
    return out


def proof_values(values, deps: Deps, nodes) -> list:
    """Values of the region's inputs to prove on, never running a collective: a value computed
    after one (a gathered tensor, a layer after an all_reduce) gets a stand-in of its shape and
    dtype — R variants of the gather's own input where that needs no collective, else random
    rows.  The proof replaces the routing anyway; x only has to exercise the experts."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for node in nodes:
        value = meta(node)
        if value is None or not _has_collective_ancestor(deps, node):
            values.compute([node])
            out.append(values[node])
            continue
        shape = _concrete(value.shape)
        source = _gather_input(node)
        if source is not None and not _has_collective_ancestor(deps, source) and shape and shape[0]:
            values.compute([source])
            local = values[source]
            reps = -(-shape[0] // max(local.shape[0], 1)) if local.shape[0] else 0
            if reps and list(local.shape[1:]) == shape[1:]:
                rows = torch.cat([local.roll(r, 0) * (1.0 + 0.25 * r) if local.is_floating_point() else local
                                  for r in range(reps)])[: shape[0]]
                out.append(rows.to(value.dtype))
                continue
        if value.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(value.dtype))
        else:
            out.append(torch.zeros(shape, dtype=value.dtype))
    return out


def _gather_input(node: fx.Node) -> fx.Node | None:
    """The tensor an all-gather gathered into node (the wait, the legacy ``out`` buffer, a custom
    Function's output)."""
    candidates = [node, *(c.args[1] for c in node.users if target_name(c) == "copy_" and c.args[0] is node)]
    for value in candidates:
        if not isinstance(value, fx.Node):
            continue
        item = gathered_at(value.args[0]) if collective(value) == WAIT and value.args else gathered_at(value)
        if item is not None and isinstance(item.source, fx.Node):
            return item.source
    return None


def run_local_proof(region: Region, inputs, params_values, hyps, K: int, E: int, lo: int, op_dtype,
                    dense: bool = False):
    """prove.run_proof of the local region on global ids (local slice [lo, lo + E_l) first).
    ``dense``: the region reads a routing map and probs [N, E], scattered from the synthetic ids."""
    region_fn = region_mod.extract(region)
    x, ids, weights, *sizes = inputs
    map_dtype, probs_dtype = ids.dtype, weights.dtype  # dense: the model's routing map and probs

    def on_global_ids(x, local_ids, g, *rest):  # synthetic ids in [0, E): local slice first
        glob = (local_ids + lo) % E  # [N, K]
        if not dense:
            return region_fn(x, glob, g, *rest)
        probs = torch.zeros(glob.shape[0], E, dtype=probs_dtype).scatter(1, glob, g.to(probs_dtype))
        routing_map = torch.zeros(glob.shape[0], E, dtype=map_dtype).scatter(1, glob, 1)
        return region_fn(x, routing_map, probs, *rest)  # [N, E] each, as the model gathers them

    if dense:  # the synthetic routing is [N, K]; the region is fed its dense form
        ids, weights = torch.zeros(x.shape[0], K, dtype=torch.int64), torch.zeros(x.shape[0], K, dtype=weights.dtype)
    return prove.run_proof(on_global_ids, x, ids, weights, params_values, sizes, hyps, K, E, None, op_dtype)


def dense_slice(routing_map: fx.Node, probs: fx.Node, local: int, at: fx.Node) -> int:
    """lo of the columns [lo, lo + E_l) the local experts read of the gathered map and probs
    (Megatron: ``routing_map[:, lo:hi]``, or one column ``[:, lo + e]`` per expert)."""
    starts = set()
    for node in (*routing_map.users, *probs.users):
        if node.op != "call_function" or target_name(node) not in ("getitem", "__getitem__"):
            continue
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if len(index) != 2 or index[0] != slice(None):
            continue
        col = index[1]
        if isinstance(col, slice) and col.step in (None, 1) and isinstance(col.start, int) \
                and isinstance(col.stop, int) and col.stop - col.start == local:
            starts.add(col.start)
        elif isinstance(col, int):
            starts.add(col - col % local)  # a single column: the slice holding it
    if len(starts) != 1:
        raise Refusal(f"could not tell which {local} columns of the gathered routing map the local experts read "
                      f"(found {sorted(starts)})", at)
    return starts.pop()


def local_slice(deps: Deps, ordered_keys, E: int, at: fx.Node) -> tuple[int, int]:
    """(lo, E_l) of the local experts' global ids, which must be one contiguous slice of [0, E)."""
    keys = list(ordered_keys)
    lo, n = keys[0], len(keys)
    if keys != list(range(lo, lo + n)) or lo + n > E:
        raise Refusal(f"the local experts {keys} are not one contiguous slice of the router's {E} experts", at)
    return lo, n


