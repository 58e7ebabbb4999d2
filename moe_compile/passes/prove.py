"""Prove a lifted MoE region equals the fused op, by running both on inputs that reach every expert.

Shapes:  T0 proof tokens, H hidden, E experts, K top-k.

Structure tells the matchers *where* the experts are; this step decides *what* they compute.  For
each hypothesis (layout, activation, clamp, where the weight multiplies, gate/up order) it runs the
original region and ``kernels/reference.py`` on the same synthetic routing — every expert receives
tokens, weights are random — with the model's real expert weights, and keeps the first hypothesis
whose relative error is inside the dtype's tolerance.  No hypothesis within tolerance means no
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


@dataclasses.dataclass(frozen=True)
class Hypothesis:
    weights: ExpertWeights
    attrs: FFNAttrs
    roles: tuple  # (fc1 nodes, fc1_up nodes, fc2 nodes) matching weights' tensors


def synthetic_routing(T0: int, K: int, E: int, w_dtype, device, generator):
    """ids [T0, K]: slot (t, k) gets expert (t*K + k) mod E (distinct per token when K <= E)."""
    slots = torch.arange(T0 * K, device=device).view(T0, K)
    ids = slots % E
    weights = torch.rand(T0, K, generator=generator, dtype=torch.float32).to(device, w_dtype) + 0.1
    return ids, weights


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want64, got64 = want.double(), got.double()
    scale = want64.abs().max().item()
    if not math.isfinite(scale):
        return math.inf
    return (got64 - want64).abs().max().item() / max(scale, 1e-30)


def run_proof(region_fn, x_real, ids_dtype, weights_like, params, sizes, hypotheses, K, E, dense_mode):
    """(best hypothesis, its error, tolerance); best is None when none is inside the tolerance."""
    gen = torch.Generator().manual_seed(0)
    if sizes:  # the region reads sizes of the real batch: keep its token count
        T0 = x_real.shape[0]
        x0 = x_real
    else:
        T0 = max(4, -(-2 * E // max(K, 1)))
        rows = torch.randint(0, max(x_real.shape[0], 1), (T0,), generator=gen)
        x0 = x_real[rows] if x_real.shape[0] else torch.randn(T0, x_real.shape[1], dtype=x_real.dtype)
    ids0, g0 = synthetic_routing(T0, K, E, weights_like.dtype, x0.device, gen)
    ids0 = ids0.to(ids_dtype)
    routed = g0
    if dense_mode is not None:
        dense = torch.zeros(T0, E, dtype=g0.dtype, device=g0.device).scatter_(1, ids0.long(), g0)
        routed = dense.t().contiguous() if dense_mode == "transposed" else dense
    with torch.no_grad():
        want = region_fn(x0, ids0, routed, *params, *sizes)
        tol = PROOF_TOLERANCE.get(x0.dtype, 3e-2)
        best = (None, math.inf)
        for hyp in hypotheses:
            try:
                got = fused_moe_reference(x0, ids0, g0, hyp.weights, hyp.attrs)
            except (RuntimeError, ValueError, IndexError):
                continue
            if got.shape != want.shape:
                continue
            err = relative_error(got, want)
            if err < best[1]:
                best = (hyp, err)
            if err <= tol:
                return hyp, err, tol
    return None, best[1], tol
