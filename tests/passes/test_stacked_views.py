"""Experts as one ``nn.Linear(H, E*F)`` whose output is viewed [T, E, F] (clusters.WeightRef.unflat,
ir.MoESpec.unflattened): a stack of E weight slices seen from the output side.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K top-k.

Every expert runs on every token, the top-k outputs are picked and weighted: the op's semantics
with the stacked weight ``linear.weight.view(E, F, H)``, read in place.
fp32: eager and the op differ in summation order only (tests.conftest.TOL).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.conftest import TOL, compiled_with_fused_call, rel_err, run_compiled


class LinearExperts(nn.Module):
    """``fused``: gate and up as one Linear(H, E*2F) viewed [T, E, 2F] and chunked; else two
    Linear(H, E*F).  ``unflatten``: ``unflatten(-1, (E, F))`` instead of ``view(T, E, F)``."""

    def __init__(self, hidden=32, ffn=16, experts=4, top_k=2, fused=False, unflatten=False, bias=False):
        super().__init__()
        self.E, self.F, self.K, self.fused, self.unflatten = experts, ffn, top_k, fused, unflatten
        self.router = nn.Linear(hidden, experts, bias=False)
        if fused:
            self.gate_up = nn.Linear(hidden, experts * 2 * ffn, bias=bias)
        else:
            self.gate, self.up = nn.Linear(hidden, experts * ffn, bias=bias), nn.Linear(hidden, experts * ffn, bias=bias)
        self.w_down = nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)  # [E, H, F]

    def _per_expert(self, h, n):  # [T, E*n] -> [T, E, n]
        return h.unflatten(-1, (self.E, n)) if self.unflatten else h.view(h.shape[0], self.E, n)

    def forward(self, x):  # [T, H]
        weights, ids = self.router(x).softmax(-1).topk(self.K, dim=-1)  # [T, K]
        if self.fused:
            g, u = self._per_expert(self.gate_up(x), 2 * self.F).chunk(2, dim=-1)  # [T, E, F] each
        else:
            g, u = self._per_expert(self.gate(x), self.F), self._per_expert(self.up(x), self.F)
        out = torch.einsum("tef,ehf->teh", F.silu(g) * u, self.w_down)  # [T, E, H]
        picked = out.gather(1, ids[..., None].expand(-1, -1, out.shape[-1]))  # [T, K, H]
        return (picked * weights[..., None]).sum(1)


@pytest.mark.parametrize("fused, unflatten, bias", [(False, False, False), (True, False, False), (False, True, False),
                                                   (False, False, True), (True, False, True)],
                         ids=["two_linears", "fused_gate_up", "unflatten", "biases", "fused_bias"])
def test_linear_over_all_experts_is_rewritten_and_equal_to_eager(fused, unflatten, bias):
    """With biases, the Linear's [E*F] bias is the stacked bias ``bias.view(E, F)``."""
    model = LinearExperts(fused=fused, unflatten=unflatten, bias=bias).eval()
    x = torch.randn(7, 32)
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    assert len(report.rewritten) == 1 and report.rewritten[0].num_experts == 4, report
    assert report.rewritten[0].gate_up == ("concat" if fused else "separate")
    assert report.rewritten[0].biases == (("fc1",) if fused else ("fc1", "fc1_up")) * bias
    assert report.rewritten[0].unflattened and "unflattened=" in report.rewritten[0].line()  # said in explain()
    assert rel_err(got, want) <= TOL[torch.float32]


def test_the_op_reads_the_linear_weight_as_a_view():
    """The op's gate role is ``weight.view(E, F, H)`` of the Linear's own parameter (no copy)."""
    model = LinearExperts().eval()
    x = torch.randn(5, 32)
    got, want, call = compiled_with_fused_call(model, x)
    assert rel_err(got, want) <= TOL[torch.float32]
    (gate,) = call.args[3]
    assert gate.target == "view" and tuple(gate.args[1:]) == (4, 16, 32) and gate.args[0].op == "placeholder"


def test_a_linear_output_viewed_otherwise_is_never_wrong():
    """[T, E*F] viewed [T, F, E] (f-major): not the stack ``view(E, F, H)``; refused or proven, never wrong."""
    model = LinearExperts().eval()
    x = torch.randn(6, 32)

    def f_major(h, n):  # [T, E*n] -> [T, n, E] -> [T, E, n]
        return h.view(h.shape[0], n, model.E).transpose(1, 2)

    model._per_expert = f_major
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    assert rel_err(got, want) <= TOL[torch.float32]
    assert not report.rewritten and all(s.reason for s in report.skipped), report


def test_linear_experts_gradients_match_eager():
    model = LinearExperts()
    x = torch.randn(6, 32)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in (model.gate.weight, model.up.weight, model.w_down)]
    model.zero_grad()
    out, report = run_compiled(model, x)
    out.square().sum().backward()
    assert len(report.rewritten) == 1, report
    for p, w in zip((model.gate.weight, model.up.weight, model.w_down), want):
        assert rel_err(p.grad, w) <= 1e-4  # fp32 backward: summation order over tokens and F
