"""Look-alikes are left untouched, and explain() says why."""

import torch

import moe_compile
from moe_compile.models import zoo
from tests.conftest import run_compiled


def test_dense_mlp_loop_is_untouched_and_explained():
    model = zoo.DenseMLPLoop()
    x = torch.randn(3, 64)
    got, report = run_compiled(model, x)
    assert report.rewritten == []
    torch.testing.assert_close(got, model(x))
    text = " ".join(s.reason for s in moe_compile.explain(model, x).skipped)
    assert "no top-k routing" in text


def test_topk_for_something_else_is_untouched_and_explained():
    model = zoo.TopKNotRouting()
    x = torch.randn(5, 64)
    got, report = run_compiled(model, x)
    assert report.rewritten == []
    torch.testing.assert_close(got, model(x))
    assert moe_compile.explain(model, x).skipped  # a reason is recorded


def test_unprovable_region_is_left_alone():
    class WrongExperts(zoo.ModuleListMoE):
        def forward(self, hidden_states):
            x = hidden_states.view(-1, hidden_states.shape[-1])
            weights, ids = self.gate(x)
            out = torch.zeros_like(x)
            mask = torch.nn.functional.one_hot(ids, num_classes=self.num_experts).permute(2, 1, 0)
            for e in range(self.num_experts):
                top, tok = torch.where(mask[e])
                h = self.experts[e].gate_proj(x[tok])
                h = torch.tanh(h) * self.experts[e].up_proj(x[tok])  # tanh: no supported activation
                out.index_add_(0, tok, self.experts[e].down_proj(h) * weights[tok, top, None])
            return out.view(hidden_states.shape)

    model = WrongExperts(experts=4)
    x = torch.randn(1, 6, 64)
    got, report = run_compiled(model, x)
    assert report.rewritten == []
    assert any("could not prove" in s.reason for s in report.skipped)
    torch.testing.assert_close(got, model(x))


class LinearExperts(torch.nn.Module):
    """Routed experts that are one GEMM each (a mixture of linear maps, no FFN): the ids pick the
    weights, but there is no FC1 -> activation -> FC2 to fuse."""

    def __init__(self, hidden=64, experts=4, top_k=2):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w = torch.nn.Parameter(torch.randn(experts, hidden, hidden) / hidden**0.5)
        self.top_k = top_k

    def forward(self, x):  # [T, H]
        g, ids = self.router(x).softmax(-1).topk(self.top_k, dim=-1)  # [T, K]
        y = torch.bmm(x.repeat_interleave(self.top_k, 0)[:, None], self.w[ids.reshape(-1)])[:, 0]  # [T*K, H]
        return (y.view(-1, self.top_k, x.shape[1]) * g[..., None]).sum(1)


def test_routed_weights_without_an_ffn_are_explained():
    model = LinearExperts()
    x = torch.randn(5, 64)
    got, report = run_compiled(model, x)
    assert report.rewritten == []
    torch.testing.assert_close(got, model(x))
    (skip,) = moe_compile.explain(model, x).skipped
    assert "select expert weights" in skip.reason and "test_negative.py" in skip.reason


def test_no_expert_weights_no_such_line():
    # A top-k that picks features (no weights indexed by its ids, no grouped GEMM) gets no such line.
    reasons = [s.reason for s in moe_compile.explain(zoo.TopKNotRouting(), torch.randn(5, 64)).skipped]
    assert not any("select expert weights" in r for r in reasons)
