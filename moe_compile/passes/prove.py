"""Prove a lifted MoE region equals the fused op, by running both on inputs that reach every expert.

Shapes:  T0 proof tokens, H hidden, E experts, K top-k.

Structure tells the matchers *where* the experts are; this step decides *what* they compute.  For
each hypothesis (layout, activation, clamp, where the weight multiplies, gate/up order) it runs the
original region and ``kernels/reference.py`` on the same synthetic routing — every expert receives
tokens, weights are random — with the model's real expert weights, and keeps the first hypothesis
whose relative error is inside the dtype's tolerance.  Packed weights (a model loaded quantized)
stay packed, and the routing reaches a spread of their experts (``proof_experts``): each op then
dequantizes only the experts that receive tokens.  No hypothesis within tolerance means no
rewrite, with the closest error in the reason.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.reference import fused_moe_reference

# Relative error (max |diff| / max |ref|) accepted as "the same computation": fp32 differs only by
# summation order (~1e-6 observed; 1e-4 leaves room for large H); bf16/fp16 regions round every
# intermediate to 8/11 mantissa bits while the reference keeps fp32 — 3e-2 / 5e-3 cover that.
# A wrong hypothesis (other activation, swapped gate/up, wrong layout) errs by O(1).
PROOF_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 3e-2, torch.float16: 5e-3}
CLEARLY_CLOSER = 0.5  # a later hypothesis must err by less than this fraction of the one that passed
ROUNDING_LEVEL = 0.01  # ... which itself erred by more than this fraction of the tolerance


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    weights: ExpertWeights
    attrs: FFNAttrs
    roles: tuple  # (fc1 nodes, fc1_up nodes, fc2 nodes) matching weights' tensors
    flipped: tuple = ()  # roles whose weights are transposed views of the model's (ir.MoESpec.flipped)
    unflattened: tuple = ()  # (role, [E, out, in]) viewed from a [E*out, in] weight (ir.MoESpec.unflattened)


def synthetic_routing(T: int, K: int, E: int, round_: int, w_dtype, device, generator):
    """ids [T, K]: slot (t, k) of round r gets expert (r*T*K + t*K + k) mod E — distinct per token
    when K <= E, and ceil(E / (T*K)) rounds reach every expert."""
    slots = torch.arange(T * K, device=device).view(T, K) + round_ * T * K
    ids = slots % E
    weights = torch.rand(T, K, generator=generator, dtype=torch.float32).to(device, w_dtype) + 0.1
    return ids, weights


def crowded_routing(T: int, K: int, E: int, w_dtype, device, generator):
    """ids [T, K] = (0, 1, .., K-1) for every token: K experts receive all T tokens each."""
    ids = torch.arange(K, device=device).expand(T, K) % E
    weights = torch.rand(T, K, generator=generator, dtype=torch.float32).to(device, w_dtype) + 0.1
    return ids.contiguous(), weights


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want64, got64 = want.double(), got.double()
    scale = want64.abs().max().item() if want64.numel() else 0.0
    if not math.isfinite(scale):
        return math.inf
    return (got64 - want64).abs().max().item() / max(scale, 1e-30) if want64.numel() else 0.0


def run_proof(region_fn, x_real, ids_like, weights_like, params, sizes, hypotheses, K, E, dense_mode,
              op_dtype=None, choices=None):
    """(best hypothesis, its worst error over the rounds, tolerance); best is None when none fits
    (the error is then the closest hypothesis's).

    The proof keeps the real batch (static graphs bake its token count into sizes) and replaces
    the routing: enough rounds of synthetic ids that every expert receives tokens.  ``ids_like`` /
    ``weights_like`` are the real routing tensors: the synthetic [T, K] ones take their dtype and
    shape ([B, S, K] ids, a dense [T, E] matrix).  ``op_dtype``: the dtype the region's GEMMs run
    in when it is not x's (the region casts x or its weights); the hypotheses then run on x and
    weights in that dtype, as the rewrite will, and the tolerance is that dtype's.  ``choices``: how
    many ids the top-k picks among, where more than E (a router scoring zero-compute / identity
    experts besides the E stacked ones): further rounds reach ids in [E, choices), which the op
    ignores, so a region that computes anything for them (LongCat-Flash's identity experts add
    w * x) is not proven.
    """
    x_rows = x_real.reshape(-1, x_real.shape[-1])  # [B, S, H] tokens (an unflattened region) as [T, H]
    T = x_rows.shape[0]
    if T == 0:
        return None, math.inf, 0.0
    experts = proof_experts(E, K, _any_packed(params, hypotheses))
    gen = torch.Generator().manual_seed(0)
    tol = PROOF_TOLERANCE.get(op_dtype or _compute_dtype(x_real), 3e-2)
    x_op = x_rows if op_dtype is None else x_rows.to(op_dtype)
    rounds = []  # (ids, weights, region output) per round, computed once and shared by hypotheses
    for r in range(min(-(-len(experts) // (T * K)), 64)):
        ids0, g0 = synthetic_routing(T, K, len(experts), r, weights_like.dtype, x_real.device, gen)
        rounds.append((experts[ids0].to(ids_like.dtype), g0, None))
    if choices is not None and choices > E and dense_mode is None:
        beyond = torch.cat([experts, torch.arange(E, choices)])  # ids past the stacked experts, among real ones
        for r in range(min(-(-len(beyond) // (T * K)), 64)):
            ids0, g0 = synthetic_routing(T, K, len(beyond), r, weights_like.dtype, x_real.device, gen)
            rounds.append((beyond[ids0].to(ids_like.dtype), g0, None))
    if T > 1:  # every token on experts 0..K-1: a region that caps an expert's tokens drops some here
        ids0, g0 = crowded_routing(T, K, E, weights_like.dtype, x_real.device, gen)
        rounds.append((ids0.to(ids_like.dtype), g0, None))
    best, best_err, closest = None, math.inf, math.inf
    with torch.no_grad():
        for hyp in hypotheses:  # ordered by structural likelihood: the first usually passes
            # After a pass only a clearly closer hypothesis replaces it, and none once the error is
            # at rounding level: at bf16's tolerance a near variant (GPT-OSS's sigmoid slope 1.702
            # for the graph's 1.25: 9e-3) passes too, while structurally equal ones (weight
            # "between" vs "output") differ by rounding only and structure picks.
            bar = tol if best is None else best_err * CLEARLY_CLOSER if best_err > tol * ROUNDING_LEVEL else 0.0
            worst = 0.0
            for i, (ids0, g0, want) in enumerate(rounds):
                if want is None:
                    routed = _routed(ids0, g0, E, dense_mode).reshape(weights_like.shape)
                    want = region_fn(x_real, ids0.reshape(ids_like.shape), routed, *params, *sizes)
                    want = want.reshape(T, -1) if want.dim() > 2 else want
                    rounds[i] = (ids0, g0, want)
                worst = max(worst, _hypothesis_error(hyp, x_op, ids0, g0, want))
                if worst > bar:
                    break
            if worst <= tol and (best is None or worst < bar):
                best, best_err = hyp, worst
            closest = min(closest, worst)
    return best, (best_err if best is not None else closest), tol


_WEIGHT_ROLES = ("fc1", "fc1_up", "fc2", "fc1_bias", "fc1_up_bias", "fc2_bias")
# Experts a proof on packed weights reaches (at least 2K): a spread over [0, E) with the first and
# the last.  A packed stack is one [E, N, K] tensor the region indexes by expert id, so its experts
# are slices of one tensor under one computation; what the proof decides (layout, activation,
# gate/up order, where the weight multiplies) shows on any of them.  Reaching every expert would
# dequantize the whole stack (a 128-expert layer of a 30B model: 2.4 GB of fp32) where the packed
# weight dequantizes only the experts that receive tokens.
PACKED_PROOF_EXPERTS = 16


def proof_experts(E: int, K: int, packed: bool) -> torch.Tensor:
    """The expert ids the proof's synthetic routing reaches: all E, or (packed weights) a spread of
    max(PACKED_PROOF_EXPERTS, 2K) of them, ascending, 0 and E - 1 among them."""
    n = min(E, max(PACKED_PROOF_EXPERTS, 2 * K))
    if not packed or n == E:
        return torch.arange(E)
    return torch.linspace(0, E - 1, n).round().long().unique()


def _any_packed(params, hypotheses) -> bool:
    from moe_compile.quant.packed import is_packed

    return any(is_packed(p) for p in params) or any(
        is_packed(t) for h in hypotheses for r in _WEIGHT_ROLES for t in getattr(h.weights, r))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the region's GEMMs run in: the autocast dtype when autocast is on (the backend
    compiles inside the caller's autocast region), else x's."""
    device = x.device.type
    if torch._C._is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _routed(ids, g, E, dense_mode):
    """What the region reads as routing weights: [T, K], or the dense [T, E] / [E, T] matrix."""
    if dense_mode is None:
        return g
    dense = torch.zeros(ids.shape[0], E, dtype=g.dtype, device=g.device).scatter_(1, ids.long(), g)
    return dense.t().contiguous() if dense_mode == "transposed" else dense


def _hypothesis_error(hyp, x, ids, g, want) -> float:
    try:
        got = fused_moe_reference(x, ids, g, hyp.weights, hyp.attrs)
    except (RuntimeError, ValueError, IndexError):
        return math.inf
    if got.shape != want.shape:
        return math.inf
    return relative_error(got, want)


def lowest_precision(dtypes) -> torch.dtype | None:
    """The floating dtype with the fewest mantissa bits among dtypes (None if there is none)."""
    floats = [d for d in dtypes if d is not None and d.is_floating_point]
    return max(floats, key=lambda d: torch.finfo(d).eps, default=None)


def proof_key(region_fn: torch.fx.GraphModule, inputs, hypotheses, K: int, E: int, dense_mode, op_dtype):
    """What a proof's outcome depends on besides the values: the region's ops and how they connect,
    its inputs' shapes, dtypes and kinds, and the hypotheses' attributes, in order.  The layers of
    one model are one region repeated with other weights: equal keys are one function, proven once
    per graph (``lift``), where a 48-layer model of packed experts spent minutes dequantizing every
    layer's stacks to prove each copy again."""
    index: dict = {}
    ops = []
    for node in region_fn.graph.nodes:
        index[node] = len(index)
        ops.append((node.op, _target_key(node), _arg_key(node.args, index), _arg_key(node.kwargs, index)))
    shapes = tuple(_value_key(v) for v in inputs)
    hyps = tuple((h.attrs, h.flipped, tuple(r for r, _ in h.unflattened),
                  tuple(len(r) for r in h.roles)) for h in hypotheses)
    return (tuple(ops), shapes, hyps, K, E, dense_mode, op_dtype)


def _target_key(node) -> str:
    target = node.target
    if node.op in ("placeholder", "output"):
        return node.op
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', target)!s}"


def _arg_key(value, index):
    if isinstance(value, torch.fx.Node):
        return ("node", index[value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_arg_key(v, index) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _arg_key(v, index)) for k, v in value.items()))
    return (type(value).__name__, str(value))


def _value_key(value):
    from moe_compile.quant.packed import is_packed

    if isinstance(value, torch.Tensor):
        kind = (value.fmt, value.group, value.packing) if is_packed(value) else type(value).__name__
        strides = () if is_packed(value) else tuple(map(str, value.stride()))
        return (tuple(map(str, value.shape)), value.dtype, strides, kind)  # str: a SymInt does not hash
    return (type(value).__name__, str(value))
