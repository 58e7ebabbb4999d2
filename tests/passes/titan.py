"""torchtitan's MoE spellings (``torchtitan/models/common/moe.py`` and ``gpt_oss/moe.py``, release 0.3.0),
rewritten here from their description: torchtitan does not install beside torch 2.13 without pulling
its own torch (torchdata, spmd_types), so nothing of it is vendored.

Shapes:  B batch, L sequence, T = B*L tokens, D hidden, F expert FFN width, E experts, K top-k,
         N = T*K routed rows.

What these blocks do that other code does not (each one a mechanism the matcher must follow):
  * the top-k runs on 3-D [B, L, E] scores; ids and scores are viewed as [T, K] later;
  * the per-expert counts are ``zeros_like(scores, dtype=bool).scatter_(-1, ids, True).sum((0, 1))``
    (``zeros_like`` reads only a shape);
  * fp32 master weights are cast with ``.bfloat16()`` around ``torch._grouped_mm``; the result is cast
    back with ``type_as(x)``;
  * the routing scores multiply the expert-sorted rows in fp32 before a ``scatter_add`` combine;
  * GPT-OSS: interleaved gate/up, clamped, ``torch.addcmul(glu, glu, up)``, biases gathered per row by
    ``bias.repeat_interleave(counts, dim=0)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Router(nn.Module):
    """TokenChoiceTopKRouter: sigmoid or softmax scores [B, L, E], optional selection bias and
    group-limited choice, top-k on the 3-D scores, scores gathered at the ids, renorm, scale."""

    def __init__(self, dim, experts, top_k, score_func="sigmoid", route_norm=False, route_scale=1.0,
                 groups=None, limited_groups=None):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts, self.top_k, self.score_func = experts, top_k, score_func
        self.route_norm, self.route_scale = route_norm, route_scale
        self.groups, self.limited_groups = groups, limited_groups

    def _limit_groups(self, choice):  # [B, L, E] -> [B, L, E], other groups -inf
        grouped = choice.unflatten(-1, (self.groups, self.experts // self.groups))
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [B, L, G]
        _, group_idx = torch.topk(group_scores, k=self.limited_groups, dim=-1, sorted=False)
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(-1, group_idx, False)
        return grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(-2)

    def forward(self, x, expert_bias=None):  # x [B, L, D]
        scores = self.gate(x.float())  # [B, L, E] in fp32
        scores = torch.sigmoid(scores) if self.score_func == "sigmoid" else F.softmax(scores, dim=-1)
        choice = scores if expert_bias is None else scores + expert_bias
        if self.groups is not None:
            choice = self._limit_groups(choice)
        _, ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)  # [B, L, K]
        top = scores.gather(dim=-1, index=ids)  # [B, L, K]
        if self.route_norm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return top * self.route_scale, ids, scores


class GroupedExperts(nn.Module):
    """fp32 master weights w1/w3 [E, F, D], w2 [E, D, F]; grouped GEMMs in bf16."""

    def __init__(self, dim, ffn, experts):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, ffn, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, ffn) / ffn**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, ffn, dim) / dim**0.5)

    def forward(self, x, counts):  # x [N, D] sorted by expert, counts [E]
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x.bfloat16(), self.w1.bfloat16().transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(x.bfloat16(), self.w3.bfloat16().transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.bfloat16().transpose(-2, -1), offs=offsets).type_as(x)


def swiglu_addcmul(h, alpha=1.702, limit=7.0):
    """GPT-OSS's clamped SwiGLU on interleaved gate/up, spelled with addcmul."""
    glu, lin = h[..., ::2], h[..., 1::2]
    glu = glu.clamp(min=None, max=limit)
    lin = lin.clamp(min=-limit, max=limit)
    out = glu * torch.sigmoid(alpha * glu)
    return torch.addcmul(out, out, lin)


class GptOssGroupedExperts(nn.Module):
    """mlp1 [E, 2F, D] (gate/up interleaved) + bias [E, 2F], mlp2 [E, D, F] + bias [E, D]."""

    def __init__(self, dim, ffn, experts, limit=7.0):
        super().__init__()
        self.limit = limit
        self.mlp1_weight = nn.Parameter(torch.randn(experts, 2 * ffn, dim) / dim**0.5)
        self.mlp1_bias = nn.Parameter(torch.randn(experts, 2 * ffn) * 0.1)
        self.mlp2_weight = nn.Parameter(torch.randn(experts, dim, ffn) / ffn**0.5)
        self.mlp2_bias = nn.Parameter(torch.randn(experts, dim) * 0.1)

    def forward(self, x, counts):  # x [N, D], counts [E]
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        # rows past the last expert's (padding) get a zero bias row: counts + [slack], bias + [0]
        slack = (x.shape[0] - offsets[-1]).unsqueeze(0).to(counts.dtype)
        counts_long = torch.cat([counts, slack]).long()  # [E + 1]
        h = torch._grouped_mm(x.bfloat16(), self.mlp1_weight.transpose(-2, -1).bfloat16(), offs=offsets)
        b1 = torch.cat([self.mlp1_bias, self.mlp1_bias.new_zeros(1, self.mlp1_bias.shape[-1])])
        b1 = b1.repeat_interleave(counts_long, dim=0, output_size=x.shape[0])  # [N, 2F]
        h = swiglu_addcmul(h + b1.to(h.dtype), limit=self.limit)
        h = torch._grouped_mm(h, self.mlp2_weight.transpose(-2, -1).bfloat16(), offs=offsets)
        b2 = torch.cat([self.mlp2_bias, self.mlp2_bias.new_zeros(1, self.mlp2_bias.shape[-1])])
        b2 = b2.repeat_interleave(counts_long, dim=0, output_size=x.shape[0])  # [N, D]
        return (h + b2.to(h.dtype)).type_as(x)  # torchtitan returns bf16 (its GPT-OSS runs in bf16)


class FeedForward(nn.Module):
    def __init__(self, dim, ffn):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """torchtitan's MoE on one rank (LocalTokenDispatcher): argsort the flat ids, gather rows, grouped
    experts, scores on the sorted rows in fp32, scatter_add back, shared expert added."""

    def __init__(self, dim=64, ffn=32, experts=8, top_k=2, shared_ffn=0, gpt_oss=False, load_balance=True,
                 **router):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = Router(dim, experts, top_k, **router)
        self.inner = GptOssGroupedExperts(dim, ffn, experts) if gpt_oss else GroupedExperts(dim, ffn, experts)
        self.shared = FeedForward(dim, shared_ffn) if shared_ffn else None
        if load_balance:
            self.register_buffer("expert_bias", torch.randn(experts) * 0.01)
        else:
            self.expert_bias = None

    def forward(self, x):  # [B, L, D]
        top, ids, scores = self.router(x, self.expert_bias)  # [B, L, K], [B, L, K], [B, L, E]
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True)  # [B, L, E]
        counts = routing_map.sum(dim=(0, 1))  # [E]
        out = self.routed(x, top, ids, counts)
        if self.shared is not None:
            out = out + self.shared(x)
        return out

    def routed(self, x, top, ids, counts):
        B, L, D = x.shape
        K, T = top.size(-1), B * L
        x_td = x.view(T, D)
        top_tk, ids_tk = top.view(T, K), ids.view(T, K)
        order = torch.argsort(ids_tk.view(-1), stable=True)  # [N]
        top_sorted = top_tk.view(-1)[order]  # [N]
        tok = order // self.top_k
        rows = self.inner(x_td[tok], counts)  # [N, D]
        rows = (rows.to(torch.float32) * top_sorted.reshape(-1, 1)).to(rows.dtype)
        out = torch.zeros_like(x_td).scatter_add(0, tok.reshape(-1, 1).expand(-1, D), rows)
        return out.view(B, -1, D)


class EPMoE(MoE):
    """torchtitan's MoE under expert parallelism (AllToAllTokenDispatcher): counts exchanged with
    an all-to-all of [R, E_l], ``.tolist()`` split sizes, token rows sent to the owning rank,
    ``_permute`` from rank-major to expert-major rows, local grouped experts, ``_unpermute``, the
    reverse all-to-all, and only then the routing scores on the rows and the scatter_add combine.

    Every rank builds the same global experts from ``seed`` and keeps its slice."""

    def __init__(self, dim=64, ffn=32, experts=8, top_k=2, group=None, seed=0, **kw):
        import torch.distributed as dist

        torch.manual_seed(seed)
        super().__init__(dim, ffn, experts, top_k, **kw)
        self.group = group if group is not None else dist.group.WORLD
        self.world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.local = experts // self.world
        keep = slice(rank * self.local, (rank + 1) * self.local)
        for name in ("w1", "w2", "w3"):
            setattr(self.inner, name, nn.Parameter(getattr(self.inner, name).data[keep].clone()))

    def routed(self, x, top, ids, counts):
        from torch.distributed import _functional_collectives as funcol

        B, L, D = x.shape
        K, T, R = top.size(-1), B * L, self.world
        x_td = x.view(T, D)
        order = torch.argsort(ids.view(T, K).view(-1), stable=True)  # [N] slots by global expert
        top_sorted = top.view(T, K).view(-1)[order]
        tok = order // self.top_k
        recv_counts = funcol.all_to_all_single(counts.view(R, -1), None, None, self.group).reshape(-1)  # [R*E_l]
        in_splits = counts.view(R, -1).sum(dim=1).tolist()
        out_splits = recv_counts.view(R, -1).sum(dim=1).tolist()
        recv = funcol.all_to_all_single(x_td[tok], out_splits, in_splits, self.group)  # [M, D] rank-major
        permuted, local_counts = self._permute(recv, recv_counts)
        rows = self.inner(recv[permuted, :], local_counts)  # [M, D] expert-major
        unpermuted = rows.new_empty(recv.shape)
        unpermuted[permuted, :] = rows
        back = funcol.all_to_all_single(unpermuted, in_splits, out_splits, self.group)  # [N, D] in `order`
        back = (back.to(torch.float32) * top_sorted.reshape(-1, 1)).to(back.dtype)
        out = torch.zeros_like(x_td).scatter_add(0, tok.reshape(-1, 1).expand(-1, D), back)
        return out.view(B, -1, D)

    def _permute(self, recv, recv_counts):
        """Indices taking rank-major rows (e0 r0, e1 r0, .., e0 r1, ..) to expert-major order."""
        t_mat = recv_counts.view(self.world, self.local)
        starts = (recv_counts.cumsum(0) - recv_counts).view(self.world, self.local)
        seg_lens, starts = t_mat.t().reshape(-1), starts.t().reshape(-1)
        seg_ids = torch.arange(seg_lens.shape[0]).repeat_interleave(seg_lens, output_size=recv.shape[0])
        out_starts = seg_lens.cumsum(0) - seg_lens
        permuted = starts[seg_ids] + torch.arange(seg_ids.shape[0]) - out_starts[seg_ids]
        return permuted, t_mat.sum(0)
