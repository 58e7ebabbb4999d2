"""Lift a candidate to ``MoESpec``: cut the region, enumerate hypotheses, prove one.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K top-k.

The family matchers (loop.py, sorted.py, gathered.py, dense.py) decide which candidates are
theirs and in which order the clusters are experts 0..E-1; everything after that is shared.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator

import torch
import torch.fx as fx

from moe_compile.ir import ROLES, ExpertWeights, FFNAttrs, MoESpec
from moe_compile.passes import prove, region as region_mod
from moe_compile.passes.clusters import Cluster
from moe_compile.passes.graph import Deps, dtype_of, meta, module_path, shape_of, target_name
from moe_compile.passes.region import Refusal, Region


@dataclasses.dataclass
class Roles:
    """Expert weights by role, as graph inputs: one stacked node, or E per-expert nodes."""

    fc1: tuple[fx.Node, ...]
    fc1_up: tuple[fx.Node, ...]
    fc2: tuple[fx.Node, ...]
    gate_first_known: bool  # structure told which FC1 GEMM is the gate
    fc1_bias: tuple[fx.Node, ...] = ()  # same forms as the weights: stacked [E, n] or E x [n]
    fc1_up_bias: tuple[fx.Node, ...] = ()
    fc2_bias: tuple[fx.Node, ...] = ()
    # (role, [E, out, in]) for roles held as a [E*out, in] Linear weight that the op reads as
    # ``param.view(E, out, in)`` (experts as one ``nn.Linear(H, E*F)`` viewed [T, E, F]); its bias
    # (role "<name>_bias", [E, out]) as ``bias.view(E, out)``
    unflattened: tuple = ()

    def nodes(self) -> list[fx.Node]:
        return list(dict.fromkeys((*self.fc1, *self.fc1_up, *self.fc2, *self.fc1_bias, *self.fc1_up_bias,
                                   *self.fc2_bias)))


@dataclasses.dataclass
class Match:
    """A proven MoE region and how to replace it."""

    spec: MoESpec
    region: Region
    error: float
    op_dtype: torch.dtype | None = None  # the region casts x / its weights to this dtype for its GEMMs

    def replace_with_fused_op(self, graph: fx.Graph, deps: Deps, save_fc1: bool = True, quant=None) -> fx.Node:
        """``quant``: a ``quant.plan.QuantPlan`` with a policy, or None (the unquantized op)."""
        spec = self.spec

        def make_call(g: fx.Graph) -> fx.Node:
            ids, routing = region_mod.flat_routing(g, self.region)
            a = spec.attrs
            x, roles = cast_operands(g, self.region.x, spec_roles(spec), self.op_dtype)
            roles = op_views(g, spec, roles)
            unflattened = len(shape_of(self.region.x)) > 2  # [B, S, H] tokens, combined as [B, S, H]
            if unflattened:
                x = g.call_method("reshape", (x, -1, shape_of(self.region.x)[-1]))  # [T, H]
            args = (x, ids, routing, *roles, a.gate_up, a.transposed, a.activation, a.limit, a.alpha, a.weight_on)
            if quant is not None and quant.policy:  # inference only: the plan refused training graphs
                call = g.call_function(torch.ops.moe_compile.fused_moe_quant.default,
                                       (*args, quant.policy, quant.budget_db, quant.tag))
            else:
                call = emit_fused_moe(g, args, save_fc1)
            if unflattened:
                call = g.call_method("view_as", (call, self.region.x))  # [T, H] -> [B, S, H]
            return cast_result(g, call, self.region, self.op_dtype)

        return region_mod.replace_region(graph, deps, self.region, make_call)


def spec_roles(spec: MoESpec) -> list[list[fx.Node]]:
    return [list(spec.fc1), list(spec.fc1_up), list(spec.fc2), list(spec.fc1_bias), list(spec.fc1_up_bias),
            list(spec.fc2_bias)]


def op_dtype_of(clusters: list[Cluster], x: fx.Node, params) -> torch.dtype | None:
    """The dtype the region's GEMMs compute in when the op must cast to get there: the lowest
    precision among the GEMMs' results (fp32 master weights ``.bfloat16()`` around a grouped GEMM,
    bf16 experts under an fp32 router), if x or some weight is held in another dtype; else None."""
    low = prove.lowest_precision([dtype_of(g) for c in clusters for g in c.gemms])
    if low is None or all(dtype_of(n) in (low, None) for n in (x, *params)):
        return None
    return low


def cast_operands(g: fx.Graph, x: fx.Node, roles, dtype):
    """x and the weight roles cast to ``dtype`` where they are held in another (no-op when None)."""
    if dtype is None:
        return x, roles

    def cast(node):
        return node if dtype_of(node) in (dtype, None) else g.call_method("to", (node, dtype))

    return cast(x), [[cast(n) for n in role] for role in roles]


def cast_result(g: fx.Graph, out: fx.Node, region: Region, dtype) -> fx.Node:
    """The op's result (in ``dtype``) cast back to the dtype of the value it replaces."""
    want = dtype_of(region.buffer if region.buffer is not None else region.output) or dtype_of(region.x)
    return out if dtype is None or want in (dtype, None) else g.call_method("to", (out, want))


def will_be_differentiated(args) -> bool:
    """Whether autograd will run through the op: grad mode is on while the graph is compiled (Dynamo
    guards on it) and some tensor argument's example value requires grad — AOTAutograd's own test
    for tracing a backward."""
    if not torch.is_grad_enabled():
        return False
    nodes = [n for a in args for n in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(n, fx.Node)]
    return any(getattr(meta(n), "requires_grad", False) for n in nodes)


def emit_fused_moe(g: fx.Graph, args, save_fc1: bool = True) -> fx.Node:
    """A call of ``fused_moe_infer`` where the graph will not be differentiated (no autograd
    layer to pass through); where it will, of ``fused_moe_train`` (its y) when ``save_fc1``
    allows, so that the backward reads FC1's saved output instead of recomputing it, else of
    ``fused_moe``."""
    if not will_be_differentiated(args):
        return g.call_function(torch.ops.moe_compile.fused_moe_infer.default, args)
    if not save_fc1:
        return g.call_function(torch.ops.moe_compile.fused_moe.default, args)
    both = g.call_function(torch.ops.moe_compile.fused_moe_train.default, args)
    return g.call_function(operator.getitem, (both, 0))


def _activation_options(nodes) -> list[str]:
    found = []
    for node in nodes:
        name = target_name(node)
        if name in ("silu", "silu_"):
            found.append("silu")
        elif name == "gelu":
            found.append("gelu_tanh" if node.kwargs.get("approximate") == "tanh" else "gelu")
        elif name in ("relu", "relu_"):
            found.append("relu")
    found = list(dict.fromkeys(found)) or ["silu", "gelu", "gelu_tanh", "relu"]
    if any(target_name(n) in ("sigmoid", "sigmoid_") for n in nodes):
        found.append("gptoss")  # GPT-OSS's (up + 1) * g * sigmoid(alpha g); silu when written g * sigmoid(g)
    return found


DEFAULT_ALPHA = FFNAttrs.alpha  # GPT-OSS's sigmoid slope, the IR's default


def _alpha_options(nodes) -> list[float]:
    """Sigmoid slopes for "gptoss": the constant a sigmoid's input is multiplied by
    (``sigmoid(g * alpha)``) first, then GPT-OSS's default.  Structure orders them: at bf16's
    tolerance the default passes the proof for a graph's 1.25 too (see prove.CLEARLY_CLOSER)."""
    alphas = []
    for node in nodes:
        arg = node.args[0] if target_name(node) in ("sigmoid", "sigmoid_") and node.args else None
        if isinstance(arg, fx.Node) and target_name(arg) in ("mul", "__mul__"):
            alphas += [float(a) for a in arg.args if isinstance(a, (int, float)) and a > 0]
    return list(dict.fromkeys([*alphas, DEFAULT_ALPHA]))


def _clamp_limits(nodes) -> list[float]:
    limits = {0.0}
    for node in nodes:
        if target_name(node) in ("clamp", "clamp_", "clip"):
            for value in (*node.args[1:], *node.kwargs.values()):
                if isinstance(value, (int, float)) and value > 0:
                    limits.add(float(value))
    return sorted(limits, reverse=True)


def _weight_on_options(deps: Deps, region: Region, clusters: list[Cluster]) -> list[str]:
    touched = deps.descendants([region.weights])
    if any(g in touched for c in clusters for g in c.fc1):
        first = "input"
    elif any(c.down in touched for c in clusters):
        first = "between"
    else:
        first = "output"
    return [first] + [w for w in ("output", "between", "input") if w != first]


def _role_orientations(shape, x_hidden, down: bool) -> list[tuple[bool, int]]:
    """(transposed, the role's other width) for each orientation in which a weight of ``shape``
    meets H where it must: an FC1 weight reads H ([n, H], or [H, n] transposed), FC2 writes it
    ([H, F], or [F, H] transposed)."""
    a, b = shape
    found = []
    for transposed in (False, True):
        h_side, other = (a, b) if transposed != down else (b, a)
        if h_side == x_hidden:
            found.append((transposed, other))
    return found


def _layouts(roles: Roles, values, x_hidden) -> list[tuple[str, bool, tuple]]:
    """(gate_up, transposed, flipped) triples consistent with the weight shapes.  Each role (gate,
    up, down) has its own orientation; ``transposed`` is the op's (the roles' majority, FC1's on a
    tie) and ``flipped`` the roles held in the other one, which the op reads as transposed views
    (DBRX: w1 / v1 as ``x @ W.t()``, w2 as ``h @ W``).  One orientation for every role comes first."""
    def shape(role):
        return tuple(_viewed(values[role[0]], roles.unflattened, _name_of(roles, role)).shape[-2:])

    downs = _role_orientations(shape(roles.fc2), x_hidden, down=True)
    gates = _role_orientations(shape(roles.fc1), x_hidden, down=False)
    ups = _role_orientations(shape(roles.fc1_up), x_hidden, down=False) if roles.fc1_up else [(None, None)]
    out = []
    for (t2, ffn), (t1, n1), (tu, nu) in itertools.product(downs, gates, ups):
        if roles.fc1_up:
            layouts = ["separate"] if n1 == ffn and nu == ffn else []
        elif n1 == 2 * ffn:
            layouts = ["concat", "interleaved"]
        elif n1 == ffn:
            layouts = ["none"]
        else:
            layouts = []
        orient = {"fc1": t1, "fc1_up": tu, "fc2": t2} if roles.fc1_up else {"fc1": t1, "fc2": t2}
        flips = sum(orient.values())
        op_t = t1 if 2 * flips == len(orient) else 2 * flips > len(orient)
        flipped = tuple(r for r, t in orient.items() if t != op_t)
        out += [(layout, op_t, flipped) for layout in layouts]
    return sorted(out, key=lambda o: bool(o[2]))  # stable: uniform first, in the order above


_SWAPPED = {"fc1": "fc1_up", "fc1_up": "fc1", "fc1_bias": "fc1_up_bias", "fc1_up_bias": "fc1_bias"}


def hypotheses(deps, region, clusters, roles: Roles, values, op_dtype=None) -> list[prove.Hypothesis]:
    """Every (layout, role orientation, activation, clamp, slope, placement, gate/up order) the
    structure allows, on the real expert weights (cast to ``op_dtype`` as the rewrite will cast them)."""
    x_hidden = shape_of(region.x)[-1]
    acts = _activation_options(region.nodes)
    limits = _clamp_limits(region.nodes)
    alphas = _alpha_options(region.nodes)
    places = _weight_on_options(deps, region, clusters)
    orders = [False] if roles.gate_first_known or not roles.fc1_up else [False, True]
    out = []
    for (layout, transposed, flipped), act, limit, alpha, place, swap in itertools.product(
        _layouts(roles, values, x_hidden), acts, limits, alphas, places, orders
    ):
        if act == "gptoss" and (limit <= 0 or layout == "none") or act != "gptoss" and alpha != DEFAULT_ALPHA:
            continue  # gptoss needs its clamp and a gate/up pair; alpha only matters to gptoss
        fc1, up = (roles.fc1_up, roles.fc1) if swap else (roles.fc1, roles.fc1_up)
        b1, b1u = (roles.fc1_up_bias, roles.fc1_bias) if swap else (roles.fc1_bias, roles.fc1_up_bias)
        flips = tuple(_SWAPPED.get(r, r) for r in flipped) if swap else flipped
        views = tuple((_SWAPPED.get(r, r), v) for r, v in roles.unflattened) if swap else roles.unflattened
        nodes = (fc1, up, roles.fc2, b1, b1u, roles.fc2_bias)
        weights = ExpertWeights(*(tuple(_oriented(_viewed(_as(values[n], op_dtype), views, name), name in flips)
                                        for n in role)
                                  for name, role in zip(ROLES, nodes)),
                                transposed=transposed)
        attrs = FFNAttrs(layout, transposed, act, limit, alpha, place)
        out.append(prove.Hypothesis(weights, attrs, nodes, flips, views))
    return out




def _name_of(roles: Roles, role) -> str:
    return "fc1" if role is roles.fc1 else "fc1_up" if role is roles.fc1_up else "fc2"


def _viewed(t: torch.Tensor, views, name: str) -> torch.Tensor:
    shape = dict(views).get(name)
    return t if shape is None else t.view(shape)  # a [E*n, in] Linear weight as the stack [E, n, in] ([E*n] bias: [E, n])


def uniform_hypotheses(*args, **kwargs) -> list[prove.Hypothesis]:
    """The hypotheses with one orientation for every role (the expert-parallel ops take no flipped role)."""
    return [h for h in hypotheses(*args, **kwargs) if not h.flipped]


def _oriented(t: torch.Tensor, flip: bool) -> torch.Tensor:
    return t.transpose(-2, -1) if flip else t  # a view with swapped strides, as the rewrite emits


def op_views(g: fx.Graph, spec: MoESpec, roles) -> list[list[fx.Node]]:
    """The op's six role lists (``spec_roles``, after ``cast_operands``) as the op reads them, emitted
    into g: viewed ``[E, out, in]`` where the model holds a role as one [E*out, in] Linear weight
    (``spec.unflattened``), then a ``transpose(-2, -1)`` view of each tensor of a role held in the
    other orientation (``spec.flipped``).  Views only: the op reads the model's storage."""
    flipped, views = set(spec.flipped), dict(spec.unflattened)

    def emit(node, name):
        if name in views:
            node = g.call_method("view", (node, *views[name]))
        return g.call_method("transpose", (node, -2, -1)) if name in flipped else node

    return [[emit(n, name) for n in role] for name, role in zip(ROLES, roles)]


def _as(t: torch.Tensor, dtype) -> torch.Tensor:
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


class GraphValues:
    """Real values of a graph's nodes on the example inputs, computed on demand and kept.

    The proof needs the real x (and any sizes) of each candidate; candidates of one graph share
    this cache, so the layers before them run once, not once per candidate.
    """

    def __init__(self, gm: fx.GraphModule, deps: Deps, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.deps = deps
        self.inputs = dict(zip(placeholders, example_inputs))
        self._interp = fx.Interpreter(gm, garbage_collect_values=False)
        self._interp.env = dict(self.inputs)
        self.proofs: dict = {}  # prove.proof_key -> (index of the hypothesis that passed or None, error, tol)
        self._vmap_spans = _vmap_spans(gm.graph)

    def __getitem__(self, node: fx.Node):
        return self._interp.env[node]

    def real(self, wanted) -> list:
        """The real values of the wanted nodes, in order (computed as ``compute`` does)."""
        self.compute(wanted)
        return [self[n] for n in wanted]

    def compute(self, wanted) -> GraphValues:
        env = self._interp.env
        needed = self.deps.ancestors(wanted, stop=lambda n: n in env)
        # A vmap Dynamo inlined (HF's mask functions) runs only whole: its batched values live inside
        # the nesting level its increment / decrement nodes open and close, which no data edge reaches.
        spans = [span for span in self._vmap_spans if not needed.isdisjoint(span)]
        if spans:
            whole = [n for span in spans for n in span]
            needed = set(needed) | set(self.deps.ancestors(whole, stop=lambda n: n in env)) | set(whole)
        with torch.no_grad():
            for node in sorted(needed, key=self.deps.order.get):
                if node.op not in ("placeholder", "output") and node not in env:
                    env[node] = self._interp.run_node(node)
        return self


def lift(family, graph, deps, candidate, roles: Roles, values: GraphValues, top_k, num_experts) -> Match:
    params = roles.nodes()
    values.compute(params)  # placeholders, or views of them (a stacked view of a fused parameter)
    down_w = values[roles.fc2[0]]
    hidden_sizes = tuple(down_w.shape[-2:])
    region = region_mod.cut_region(
        graph, deps, candidate.topk, [c.down for c in candidate.clusters], params, top_k, num_experts, hidden_sizes
    )
    routing_inputs = [region.x, region.ids, region.weights, *region.extra_inputs]
    op_dtype = op_dtype_of(candidate.clusters, region.x, params)
    hyps = hypotheses(deps, region, candidate.clusters, roles, values, op_dtype)
    if not hyps:
        raise Refusal("the expert weight shapes fit no supported gate/up layout in any orientation of each role",
                      candidate.clusters[0].down)
    region_fn = region_mod.extract(region)
    dense_mode = None if not region.dense else ("transposed" if region.dense_transposed else "plain")
    # One orientation for every role is proven first; roles in mixed orientations only if it fails
    # (square weights fit both, and the common case pays for no extra hypotheses).
    uniform = [h for h in hyps if not h.flipped]
    choices = router_choices(candidate.topk)
    best, err, tol = None, float("inf"), 0.0
    for group in (uniform, [h for h in hyps if h.flipped]):
        if not group or best is not None:
            continue
        like = [_recorded(n) for n in routing_inputs]
        if any(v is None for v in like):  # nothing recorded to key on: the real values
            like = values.real(routing_inputs)
        key = prove.proof_key(region_fn, [*like[:3], *(values[p] for p in params), *like[3:]], group, top_k,
                              num_experts, dense_mode, op_dtype)
        if key in values.proofs:  # the same region as an earlier layer's: its outcome, for these roles
            at, group_err, tol = values.proofs[key]
            best = group[at] if at is not None else None
        else:
            # the real x of this layer: every layer before it runs (once per graph, kept in values)
            real = values.real(routing_inputs)
            try:
                best, group_err, tol = prove.run_proof(
                    region_fn, real[0], real[1], real[2], [values[p] for p in params], real[3:], group, top_k,
                    num_experts, dense_mode, op_dtype, choices,
                )
            except Exception as exc:  # the region itself failed on synthetic routing: not provable
                raise Refusal(f"running the region on synthetic routing failed ({type(exc).__name__}: {exc})",
                              candidate.clusters[0].down) from exc
            # the proof may hand back a copy (packed weights swapped for their values): found by its roles
            at = next((i for i, h in enumerate(group) if best is not None and h.roles is best.roles), None)
            values.proofs[key] = (at, group_err, tol)
        err = group_err if best is not None else min(err, group_err)
    if best is None and choices is not None and choices > num_experts:
        raise Refusal(
            f"the router picks among {choices} choices for {num_experts} experts, and ids >= {num_experts} "
            f"(zero-compute / identity experts) change the output: the op computes routed experts only "
            f"(closest hypothesis erred by {err:.2e})", candidate.clusters[0].down,
        )
    if best is None:
        raise Refusal(
            f"could not prove the experts compute a supported FFN (closest hypothesis erred by {err:.2e}, "
            f"tolerance {tol:.0e})", candidate.clusters[0].down,
        )
    fc1, up, fc2, b1, b1u, b2 = best.roles
    spec = MoESpec(
        family=family, x=region.x, topk_ids=region.ids, topk_weights=region.weights, output=region.output,
        fc1=tuple(fc1), fc1_up=tuple(up), fc2=tuple(fc2), fc1_bias=tuple(b1), fc1_up_bias=tuple(b1u),
        fc2_bias=tuple(b2),
        attrs=best.attrs, num_experts=num_experts, top_k=top_k, hidden=best.weights.hidden(),
        ffn=best.weights.ffn(), region=tuple(region.nodes), source=_source_of(fc2), flipped=best.flipped,
        unflattened=best.unflattened,
    )
    return Match(spec, region, err, op_dtype)


def _vmap_spans(graph: fx.Graph) -> list[set]:
    """The nodes of each outermost ``_vmap_increment_nesting`` .. ``_vmap_decrement_nesting`` span."""
    spans, depth = [], 0
    for node in graph.nodes:
        name = target_name(node) if node.op == "call_function" else ""
        if name == "_vmap_increment_nesting":
            if depth == 0:
                spans.append(set())
            depth += 1
        if depth:
            spans[-1].add(node)
        if name == "_vmap_decrement_nesting" and depth:
            depth -= 1
    return spans


def router_choices(topk: fx.Node) -> int | None:
    """How many ids a ``topk`` picks among (its scores' last dim, when static); None for an id source
    that is not a top-k (a hash table lookup) or a symbolic width."""
    if target_name(topk) != "topk" or not topk.args or not isinstance(topk.args[0], fx.Node):
        return None
    dim = topk.kwargs.get("dim", topk.args[2] if len(topk.args) > 2 else -1)
    shape = shape_of(topk.args[0])
    if not shape or dim not in (-1, len(shape) - 1) or not isinstance(shape[-1], int):
        return None
    return shape[-1]


def _recorded(node: fx.Node):
    """The value Dynamo recorded for a node (a fake tensor, a SymInt or an int), or None."""
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, (torch.Tensor, torch.SymInt, int)) else None


def _source_of(fc2_nodes) -> str:
    """The experts' module path: per-expert weights (``model.layers.3.mlp.experts.0.down_proj.weight``,
    ``...experts.1...``) up to where the experts' paths differ; a stacked weight's module ("self":
    the compiled module itself)."""
    paths = [module_path(n).split(".") for n in fc2_nodes[:2]]
    if len(paths) == 2 and len(paths[0]) == len(paths[1]):
        differ = next((i for i, (a, b) in enumerate(zip(*paths)) if a != b), None)
        if differ is not None:
            return ".".join(paths[0][:differ])
    parts = paths[0]
    if len(parts) > 2 and parts[-3].isdigit():  # one expert in a list: experts.0.down_proj.weight
        return ".".join(parts[:-3])
    # weights held by a module: its path; by the compiled module itself (``self.w2``): "self", so
    # that a region is named by the module holding its experts in every family, never by a weight
    return ".".join(parts[:-1]) or "self"


def int_index_roles(clusters: list[Cluster], refs_of) -> tuple[fx.Node, ...] | None:
    """A single stacked param when every cluster reads ``param[e]`` with e = its expert index."""
    refs = [refs_of(c) for c in clusters]
    if all(r.expert == e and r.param is refs[0].param and r.stack is refs[0].stack for e, r in enumerate(refs)):
        return (refs[0].stack if refs[0].stack is not None else refs[0].param,)  # a view of it: w.view(E, F, H)
    return None


def expert_constant(deps: Deps, cluster: Cluster, ids: fx.Node, from_ids: set) -> int | None:
    """The e in ``ids == e`` / ``mask[e]`` that selects this cluster's tokens, if there is one.

    ``from_ids`` is the set of nodes depending on ids; the walk stays inside it, so it only visits
    the mask chain between the router and this expert.
    """
    found = set()
    for node in deps.ancestors([cluster.fc1[0]], stop=lambda n: n is ids or n not in from_ids):
        if node not in from_ids:
            continue
        name = target_name(node)
        if name in ("eq", "__eq__") and len(node.args) == 2 and isinstance(node.args[1], int):
            found.add(node.args[1])
        elif node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
            src = node.args[0]
            if src in from_ids and shape_of(src) and len(shape_of(src)) == 3:
                found.add(node.args[1])
    return found.pop() if len(found) == 1 else None
