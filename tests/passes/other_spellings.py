"""MoE layers spelled the way other codebases spell them, as general mechanisms.

Shapes:  B batch, S sequence, T = B*S tokens, H hidden, F expert FFN width, E experts, K top-k.

Each ``SPELLINGS`` entry is one block's forward over ``x [T, H]`` (or ``[B, S, H]`` where it keeps the
batch), each an exact top-k token-choice MoE with SwiGLU experts and a weighted sum: every one is the
op's semantics, so each must be rewritten or refused with a non-empty reason, and never computed
differently from eager.  ``build(name, layers, attention, dtype)`` stacks ``layers`` of them with
RMS norms, residual adds and (optionally) a causal self-attention before each.

  dbrx_chunk      DBRX: w1 / v1 / w2 as one [E*F, H] parameter each, ``view(E, F, H).chunk(E)``,
                  ``x @ w1.t()``, ``x @ v1.t()`` but ``h @ w2`` (one role transposed, one not)
  dbrx_index      the same parameters cut with ``W.view(E, F, H)[e]``
  fused_views     [E*F, H] / [E*F, H] / [E*H, F] parameters viewed [E, out, in] and cut per expert, one
                  orientation for every role
  all_gather      every expert on every token (``einsum("th,ehf->tef")``), then ``gather(out, 1, ids)``
  all_mask_loop   a loop running every expert on every token, weighted by ``(w * (ids == e)).sum(-1)``
  bsk_where       ``b, s, k = torch.where(ids == e)`` on [B, S, K] ids, ``y[b, s] += ...``
  jetmoe          sorted rows, ``split(counts.tolist())``, FC1 per group, ``cat``, the activation on
                  all rows, split again, FC2 per group, ``cat``, ``index_add``
  dropout_eval    a Switch / T5 FFN with ``nn.Dropout`` between activation and down projection (eval)
  contiguous      ``x[tok].contiguous()`` and ``.to(x.dtype)`` no-ops around a loop's FFN
  top1_max        top-1 via ``probs.max(dim=-1)``
  top1_argmax     top-1 via ``argmax`` + ``gather``
  onehot_scatter  one_hot counts + stable argsort + ``index_select`` + ``split`` + ``scatter_reduce(sum)``
  sorted_gather   rows sorted by ``gather``, experts per ``split`` group, ``cat``, the inverse permutation
                  gathered back, a weighted sum over K (``_k1``: at K = 1, where sorted rows are [T, H] too)
  linear_all      gate and up as one ``nn.Linear(H, E*F)`` each, viewed [T, E, F] (a stack of E weight
                  slices seen from the output side), down ``einsum("tef,ehf->teh")``, ``take_along_dim``
  einsum_ehf      every expert on every token with [E, in, out] weights, ``einsum("th,ehf->tef")``,
                  the top-k outputs selected by advanced indexing ``out[arange(T)[:, None], ids]``
"""

from __future__ import annotations

import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

FFN = 16


class Block(nn.Module):
    def __init__(self, name: str, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.name, self.E, self.K, self.H = name, experts, top_k, hidden
        self.router = nn.Linear(hidden, experts, bias=False)
        E, H = experts, hidden
        if name.startswith("dbrx") or name == "fused_views":
            self.w1 = nn.Parameter(torch.randn(E * FFN, H) / H**0.5)
            self.v1 = nn.Parameter(torch.randn(E * FFN, H) / H**0.5)
            down = (E * H, FFN) if name == "fused_views" else (E * FFN, H)  # DBRX: [E*F, H], used as h @ w2
            self.w2 = nn.Parameter(torch.randn(*down) / FFN**0.5)
        elif name == "linear_all":
            self.gate_lin, self.up_lin = nn.Linear(H, E * FFN, bias=False), nn.Linear(H, E * FFN, bias=False)
            self.w_down = nn.Parameter(torch.randn(E, H, FFN) / FFN**0.5)
        elif name == "einsum_ehf":  # [E, in, out]: used as x @ W
            self.w_gate = nn.Parameter(torch.randn(E, H, FFN) / H**0.5)
            self.w_up = nn.Parameter(torch.randn(E, H, FFN) / H**0.5)
            self.w_down = nn.Parameter(torch.randn(E, FFN, H) / FFN**0.5)
        else:
            self.w_gate = nn.Parameter(torch.randn(E, FFN, H) / H**0.5)
            self.w_up = nn.Parameter(torch.randn(E, FFN, H) / H**0.5)
            self.w_down = nn.Parameter(torch.randn(E, H, FFN) / FFN**0.5)
        self.dropout = nn.Dropout(0.1)

    def route(self, x):  # [..., H] -> weights, ids [..., K]
        probs = self.router(x).softmax(-1)
        weights, ids = probs.topk(self.K, dim=-1)
        return weights / weights.sum(-1, keepdim=True), ids

    def ffn(self, rows, e):  # [n, H] -> [n, H]
        return (F.silu(rows @ self.w_gate[e].t()) * (rows @ self.w_up[e].t())) @ self.w_down[e].t()

    def forward(self, hidden_states):  # [B, S, H]
        if self.name == "bsk_where":
            return self._bsk_where(hidden_states)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [T, H]
        return getattr(self, "_" + self.name.removesuffix("_k1"))(x).view(shape)

    def _loop(self, x, weights, ids, ffn):
        y = torch.zeros_like(x)
        for e in range(self.E):
            tok, k = torch.where(ids == e)
            y.index_add_(0, tok, ffn(x[tok], e) * weights[tok, k, None])
        return y

    def _dbrx_chunk(self, x):
        weights, ids = self.route(x)
        w1 = self.w1.view(self.E, FFN, self.H).chunk(self.E, dim=0)
        v1 = self.v1.view(self.E, FFN, self.H).chunk(self.E, dim=0)
        w2 = self.w2.view(self.E, FFN, self.H).chunk(self.E, dim=0)

        def ffn(rows, e):
            return (F.silu(rows @ w1[e].squeeze(0).t()) * (rows @ v1[e].squeeze(0).t())) @ w2[e].squeeze(0)

        return self._loop(x, weights, ids, ffn)

    def _dbrx_index(self, x):
        weights, ids = self.route(x)
        w1, v1, w2 = (w.view(self.E, FFN, self.H) for w in (self.w1, self.v1, self.w2))

        def ffn(rows, e):
            return (F.silu(rows @ w1[e].t()) * (rows @ v1[e].t())) @ w2[e]

        return self._loop(x, weights, ids, ffn)

    def _fused_views(self, x):  # one orientation for every role: [E*F, H], [E*F, H], [E*H, F]
        weights, ids = self.route(x)
        w1, v1 = (w.view(self.E, FFN, self.H) for w in (self.w1, self.v1))
        w2 = self.w2.view(self.E, self.H, FFN)

        def ffn(rows, e):
            return (F.silu(rows @ w1[e].t()) * (rows @ v1[e].t())) @ w2[e].t()

        return self._loop(x, weights, ids, ffn)

    def _all_gather(self, x):
        weights, ids = self.route(x)
        g = torch.einsum("th,efh->tef", x, self.w_gate)  # [T, E, F]
        u = torch.einsum("th,efh->tef", x, self.w_up)
        out = torch.einsum("tef,ehf->teh", F.silu(g) * u, self.w_down)  # [T, E, H]
        picked = out.gather(1, ids[..., None].expand(-1, -1, self.H))  # [T, K, H]
        return (picked * weights[..., None]).sum(1)

    def _linear_all(self, x):
        weights, ids = self.route(x)
        T = x.shape[0]
        g = self.gate_lin(x).view(T, self.E, FFN)  # [T, E*F] -> [T, E, F]
        u = self.up_lin(x).view(T, self.E, FFN)
        out = torch.einsum("tef,ehf->teh", F.silu(g) * u, self.w_down)  # [T, E, H]
        picked = torch.take_along_dim(out, ids[..., None], dim=1)  # [T, K, H]
        return (picked * weights[..., None]).sum(1)

    def _einsum_ehf(self, x):
        weights, ids = self.route(x)
        g = torch.einsum("th,ehf->tef", x, self.w_gate)  # [T, E, F]
        u = torch.einsum("th,ehf->tef", x, self.w_up)
        out = torch.einsum("tef,efh->teh", F.silu(g) * u, self.w_down)  # [T, E, H]
        picked = out[torch.arange(x.shape[0], device=x.device)[:, None], ids]  # [T, K, H]
        return torch.einsum("tkh,tk->th", picked, weights)

    def _all_mask_loop(self, x):
        weights, ids = self.route(x)
        y = torch.zeros_like(x)
        for e in range(self.E):
            w = (weights * (ids == e)).sum(-1)  # [T]
            y = y + self.ffn(x, e) * w[:, None]
        return y

    def _bsk_where(self, hidden_states):  # [B, S, H], ids [B, S, K]
        weights, ids = self.route(hidden_states)
        y = torch.zeros_like(hidden_states)
        for e in range(self.E):
            b, s, k = torch.where(ids == e)
            y[b, s] += self.ffn(hidden_states[b, s], e) * weights[b, s, k, None]
        return y

    def _jetmoe(self, x):
        weights, ids = self.route(x)
        flat = ids.view(-1)  # [T*K]
        order = flat.argsort(stable=True)
        counts = torch.histc(flat.float(), bins=self.E, min=0, max=self.E - 1).int().tolist()
        tok = order // self.K
        groups = x[tok].split(counts)
        h = torch.cat([torch.cat([g @ self.w_gate[e].t(), g @ self.w_up[e].t()], -1) for e, g in enumerate(groups)])
        gate, up = h.chunk(2, dim=-1)
        h = (F.silu(gate) * up).split(counts)
        out = torch.cat([g @ self.w_down[e].t() for e, g in enumerate(h)]) * weights.view(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tok, out)

    def _dropout_eval(self, x):
        weights, ids = self.route(x)

        def ffn(rows, e):
            return self.dropout(F.silu(rows @ self.w_gate[e].t()) * (rows @ self.w_up[e].t())) @ self.w_down[e].t()

        return self._loop(x, weights, ids, ffn)

    def _contiguous(self, x):
        weights, ids = self.route(x)

        def ffn(rows, e):
            return self.ffn(rows.contiguous().to(x.dtype), e).contiguous()

        return self._loop(x, weights, ids, ffn)

    def _top1_max(self, x):
        weights, ids = self.router(x).softmax(-1).max(dim=-1)  # [T], [T]
        y = torch.zeros_like(x)
        for e in range(self.E):
            tok = torch.where(ids == e)[0]
            y.index_add_(0, tok, self.ffn(x[tok], e) * weights[tok, None])
        return y

    def _top1_argmax(self, x):
        probs = self.router(x).softmax(-1)
        ids = probs.argmax(dim=-1, keepdim=True)  # [T, 1]
        weights = probs.gather(1, ids)
        return self._loop(x, weights, ids, self.ffn)

    def _onehot_scatter(self, x):
        weights, ids = self.route(x)
        flat = ids.view(-1)
        counts = F.one_hot(flat, self.E).sum(0).tolist()  # [E]
        order = flat.argsort(stable=True)
        tok = order // self.K
        groups = x.index_select(0, tok).split(counts)
        out = torch.cat([self.ffn(g, e) for e, g in enumerate(groups)]) * weights.view(-1)[order, None]
        index = tok[:, None].expand(-1, x.shape[-1])
        return torch.zeros_like(x).scatter_reduce(0, index, out, reduce="sum")

    def _sorted_gather(self, x):
        weights, ids = self.route(x)
        flat = ids.view(-1)  # [T*K]
        order = flat.argsort(stable=True)
        counts = torch.histc(flat.float(), bins=self.E, min=0, max=self.E - 1).int().tolist()
        rows = x.gather(0, (order // self.K)[:, None].expand(-1, x.shape[-1])).split(counts)  # sorted [T*K, H]
        out = torch.cat([self.ffn(r, e) for e, r in enumerate(rows)])
        back = out.gather(0, order.argsort()[:, None].expand(-1, x.shape[-1]))  # slot order [T*K, H]
        return (back.view(-1, self.K, x.shape[-1]) * weights[..., None]).sum(1)


SPELLINGS = ("dbrx_chunk", "dbrx_index", "fused_views", "all_gather", "all_mask_loop", "bsk_where", "jetmoe", "dropout_eval",
             "contiguous", "top1_max", "top1_argmax", "onehot_scatter", "sorted_gather", "sorted_gather_k1", "linear_all",
             "einsum_ehf")
TOP1 = ("top1_max", "top1_argmax", "sorted_gather_k1")


class Attention(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):  # [B, S, H]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        heads = lambda t: t.unflatten(-1, (2, -1)).transpose(1, 2)  # noqa: E731  [B, 2, S, H/2]
        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.out(o.transpose(1, 2).flatten(-2))


class Stack(nn.Module):
    def __init__(self, name: str, layers: int, attention: bool, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.blocks = nn.ModuleList([Block(name, hidden, experts, top_k) for _ in range(layers)])
        self.attn = nn.ModuleList([Attention(hidden) for _ in range(layers)]) if attention else None

    def forward(self, x):  # [B, S, H]
        for i, block in enumerate(self.blocks):
            if self.attn is not None:
                x = x + self.attn[i](F.rms_norm(x, (x.shape[-1],)))
            x = x + block(F.rms_norm(x, (x.shape[-1],)))
        return x


def build(name: str, layers: int = 1, attention: bool = False, dtype=torch.float32, tokens: int = 7,
          batch: int | None = None, hidden: int = 32, experts: int = 4):
    """(the stack in eval mode and dtype, input [batch, tokens, hidden]; batch 2 where the block keeps it)."""
    batch = batch or (2 if name == "bsk_where" else 1)
    torch.manual_seed(zlib.crc32(f"{name}-{layers}-{attention}-{dtype}".encode()))
    top_k = 1 if name in TOP1 else 2
    model = Stack(name, layers, attention, hidden, experts, top_k).to(dtype).eval()
    return model, torch.randn(batch, tokens, hidden, dtype=dtype)
