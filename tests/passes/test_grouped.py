"""Grouped passes over sorted rows (passes/clusters.py ``_fc1_gemms`` through ``split`` / ``cat``).

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K top-k, S = T*K sorted rows.

JetMoE's ``ParallelExperts`` runs one GEMM per expert group of the sorted rows and ``cat``s the
groups back: FC1 per group, ``cat``, the activation on all S rows, ``split`` on the same counts,
FC2 per group, ``cat``, ``index_add``.  Seen from group e's FC2, its FC1 is part e of the cat.
fp32: eager and the op differ in summation order only (tests.conftest.TOL).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.conftest import TOL, rel_err, run_compiled


class ParallelExperts(nn.Module):
    """HF JetMoE's: [E, out, in] weights, ``F.linear`` per group of rows split by ``sizes``."""

    def __init__(self, experts, inputs, outputs):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, outputs, inputs) / inputs**0.5)

    def forward(self, rows, sizes):  # [S, in] -> [S, out]
        groups = rows.split(sizes, dim=0)
        return torch.cat([F.linear(g, self.weight[e]) for e, g in enumerate(groups)], dim=0)


class JetMoEMoE(nn.Module):
    """JetMoE's MoE block: a concatenated gate/up ParallelExperts, SwiGLU on all rows, the down one.
    ``resplit``: the FC2 pass splits the activations on other sizes than FC1's groups (a wrong
    pairing of rows and experts: another function, which the proof must refuse)."""

    def __init__(self, hidden=32, ffn=16, experts=4, top_k=2, resplit="same"):
        super().__init__()
        self.E, self.K, self.resplit = experts, top_k, resplit
        self.router = nn.Linear(hidden, experts, bias=False)
        self.input_linear = ParallelExperts(experts, hidden, 2 * ffn)
        self.output_linear = ParallelExperts(experts, ffn, hidden)

    def forward(self, x):  # [T, H]
        weights, ids = self.router(x).softmax(-1).topk(self.K, dim=-1)  # [T, K]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # [S]
        sizes = torch.histc(flat.float(), bins=self.E, min=0, max=self.E - 1).int().tolist()
        tok = order // self.K
        h = self.input_linear(x[tok], sizes)  # [S, 2F]
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) * up
        out = self.output_linear(a, sizes if self.resplit == "same" else sizes[::-1])  # [S, H]
        out = out * weights.flatten()[order, None]
        return torch.zeros_like(x).index_add(0, tok, out)


@pytest.mark.parametrize("T", [1, 7, 33])
def test_jetmoe_parallel_experts_are_rewritten_and_equal_to_eager(T):
    model = JetMoEMoE().eval()
    x = torch.randn(T, 32)
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    assert len(report.rewritten) == 1 and report.rewritten[0].num_experts == 4, report
    assert report.rewritten[0].gate_up == "concat"
    assert rel_err(got, want) <= TOL[torch.float32]


def test_resplit_on_other_sizes_is_refused_never_wrong():
    """FC2's groups split on reversed sizes pair rows with the wrong experts' weights: the walk
    still sees group e's FC2 reach part e of the cat, and the proof must find it is not the op."""
    model = JetMoEMoE(resplit="reversed").eval()
    x = torch.randn(9, 32)
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    assert not report.rewritten and report.skipped and all(s.reason for s in report.skipped), report
    assert rel_err(got, want) <= TOL[torch.float32]
