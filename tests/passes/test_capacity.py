"""Capacity-limited routing spelt as a bound on a count of the ids (GShard / Switch style: a
slot's place in its expert's queue against a constant capacity) — not the token-list slice
``where(mask)[i][:capacity]``, which passes/region.py refuses everywhere.

In a graph static in T the proof's crowded round (every token to the same K experts) shows
whether the capacity binds at that T: the rewrite is exact where it cannot.  In a graph dynamic in
T a constant capacity above the compiled T would pass that round and bind at a larger batch, so
the region must be refused there, and the compiled model must still equal eager at every T.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.conftest import TOL as TOLS, rel_err, run_compiled

H, FF, E, K, CAP = 32, 64, 4, 2, 12
TOL = TOLS[torch.float32]  # fp32: summation order only


class QueueCapacityMoE(nn.Module):
    """Top-2 of 4 experts; a slot whose place in its expert's queue exceeds CAP gets weight 0."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.router = nn.Linear(H, E, bias=False)
        self.w1 = nn.Parameter(torch.randn(E, 2 * FF, H) / H**0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, FF) / FF**0.5)

    def forward(self, x):
        w, ids = torch.topk(self.router(x).softmax(-1), K, dim=-1)
        onehot = F.one_hot(ids.reshape(-1), E)
        place = (onehot.cumsum(0) * onehot).sum(-1)  # 1-based place of each slot in its expert's queue
        if self.spelling == "kept":
            keep = (place <= CAP).to(x.dtype)
        else:  # "dropped"
            keep = 1.0 - (place > CAP).to(x.dtype)
        w = w * keep.view_as(w)
        y = torch.zeros_like(x)
        for e in range(E):
            tok, k = torch.where(ids == e)
            g, u = (x[tok] @ self.w1[e].t()).chunk(2, -1)
            y.index_add_(0, tok, (F.silu(g) * u) @ self.w2[e].t() * w[tok, k, None])
        return y


@pytest.mark.parametrize("spelling", ["kept", "dropped"])
def test_constant_capacity_in_a_dynamic_graph_is_refused(spelling):
    model = QueueCapacityMoE(spelling).eval()
    x = torch.randn(4, H)  # 4 tokens: no expert's queue reaches CAP, so the proof alone cannot tell
    with torch.no_grad():
        got, report = run_compiled(model, x, dynamic=True)
        assert rel_err(got, model(x)) <= TOL
        assert not report.rewritten, report
        assert any("capacity" in s.reason and "token count varies" in s.reason for s in report.skipped), report
        big = torch.randn(40, H)  # here the capacity binds: the graph must still equal eager
        compiled = torch.compile(model, backend="moe", dynamic=True, options={"inner": "eager"})
        from moe_compile.api import capture_flags

        with capture_flags():
            compiled(x)
            assert rel_err(compiled(big), model(big)) <= TOL


def test_constant_capacity_that_cannot_bind_in_a_static_graph_is_rewritten():
    model = QueueCapacityMoE("kept").eval()
    x = torch.randn(4, H)  # at most 4 slots per expert < CAP: the static graph is exactly the op
    with torch.no_grad():
        got, report = run_compiled(model, x, dynamic=False)
    assert len(report.rewritten) == 1, report
    assert rel_err(got, model(x)) <= TOL


def test_constant_capacity_that_binds_in_a_static_graph_is_refused_by_the_proof():
    model = QueueCapacityMoE("kept").eval()
    x = torch.randn(40, H)
    with torch.no_grad():
        got, report = run_compiled(model, x, dynamic=False)
    assert not report.rewritten, report
    assert rel_err(got, model(x)) <= TOL
