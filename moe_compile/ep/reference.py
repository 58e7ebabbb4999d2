"""The unfused expert-parallel layer as torchtitan / Megatron write it, in plain torch + gloo.

Shapes:  T tokens, H hidden, E global experts, El local, K top-k, R ranks.

    counts  -> all_to_all_single -> .tolist() split sizes
    tokens  -> permute by expert -> all_to_all_single -> local permute -> per-expert FFN
            -> all_to_all_single back -> unpermute -> weighted sum over K

It is the oracle of the EP tests and the baseline of ``benchmarks/bench_ep.py``; it is what the
graph matcher's ``expert_parallel`` family rewrites.  Weight multiplies on the output.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.reference import expert_fc1, gated_activation


def eager_ep_layer(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, group, num_experts: int):
    R = dist.get_world_size(group)
    el = num_experts // R
    T, H = x.shape
    K = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)  # permutation to expert-major
    counts = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts - 1).long()  # [E]
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [R*El] from each source
    in_splits = counts.view(R, el).sum(1).tolist()
    out_splits = recv_counts.view(R, el).sum(1).tolist()
    send = x[order // K]  # [T*K, H] permuted tokens
    recv = x.new_empty(sum(out_splits), H)
    dist.all_to_all_single(recv, send, out_splits, in_splits, group=group)
    # local permute: rows arrive src-major; sort them expert-major
    local_ids = torch.arange(el).repeat(R).repeat_interleave(recv_counts)  # [N]
    lorder = torch.argsort(local_ids, stable=True)
    xs = recv[lorder]
    per_expert = recv_counts.view(R, el).sum(0).tolist()
    outs = []
    for e, rows in zip(range(el), xs.split(per_expert)):
        h = gated_activation(expert_fc1(w, e, rows, x.dtype), attrs)
        w2 = w.fc2_of(e)
        outs.append(h @ w2 if w.transposed else h @ w2.t())
    out = torch.cat(outs) if outs else xs.new_empty(0, H)
    back = torch.empty_like(out)
    back[lorder] = out  # undo the local permute
    ret = x.new_empty(T * K, H)
    dist.all_to_all_single(ret, back, in_splits, out_splits, group=group)
    y = torch.zeros(T * K, H, dtype=x.dtype)
    y[order] = ret  # unpermute
    return (y.view(T, K, H) * topk_weights[..., None].to(x.dtype)).sum(1)
