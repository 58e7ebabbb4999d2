"""Family A — per-expert loops (HF v4 ModuleList, HF v5 eager slices, DeepSeek official code).

Shapes:  T tokens, H hidden, F expert FFN width, E experts (one unrolled cluster each), K top-k.

The graph holds E FFN clusters, each reading its tokens' rows (``x[tok]`` with ``tok`` from
``where``/``nonzero`` of an ``ids == e`` or ``one_hot(ids)[e]`` mask) and accumulating into one
buffer (``index_add_``, ``index_put_``, ``y[idx] += ...``) or a running sum.  Experts are ordered
by the constant e of their mask when the graph shows it, else by graph order; the proof checks it.
"""

from __future__ import annotations

from moe_compile.passes.clusters import Candidate, Cluster, weight_refs
from moe_compile.passes.graph import target_name
from moe_compile.passes.lift import Roles, expert_constant, int_index_roles, lift
from moe_compile.passes.region import Refusal, routing_shape, topk_indices

FAMILY = "loop"


def claims(candidate: Candidate) -> bool:
    """Per-expert 2-D weights (Linears, or int slices of a stacked tensor), no gathered weights."""
    refs = weight_refs(candidate)
    if any(w.indexed_by is not None or w.unflat is not None for w in refs):
        return False
    return all(w.expert is not None or _ndim(w.param) == 2 for w in refs)


def _ndim(node) -> int:
    value = node.meta.get("example_value")
    return value.dim() if value is not None else -1


def _is_gate(gemm) -> bool:
    return any(target_name(u) in ("silu", "gelu", "relu", "sigmoid", "silu_") for u in gemm.users)


def _split_fc1(cluster: Cluster):
    """(gate ref, up ref or None, structure knows the order)."""
    if len(cluster.fc1) == 1:
        return cluster.fc1_w[0], None, True
    a, b = cluster.fc1
    if _is_gate(b) and not _is_gate(a):
        return cluster.fc1_w[1], cluster.fc1_w[0], True
    return cluster.fc1_w[0], cluster.fc1_w[1], _is_gate(a) and not _is_gate(b)


def ordered_clusters(deps, candidate: Candidate) -> list[Cluster]:
    ids = topk_indices(candidate.topk)
    from_ids = deps.descendants([ids])
    keyed = [(expert_constant(deps, c, ids, from_ids), deps.order[c.down], c) for c in candidate.clusters]
    if all(k[0] is not None for k in keyed):
        if sorted(k[0] for k in keyed) != list(range(len(keyed))):
            raise Refusal("the per-expert masks do not select experts 0..E-1 exactly once", candidate.topk)
        return [c for _, _, c in sorted(keyed, key=lambda k: k[0])]
    return [c for _, _, c in sorted(keyed, key=lambda k: k[1])]


def _role(clusters, pick):
    stacked = int_index_roles(clusters, pick)
    return stacked if stacked is not None else tuple(pick(c).param for c in clusters)


def find_loop(graph, deps, candidate: Candidate, example_inputs):
    clusters = ordered_clusters(deps, candidate)
    splits = [_split_fc1(c) for c in clusters]
    if len({s[1] is None for s in splits}) != 1:
        raise Refusal("experts in one loop differ in their gate/up structure", candidate.topk)
    by_cluster = dict(zip(map(id, clusters), splits))
    fc1 = _role(clusters, lambda c: by_cluster[id(c)][0])
    up = () if splits[0][1] is None else _role(clusters, lambda c: by_cluster[id(c)][1])
    fc2 = _role(clusters, lambda c: c.down_w)
    roles = Roles(fc1, up, fc2, gate_first_known=all(s[2] for s in splits),
                  **_bias_roles(clusters, by_cluster, candidate))
    top_k = candidate_top_k(candidate)
    return lift(FAMILY, graph, deps, candidate, roles, example_inputs, top_k, len(clusters))


def _bias_roles(clusters, by_cluster, candidate: Candidate) -> dict:
    """Bias roles from ``F.linear``'s bias operands; every expert must agree on having one."""
    def bias_of(c, gemm_ref):
        if gemm_ref is None:
            return None
        return c.fc1_b[c.fc1_w.index(gemm_ref)] if c.fc1_b else None

    picks = {
        "fc1_bias": lambda c: bias_of(c, by_cluster[id(c)][0]),
        "fc1_up_bias": lambda c: bias_of(c, by_cluster[id(c)][1]),
        "fc2_bias": lambda c: c.down_b,
    }
    roles = {}
    for name, pick in picks.items():
        refs = [pick(c) for c in clusters]
        if all(r is None for r in refs):
            roles[name] = ()
        elif any(r is None for r in refs):
            raise Refusal(f"some experts have a {name.replace('_', ' ')} and others not", candidate.topk)
        else:
            roles[name] = _role(clusters, pick)
    return roles


def candidate_top_k(candidate: Candidate) -> int:
    return int(routing_shape(topk_indices(candidate.topk))[-1])
