"""Find expert FFNs in a Dynamo graph and group them into MoE candidates.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K top-k.

An *FFN cluster* is one FC2 GEMM (``down``) together with the FC1 GEMMs (gate/up or fused gate_up)
whose outputs reach its activation operand through element-wise ops only.  Each GEMM's weight
operand is traced through views/casts/indexing to a graph input (a parameter): ``param``,
``param[e]`` (a Python-int expert slice) or ``param[ids]`` (gathered per token).

A cluster is *routed* when it depends on a ``topk`` node; routed clusters that share their nearest
``topk`` form one ``Candidate``.  The family matchers decide what the candidate is.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from moe_compile.passes.graph import (Deps, const_int_index, is_grouped_mm, is_inplace, is_matmul, is_view_like,
                                     rows_gathered_from, source_line, target_name)

_ELEMENTWISE = {
    "mul", "add", "sub", "truediv", "div", "silu", "gelu", "relu", "relu_", "sigmoid", "tanh", "tanh_",
    "clamp", "clamp_min", "clamp_max", "clip", "chunk", "split", "getitem", "view", "reshape", "to", "float",
    "half", "bfloat16", "contiguous", "neg", "mul_", "add_", "silu_", "unflatten", "flatten",
    "squeeze", "unsqueeze", "type_as", "pow", "minimum", "maximum", "__mul__", "__add__", "__sub__",
    "__getitem__", "sigmoid_", "clamp_", "transpose", "permute", "masked_fill", "addcmul",
}


@dataclasses.dataclass(frozen=True)
class WeightRef:
    """Where a GEMM's weight operand comes from."""

    param: fx.Node  # the graph input (placeholder) holding the weight
    expert: int | None = None  # param[e] with a Python int e
    indexed_by: fx.Node | None = None  # param[ids] with a tensor index
    # The [E, out, in] tensor indexed by ``expert`` when it is a view of param rather than param
    # itself (DBRX's ``w1.view(E, F, H)[e]`` on a [E*F, H] parameter): the stacked role the op reads.
    stack: fx.Node | None = None
    # (E, n) when param is a [E*n, in] ``F.linear`` weight whose [.., E*n] output is viewed [.., E, n]:
    # every expert's slice at once, a stack ``param.view(E, n, in)`` seen from the output side.
    unflat: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class Cluster:
    down: fx.Node
    down_w: WeightRef
    fc1: tuple[fx.Node, ...]
    fc1_w: tuple[WeightRef, ...]
    down_b: WeightRef | None = None  # the bias added to the GEMM's output, when it has one
    fc1_b: tuple[WeightRef | None, ...] = ()

    @property
    def gemms(self) -> tuple[fx.Node, ...]:
        return (*self.fc1, self.down)


@dataclasses.dataclass
class Candidate:
    """Routed clusters sharing one top-k: possibly one MoE layer."""

    topk: fx.Node  # the id source: a topk node, or a hash table lookup giving the ids themselves
    clusters: list[Cluster]


def trace_weight(node) -> WeightRef | None:
    """Follow views/casts/indexing from a GEMM operand to the placeholder that holds it."""
    expert, indexed_by, stack = None, None, None
    for _ in range(16):
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder":
            if not is_parameter(node):
                return None
            return WeightRef(node, expert, indexed_by, stack if stack is not node else None)
        index = const_int_index(node)
        if index is not None:
            expert = index
            base = node.args[0]
            if isinstance(base, fx.Node) and _unit_chunks(base):
                base = base.args[0]  # W.chunk(E)[e] (then squeeze(0)): the same slice as W[e]
            stack = base if _contiguous_3d(base) and _reshapes_a_parameter(base) else None
            node = base
            continue
        elif node.op == "call_function" and node.target is operator.getitem:
            idx = node.args[1]
            if isinstance(idx, fx.Node):
                indexed_by = idx
            else:
                return None
        elif not is_view_like(node):
            return None
        node = node.args[0]
    return None


def _unit_chunks(node: fx.Node) -> bool:
    """``t.chunk(n)`` / ``t.split(1)`` along dim 0 into pieces of one row each."""
    if node.op not in ("call_function", "call_method") or target_name(node) not in ("chunk", "split"):
        return False
    value = node.args[0].meta.get("example_value") if isinstance(node.args[0], fx.Node) else None
    dim = node.kwargs.get("dim", node.args[2] if len(node.args) > 2 else 0)
    size = node.args[1] if len(node.args) > 1 else node.kwargs.get("chunks", node.kwargs.get("split_size"))
    if not isinstance(value, torch.Tensor) or dim != 0 or not isinstance(size, int) or value.dim() != 3:
        return False
    return size == (value.shape[0] if target_name(node) == "chunk" else 1)


def _reshapes_a_parameter(node: fx.Node) -> bool:
    """``param.view(...)`` / ``reshape`` / ``unflatten`` chains down to a parameter (no cast, no
    transpose): the same storage, read in place."""
    for _ in range(4):
        if node.op == "placeholder":
            return is_parameter(node)
        if node.op not in ("call_function", "call_method") or target_name(node) not in ("view", "reshape", "unflatten"):
            return False
        node = node.args[0]
    return False


def _contiguous_3d(node) -> bool:
    """A 3-D view whose experts are contiguous blocks of one storage (what the op reads in place)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() == 3 and value.is_contiguous()


def is_parameter(node: fx.Node) -> bool:
    """A graph input that holds module state (parameter or buffer), not an activation."""
    arg = node.meta.get("grapharg")
    if arg is None:
        return False
    if isinstance(getattr(arg, "example", None), torch.nn.Parameter):
        return True
    source = getattr(arg, "source", None)
    name = source.name() if callable(getattr(source, "name", None)) else str(getattr(source, "name", ""))
    return "_parameters" in name or "_buffers" in name


def gemm_operands(node: fx.Node) -> tuple[fx.Node | None, WeightRef | None]:
    """(activation operand, weight ref) of a GEMM node; the weight is the operand tracing to an input."""
    args = [a for a in node.args if isinstance(a, fx.Node)]
    if target_name(node) in ("linear",) and len(args) >= 2:
        return args[0], trace_weight(args[1])
    refs = [(a, trace_weight(a)) for a in args]
    weights = [(a, r) for a, r in refs if r is not None and a is not None]
    acts = [a for a, r in refs if r is None]
    if len(weights) == 1 and acts:
        return acts[0], weights[0][1]
    return None, None


_ADDS = ("add", "add_", "__add__", "__iadd__")


def gemm_bias(node: fx.Node) -> WeightRef | None:
    """The parameter added to a GEMM's output, or None: ``F.linear(x, w, b)``'s bias operand, or
    the other operand of an add that reads the GEMM's output (``x @ w[e] + b[e]``, HF's grouped and
    batched experts' ``out.add_(bias[ids])``).  The proof checks what the bias really does."""
    if target_name(node) == "linear":
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return trace_weight(bias) if isinstance(bias, fx.Node) else None
    outputs = [node]  # the GEMM's output and its views (bmm(...).squeeze(1))
    for out in outputs:
        for user in out.users:
            if is_view_like(user) and user.args[0] is out and len(outputs) < 4:
                outputs.append(user)
            elif target_name(user) in _ADDS and len(user.args) == 2 and user.args[0] is out:
                ref = trace_weight(rows_gathered_from(user.args[1]))
                if ref is not None:
                    return ref
    return None


def _slicing(index) -> bool:
    """Whether a getitem index only slices (``h[..., ::2]``, ``h[:, :F]``, ``pair[0]``): FC1's
    output split into gate and up.  Tensor indices (``weights[tok, k]``) and int/None picks inside
    a tuple (``scores[:, e]``: a router column) leave the FFN."""
    if not isinstance(index, tuple):
        return not isinstance(index, fx.Node)
    return all(i is Ellipsis or isinstance(i, slice) for i in index)


# An expert FFN's FC1 output reaches FC2 through one of these; a path of norms, residual adds and
# slices only (the last hidden state into the LM head) is not an FFN.
_NONLINEAR = {"silu", "silu_", "gelu", "relu", "relu_", "sigmoid", "sigmoid_", "tanh", "tanh_", "clamp_min"}


def _fc1_gemms(act: fx.Node) -> list[fx.Node]:
    """GEMMs reaching ``act`` through element-wise ops only (the FC1 side of a down GEMM), when
    that path holds a nonlinearity; else none.

    Grouped passes over sorted rows (JetMoE) run FC1 per group, ``cat`` the groups' rows, apply the
    activation to all rows at once and split them again: seen from group e's FC2, the walk passes
    ``split(h, counts)[e]`` and, at a ``cat`` along the rows of as many parts, goes on into part e
    only (``_row_cat_part``).  A ``cat`` along the last dim (gate and up side by side) is read whole."""
    found, seen, stack, nonlinear = [], set(), [(act, None)], False
    while stack:
        node, group = stack.pop()
        if (node, group) in seen or not isinstance(node, fx.Node):
            continue
        seen.add((node, group))
        if is_matmul(node):
            found.append(node)
            continue
        name = target_name(node)
        if is_identity(node):
            stack.append((node.args[0], group))
            continue
        if name in ("cat", "concat"):
            parts, group = _cat_parts(node, group)
            stack.extend((p, group) for p in parts)
            continue
        if node.op not in ("call_function", "call_method") or name not in _ELEMENTWISE:
            continue
        if name in ("getitem", "__getitem__") and not _slicing(node.args[1]):
            continue  # advanced indexing (weights[tok, k]) leaves the FFN; h[..., ::2] stays in it
        row_group = _row_group(node)
        if row_group is not None:
            stack.append((node.args[0].args[0], row_group))
            continue
        nonlinear |= name in _NONLINEAR
        stack.extend((a, group) for a in node.args if isinstance(a, fx.Node))
    return found if nonlinear else []


def _row_group(node: fx.Node) -> tuple[int, int] | None:
    """(e, n) for ``split(h, sizes)[e]`` with n sizes along dim 0 (a list: one group per expert)."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[1], int):
        return None
    src = node.args[0]
    if not isinstance(src, fx.Node) or target_name(src) not in ("split", "split_with_sizes"):
        return None
    sizes = src.args[1] if len(src.args) > 1 else src.kwargs.get("split_size_or_sections", src.kwargs.get("split_sizes"))
    dim = src.kwargs.get("dim", src.args[2] if len(src.args) > 2 else 0)
    if not isinstance(sizes, (list, tuple)) or dim != 0 or not isinstance(src.args[0], fx.Node):
        return None
    return node.args[1], len(sizes)


def _cat_parts(node: fx.Node, group) -> tuple[list, tuple | None]:
    """(what the FFN walk follows into from a ``cat``, the group it carries on): every part along
    the last dim; part e along the rows when the walk came from group e of a split into as many
    groups (the group is then used up); else nothing (rows of other tensors joined: no FFN path)."""
    parts = node.args[0] if node.args else node.kwargs.get("tensors", ())
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    value = node.meta.get("example_value")
    if not isinstance(parts, (list, tuple)) or not isinstance(value, torch.Tensor):
        return [], None
    if value.dim() > 1 and dim in (-1, value.dim() - 1):
        return list(parts), group
    if dim == 0 and group is not None and group[1] == len(parts):
        return [parts[group[0]]], None
    return [], None


_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


def dropout_training(node: fx.Node) -> bool | None:
    """For ``F.dropout(x, p, training, inplace)`` (and its 1d/2d/3d/alpha forms): whether it drops
    (training with p > 0); None for any other node."""
    if node.op != "call_function" or target_name(node) not in _DROPOUTS:
        return None
    names = ("input", "p", "training", "inplace")
    args = {**dict(zip(names, node.args)), **node.kwargs}
    p, training = args.get("p", 0.5), args.get("training", True)
    if not isinstance(p, (int, float)) or not isinstance(training, bool):
        return True  # a traced flag or rate: possibly dropping
    return training and p > 0


def is_identity(node: fx.Node) -> bool:
    """Ops that return their input's values unchanged: Dropout in eval mode (or p = 0), ``clone``.
    Casts and ``contiguous`` are views to the weight trace and element-wise to the FFN search."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    return dropout_training(node) is False or (node.op in ("call_function", "call_method")
                                                and target_name(node) == "clone")


def find_clusters(graph: fx.Graph) -> list[Cluster]:
    clusters = []
    for node in graph.nodes:
        if not is_matmul(node):
            continue
        act, down_w = gemm_operands(node)
        if act is None or down_w is None:
            continue
        fc1 = _fc1_gemms(act)
        fc1_w = [gemm_operands(n)[1] for n in fc1]
        if fc1 and len(fc1) <= 2 and all(w is not None for w in fc1_w):
            fc1_w = [_unflattened(g, w) for g, w in zip(fc1, fc1_w)]
            clusters.append(Cluster(node, down_w, tuple(fc1), tuple(fc1_w), gemm_bias(node),
                                    tuple(gemm_bias(n) for n in fc1)))
    return clusters


def _unflattened(gemm: fx.Node, ref: WeightRef) -> WeightRef:
    """``ref`` with ``unflat`` set when gemm is ``F.linear(x, W)`` on a 2-D parameter [E*n, in] and its
    only reader views the [.., E*n] output as [.., E, n] with E > 1 (experts as one ``nn.Linear(H, E*F)``)."""
    weight = ref.param.meta.get("example_value")
    if target_name(gemm) != "linear" or ref.expert is not None or ref.indexed_by is not None \
            or not isinstance(weight, torch.Tensor) or weight.dim() != 2 or len(gemm.users) != 1:
        return ref
    (view,) = gemm.users
    value = view.meta.get("example_value")
    if view.op not in ("call_function", "call_method") or target_name(view) not in ("view", "reshape", "unflatten") \
            or not isinstance(value, torch.Tensor) or value.dim() < 3:
        return ref
    experts, n = value.shape[-2:]
    if not (isinstance(experts, int) and isinstance(n, int)) or experts < 2 or experts * n != weight.shape[0]:
        return ref
    return dataclasses.replace(ref, unflat=(experts, n))


def is_topk(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method") and target_name(node) == "topk"


def is_hash_lookup(node: fx.Node) -> bool:
    """``table[token_ids]``: [T, K] expert ids read from an integer table the module holds
    (DeepSeek-V4's hash layers, ``tid2eid[input_ids]``), indexed by an integer tensor."""
    if node.op != "call_function" or node.target is not operator.getitem or not isinstance(node.args[1], fx.Node):
        return False
    table = trace_weight(node.args[0])
    value, index = node.meta.get("example_value"), node.args[1].meta.get("example_value")
    return (
        table is not None and table.expert is None and table.indexed_by is None
        and isinstance(value, torch.Tensor) and value.dim() == 2 and not value.dtype.is_floating_point
        and isinstance(index, torch.Tensor) and not index.dtype.is_floating_point and index.dtype != torch.bool
    )


def _picked_indices(node) -> bool:
    """``scores.max(dim)[1]`` / ``scores.topk(k)[1]`` / ``argmax(dim)``, possibly viewed (unsqueeze)."""
    for _ in range(4):
        if not isinstance(node, fx.Node):
            return False
        if node.op in ("call_function", "call_method") and target_name(node) == "argmax":
            return True
        if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 1:
            src = node.args[0]
            return isinstance(src, fx.Node) and target_name(src) in ("max", "topk")
        if not is_view_like(node):
            return False
        node = node.args[0]
    return False


def is_concatenated_ids(node: fx.Node) -> bool:
    """``cat((idx_1, idx_2), -1)`` of picked indices: [T, K] ids chosen one max at a time (PhiMoE's
    sparsemixer: the top expert, then the top of the rest)."""
    if node.op != "call_function" or target_name(node) not in ("cat", "concat"):
        return False
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    value = node.meta.get("example_value")
    return (
        isinstance(parts, (list, tuple)) and len(parts) >= 2 and all(_picked_indices(p) for p in parts)
        and isinstance(value, torch.Tensor) and value.dim() == 2 and not value.dtype.is_floating_point
    )


def is_top1(node: fx.Node) -> bool:
    """A top-1 pick along the last dim of float scores: ``scores.max(dim=-1)`` (its indices used) or
    ``scores.argmax(dim=-1)`` — the ids of top-1 routing, [..., 1] with ``keepdim``, else [...]."""
    if node.op not in ("call_function", "call_method") or target_name(node) not in ("max", "argmax"):
        return False
    scores = node.args[0] if node.args else node.kwargs.get("input")
    value = scores.meta.get("example_value") if isinstance(scores, fx.Node) else None
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if not isinstance(value, torch.Tensor) or not value.dtype.is_floating_point or not isinstance(dim, int) \
            or value.dim() < 2 or dim not in (-1, value.dim() - 1):
        return False
    if target_name(node) == "argmax":
        return True
    return any(u.op == "call_function" and u.target is operator.getitem and u.args[1] == 1 for u in node.users)


def squeezed_top1(ids: fx.Node) -> bool:
    """Whether ``ids`` are a top-1 pick without ``keepdim``: [T] (or [B, S]) standing for [T, 1]."""
    src = ids.args[0] if ids.op == "call_function" and ids.target is operator.getitem else ids
    if not isinstance(src, fx.Node) or not is_top1(src):
        return False
    keepdim = src.kwargs.get("keepdim", src.args[2] if len(src.args) > 2 else False)
    return not keepdim


def inside_router(node: fx.Node, limit: int = 64) -> bool:
    """Whether an id source feeds another one without a GEMM between them: a step of a router
    (group-limited routing's group top-k, sparsemixer's max picks), not a layer's routing.  An
    in-place write (``group_mask.scatter_(1, group_idx, 1)``) feeds the later readers of its buffer."""
    seen, frontier = {node}, [node]
    while frontier and len(seen) < limit:
        current = frontier.pop(0)
        users = list(current.users)
        if is_inplace(current) and isinstance(current.args[0], fx.Node):
            users += [u for u in current.args[0].users if u is not current]
        for user in users:
            if user in seen or is_matmul(user):
                continue
            if is_id_source(user):
                return True
            seen.add(user)
            frontier.append(user)
    return False


def is_id_source(node: fx.Node) -> bool:
    """Where a candidate's expert ids come from: a top-k (or top-1 max / argmax), a hash table
    lookup, or picked indices concatenated into [T, K]."""
    return is_topk(node) or is_top1(node) or is_hash_lookup(node) or is_concatenated_ids(node)


def selected_by(deps: Deps, topk: fx.Node, ffn_outputs: set[fx.Node]) -> set[fx.Node]:
    """The nodes whose inputs a top-k's routing selects: reached from it along paths that never
    leave an expert FFN's output.  Everything computed from a down GEMM the routing reached (the
    combine, the residual stream, the next layers' routers and FFNs, a shared expert applied to
    the MoE's output) is after the experts, not chosen by them: it is reached but not walked on.

    One forward pass in graph order (``Deps`` edges point backwards, mutation edges included):
    ``after`` marks nodes that depend on such a down GEMM, ``reached`` the nodes selected."""
    reached, after = {topk}, set()
    start = deps.order[topk]
    for node, index in deps.order.items():
        if index <= start:
            continue
        ins = deps.inputs(node)
        if any(i in reached and i not in after for i in ins):
            reached.add(node)
        # reading any FFN's output is after it, reached or not (dense experts run on every token
        # before the mask: ``einsum("eth,te->th", out, mask)`` is reached through the mask only)
        if (node in reached and node in ffn_outputs) or any(i in after or i in ffn_outputs for i in ins):
            after.add(node)
    return reached


def group_by_topk(graph: fx.Graph, deps: Deps, clusters: list[Cluster]) -> tuple[list[Candidate], list[Cluster]]:
    """Routed candidates (clusters grouped by the nearest top-k whose routing selects them) and
    the unrouted clusters.  In a deep model every later layer depends on every earlier top-k
    through the residual stream; only the paths that stop at an FFN's output select (see
    ``selected_by``), so a layer's top-k holds its own experts and no later layer's FFN."""
    topks = [n for n in graph.nodes if is_id_source(n)]
    downs = {c.down for c in clusters}
    groups: dict[fx.Node, list[Cluster]] = {}
    unrouted = []
    reach = {t: selected_by(deps, t, downs) for t in topks}  # one walk per top-k, not per cluster
    for cluster in clusters:
        near = [t for t in topks if cluster.down in reach[t] or _masked_after(cluster, reach[t])]
        if not near:
            unrouted.append(cluster)
            continue
        nearest = max(near, key=lambda t: deps.order[t])
        groups.setdefault(nearest, []).append(cluster)
    return [Candidate(t, cs) for t, cs in groups.items()], unrouted


def _masked_after(cluster: Cluster, reach: set) -> bool:
    """Experts run on every token before any routing, their output weighted by a dense mask that
    depends on the top-k: stacked [E, T, H] (``einsum("eth,te->th", out, mask)``, ``out * mask``), or
    one expert's [T, H] times its column of the mask: routed by that top-k.  (A shared expert's
    [T, H] output added to the routed one is not.)"""
    value = cluster.down.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.dim() not in (2, 3):
        return False
    if value.dim() == 3 and cluster.down_w.expert is not None:
        return False  # [E, T, H] from one stacked weight: all experts at once
    if value.dim() == 2 and cluster.down_w.expert is None and _ndim(cluster.down_w.param) != 2:
        return False  # [T, H] from one expert: ``ffn(x, e) * (w * (ids == e)).sum(-1)[:, None]``
    frontier = [cluster.down]
    for _ in range(3):
        frontier = [u for n in frontier for u in n.users]
        if any(u in reach and target_name(u) in _MASKING for u in frontier):
            return True
        frontier = [u for u in frontier if is_view_like(u)]
    return False


def _ndim(node: fx.Node) -> int:
    value = node.meta.get("example_value")
    return value.dim() if isinstance(value, torch.Tensor) else -1


_MASKING = ("einsum", "mul", "__mul__", "bmm", "matmul", "__matmul__", "gather", "take_along_dim")


def unrecognised_experts(graph: fx.Graph, deps: Deps, candidates: list[Candidate]) -> list[tuple[fx.Node, fx.Node]]:
    """For each top-k that no candidate holds, (top-k, the first GEMM after it that reads expert weights
    the way MoE experts do (a grouped GEMM, or weights indexed by a tensor: ``w[ids]``)  and is in
    no candidate's FFN): an MoE whose FFN the clusters did not recognise, worth a line in explain()."""
    held = {c.topk for c in candidates}
    in_ffn = {g for c in candidates for cl in c.clusters for g in cl.gemms}
    downs = {cl.down for c in candidates for cl in c.clusters}
    found = []
    for topk in (n for n in graph.nodes if is_id_source(n) and n not in held):
        reach = selected_by(deps, topk, downs)
        gemm = next((n for n in graph.nodes if n in reach and n not in in_ffn and _reads_expert_weights(n)), None)
        if gemm is not None:
            found.append((topk, gemm))
    return found


def _reads_expert_weights(node: fx.Node) -> bool:
    if is_grouped_mm(node):
        return True
    if not is_matmul(node):
        return False
    ref = gemm_operands(node)[1]
    return ref is not None and ref.indexed_by is not None


def uses_grouped_mm(candidate: Candidate) -> bool:
    return any(is_grouped_mm(g) for c in candidate.clusters for g in c.gemms)


def weight_refs(candidate: Candidate) -> list[WeightRef]:
    return [w for c in candidate.clusters for w in (*c.fc1_w, c.down_w)]


def why_no_experts(graph: fx.Graph, deps: Deps, topk: fx.Node, clusters: list[Cluster]) -> str:
    """Why no candidate holds this top-k: the step that found no expert FFN after it and the op
    where that step stopped (every top-k has an outcome a user can act on)."""
    downs = {c.down for c in clusters}
    reach = selected_by(deps, topk, downs)
    for cluster in clusters:  # experts run on every token, then routed by something no family reads
        reader = _reader_in(cluster.down, reach)
        if reader is not None:
            return (f"its expert FFN (FC2 at {_at(cluster.down)}) runs on every token before routing and its output "
                    f"is combined by `{target_name(reader)}` ({_at(reader)}), which no family reads as a dense "
                    f"[T, E] mask over the experts' outputs")
    gemms = [n for n in graph.nodes if n in reach and is_matmul(n) and gemm_operands(n)[1] is not None]
    untraced = next((n for n in graph.nodes if n in reach and is_matmul(n) and not gemms), None)
    if untraced is not None:
        stop = next((s for a in untraced.args if a not in reach and (s := _weight_trace_stop(a)) is not None), None)
        return (f"the GEMM at {_at(untraced)} reads a weight traced to no parameter through views and indexing"
                + (f" (the trace stopped at `{target_name(stop)}`, {_at(stop)})" if stop is not None else ""))
    if not gemms:
        return ("no GEMM on the module's weights reads what it selects: not an MoE router (a top-k over features), "
                "or experts that are not GEMMs")
    stop = _first_non_elementwise(gemms[0])
    if stop is not None and dropout_training(stop):
        return (f"Dropout in training mode between the expert GEMMs ({_at(stop)}): it zeroes random activations, "
                f"which the fused op does not compute (model.eval() makes it an identity, rewritten)")
    if stop is not None:
        return (f"the GEMM at {_at(gemms[0])} reaches no FC2 GEMM through element-wise ops: the FFN search stopped "
                f"at `{target_name(stop)}` ({_at(stop)})")
    return (f"the FFN after the GEMM at {_at(gemms[0])} fits no FC1 GEMM(s) -> activation -> FC2 GEMM on weights "
            f"traced to parameters (at most two FC1 GEMMs, a nonlinearity between them and FC2)")


def _weight_trace_stop(node) -> fx.Node | None:
    """Where ``trace_weight`` gives up on a GEMM operand that is not an activation (None: it is one)."""
    for _ in range(16):
        if not isinstance(node, fx.Node) or node.op == "placeholder":
            return None
        if const_int_index(node) is None and not is_view_like(node) and node.target is not operator.getitem:
            return node if any(isinstance(a, fx.Node) and a.op == "placeholder" and is_parameter(a)
                               for a in _flat_args(node)) else None
        node = node.args[0]
    return None


def _flat_args(node: fx.Node) -> list:
    return [b for a in node.args for b in (a if isinstance(a, (list, tuple)) else (a,))]


def _at(node: fx.Node) -> str:
    return source_line(node) or node.format_node()[:120]


def _reader_in(down: fx.Node, reach: set) -> fx.Node | None:
    frontier = [down]
    for _ in range(3):
        frontier = [u for n in frontier for u in n.users]
        hit = next((u for u in frontier if u in reach), None)
        if hit is not None:
            return hit
        frontier = [u for u in frontier if is_view_like(u)]
    return None


def _first_non_elementwise(gemm: fx.Node) -> fx.Node | None:
    """The first op on the paths from an FC1 GEMM's output that is neither element-wise nor a GEMM:
    where the search for the FFN's FC2 stopped (None when a GEMM is reached)."""
    frontier, seen = [gemm], set()
    while frontier:
        node = frontier.pop(0)
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if is_matmul(user):
                return None
            if is_identity(user):
                frontier.append(user)
                continue
            if user.op not in ("call_function", "call_method") or target_name(user) not in _ELEMENTWISE:
                return user
            frontier.append(user)
    return None
