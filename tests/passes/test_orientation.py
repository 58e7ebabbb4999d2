"""Each weight role (gate, up, down) in its own orientation (passes/lift.py ``_layouts``, ir.MoESpec.flipped).

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K top-k.

A role stored [E, out, in] is used as ``x @ W[e].t()``, one stored [E, in, out] as ``x @ W[e]``;
DBRX mixes them (w1 / v1 the first way, w2 the second).  The op takes one orientation and reads
the other roles as ``transpose(-2, -1)`` views of the model's own tensors: never a copy.

Tolerance: fp32 differs from eager only in summation order (tests.conftest.TOL); bf16 eager rounds
each GEMM's output to bf16 while the op accumulates in fp32: a few bf16 ulps, 3e-2.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_compile.api import capture_flags
from tests.conftest import TOL, compiled_with_fused_call, rel_err, run_compiled

BF16_TOL = 3e-2


class MixedOrientation(nn.Module):
    """A per-expert loop whose gate, up and down weights are each [E, out, in] (``flip`` False: used
    as ``x @ W[e].t()``) or [E, in, out] (True: ``x @ W[e]``); ``gathered``: family C instead
    (``W[ids]`` per slot, bmm)."""

    def __init__(self, flips=(False, False, True), hidden=32, ffn=16, experts=4, top_k=2, gathered=False,
                 cast=None):
        super().__init__()
        self.flips, self.E, self.K, self.gathered, self.cast = flips, experts, top_k, gathered, cast
        self.router = nn.Linear(hidden, experts, bias=False)
        shapes = [(ffn, hidden), (ffn, hidden), (hidden, ffn)]  # [out, in] per role
        self.w = nn.ParameterList([
            nn.Parameter(torch.randn(experts, *(s[::-1] if f else s)) / s[1] ** 0.5) for s, f in zip(shapes, flips)])

    def _gemm(self, rows, role, e):  # [n, in] -> [n, out]
        w = self.w[role][e]
        if self.cast is not None:  # fp32 master weights, GEMMs in ``cast`` (torchtitan's habit)
            rows, w = rows.to(self.cast), w.to(self.cast)
        out = rows @ w if self.flips[role] else rows @ w.t()
        return out.float() if self.cast is not None else out

    def forward(self, x):  # [T, H]
        probs = self.router(x).softmax(-1)
        weights, ids = probs.topk(self.K, dim=-1)  # [T, K]
        if self.gathered:
            return self._gathered(x, weights, ids)
        y = torch.zeros_like(x)
        for e in range(self.E):
            tok, k = torch.where(ids == e)
            rows = x[tok]
            h = F.silu(self._gemm(rows, 0, e)) * self._gemm(rows, 1, e)
            y.index_add_(0, tok, self._gemm(h, 2, e) * weights[tok, k, None])
        return y

    def _gathered(self, x, weights, ids):
        def gemm(rows, role):  # rows [T*K, 1, in] -> [T*K, 1, out]
            w = self.w[role][ids.reshape(-1)]  # [T*K, ., .]
            return rows @ (w if self.flips[role] else w.transpose(1, 2))

        rows = x.repeat_interleave(self.K, 0)[:, None]  # [T*K, 1, H]
        h = F.silu(gemm(rows, 0)) * gemm(rows, 1)
        out = gemm(h, 2).view(-1, self.K, x.shape[-1])  # [T, K, H]
        return (out * weights[..., None]).sum(1)


def _rewritten_and_equal_fp32(model, x):
    """model(x) through backend="moe": one layer rewritten and equal to eager at fp32's tolerance;
    the report."""
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    assert len(report.rewritten) == 1, report
    assert rel_err(got, want) <= TOL[torch.float32]
    return report


@pytest.mark.parametrize("flips", list(itertools.product((False, True), repeat=3)), ids=str)
def test_every_role_orientation_is_rewritten_and_equal_to_eager(flips):
    model = MixedOrientation(flips).eval()
    x = torch.randn(9, 32)
    report = _rewritten_and_equal_fp32(model, x)
    r = report.rewritten[0]  # the report names the roles read as transposed views, and only those
    assert bool(r.flipped) == (len(set(flips)) > 1) and ("flipped=" in r.line()) == bool(r.flipped)


def test_square_weights_try_mixed_orientations_after_uniform_ones():
    """H == F: every role fits both orientations by shape; uniform hypotheses fail the proof and a
    mixed one proves (the down weight flipped relative to gate and up)."""
    model = MixedOrientation((False, False, True), hidden=32, ffn=32).eval()
    _rewritten_and_equal_fp32(model, torch.randn(7, 32))


@pytest.mark.parametrize("gathered", [False, True], ids=["loop", "gathered"])
def test_mixed_orientation_bf16(gathered):
    model = MixedOrientation((True, False, True), gathered=gathered).to(torch.bfloat16).eval()
    x = torch.randn(7, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    assert len(report.rewritten) == 1, report
    assert rel_err(got, want) <= BF16_TOL


_compiled_with_call = compiled_with_fused_call


def test_mixed_orientation_with_gemms_cast_to_bf16():
    """The region casts fp32 x and weights to bf16 for its GEMMs: the op gets the flipped role cast
    too (cast, then the view).  bf16 GEMMs against the op's fp32 accumulation: 3e-2."""
    model = MixedOrientation((False, True, True), cast=torch.bfloat16).eval()
    got, want, call = _compiled_with_call(model, torch.randn(7, 32))
    assert rel_err(got, want) <= BF16_TOL
    (gate,) = call.args[3]  # up and down are [E, in, out]: the op takes that, and flips the gate
    assert call.args[10] is True  # transposed
    assert gate.target == "transpose" and gate.args[0].target == "to" and torch.bfloat16 in gate.args[0].args


def test_flipped_role_is_a_transposed_view_of_the_parameter():
    """The op's down-role argument is ``transpose`` of the parameter itself (no copy node between),
    and the rewritten graph computes eager's output."""
    model = MixedOrientation((False, False, True)).eval()
    got, want, call = _compiled_with_call(model, torch.randn(5, 32))
    assert rel_err(got, want) <= TOL[torch.float32]
    gate, up, down = call.args[3:6]
    assert len(down) == 1 and down[0].target == "transpose" and down[0].args[1:] == (-2, -1)
    assert all(n.op == "placeholder" for n in (*gate, *up, down[0].args[0]))  # the stacked parameters, in place


def test_mixed_orientation_gradients_match_eager():
    """Training through the op: the flipped role's gradient reaches the parameter through the view."""
    model = MixedOrientation((False, True, True))
    x = torch.randn(6, 32)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.w]
    model.zero_grad()
    out, report = run_compiled(model, x)
    out.square().sum().backward()
    assert len(report.rewritten) == 1, report
    for g, w in zip((p.grad for p in model.w), want):
        assert rel_err(g, w) <= 1e-4  # fp32 backward: summation order over tokens and F


@pytest.mark.parametrize("T", [1, 3, 40])
def test_flipped_role_updated_in_place_is_read_anew(T):
    """On CPU the inference op reads a flipped role through a contiguous copy made once per weight
    version (kernels/cpu/prepack.rows_contiguous): an in-place update must reach the next call."""
    model = MixedOrientation((False, False, True)).eval()
    x = torch.randn(T, 32)
    compiled = torch.compile(model, backend="moe", options={"inner": "eager"})
    torch._dynamo.reset()
    with torch.no_grad(), capture_flags():
        for step in range(3):
            got, want = compiled(x), model(x)
            assert rel_err(got, want) <= TOL[torch.float32], f"step {step}"
            model.w[2].mul_(-1.5)  # the flipped down weight, written in place
