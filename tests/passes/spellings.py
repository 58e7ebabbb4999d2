"""A randomized generator of MoE blocks, spelled the ways model code spells them.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K top-k.

A ``Case`` names one block: its family (how the experts are dispatched and combined), its router
form, E, K, a shared expert or none, the dtype, the number of stacked layers and the spelling of the
gated activation.  ``build(case)`` returns the module; ``covered(case)`` says whether the fused op's
semantics cover it (the backend must then rewrite it) or why not (capacity-limited and
expert-choice routing: tokens are dropped or experts choose tokens, which the op does not express;
those must be refused with a reason, never approximated).

Families (docs/architecture.md#pattern-families and torchtitan 0.3.0, tests/passes/titan.py):
  loop_list     HF v4: ModuleList experts, one-hot mask, ``where(mask[e])``, ``index_add_``
  loop_stacked  stacked weights sliced per expert ``w[e]``, ``where(ids == e)``, ``y[idx] +=``
  loop_cast     ModuleList experts held in bf16 under an fp32 router: ``expert(x[tok].to(bf16)).to(fp32)``
  split         sorted rows split by counts per expert; the permutation feeds dispatch and combine
                (``x[tok].split(counts)`` ... ``y.index_add_(0, tok, ...)``)
  sort_scatter  ``torch.sort`` of the flat ids, grouped GEMMs, ``scatter_add_`` combine
  gathered      gpt-fast: ``w[ids]`` and einsum per (token, k)
  dense_in      Llama4: all experts on all tokens, the sigmoid mask on the input
  dense_out     all experts on all tokens, a dense [T, E] mask on the outputs (``einsum("eth,te->th")``)
  titan         torchtitan: 3-D top-k, ``zeros_like(scores).scatter_`` counts, bf16 casts around
                ``_grouped_mm`` on fp32 master weights
  capacity      loop with a per-expert capacity (tokens over it dropped): not covered
  expert_choice experts pick their top tokens: not covered
"""

from __future__ import annotations

import dataclasses
import random
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.passes import titan

FAMILIES = ("loop_list", "loop_stacked", "loop_cast", "split", "sort_scatter", "gathered", "dense_in", "dense_out",
            "titan", "capacity", "expert_choice")
ROUTERS = ("softmax_renorm", "softmax", "sigmoid_group", "softplus_sqrt", "logits_softmax")
ACTIVATIONS = ("silu_mul", "torch_mul", "sigmoid_spelled", "gptoss_addcmul", "gptoss_add")
EXPERT_COUNTS = (1, 2, 3, 8, 16, 64)
FFN = 16


@dataclasses.dataclass(frozen=True)
class Case:
    family: str
    router: str
    experts: int
    top_k: int
    shared: bool
    dtype: torch.dtype
    layers: int
    activation: str
    tokens: int
    hidden: int = 32  # 8 and 16 make H == E for some E: an [T, H] buffer then looks like a [T, E] mask

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (f"{self.family}-{self.router}-E{self.experts}-K{self.top_k}-{'sh' if self.shared else 'nosh'}-"
                f"{dt}-L{self.layers}-{self.activation}-T{self.tokens}-H{self.hidden}")


def computes_in_bf16(case: Case) -> bool:
    return case.dtype == torch.bfloat16 or case.family in ("titan", "loop_cast")


def covered(case: Case) -> bool | str | None:
    """True when the op's semantics cover the block (it must be rewritten), a reason when they do
    not (it must be refused), None when both are right: a capacity that never binds at this token
    count (the static graph holds exactly the op's computation), experts that choose every token."""
    if case.family == "capacity":
        return None if case.tokens <= capacity(case) else "capacity-limited routing drops tokens over capacity"
    if case.family == "expert_choice":
        return None if per_expert(case) >= case.tokens else "expert-choice routing: experts pick tokens"
    return True


def capacity(case: Case) -> int:
    return max(1, case.tokens * case.top_k // case.experts // 2)  # half the even share: tokens drop


def per_expert(case: Case) -> int:
    return max(1, case.tokens * case.top_k // case.experts)


def random_cases(seed: int, n: int) -> list[Case]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        family = rng.choice(FAMILIES)
        E = rng.choice(EXPERT_COUNTS)
        K = rng.choice(sorted({1, 2, min(4, E), E}))
        K = min(K, E)
        router = rng.choice(ROUTERS)
        if router == "sigmoid_group" and (E % 4 or E < 8):
            router = "softmax_renorm"  # group-limited routing needs 4 groups of >= 2 experts
        activation = rng.choice(ACTIVATIONS if family in ("loop_list", "loop_stacked", "split", "gathered") else
                                ("silu_mul",))
        # grouped GEMMs trace only in bf16 (torch 2.13's meta): sort_scatter runs in bf16, titan casts itself
        dtype = {"sort_scatter": torch.bfloat16, "titan": torch.float32, "loop_cast": torch.float32}.get(
            family, rng.choice((torch.float32, torch.float32, torch.bfloat16)))
        out.append(Case(family, router, E, K, rng.random() < 0.3, dtype, rng.choice((1, 1, 2)), activation,
                        rng.choice((1, 5, 13)), rng.choice((8, 16, 32, 32))))
    return out


# ----------------------------------------------------------------------------- routers


class Router(nn.Module):
    """(weights [T, K] in x's dtype, ids [T, K]) in one of the forms real routers take."""

    def __init__(self, form: str, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.form, self.top_k = form, top_k
        self.weight = nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)
        self.register_buffer("bias", torch.randn(experts) * 0.1)

    def forward(self, x):  # [T, H]
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        E = logits.shape[-1]
        if self.form in ("softmax_renorm", "softmax"):
            weights, ids = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
            if self.form == "softmax_renorm":
                weights = weights / weights.sum(-1, keepdim=True)
        elif self.form == "sigmoid_group":
            scores = logits.sigmoid()
            choice = scores + self.bias
            groups = choice.view(-1, 4, E // 4).topk(2, dim=-1)[0].sum(-1)  # [T, 4]
            mask = torch.zeros_like(groups).scatter_(1, groups.topk(2, dim=-1)[1], 1.0)
            mask = mask.unsqueeze(-1).expand(-1, 4, E // 4).reshape(-1, E)
            ids = choice.masked_fill(mask == 0, float("-inf")).topk(self.top_k, dim=-1)[1]
            weights = scores.gather(1, ids)
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * 2.5
        elif self.form == "softplus_sqrt":
            scores = F.softplus(logits).sqrt()
            ids = (scores + self.bias).topk(self.top_k, dim=-1)[1]
            weights = scores.gather(1, ids)
            weights = weights / weights.sum(-1, keepdim=True) * 1.5
        else:  # top-k on logits, softmax over the k
            weights, ids = torch.topk(logits, self.top_k, dim=-1)
            weights = weights.softmax(-1)
        return weights.to(x.dtype), ids


# ----------------------------------------------------------------------------- activations


def gated(gate, up, spelling: str):
    """act(gate) * up in one of its spellings; GPT-OSS's clamped form for the gptoss ones."""
    if spelling == "silu_mul":
        return F.silu(gate) * up
    if spelling == "torch_mul":
        return torch.mul(up, F.silu(gate))
    if spelling == "sigmoid_spelled":
        return gate * torch.sigmoid(gate) * up
    gate = gate.clamp(max=7.0)
    up = up.clamp(min=-7.0, max=7.0)
    glu = gate * torch.sigmoid(gate * 1.702)
    if spelling == "gptoss_addcmul":
        return torch.addcmul(glu, glu, up)
    return glu * up + glu


class Expert(nn.Module):
    def __init__(self, hidden, ffn, spelling):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.spelling = spelling

    def forward(self, x):
        return self.down_proj(gated(self.gate_proj(x), self.up_proj(x), self.spelling))


# ----------------------------------------------------------------------------- blocks


class Block(nn.Module):
    """One MoE layer of a case's family, with an optional shared expert (plain or sigmoid-gated)."""

    def __init__(self, case: Case):
        super().__init__()
        H, F_, E, K = case.hidden, FFN, case.experts, case.top_k
        self.case, self.E, self.K = case, E, K
        self.router = Router(case.router, H, E, K)
        if case.family in ("loop_list", "loop_cast"):
            self.experts = nn.ModuleList([Expert(H, F_, case.activation) for _ in range(E)])
        else:
            self.w_gate = nn.Parameter(torch.randn(E, F_, H) / H**0.5)
            self.w_up = nn.Parameter(torch.randn(E, F_, H) / H**0.5)
            self.w_down = nn.Parameter(torch.randn(E, H, F_) / F_**0.5)
        self.shared = Expert(H, 2 * F_, "silu_mul") if case.shared else None
        self.shared_gate = nn.Linear(H, 1, bias=False) if case.shared and E % 2 else None

    def forward(self, hidden_states):  # [B, S, H]
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        out = getattr(self, "_" + self.case.family)(x)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out.view(shape)

    def _ffn(self, rows, e):  # rows [n, H] through stacked expert e
        return gated(rows @ self.w_gate[e].t(), rows @ self.w_up[e].t(), self.case.activation) @ self.w_down[e].t()

    def _loop_list(self, x):
        weights, ids = self.router(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, num_classes=self.E).permute(2, 1, 0)  # [E, K, T]
        for e in range(self.E):
            top, tok = torch.where(mask[e])
            out.index_add_(0, tok, (self.experts[e](x[tok]) * weights[tok, top, None]).to(x.dtype))
        return out

    def _loop_cast(self, x):  # experts in bf16 (build() casts them), x and router in fp32
        weights, ids = self.router(x)
        out = torch.zeros_like(x)
        for e in range(self.E):
            tok, top = torch.where(ids == e)
            y = self.experts[e](x[tok].to(torch.bfloat16)).to(x.dtype)
            out.index_add_(0, tok, y * weights[tok, top, None])
        return out

    def _loop_stacked(self, x):
        weights, ids = self.router(x)
        y = torch.zeros_like(x)
        for e in range(self.E):
            idx, top = torch.where(ids == e)
            y[idx] += self._ffn(x[idx], e) * weights[idx, top, None]
        return y

    def _split(self, x):
        weights, ids = self.router(x)
        flat = ids.view(-1)  # [T*K]
        order = flat.argsort(stable=True)
        counts = torch.histc(flat.float(), bins=self.E, min=0, max=self.E - 1).int().tolist()  # bincount: untraceable
        tok = order // self.K
        rows = x[tok].split(counts)
        outs = [self._ffn(r, e) for e, r in enumerate(rows)]
        y = torch.cat(outs) * weights.view(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))

    def _sort_scatter(self, x):
        weights, ids = self.router(x)
        flat = ids.view(-1)
        _, order = torch.sort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=self.E, min=0, max=self.E - 1)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        tok = order // self.K
        xs = x[tok]
        h = gated(torch._grouped_mm(xs, self.w_gate.transpose(1, 2), offs=offs),
                  torch._grouped_mm(xs, self.w_up.transpose(1, 2), offs=offs), "silu_mul")
        rows = torch._grouped_mm(h, self.w_down.transpose(1, 2), offs=offs) * weights.view(-1)[order, None]
        index = tok[:, None].expand(-1, x.shape[-1])
        return torch.zeros_like(x).scatter_add_(0, index, rows.to(x.dtype))

    def _gathered(self, x):
        weights, ids = self.router(x)
        g = F.silu(torch.einsum("th,tkfh->tkf", x, self.w_gate[ids]))
        u = torch.einsum("th,tkfh->tkf", x, self.w_up[ids])
        if self.case.activation != "silu_mul":
            g = gated(torch.einsum("th,tkfh->tkf", x, self.w_gate[ids]), u, self.case.activation)
            u = None
        h = g if u is None else g * u
        out = torch.einsum("tkf,tkhf->tkh", h, self.w_down[ids])  # [T, K, H]
        return torch.einsum("tkh,tk->th", out, weights)

    def _dense_scores(self, x):  # [T, E], zero outside the top-k
        weights, ids = self.router(x)
        return torch.zeros(x.shape[0], self.E, dtype=x.dtype, device=x.device).scatter(1, ids, weights)

    def _dense_in(self, x):
        scores = self._dense_scores(x).t()  # [E, T]
        routed = x[None] * scores[..., None]  # [E, T, H]
        h = gated(torch.bmm(routed, self.w_gate.transpose(1, 2)), torch.bmm(routed, self.w_up.transpose(1, 2)),
                  "silu_mul")
        return torch.bmm(h, self.w_down.transpose(1, 2)).sum(0)

    def _dense_out(self, x):
        scores = self._dense_scores(x)  # [T, E]
        xe = x[None].expand(self.E, -1, -1)  # [E, T, H]
        h = gated(torch.bmm(xe, self.w_gate.transpose(1, 2)), torch.bmm(xe, self.w_up.transpose(1, 2)), "silu_mul")
        out = torch.bmm(h, self.w_down.transpose(1, 2))  # [E, T, H]
        return torch.einsum("eth,te->th", out, scores)

    def _capacity(self, x):
        weights, ids = self.router(x)
        cap = capacity(self.case)
        y = torch.zeros_like(x)
        for e in range(self.E):
            idx, top = torch.where(ids == e)
            idx, top = idx[:cap], top[:cap]
            y.index_add_(0, idx, self._ffn(x[idx], e) * weights[idx, top, None])
        return y

    def _expert_choice(self, x):
        logits = F.linear(x.float(), self.router.weight.float()).softmax(-1)  # [T, E]
        weights, tok = torch.topk(logits.t(), per_expert(self.case), dim=-1)  # [E, C]: experts pick tokens
        y = torch.zeros_like(x)
        for e in range(self.E):
            y.index_add_(0, tok[e], self._ffn(x[tok[e]], e) * weights[e, :, None].to(x.dtype))
        return y


class TitanBlock(nn.Module):
    """torchtitan's MoE (tests/passes/titan.py) at this case's E, K, router and shared expert."""

    def __init__(self, case: Case):
        super().__init__()
        router = {"softmax": dict(score_func="softmax"), "softmax_renorm": dict(score_func="softmax", route_norm=True),
                  "sigmoid_group": dict(groups=4, limited_groups=2, route_norm=True, route_scale=2.5)}
        self.moe = titan.MoE(case.hidden, FFN, case.experts, case.top_k, shared_ffn=2 * FFN if case.shared else 0,
                             **router.get(case.router, {}))

    def forward(self, x):
        return self.moe(x)


class Stack(nn.Module):
    """``layers`` MoE layers with residual adds and RMS norms between them."""

    def __init__(self, case: Case):
        super().__init__()
        make = TitanBlock if case.family == "titan" else Block
        self.blocks = nn.ModuleList([make(case) for _ in range(case.layers)])

    def forward(self, x):  # [B, S, H]
        for block in self.blocks:
            x = x + block(F.rms_norm(x, (x.shape[-1],)))
        return x


def build(case: Case) -> tuple[nn.Module, torch.Tensor]:
    """(module in the case's dtype, input [1, T, H])."""
    torch.manual_seed(zlib.crc32(str(case).encode()))
    model = Stack(case)
    if case.family != "titan":  # torchtitan holds fp32 master weights and casts itself
        model = model.to(case.dtype)
    if case.family == "loop_cast":
        for block in model.blocks:
            block.experts.to(torch.bfloat16)
    x = torch.randn(1, case.tokens, case.hidden, dtype=torch.float32 if case.family == "titan" else case.dtype)
    return model, x
