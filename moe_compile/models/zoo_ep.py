"""Expert-parallel MoE blocks written the way EP model code writes them (family E of
docs/architecture.md#pattern-families; docs/architecture.md#expert-parallel).

They feed the EP example, the ``demo --world-size`` command and the EP tests; none of them knows
about moe_compile.  Every rank builds the same *global* model from one seed and keeps its slice,
so ``GlobalReference`` (all experts on one device) gives the same answer as the EP ranks together.

Shapes:  B batch, S sequence, T = B*S tokens per rank, H hidden, F expert FFN width, E experts
(global), R ranks, E_l = E / R local experts, K top-k, S_k = T*K routed slots.

* ``AllToAllEPMoE``  torchtitan / Megatron style: route locally; count tokens per global expert
  (histc); exchange the counts with ``all_to_all_single``; split sizes by ``.tolist()``; exchange
  the tokens with ``all_to_all_single``; permute the received rows to expert-major order; local
  experts (for-loop over ``torch.split`` of the rows, stacked ``[E_l, ...]`` weights or a
  ModuleList); reverse permute; reverse ``all_to_all_single``; weighted combine with
  ``index_add_``.  ``collectives="functional"`` uses
  ``torch.distributed._functional_collectives.all_to_all_single``, ``"legacy"`` the in-place
  ``dist.all_to_all_single`` into preallocated outputs.
* ``AllReduceEPMoE``  DeepSeek official inference style: every rank runs its local slice of experts
  on all its tokens (``ids == i`` for i in its range; other ids are skipped) and ``all_reduce``s the
  partial result, then adds the shared expert.
* ``AllGatherEPMoE``  Megatron's all-gather token dispatcher: route the rank's own tokens; all-gather
  tokens, top-k ids and weights over the group; each rank runs its local experts on the gathered
  rows routed to them (``torch.where(ids == e)``); ``reduce_scatter_tensor`` (sum) hands every rank
  its own tokens' sums back.  ``tp > 1``: expert tensor parallel inside the group (Megatron's
  tp_ep group, expert-TP ranks adjacent): rank r holds experts of EP rank r // tp and the F-shard
  r % tp of their FC1 / FC1-up / FC2, so the reduce-scatter also sums the F-shards.
  ``routing="map"``: Megatron's own form (a [T, E] routing map and probs gathered, permute by
  ``masked_select``, experts on ``split`` by counts, unpermute by ``scatter_add``);
  ``collectives="autograd_function"``: its gather / reduce-scatter autograd.Functions.
* ``ETPMoE``  expert tensor parallel with tokens already replicated over the ETP group (after a
  TP attention without sequence parallel): every expert on every rank, F-sharded; the partial
  outputs are summed by ``all_reduce`` over the ETP group.
* ``AllToAllEPMoE(etp_group=...)``  EP x ETP: the all-to-all dispatch over the EP group with
  F-sharded local experts (tokens replicated over the ETP group) and an ``all_reduce`` of the
  partial outputs over the ETP group; ``etp_tokens="sequence"``: sequence-parallel tokens
  all-gathered over the ETP group before the router and reduce-scattered back after the combine.

Expert tensor parallel is exact: SwiGLU is elementwise in F, so FC2 over an F-shard of the
activations is a partial sum of the full FC2, and the F-shards' partial outputs add up to it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from moe_compile.models.zoo import SoftmaxRouter, SwiGLU

COLLECTIVES = ("functional", "legacy")
LOCAL_EXPERTS = ("stacked", "modulelist")


def _group_info(group):
    return dist.get_rank(group), dist.get_world_size(group)


def _global_experts(hidden, ffn, experts, seed):
    """The global expert weights, identical on every rank: w1, w3 [E, F, H], w2 [E, H, F]."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(experts, ffn, hidden, generator=gen) / hidden**0.5
    w3 = torch.randn(experts, ffn, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, ffn, generator=gen) / ffn**0.5
    return w1, w3, w2


class BiasedRouter(SoftmaxRouter):
    """softmax(logits + bias) -> topk -> renormalise; a large bias skews routing (uneven EP load)."""

    def __init__(self, hidden: int, experts: int, top_k: int, bias: torch.Tensor):
        super().__init__(hidden, experts, top_k)
        self.register_buffer("bias", bias.float())

    def forward(self, x):  # x [T, H]
        probs = F.softmax(F.linear(x, self.weight) + self.bias, dim=-1, dtype=torch.float)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # [T, K], [T, K]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


def _router(hidden, experts, top_k, seed, route_bias=None):
    gen = torch.Generator().manual_seed(seed + 1)
    router = SoftmaxRouter(hidden, experts, top_k) if route_bias is None else BiasedRouter(
        hidden, experts, top_k, torch.as_tensor(route_bias))
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen) / hidden**0.5)
    return router


def _swiglu_from(w1, w3, w2) -> SwiGLU:
    mlp = SwiGLU(w1.shape[1], w1.shape[0])
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(w1)
        mlp.up_proj.weight.copy_(w3)
        mlp.down_proj.weight.copy_(w2)
    return mlp


def _f_shard(w1, w3, w2, tp_rank, tp):
    """Expert tensor parallel: F-shard tp_rank of w1, w3 [E, F, H] and w2 [E, H, F]."""
    if w1.shape[1] % tp:
        raise ValueError(f"the FFN width {w1.shape[1]} does not divide over {tp} expert-TP ranks")
    f = w1.shape[1] // tp
    cols = slice(tp_rank * f, (tp_rank + 1) * f)
    return w1[:, cols].contiguous(), w3[:, cols].contiguous(), w2[:, :, cols].contiguous()


def _funcol(name: str, differentiable: bool):
    """funcol's ``<name>_single`` (torch 2.13; ``<name>_tensor`` before), or its autograd form."""
    suffix = "_autograd" if differentiable else ""
    found = getattr(funcol, f"{name}_single{suffix}", None)
    return found if found is not None else getattr(funcol, f"{name}_tensor{suffix}")


class _GatherFromRegion(torch.autograd.Function):
    """Megatron's all-gather of sequence-parallel rows as an autograd.Function: the legacy in-place
    collective forward, its reduce-scatter backward."""

    @staticmethod
    def forward(ctx, t, group):  # [T, ...] -> [R*T, ...]
        ctx.group = group
        out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatterToRegion.apply(grad, ctx.group), None


class _ReduceScatterToRegion(torch.autograd.Function):
    """Megatron's reduce-scatter back to sequence-parallel rows; its backward is the all-gather."""

    @staticmethod
    def forward(ctx, y, group):  # [R*T, ...] -> [T, ...]
        ctx.group = group
        out = y.new_empty((y.shape[0] // dist.get_world_size(group), *y.shape[1:]))
        dist.reduce_scatter_tensor(out, y.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _GatherFromRegion.apply(grad, ctx.group), None


def _gather_rows(t, group, collectives):  # [T, ...] -> [R*T, ...]
    if collectives == "functional":
        return _funcol("all_gather", False)(t, 0, group)
    out = t.new_empty((dist.get_world_size(group) * t.shape[0], *t.shape[1:]))
    dist.all_gather_into_tensor(out, t, group=group)
    return out


def _reduce_scatter_rows(y, group, collectives):  # [R*T, ...] -> [T, ...], summed
    if collectives == "functional":
        return _funcol("reduce_scatter", False)(y, "sum", 0, group)
    out = y.new_empty((y.shape[0] // dist.get_world_size(group), *y.shape[1:]))
    dist.reduce_scatter_tensor(out, y, group=group)
    return out


def _all_reduce(y, group, collectives):
    if collectives == "functional":
        return funcol.all_reduce(y, "sum", group)
    dist.all_reduce(y, group=group)
    return y


class AllToAllEPMoE(nn.Module):
    """torchtitan / Megatron expert parallelism: all-to-all dispatch and combine around local experts."""

    def __init__(self, hidden=64, ffn=96, experts=8, top_k=2, group=None, collectives="functional",
                 local_experts="stacked", seed=0, route_bias=None, etp_group=None, etp_tokens="replicated"):
        super().__init__()
        if collectives not in COLLECTIVES or local_experts not in LOCAL_EXPERTS:
            raise ValueError(f"collectives in {COLLECTIVES}, local_experts in {LOCAL_EXPERTS}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = _group_info(self.group)
        if experts % self.world:
            raise ValueError(f"{experts} experts do not divide over {self.world} ranks")
        self.num_experts, self.top_k, self.local = experts, top_k, experts // self.world
        self.collectives, self.local_style = collectives, local_experts
        self.etp_group = etp_group  # EP x ETP: F-sharded local experts, partial outputs summed over it
        if etp_tokens not in ("replicated", "sequence"):
            raise ValueError("etp_tokens is 'replicated' (all_reduce after) or 'sequence' (gather / reduce-scatter)")
        self.etp_tokens = etp_tokens
        self.gate = _router(hidden, experts, top_k, seed, route_bias)
        w1, w3, w2 = (w[self.rank * self.local:(self.rank + 1) * self.local] for w in
                      _global_experts(hidden, ffn, experts, seed))
        if etp_group is not None:
            w1, w3, w2 = _f_shard(w1, w3, w2, *_group_info(etp_group))
        if local_experts == "stacked":
            self.w1, self.w3, self.w2 = (nn.Parameter(w.clone()) for w in (w1, w3, w2))
        else:
            self.experts = nn.ModuleList([_swiglu_from(w1[e], w3[e], w2[e]) for e in range(self.local)])

    def _all_to_all(self, tensor, out_splits, in_splits):
        if self.collectives == "functional":
            return funcol.all_to_all_single(tensor, out_splits, in_splits, self.group)
        rows = sum(out_splits) if out_splits is not None else tensor.shape[0]
        out = tensor.new_empty((rows, *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor, out_splits, in_splits, group=self.group)
        return out

    def _run_local_experts(self, h, counts):  # h [N, H] expert-major, counts: E_l Python ints
        h = h[: sum(counts)]
        outs = []
        for e, rows in enumerate(torch.split(h, counts, dim=0)):
            if self.local_style == "stacked":
                act = F.silu(torch.matmul(rows, self.w1[e].transpose(-2, -1)))
                act = act * torch.matmul(rows, self.w3[e].transpose(-2, -1))
                outs.append(torch.matmul(act, self.w2[e].transpose(-2, -1)))
            else:
                outs.append(self.experts[e](rows))
        return torch.cat(outs, dim=0)

    def forward(self, hidden_states):  # [B, S, H]
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])  # [T, H]
        sequence = self.etp_group is not None and self.etp_tokens == "sequence"
        if sequence:  # sequence-parallel tokens: the ETP group's rows, routed and dispatched together
            x = _gather_rows(x, self.etp_group, self.collectives)  # [tp*T, H]
        weights, ids = self.gate(x)  # [T, K], [T, K]
        flat = ids.reshape(-1)  # [S_k]
        order = torch.argsort(flat, stable=True)  # slots sorted by global expert = by owner rank
        counts = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        counts = counts.to(torch.int64)  # [E] tokens this rank sends to each global expert
        recv_counts = self._all_to_all(counts, None, None)  # [E] = [R, E_l]: from each source rank
        send_splits = counts.view(self.world, self.local).sum(1).tolist()
        recv_counts = recv_counts.view(self.world, self.local)
        recv_splits = recv_counts.sum(1).tolist()
        routed = x[order // self.top_k]  # [S_k, H]
        recv = self._all_to_all(routed, recv_splits, send_splits)  # [N, H] source-major
        # source-major -> expert-major: row i's local expert from the received counts
        bounds = torch.cumsum(recv_counts.reshape(-1), 0)  # [R*E_l]
        slot = torch.arange(recv.shape[0], device=recv.device)
        local_ids = torch.searchsorted(bounds, slot, right=True) % self.local  # [N]
        perm = torch.argsort(local_ids, stable=True)
        out = self._run_local_experts(recv[perm], recv_counts.sum(0).tolist())  # [N, H]
        unperm = torch.empty_like(out)
        unperm[perm] = out  # back to source-major
        back = self._all_to_all(unperm, send_splits, recv_splits)  # [S_k, H] in `order`
        back = back * weights.reshape(-1)[order, None]
        y = torch.zeros_like(x).index_add_(0, order // self.top_k, back.to(x.dtype))
        if sequence:  # the F-shards summed, each rank its own rows back
            return _reduce_scatter_rows(y, self.etp_group, self.collectives).view(shape)
        if self.etp_group is not None:  # this rank's F-shard of every token's output: sum the shards
            y = _all_reduce(y, self.etp_group, self.collectives)
        return y.view(shape)


class AllReduceEPMoE(nn.Module):
    """DeepSeek official inference: local expert slice on all tokens, then ``all_reduce``."""

    def __init__(self, hidden=64, ffn=96, experts=8, top_k=2, group=None, collectives="legacy", shared=0,
                 seed=0, route_bias=None):
        super().__init__()
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = _group_info(self.group)
        if experts % self.world:
            raise ValueError(f"{experts} experts do not divide over {self.world} ranks")
        self.num_experts, self.top_k, self.local = experts, top_k, experts // self.world
        self.start, self.end = self.rank * self.local, (self.rank + 1) * self.local
        self.collectives = collectives
        self.gate = _router(hidden, experts, top_k, seed, route_bias)
        w1, w3, w2 = _global_experts(hidden, ffn, experts, seed)
        self.experts = nn.ModuleList([
            _swiglu_from(w1[i], w3[i], w2[i]) if self.start <= i < self.end else None for i in range(experts)
        ])
        self.shared_experts = None
        if shared:
            torch.manual_seed(seed + 2)
            self.shared_experts = SwiGLU(hidden, shared)

    def forward(self, x):  # [B, S, H]
        shape = x.size()
        x = x.view(-1, shape[-1])  # [T, H]
        weights, indices = self.gate(x)
        y = torch.zeros_like(x)
        for i in range(self.start, self.end):
            idx, top = torch.where(indices == i)
            y[idx] += self.experts[i](x[idx]) * weights[idx, top, None]
        if self.world > 1:
            if self.collectives == "functional":
                y = funcol.all_reduce(y, "sum", self.group)
            else:
                dist.all_reduce(y, group=self.group)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y.view(shape)


class AllGatherEPMoE(nn.Module):
    """Megatron's all-gather token dispatcher: gather tokens and routing, local experts, reduce-scatter.

    ``tp``: expert-TP ranks inside ``group`` (rank r: EP rank r // tp, F-shard r % tp).
    ``differentiable``: the autograd forms of funcol's gather / reduce-scatter (a training step).
    ``routing="map"``: Megatron's own spelling: a dense [T, E] probs matrix and boolean routing map
    gathered instead of the top-k ids and weights, permuted / unpermuted by the map.
    ``collectives="autograd_function"``: the float gathers and the reduce-scatter through custom
    autograd.Functions around the in-place collectives, as Megatron writes them (differentiable)."""

    def __init__(self, hidden=64, ffn=96, experts=8, top_k=2, group=None, tp=1, collectives="functional",
                 local_experts="modulelist", seed=0, route_bias=None, differentiable=False, routing="topk"):
        super().__init__()
        gathers = (*COLLECTIVES, "autograd_function")
        if collectives not in gathers or local_experts not in LOCAL_EXPERTS or routing not in ("topk", "map"):
            raise ValueError(f"collectives in {gathers}, local_experts in {LOCAL_EXPERTS}, routing topk or map")
        self.routing = routing
        if differentiable and collectives != "functional":
            raise ValueError("only funcol's autograd collectives are differentiable")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = _group_info(self.group)
        if self.world % tp or experts % (self.world // tp):
            raise ValueError(f"{experts} experts, {self.world} ranks and tp={tp} do not tile")
        self.num_experts, self.top_k, self.local = experts, top_k, experts // (self.world // tp)
        self.start = (self.rank // tp) * self.local  # this EP rank's first global expert
        self.collectives, self.local_style, self.differentiable = collectives, local_experts, differentiable
        self.gate = _router(hidden, experts, top_k, seed, route_bias)
        w1, w3, w2 = _f_shard(*(w[self.start:self.start + self.local] for w in
                                _global_experts(hidden, ffn, experts, seed)), self.rank % tp, tp)
        if local_experts == "stacked":
            self.w1, self.w3, self.w2 = (nn.Parameter(w.clone()) for w in (w1, w3, w2))
        else:
            self.experts = nn.ModuleList([_swiglu_from(w1[e], w3[e], w2[e]) for e in range(self.local)])

    def _gather(self, t, grad=True):  # [T, ...] -> [R*T, ...], rank-major
        if self.collectives == "functional":
            return _funcol("all_gather", grad and self.differentiable)(t, 0, self.group)
        if self.collectives == "autograd_function" and t.is_floating_point():
            return _GatherFromRegion.apply(t, self.group)
        out = t.new_empty((self.world * t.shape[0], *t.shape[1:]))
        dist.all_gather_into_tensor(out, t, group=self.group)
        return out

    def _reduce_scatter(self, y):  # [R*T, H] -> [T, H], summed over the group
        if self.collectives == "functional":
            return _funcol("reduce_scatter", self.differentiable)(y, "sum", 0, self.group)
        if self.collectives == "autograd_function":
            return _ReduceScatterToRegion.apply(y, self.group)
        out = y.new_empty((y.shape[0] // self.world, *y.shape[1:]))
        dist.reduce_scatter_tensor(out, y, group=self.group)
        return out

    def _expert(self, e, rows):  # rows [N_e, H] -> [N_e, H]
        if self.local_style == "modulelist":
            return self.experts[e](rows)
        act = F.silu(rows @ self.w1[e].t()) * (rows @ self.w3[e].t())
        return act @ self.w2[e].t()

    def forward(self, hidden_states):  # [B, S, H]
        shape = hidden_states.shape
        x = hidden_states.view(-1, shape[-1])  # [T, H]
        weights, ids = self.gate(x)  # [T, K], [T, K]
        x_all = self._gather(x)  # [R*T, H]
        if self.routing == "map":
            return self._reduce_scatter(self._dense_routed(x_all, weights, ids)).view(shape)
        ids_all = self._gather(ids, grad=False)  # [R*T, K]
        w_all = self._gather(weights)  # [R*T, K]
        y = torch.zeros_like(x_all)
        for e in range(self.local):
            rows, slot = torch.where(ids_all == self.start + e)  # gathered rows routed to local expert e
            out = self._expert(e, x_all[rows]) * w_all[rows, slot, None]
            y = y.index_add(0, rows, out)
        return self._reduce_scatter(y).view(shape)  # [T, H]: every rank's part of this rank's tokens

    def _dense_routed(self, x_all, weights, ids):  # -> [N, H], N = R*T
        """Megatron's permute / unpermute on a gathered routing map: the rows of each local expert
        in expert-major order, the experts on ``split`` by their counts, ``scatter_add`` back."""
        T, E, H = ids.shape[0], self.num_experts, x_all.shape[-1]
        probs = torch.zeros(T, E, dtype=weights.dtype, device=ids.device).scatter(1, ids, weights)  # [T, E]
        routing_map = torch.zeros(T, E, dtype=torch.bool, device=ids.device).scatter(1, ids, True)  # [T, E]
        local_map = self._gather(routing_map, grad=False)[:, self.start:self.start + self.local]  # [N, E_l]
        local_probs = self._gather(probs)[:, self.start:self.start + self.local]  # [N, E_l]
        counts = local_map.sum(dim=0).tolist()  # rows per local expert
        rows = torch.arange(x_all.shape[0], device=ids.device).unsqueeze(0).expand(self.local, -1)
        rows = rows.masked_select(local_map.t())  # [S] token of each permuted row, expert-major
        permuted = x_all.index_select(0, rows)  # [S, H]
        out = torch.cat([self._expert(e, part) for e, part in enumerate(torch.split(permuted, counts))])
        out = out * local_probs.t().masked_select(local_map.t()).unsqueeze(1)  # [S, H]
        return torch.zeros_like(x_all).scatter_add(0, rows.unsqueeze(1).expand(-1, H), out)


class ETPMoE(nn.Module):
    """Expert tensor parallel on replicated tokens: every expert F-sharded over ``group``, all_reduce."""

    def __init__(self, hidden=64, ffn=96, experts=8, top_k=2, group=None, collectives="functional", seed=0,
                 route_bias=None):
        super().__init__()
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}")
        self.group = group if group is not None else dist.group.WORLD
        tp_rank, tp = _group_info(self.group)
        self.num_experts, self.top_k, self.collectives = experts, top_k, collectives
        self.gate = _router(hidden, experts, top_k, seed, route_bias)
        w1, w3, w2 = _f_shard(*_global_experts(hidden, ffn, experts, seed), tp_rank, tp)
        self.experts = nn.ModuleList([_swiglu_from(w1[e], w3[e], w2[e]) for e in range(experts)])

    def forward(self, x):  # [B, S, H], the same on every rank of the group
        shape = x.shape
        x = x.view(-1, shape[-1])  # [T, H]
        weights, ids = self.gate(x)
        y = torch.zeros_like(x)
        for e in range(self.num_experts):
            idx, top = torch.where(ids == e)
            y[idx] += self.experts[e](x[idx]) * weights[idx, top, None]  # this rank's F-shard only
        return _all_reduce(y, self.group, self.collectives).view(shape)


class GlobalReference(nn.Module):
    """Every expert of an EP block on one device: what the R ranks compute together."""

    def __init__(self, hidden=64, ffn=96, experts=8, top_k=2, seed=0, route_bias=None):
        super().__init__()
        self.gate = _router(hidden, experts, top_k, seed, route_bias)
        self.w1, self.w3, self.w2 = _global_experts(hidden, ffn, experts, seed)

    def forward(self, x):  # [B, S, H]
        from moe_compile.ir import ExpertWeights, FFNAttrs
        from moe_compile.kernels.reference import fused_moe_reference

        flat = x.view(-1, x.shape[-1])
        weights, ids = self.gate(flat)
        w = ExpertWeights((self.w1,), (self.w3,), (self.w2,))
        return fused_moe_reference(flat, ids, weights, w, FFNAttrs("separate")).view(x.shape)


def demo(tokens: int = 16, hidden: int = 64, ffn: int = 96, experts: int = 8, top_k: int = 2) -> bool:
    """Compile both EP blocks on the current process group; True when every check passes here."""
    from moe_compile.api import capture_flags
    from moe_compile.compiler import collecting_reports

    rank, world = dist.get_rank(), dist.get_world_size()
    ok = True
    blocks = {
        "all-to-all (torchtitan/Megatron style)": (AllToAllEPMoE(hidden, ffn, experts, top_k), rank),
        "all_reduce (DeepSeek official style)": (AllReduceEPMoE(hidden, ffn, experts, top_k), 0),
    }
    for name, (block, seed) in blocks.items():
        torch._dynamo.reset()
        x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(seed))  # all_reduce: replicated x
        with torch.no_grad():
            want = block(x)
            with capture_flags(), collecting_reports() as report:
                got = torch.compile(block, backend="moe")(x)
        err = ((got - want).abs().max() / want.abs().max()).item()
        rewritten = [r for r in report.rewritten if r.family == "expert_parallel"]
        good = err <= 2e-5 and len(rewritten) == 1
        ok &= good
        verdicts = [None] * world
        dist.all_gather_object(verdicts, (rank, err, good))
        if rank == 0:
            print(f"== {name}, world size {world}")
            print(report)
            for r, e, g in verdicts:
                print(f"  rank {r}: max relative error vs eager {e:.2e} ({'ok' if g else 'MISMATCH'})")
    return ok
