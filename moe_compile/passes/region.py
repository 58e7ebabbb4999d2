"""Cut an MoE candidate out of its graph: inputs, output, the nodes between, and the rewrite.

Shapes:  T tokens, H hidden, E experts, K top-k.

Given a candidate (routed FFN clusters and their top-k), ``cut_region`` finds
  ids      the top-k indices [T, K], or [B, S, K] when the top-k ran on 3-D scores (the region
           reads them as the model does; the rewrite flattens them to [T, K]);
  weights  the last [T, K] (or [B, S, K]) float tensor of the router feeding the experts that
           does not itself depend on the ids' order (or, for dense-mask code, the [T, E] / [E, T]
           score matrix);
  output   the first value that depends on every expert and has x's shape [T, H] — for in-place
           accumulation (``index_add_``, ``y[idx] += ...``) the last mutation of the buffer;
  x        the single [T, H] tensor the region reads from the router's side;
and proves the region is closed: it reads nothing but x, ids, weights and the expert weights, and
nothing outside it reads its intermediates.  Reads of a tensor's shape only (``zeros_like(scores)``,
``scores.new_zeros(...)``, ``empty_like``) are not data inputs: the tensor becomes an extra input
of the extracted region, whose values never matter.  Every failure is a ``Refusal`` with the reason.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from moe_compile.passes.clusters import is_concatenated_ids, is_hash_lookup, squeezed_top1
from moe_compile.passes.graph import (Deps, dtype_of, is_inplace, is_matmul, is_view_like, meta, shape_of,
                                     source_line, target_name)


class Refusal(Exception):
    """A candidate the backend will not rewrite; the message is shown to the user."""

    def __init__(self, reason: str, node: fx.Node | None = None):
        line = source_line(node) if node is not None else ""
        super().__init__(reason + (f" (at {line})" if line else ""))
        self.reason = str(self)


@dataclasses.dataclass
class Region:
    x: fx.Node
    ids: fx.Node
    weights: fx.Node
    dense: bool  # weights is a dense [T, E] (or [E, T] if dense_transposed) score matrix
    dense_transposed: bool
    output: fx.Node
    buffer: fx.Node | None  # the accumulated tensor when output is an in-place chain
    nodes: list[fx.Node]
    params: list[fx.Node]
    extra_inputs: list[fx.Node]  # SymInt nodes the region reads (sizes), tensors it reads the shape of

    @property
    def top_k(self) -> int:
        return int(routing_shape(self.ids)[-1])


def value_shape(node: fx.Node):
    shape = shape_of(node)
    if shape is None and is_inplace(node) and isinstance(node.args[0], fx.Node):
        return shape_of(node.args[0])
    return shape


def _root_buffer(node: fx.Node) -> fx.Node | None:
    if not is_inplace(node):
        return None
    buf = node.args[0]
    while isinstance(buf, fx.Node) and is_inplace(buf):
        buf = buf.args[0]
    return buf


def topk_indices(topk: fx.Node) -> fx.Node:
    """The [T, K] ids of a candidate's id source: a top-k's indices, or the source itself (a hash
    lookup — through its integer casts, ``tid2eid[input_ids].long()`` —, concatenated picked indices)."""
    if is_hash_lookup(topk):
        ids = topk
        while len(ids.users) == 1 and _integer_cast(next(iter(ids.users))):
            ids = next(iter(ids.users))
        return ids
    if is_concatenated_ids(topk) or target_name(topk) == "argmax":
        return topk
    for user in topk.users:
        if user.op == "call_function" and user.args[1:] == (1,):
            return user
    raise Refusal("the top-k's indices are never used", topk)


def _same(a, b) -> bool:
    """a == b for ints or SymInts, without installing a Dynamo guard (unknown counts as False)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:  # unbacked symbols that cannot be compared
        return False


def same_shape(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


OUTPUT_CANDIDATES = 8  # [T, H] values tried as the combined output, in graph order


def find_outputs(deps: Deps, downs, T, hidden_sizes, tokens=None) -> list[fx.Node]:
    """The first [T, H] values depending on every expert, in graph order.  The first is usually
    the combined output; at K = 1 (or T*K = T) the expert-sorted rows are [T, H] too, and the
    combine that undoes the permutation comes later: cut_region keeps the first closed region.
    ``tokens``: the leading dims of [B, S, K] ids, whose combine may stay [B, S, H]."""
    def is_combined(node) -> bool:
        shape = value_shape(node)
        if not shape or not any(_same(shape[-1], h) for h in hidden_sizes):
            return False
        if len(shape) == 2:
            return _same(shape[0], T)
        return tokens is not None and same_shape(shape[:-1], tokens)

    outputs = deps.reached_by_all(list(downs), is_combined, OUTPUT_CANDIDATES)
    if not outputs:
        raise Refusal("no [T, H] value combines the outputs of all experts", downs[0])
    return outputs


def routing_shape(ids: fx.Node) -> tuple | None:
    """The ids' shape as [..., K]: a top-1 pick without ``keepdim`` ([T]) reads as [T, 1]."""
    shape = shape_of(ids)
    return shape + (1,) if shape is not None and squeezed_top1(ids) else shape


def tokens_of(shape) -> object:
    """T of a [..., K] routing tensor: the product of its leading dims (B*S for [B, S, K])."""
    T = 1
    for d in shape[:-1]:
        T = T * d
    return T


def is_slot_shaped(shape, T, K) -> bool:
    """[T, K] or [B, S, K] with B*S == T: one value per routed slot."""
    return shape is not None and len(shape) >= 2 and _same(tokens_of(shape), T) and _same(shape[-1], K)


def _permutations(deps: Deps, ids: fx.Node) -> set:
    """Nodes that depend on an index tensor derived from the ids (``argsort(ids)``, ``ids == e``,
    ``where(mask)``) other than the ids themselves and their views: values in expert-sorted or
    per-expert order, which are the region's work, never its routing input."""
    derived = {n for n in deps.descendants([ids]) if n is not ids and not _is_view_of(n, ids)
               and dtype_of(n) is not None and not dtype_of(n).is_floating_point}
    return deps.descendants(derived)


def _is_view_of(node: fx.Node, base: fx.Node) -> bool:
    """A view of base, or an integer cast of it (``tid2eid[input_ids].long()``): the same ids."""
    for _ in range(6):
        if node is base:
            return True
        if not (isinstance(node, fx.Node) and (target_name(node) in ("view", "reshape", "flatten", "contiguous")
                                               or _integer_cast(node))):
            return False
        node = node.args[0]
    return node is base


def _integer_cast(node: fx.Node) -> bool:
    """``.long()`` / ``.int()`` / ``.to(<integer dtype>)`` with an integer result: ids kept as they are."""
    dtype = dtype_of(node)
    return (target_name(node) in ("long", "int", "to") and dtype is not None and not dtype.is_floating_point
            and dtype != torch.bool)


def _scattered_from(deps: Deps, ids: fx.Node) -> set:
    """Nodes depending on a ``scatter(fill, dim, ids, values)`` of the ids: dense [T, E] matrices."""
    scatters = [u for u in ids.users if target_name(u) in ("scatter", "scatter_") and ids in u.args[1:3]]
    return deps.descendants(scatters)


def find_weights(deps: Deps, output, params, ids, T, K, E) -> tuple[fx.Node, bool, bool]:
    """The last routing tensor the output reads: [T, K] (or [B, S, K]) weights, or a dense [T, E]
    / [E, T] matrix.  Neither depends on a permutation of the ids (a ``weights.view(-1)[order]``
    copy is the region's work).  With K == E the two shapes agree: a matrix scattered from the ids
    is dense, anything else (``scores.gather(1, ids)``, top-k values) per-slot weights."""
    from_params = deps.descendants(params)
    # Not routing either: buffers the experts accumulate into (``out = zeros_like(x)``: [T, H] looks
    # like a dense [T, E] matrix when H == E) — whatever a param-dependent in-place op writes.
    accumulators = {n for n in deps.ancestors([output]) if any(m in from_params for m in deps.mutations_of(n))}
    excluded = from_params | accumulators | _permutations(deps, ids)
    scattered = _scattered_from(deps, ids) if _same(K, E) else set()
    from_ids = deps.descendants([ids])  # a dense mask zero outside the top-k is built from the ids
    # Routing weights come from this top-k (its values, scores gathered at its ids): an earlier
    # layer's [T, K] weights also reach the output, through the residual stream (at K = 1 they
    # would do for the expert-sorted rows, which are [T, H] there).
    from_source = deps.descendants(_routing_sources(ids))
    squeezed = len(shape_of(ids)) if squeezed_top1(ids) else None  # top-1 weights [T] stand for [T, 1]
    best = None
    for node in deps.ancestors([output]):
        if node in excluded or node not in from_source or dtype_of(node) is None or not dtype_of(node).is_floating_point:
            continue
        shape = shape_of(node)
        if shape is not None and len(shape) == squeezed:
            shape = shape + (1,)
        if shape is None or len(shape) < 2:
            continue
        if len(shape) == 2 and _same(shape[0], E) and _same(shape[1], T) and not _same(T, E) and node in from_ids:
            kind = (True, True)
        elif not _same(tokens_of(shape), T):
            continue
        elif _same(shape[-1], K) and not (_same(K, E) and node in scattered):
            kind = (False, False)
        elif _same(shape[-1], E) and node in from_ids:  # not x [T, H] (nor x[None]) when H == E
            kind = (True, False)
        else:
            continue
        if best is None or deps.order[node] > deps.order[best[0]]:
            best = (node, *kind)
    if best is None:
        raise Refusal("no [T, K] routing weights (nor a dense [T, E] score matrix) reach the experts' output", output)
    return best


def _routing_sources(ids: fx.Node) -> list[fx.Node]:
    """The nodes a top-k's weights may come from: the top-k (or max) whose indices the ids are, the
    picks concatenated into them (sparsemixer), or the ids themselves (a hash lookup, argmax)."""
    if ids.op == "call_function" and ids.target is operator.getitem and isinstance(ids.args[1], int):
        return [ids.args[0]]
    if is_concatenated_ids(ids):
        parts = ids.args[0] if ids.args else ids.kwargs.get("tensors")
        picks = []
        for part in parts:
            while is_view_like(part) and not (part.target is operator.getitem and isinstance(part.args[1], int)):
                part = part.args[0]
            picks.append(part.args[0] if part.target is operator.getitem else part)
        return picks
    return [ids]


def cut_region(graph: fx.Graph, deps: Deps, topk, downs, params, K: int, E: int, hidden_sizes) -> Region:
    if _chooses_tokens(topk):
        raise Refusal("expert-choice routing (a top-k over tokens for each expert): the fused op routes each "
                      "token to its top-k experts, which is another function — not rewritten", topk)
    ids = topk_indices(topk)
    T = tokens_of(routing_shape(ids))
    first_refusal = None
    slots = routing_shape(ids)
    for output in find_outputs(deps, downs, T, hidden_sizes, slots[:-1] if len(slots) > 2 else None):
        try:
            weights, dense, dense_t = find_weights(deps, output, params, ids, T, K, E)
            return cut_between(graph, deps, ids, weights, output, params, dense, dense_t)
        except Refusal as refusal:
            first_refusal = first_refusal or refusal
    raise first_refusal


def _chooses_tokens(topk: fx.Node) -> bool:
    """A top-k along the token dim: over transposed [E, T] scores, or dim 0 of [T, E] scores."""
    if target_name(topk) != "topk" or not topk.args or not isinstance(topk.args[0], fx.Node):
        return False
    scores = topk.args[0]
    dim = topk.kwargs.get("dim", topk.args[2] if len(topk.args) > 2 else -1)
    ndim = len(shape_of(scores) or ())
    return target_name(scores) in ("t", "transpose", "permute") or (ndim >= 2 and dim in (0, -ndim))


def _capacity_cut(deps: Deps, nodes, ids) -> fx.Node | None:
    """A slice ``tok[:capacity]`` of token indices derived from the ids: tokens over an expert's
    capacity are dropped, which the fused op never does."""
    from_ids = deps.descendants([ids])
    for node in nodes:
        if target_name(node) not in ("getitem", "__getitem__") or node.args[0] not in from_ids \
                or not _token_list(node.args[0]):
            continue
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        if any(isinstance(i, slice) and i.stop is not None for i in index) and dtype_of(node) is not None \
                and not dtype_of(node).is_floating_point:
            return node
    return None


# Ops that count tokens per expert from the ids (an expert's load, a slot's place in its queue)
# and ops that bound a value from above.  A count bounded by a constant is an expert capacity.
_COUNTING = {"cumsum", "bincount", "histc", "sum", "scatter_add", "scatter_add_", "count_nonzero"}
_BOUNDS = {"lt", "le", "gt", "ge", "__lt__", "__le__", "__gt__", "__ge__", "less", "less_equal", "greater",
           "greater_equal", "clamp", "clip", "clamp_max", "minimum", "min"}
# A bound below this is a presence test (counts > 0, rank >= 1), not a capacity.
_SMALLEST_CAPACITY = 2


def _constant_capacity(deps: Deps, nodes, ids, tokens) -> fx.Node | None:
    """A count of the ids (cumsum, bincount, sum, ...) compared with, capped at, or sliced to a
    constant number, in a region whose token count is symbolic.  The proof's crowded round sends
    every token to the same experts at the compiled T only: a constant capacity above it passes
    there and binds at a larger T, where the fused op (which drops nothing) would differ."""
    if isinstance(tokens, int):
        return None  # a static graph: the crowded round shows whether the capacity binds
    from_ids = deps.descendants([ids])
    counts = [n for n in nodes if n in from_ids and target_name(n) in _COUNTING]
    # What the counts decide before the experts' GEMMs: a capacity picks the tokens a GEMM reads, so
    # it bounds a count upstream of it; a bound after a GEMM is the experts' own arithmetic (GPT-OSS
    # clamps its activation at a constant limit, downstream of the offsets its grouped GEMM takes).
    counted = deps.descendants(counts, stop=is_matmul)
    for node in nodes:
        if node not in counted:
            continue
        name = target_name(node)
        if name in _BOUNDS:
            bounds = (node.kwargs.get("max"), *(node.args[2:3] if name in ("clamp", "clip") else ())) \
                if name in ("clamp", "clip") else (*node.args, *node.kwargs.values())
            if any(_is_constant_number(b) and b >= _SMALLEST_CAPACITY for b in bounds):
                return node
        if name in ("getitem", "__getitem__") and node.args[0] in counted:
            index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
            if any(isinstance(i, slice) and _is_constant_number(i.stop) and i.stop >= _SMALLEST_CAPACITY
                   for i in index):
                return node
    return None


def _is_constant_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token_list(node) -> bool:
    """``where(mask)[i]`` / ``nonzero(mask)`` (and views): the tokens routed to one expert."""
    for _ in range(4):
        if not isinstance(node, fx.Node):
            return False
        if target_name(node) in ("where", "nonzero", "argwhere"):
            return True
        if target_name(node) in ("getitem", "__getitem__") and isinstance(node.args[1], int) or is_view_like(node):
            node = node.args[0]
            continue
        return False
    return False


def cut_between(graph, deps: Deps, ids, weights, output, params, dense=False, dense_t=False,
                what="the experts") -> Region:
    """The closed region from (x, ids, weights, params) to output, or a Refusal.  The router is what
    the ids and the weights are computed from: a hash lookup's ids read no token state, its weights
    (the scores at those ids) do, and the experts' x is where the router read it."""
    router = deps.ancestors([ids, weights])
    stop = set(params) | {ids, weights}
    visited, frontier, nodes = _slice(deps, output, stop, router)
    reshaped = _reshaped_input(frontier, nodes, value_shape(output))
    if reshaped is not None:  # the experts view the block's [B, S, H] input as [T, H] themselves
        stop.add(reshaped)
        visited, frontier, nodes = _slice(deps, output, stop, router)
        frontier.append(reshaped)
    shape_only = _shape_only_reads(frontier, nodes)
    tensors = [n for n in frontier if meta(n) is not None and n not in shape_only]
    extra = [n for n in frontier if n not in tensors]  # sizes, and tensors read for their shape
    if len(tensors) != 1 or not same_shape(value_shape(tensors[0]), value_shape(output)):
        names = ", ".join(sorted(n.name for n in tensors))
        raise Refusal(f"{what} read tensors other than one [T, H] token input and their weights: {names}",
                      output)
    x = tensors[0]
    capped = _capacity_cut(deps, nodes, ids)
    if capped is not None:
        raise Refusal("capacity-limited routing: an expert's tokens are cut to a fixed count and the rest "
                      "dropped; the fused op keeps every routed token — not rewritten", capped)
    capped = _constant_capacity(deps, nodes, ids, (value_shape(x) or (0,))[0])
    if capped is not None:
        raise Refusal("capacity-limited routing: a count of the ids is bounded by a constant (an expert "
                      "capacity) in a graph whose token count varies; it would drop tokens at a larger batch "
                      "than the proof ran, which the fused op never does — not rewritten", capped)
    buffer = _root_buffer(output)
    sizes = _absorb_dead_ends(graph, deps, nodes, stop | set(frontier))
    shared = _sizes_used_outside(nodes, deps)
    nodes -= shared
    extra += sorted((n for n in shared | sizes if any(u in nodes for u in n.users)), key=deps.order.get)
    _check_closed(deps, nodes, output, buffer)
    ordered = sorted(nodes, key=deps.order.get)
    return Region(x, ids, weights, dense, dense_t, output, buffer, ordered, list(params), extra)


def _is_size(node: fx.Node) -> bool:
    value = node.meta.get("example_value", node.meta.get("val"))
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool) and not is_inplace(node)


def _sizes_used_outside(nodes: set, deps: Deps) -> set:
    """Size computations of the region that later code reads too, computed from sizes only: they
    stay in the graph as the region's inputs.  Dynamo computes a symbolic size once and reuses it,
    so with dynamic shapes the next layer's ``arange(T * K)`` reads this layer's ``T * K``."""
    wanted = [n for n in nodes if _is_size(n) and any(u not in nodes for u in n.users)]
    inside = deps.ancestors(wanted, stop=lambda n: n not in nodes)
    inside &= nodes
    return inside if all(_is_size(n) for n in inside) else set()


def _slice(deps: Deps, output, stop: set, router: set):
    """The region's nodes and its frontier: the router-side values it reads, and graph inputs other
    than the expert weights (a tokens input the router never reads, as when the routing comes from
    precomputed logits or is handed in).  cut_region requires the frontier to be one [T, H] tensor."""
    visited = deps.ancestors([output], stop=lambda n: n in stop or n in router)
    frontier = [n for n in visited if (n in router or n.op == "placeholder") and n not in stop]
    nodes = {n for n in visited if n not in stop and n not in frontier}
    return visited, frontier, nodes


# Calls whose first operand is read for its shape, dtype and device only.
SHAPE_ONLY_FUNCS = ("zeros_like", "empty_like", "ones_like", "full_like")
SHAPE_ONLY_METHODS = ("new_zeros", "new_empty", "new_ones", "new_full", "size", "dim", "numel")


def is_shape_only_read(node: fx.Node, of: fx.Node) -> bool:
    """Whether ``node`` reads ``of`` for its shape only (``zeros_like(of)``, ``of.new_zeros(n)``)."""
    names = SHAPE_ONLY_FUNCS if node.op == "call_function" else SHAPE_ONLY_METHODS if node.op == "call_method" else ()
    if target_name(node) not in names or not node.args or node.args[0] is not of:
        return False
    return of not in node.args[1:] and of not in node.kwargs.values()


def _shape_only_reads(frontier, nodes: set) -> set:
    """Frontier tensors the region reads only for their shape: extra inputs, not data inputs."""
    return {f for f in frontier if meta(f) is not None
            and all(is_shape_only_read(u, f) for u in f.users if u in nodes)}


def _reshaped_input(frontier, nodes, out_shape):
    """A region node viewing the one router-side tensor as [T, H], when that tensor is not [T, H]."""
    shape_only = _shape_only_reads(frontier, nodes)
    tensors = [n for n in frontier if meta(n) is not None and n not in shape_only]
    if len(tensors) != 1 or same_shape(value_shape(tensors[0]), out_shape):
        return None
    views = [u for u in tensors[0].users if u in nodes and same_shape(value_shape(u), out_shape)]
    return views[0] if len(views) == 1 else None


def _is_size_check(node: fx.Node) -> bool:
    """Nodes worth absorbing: non-tensor results (sizes, comparisons, asserts) and tuple items —
    never a collective, an in-place write or any other tensor computation with effects."""
    if is_inplace(node) or "c10d" in str(node.target) or "wait_tensor" in str(node.target):
        return False
    return meta(node) is None or (node.op == "call_function" and node.target is operator.getitem)


def _absorb_dead_ends(graph, deps: Deps, nodes: set, inputs: set) -> set:
    """Add side chains fed only by the region whose results nobody else reads (the size asserts
    Dynamo emits after ``nonzero``) to the region, so erasing it leaves nothing dangling.  Returns
    the graph's own sizes those checks compare against (the region's size inputs)."""
    extra: set = set()
    for node in graph.nodes:
        if node in nodes or node.op in ("placeholder", "output") or not _is_size_check(node):
            continue
        ins = deps.inputs(node)
        if ins and any(i in nodes or i in extra for i in ins) and all(
                i in nodes or i in inputs or i in extra or _graph_size(deps, i) for i in ins):
            extra.add(node)
    changed = True
    while changed:
        changed = False
        for node in list(extra):
            if any(u not in nodes and u not in extra for u in node.users):
                extra.discard(node)
                changed = True
    nodes |= extra
    return {i for n in extra for i in deps.inputs(n) if i not in nodes and i not in inputs}


def _graph_size(deps: Deps, node: fx.Node) -> bool:
    """A size computed from the graph's size inputs only (``2 * s27``: T * K in a dynamic graph),
    which a check of the region's split sizes compares against (``Eq(u0 + u1 + u2 + u3, 2*s27)``)."""
    ancestors = deps.ancestors([node])
    return all(isinstance(meta_value(n), (int, torch.SymInt)) for n in ancestors) and any(
        n.op == "placeholder" for n in ancestors)


def meta_value(node: fx.Node):
    return node.meta.get("example_value", node.meta.get("val"))


def _check_closed(deps: Deps, nodes: set, output: fx.Node, buffer: fx.Node | None) -> None:
    for node in nodes:
        if node is output or node is buffer:
            continue
        for user in node.users:
            if user not in nodes:
                raise Refusal(f"'{node.name}', computed inside the MoE region, is also used by '{user.name}'", user)
    if buffer is not None:
        for user in buffer.users:
            if user not in nodes and deps.order[user] < deps.order[output]:
                raise Refusal(f"'{buffer.name}' is read by '{user.name}' before the experts finish", user)


def extract(region: Region) -> fx.GraphModule:
    """The region as a standalone module: (x, ids, weights, *params, *sizes) -> output."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in (region.x, region.ids, region.weights, *region.params, *region.extra_inputs):
        env[node] = graph.placeholder(node.name)
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    result = region.buffer if region.buffer is not None else region.output
    graph.output(env[result])
    return fx.GraphModule(torch.nn.Module(), graph)


def flat_routing(g: fx.Graph, region: Region) -> tuple[fx.Node, fx.Node]:
    """(ids [T, K], weights [T, K]) for the fused op, emitted into g from what the region reads:
    [B, S, K] ids and weights are flattened, a dense [T, E] / [E, T] matrix is gathered at the ids."""
    K = region.top_k
    ids = region.ids
    if len(shape_of(ids)) != 2:
        ids = g.call_method("reshape", (ids, -1, K))  # [B, S, K] -> [T, K]
    routing = region.weights
    if region.dense:
        if region.dense_transposed:
            routing = g.call_method("t", (routing,))  # [E, T] -> [T, E]
        elif len(shape_of(routing)) != 2:
            routing = g.call_method("reshape", (routing, -1, shape_of(routing)[-1]))  # [B, S, E] -> [T, E]
        return ids, g.call_method("gather", (routing, 1, ids))  # [T, K]
    if len(shape_of(routing)) != 2:
        routing = g.call_method("reshape", (routing, -1, K))
    return ids, routing


def replace_region(graph: fx.Graph, deps: Deps, region: Region, make_call) -> fx.Node:
    """Insert ``make_call(graph)`` before the region's output and reroute its users to it."""
    with graph.inserting_before(region.output):
        new = make_call(graph)
    members = set(region.nodes)
    if region.buffer is not None:  # in-place chain: later readers of the buffer see the result
        later = [u for u in list(region.buffer.users)
                 if u not in members and u is not new and deps.order.get(u, 1 << 60) > deps.order[region.output]]
        for user in later:
            user.replace_input_with(region.buffer, new)
    region.output.replace_all_uses_with(new, delete_user_cb=lambda u: u not in members and u is not new)
    for node in reversed(region.nodes):
        if not node.users:
            graph.erase_node(node)
        else:
            remaining = [u.name for u in node.users]
            raise RuntimeError(f"moe_compile: cannot erase {node.name}; still used by {remaining}")
    return new
