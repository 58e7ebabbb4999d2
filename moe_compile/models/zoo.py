"""Small MoE blocks written the way real model code writes them (docs/architecture.md#pattern-families).

They feed the demo, the tests and the benchmarks; none of them knows about moe_compile.

Shapes:  B batch, S sequence, T = B*S tokens, H hidden, F expert FFN width, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    """One expert (or a shared expert) as three Linears, HF v4 / DeepSeek-official style."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SoftmaxRouter(nn.Module):
    """softmax -> topk -> renormalise (Mixtral, Qwen)."""

    def __init__(self, hidden: int, experts: int, top_k: int, renorm: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)
        self.top_k, self.renorm = top_k, renorm

    def forward(self, x):  # x [T, H]
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K], [T, K]
        if self.renorm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3: sigmoid scores + selection bias, group-limited top-k, renorm, scale."""

    def __init__(self, hidden: int, experts: int, top_k: int, groups: int = 8, topk_groups: int = 4,
                 scale: float = 2.5):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)
        self.register_buffer("bias", torch.randn(experts) * 0.01)
        self.top_k, self.groups, self.topk_groups, self.scale = top_k, groups, topk_groups, scale

    def forward(self, x):  # x [T, H]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.bias
        T, E = choice.shape
        group_scores = choice.view(T, self.groups, -1).topk(2, dim=-1)[0].sum(-1)  # [T, G]
        group_idx = group_scores.topk(self.topk_groups, dim=-1)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)  # [T, G]
        mask = mask.unsqueeze(-1).expand(T, self.groups, E // self.groups).reshape(T, E)
        ids = choice.masked_fill(mask == 0, float("-inf")).topk(self.top_k, dim=-1)[1]  # [T, K]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scale
        return weights.to(x.dtype), ids


class ModuleListMoE(nn.Module):
    """Family A, HF v4 style: one-hot mask, ``torch.where`` per expert, ``index_add_``."""

    def __init__(self, hidden=64, ffn=96, experts=8, top_k=2, router=None, shared=0):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.gate = router or SoftmaxRouter(hidden, experts, top_k)
        self.experts = nn.ModuleList([SwiGLU(hidden, ffn) for _ in range(experts)])
        self.shared_experts = SwiGLU(hidden, shared) if shared else None

    def forward(self, hidden_states):  # [B, S, H]
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])  # [T, H]
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.num_experts).permute(2, 1, 0)  # [E, K, T]
        for e in range(self.num_experts):
            top, tok = torch.where(mask[e])
            current = self.experts[e](x[tok]) * weights[tok, top, None]
            out.index_add_(0, tok, current.to(x.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out.view(shape)


class DeepSeekOfficialMoE(nn.Module):
    """Family A, DeepSeek inference code: ``y[idx] += expert(x[idx]) * weights[idx, top, None]``."""

    def __init__(self, hidden=64, ffn=32, experts=16, top_k=4, shared=64, groups=4, topk_groups=2):
        super().__init__()
        self.num_experts = experts
        self.gate = GroupLimitedRouter(hidden, experts, top_k, groups, topk_groups)
        self.experts = nn.ModuleList([SwiGLU(hidden, ffn) for _ in range(experts)])
        self.shared_experts = SwiGLU(hidden, shared)

    def forward(self, x):  # [B, S, H]
        shape = x.size()
        x = x.view(-1, shape[-1])
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        for i in range(self.num_experts):
            idx, top = torch.where(indices == i)
            y[idx] += self.experts[i](x[idx]) * weights[idx, top, None]
        return (y + self.shared_experts(x)).view(shape)


class HashRoutedMoE(nn.Module):
    """Family A behind DeepSeek-V4's hash layers (Megatron ``_hash_routing``): the experts of a token
    come from a fixed table indexed by its token id, ``ids = tid2eid[input_ids]``; the mixing weights
    are still the router's sqrt(softplus) scores at those experts, renormalised and scaled."""

    def __init__(self, hidden=64, ffn=32, experts=8, top_k=2, vocab=50, route_scale=1.5, seed=0):
        super().__init__()
        self.num_experts, self.route_scale = experts, route_scale
        self.router = nn.Linear(hidden, experts, bias=False)
        g = torch.Generator().manual_seed(seed)
        table = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(vocab)])
        self.register_buffer("tid2eid", table)  # [vocab, K] int64: the hash table (a checkpoint's, here random)
        self.experts = nn.ModuleList([SwiGLU(hidden, ffn) for _ in range(experts)])

    def forward(self, hidden_states, input_ids):  # [B, S, H], [B, S]
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])  # [T, H]
        scores = F.softplus(self.router(x)).sqrt()  # [T, E]
        ids = self.tid2eid[input_ids.reshape(-1)]  # [T, K]
        weights = scores.gather(1, ids)
        weights = weights / weights.sum(-1, keepdim=True) * self.route_scale  # [T, K]
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, top = torch.where(ids == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, top, None])
        return out.view(shape)


class StackedExperts(nn.Module):
    """HF v5 style stacked expert parameters: gate_up [E, 2F, H], down [E, H, F]."""

    def __init__(self, hidden, ffn, experts):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, hidden) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)


class SortedMoE(nn.Module):
    """Family B, torchtitan style: argsort ids, histc counts, cumsum offsets, grouped GEMMs."""

    def __init__(self, hidden=64, ffn=96, experts=8, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.gate = SoftmaxRouter(hidden, experts, top_k)
        self.experts = StackedExperts(hidden, ffn, experts)

    def forward(self, hidden_states):  # [B, S, H]
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])  # [T, H]
        weights, ids = self.gate(x)
        flat = ids.reshape(-1)  # [S]
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, 0).to(torch.int32)  # [E]
        xs = x[order // self.top_k]  # [S, H]
        w1 = self.experts.gate_up_proj.transpose(1, 2)  # [E, H, 2F]
        h = torch._grouped_mm(xs, w1, offs=offsets)  # [S, 2F]
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        out = torch._grouped_mm(h, self.experts.down_proj.transpose(1, 2), offs=offsets)  # [S, H]
        out = out * weights.reshape(-1)[order, None]
        y = torch.zeros_like(x).index_add_(0, order // self.top_k, out.to(x.dtype))
        return y.view(shape)


class BincountSplitMoE(nn.Module):
    """Family B as hand-written loops spell it: ``torch.bincount`` counts and a Python loop over
    ``counts.tolist()`` slicing the sorted rows.  Under the capture flags Dynamo raises on it (the
    counts' length is data-dependent, ``tolist`` cannot iterate it); without them it splits there."""

    def __init__(self, hidden=64, ffn=96, experts=8, top_k=2):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.gate = SoftmaxRouter(hidden, experts, top_k)
        self.experts = nn.ModuleList([SwiGLU(hidden, ffn) for _ in range(experts)])

    def forward(self, hidden_states):  # [B, S, H]
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])  # [T, H]
        weights, ids = self.gate(x)
        flat = ids.reshape(-1)  # [T*K]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        y, start = torch.zeros_like(x), 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            rows = order[start:start + n]  # [n]
            start += n
            tok = rows // self.top_k
            y.index_add_(0, tok, self.experts[e](x[tok]) * weights.reshape(-1)[rows, None])
        return y.view(shape)


class GatheredMoE(nn.Module):
    """Family C, gpt-fast style: index stacked weights by ids, einsum per (token, k)."""

    def __init__(self, hidden=64, ffn=96, experts=8, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, ffn, hidden) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, ffn, hidden) / hidden**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)

    def forward(self, hidden_states):  # [B, S, H]
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])  # [T, H]
        scores = self.gate(x)  # [T, E]
        weights, ids = torch.topk(scores, self.top_k, dim=-1)  # topk on logits, softmax over k
        weights = weights.softmax(dim=-1)
        w1, w3, w2 = self.w1[ids], self.w3[ids], self.w2[ids]  # [T, K, F, H], [T, K, H, F]
        x1 = F.silu(torch.einsum("ti,tkoi->tko", x, w1))
        x3 = torch.einsum("ti,tkoi->tko", x, w3)
        out = torch.einsum("tko,tkio->tki", x1 * x3, w2)  # [T, K, H]
        return torch.einsum("tki,tk->ti", out, weights).view(shape)


class DenseMoE(nn.Module):
    """Family D, Llama4 style: every expert on every token, sigmoid scores on the input."""

    def __init__(self, hidden=64, ffn=96, experts=8, top_k=1):
        super().__init__()
        self.num_experts, self.top_k, self.ffn = experts, top_k, ffn
        self.router = nn.Linear(hidden, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.randn(experts, hidden, 2 * ffn) / hidden**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, ffn, hidden) / ffn**0.5)

    def forward(self, hidden_states):  # [B, S, H]
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        logits = self.router(x)  # [T, E]
        top_value, top_index = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, top_index, top_value)
        scores = torch.sigmoid(scores.float()).to(x.dtype).transpose(0, 1)  # [E, T]
        routed = x.repeat(self.num_experts, 1) * scores.reshape(-1, 1)  # [E*T, H]
        routed = routed.view(self.num_experts, -1, shape[-1])  # [E, T, H]
        gate_up = torch.bmm(routed, self.gate_up_proj)  # [E, T, 2F]
        gate, up = gate_up.chunk(2, dim=-1)
        out = torch.bmm(up * F.silu(gate), self.down_proj)  # [E, T, H]
        return out.sum(dim=0).view(shape)


class DenseMLPLoop(nn.Module):
    """Look-alike with no routing: a loop of dense MLPs whose outputs are summed."""

    def __init__(self, hidden=64, ffn=96, experts=4):
        super().__init__()
        self.experts = nn.ModuleList([SwiGLU(hidden, ffn) for _ in range(experts)])

    def forward(self, x):
        out = torch.zeros_like(x)
        for expert in self.experts:
            out = out + expert(x)
        return out


class TopKNotRouting(nn.Module):
    """Look-alike: a top-k used to pick features, followed by a plain MLP."""

    def __init__(self, hidden=64, ffn=96):
        super().__init__()
        self.mlp = SwiGLU(hidden, ffn)

    def forward(self, x):
        vals, idx = torch.topk(x, 4, dim=-1)
        mask = torch.zeros_like(x).scatter_(-1, idx, 1.0)
        return self.mlp(x * mask)


class DeepSeekStyleBlock(ModuleListMoE):
    """DeepSeek-V3-like demo block: group-limited sigmoid router, 64 experts, top-6, shared expert."""

    def __init__(self, hidden=256, ffn=128, experts=64, top_k=6, shared=256):
        router = GroupLimitedRouter(hidden, experts, top_k, groups=8, topk_groups=4)
        super().__init__(hidden, ffn, experts, top_k, router=router, shared=shared)
