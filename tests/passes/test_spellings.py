"""More spellings of the same MoE (docs/architecture.md#pattern-families): other matmul forms, combines and router forms."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe_compile.models import zoo
from tests.conftest import TOL, rel_err, run_compiled


class MatmulLoopIndexPut(nn.Module):
    """Family A with stacked weights sliced per expert, ``@`` matmuls, index_put accumulation,
    and a DeepSeek-V4-style router: sqrt(softplus(logits)) + bias for selection, renormalised."""

    def __init__(self, hidden=64, ffn=48, experts=6, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.router = nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)
        self.register_buffer("bias", torch.randn(experts) * 0.01)
        self.w_gate_up = nn.Parameter(torch.randn(experts, hidden, 2 * ffn) / hidden**0.5)  # x @ W
        self.w_down = nn.Parameter(torch.randn(experts, ffn, hidden) / ffn**0.5)

    def forward(self, x):  # [T, H]
        scores = F.softplus(x @ self.router.t()).sqrt()  # [T, E]
        ids = (scores + self.bias).topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, k = torch.where(ids == e)
            h = x[tok] @ self.w_gate_up[e]
            gate, up = h.chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.w_down[e]
            out.index_put_((tok,), y * weights[tok, k, None], accumulate=True)
        return out


class SortedScatterAdd(zoo.SortedMoE):
    """Family B combining with scatter_add instead of index_add (bf16: grouped_mm traces only in bf16)."""

    def forward(self, hidden_states):
        x = hidden_states.view(-1, hidden_states.shape[-1])
        weights, ids = self.gate(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        rows = order // self.top_k
        h = torch._grouped_mm(x[rows], self.experts.gate_up_proj.transpose(1, 2), offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        out = torch._grouped_mm(F.silu(gate) * up, self.experts.down_proj.transpose(1, 2), offs=offsets)
        out = out * weights.reshape(-1)[order, None]
        index = rows[:, None].expand(-1, x.shape[-1])
        y = torch.zeros_like(x).scatter_add_(0, index, out.to(x.dtype))
        return y.view(hidden_states.shape)


def test_matmul_loop_with_index_put_and_softplus_router():
    model = MatmulLoopIndexPut()
    x = torch.randn(11, 64)
    got, report = run_compiled(model, x)
    (entry,) = report.rewritten
    assert (entry.family, entry.num_experts, entry.gate_up) == ("loop", 6, "concat")
    assert rel_err(got, model(x)) <= TOL[torch.float32]


def test_sorted_with_scatter_add_combine():
    model = SortedScatterAdd().to(torch.bfloat16)
    x = torch.randn(2, 9, 64, dtype=torch.bfloat16)
    got, report = run_compiled(model, x)
    assert [r.family for r in report.rewritten] == ["sorted"]
    assert rel_err(got, model(x)) <= TOL[torch.bfloat16]


class GeluClampedExperts(zoo.ModuleListMoE):
    """Loop whose experts clamp gate and up (DeepSeek-V4 style, limit 7) and gate with GELU-tanh."""

    def forward(self, hidden_states):
        x = hidden_states.view(-1, hidden_states.shape[-1])
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, k = torch.where(ids == e)
            expert = self.experts[e]
            gate = expert.gate_proj(x[tok]).clamp(max=7.0)
            up = expert.up_proj(x[tok]).clamp(min=-7.0, max=7.0)
            h = F.gelu(gate, approximate="tanh") * up
            out.index_add_(0, tok, expert.down_proj(h) * weights[tok, k, None])
        return out.view(hidden_states.shape)


def test_clamped_gelu_tanh_experts():
    model = GeluClampedExperts(experts=4)
    with torch.no_grad():
        for p in model.experts.parameters():
            p.mul_(8.0)  # push activations past the clamp so the limit matters
    x = torch.randn(1, 9, 64)
    got, report = run_compiled(model, x)
    (entry,) = report.rewritten
    assert entry.activation == "gelu_tanh"
    assert rel_err(got, model(x)) <= TOL[torch.float32]


class BiasedExperts(zoo.ModuleListMoE):
    """Experts built from nn.Linear(bias=True) (GPT-OSS-like experts carry biases)."""

    def __init__(self, hidden=64, ffn=48, experts=4, top_k=2):
        super().__init__(hidden, ffn, experts, top_k)
        for expert in self.experts:
            for name in ("gate_proj", "up_proj", "down_proj"):
                old = getattr(expert, name)
                setattr(expert, name, nn.Linear(old.in_features, old.out_features, bias=True))


def test_experts_with_biases():
    model = BiasedExperts()
    x = torch.randn(1, 9, 64)
    want = model(x)
    got, report = run_compiled(model, x)
    assert len(report.rewritten) == 1
    assert rel_err(got, want) <= TOL[torch.float32]


def test_hash_routing_by_token_id():
    # DeepSeek-V4 hash layers: ids from a table indexed by token id (no top-k); the weights are the
    # router's scores at those ids.  Forward and the router's and experts' gradients equal eager's.
    model = zoo.HashRoutedMoE()
    x, input_ids = torch.randn(2, 7, 64), torch.randint(0, 50, (2, 7))
    want = model(x, input_ids)
    want.square().mean().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got, report = run_compiled(model, x, input_ids)
    got.square().mean().backward()
    assert [r.family for r in report.rewritten] == ["loop"] and report.rewritten[0].top_k == 2
    assert rel_err(got, want) <= TOL[torch.float32]
    for name, grad in want_grads.items():  # fp32, summation order only: see tests/test_training.py
        assert rel_err(model.get_parameter(name).grad, grad) <= 1e-5, name


def test_integer_lookup_that_is_not_routing_is_left_alone():
    # Position ids read from an integer buffer by an index: a hash-lookup look-alike feeding no experts.
    class PositionLookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.arange(40).view(20, 2))
            self.mlp = zoo.SwiGLU(64, 32)

        def forward(self, x, pos):
            return self.mlp(x) + self.table[pos].float().sum(-1, keepdim=True)

    model = PositionLookup()
    x, pos = torch.randn(5, 64), torch.randint(0, 20, (5,))
    got, report = run_compiled(model, x, pos)
    assert report.rewritten == []
    torch.testing.assert_close(got, model(x, pos))
