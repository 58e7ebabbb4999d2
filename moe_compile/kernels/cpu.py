"""Fast CPU path of the fused MoE op.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots.

Plan (one host sync, no per-call weight copies):
  1. one stable sort of the S flat expert ids -> slots grouped by expert, contiguous segments;
     ``searchsorted`` gives the segment bounds (ids outside [0, E) fall outside every segment);
  2. gather the S' valid slots' token rows once (``index_select``) -> xs [S', H];
  3. per expert with tokens: FC1 GEMM on the expert's own weight (a view of the stacked tensor or
     the model's per-expert tensor), activation fused in place, FC2 GEMM written straight into its
     rows of one output buffer;
  4. routing weight multiply, then one ``index_add_`` into an fp32 [T, H] accumulator.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels import cpu_memory
from moe_compile.kernels.reference import compute_dtype


def gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] for [N, H] t into a fresh buffer (huge pages when large, see cpu_memory)."""
    out = cpu_memory.empty((index.shape[0], t.shape[1]), t.dtype, t.device)
    return torch.index_select(t, 0, index, out=out)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Flat slot order grouped by expert and the host list of E+1 segment bounds."""
    flat = topk_ids.reshape(-1)  # [S]
    sorted_ids, order = torch.sort(flat, stable=True)  # [S], [S]
    edges = torch.arange(num_experts + 1, dtype=sorted_ids.dtype, device=flat.device)
    bounds = torch.searchsorted(sorted_ids, edges).tolist()  # E+1 ints: the only host sync
    return order, bounds


# Segments of at most this many rows are computed as W [out, in] @ x^T [in, n] instead of
# x @ W^T: the same FLOPs and weight reads, but MKL runs the first form faster for skinny x.
# Sweep on the 2-core AVX-512 CI VM, torch 2.13, 2 threads, fp32, W@x^T speed-up over x@W^T
# for [out, in] = [4096, 1024] / [1024, 2048] / [1024, 512]:
#   n=2: 3.7/1.4/1.4x   n=4: 1.7/1.8/1.3x   n=8: 0.9/0.9/0.7x   n=16..64: 1.3-2.2x
#   n=96..256: 1.1-1.7x   n=512..1024: 0.9-1.1x (no clear winner: keep the usual form)
SKINNY_ROWS = 256


def expert_linear(x, weight, transposed: bool, out=None):
    """x [n, in] times the expert's weight as stored -> [n, out] (no copy of the weight)."""
    w_out_in = weight.t() if transposed else weight  # [out, in] view
    if w_out_in.dtype != x.dtype:
        w_out_in = w_out_in.to(x.dtype)
    if out is not None:  # rows of a shared buffer: write in place (a transposed result would need a copy)
        return torch.mm(x, w_out_in.t(), out=out)
    if x.shape[0] <= SKINNY_ROWS:
        return torch.mm(w_out_in, x.t()).t()  # [n, out], a transposed view of [out, n]
    return torch.mm(x, w_out_in.t())


def _fc1(xs, w: ExpertWeights, attrs: FFNAttrs, e: int, save=None):
    """FC1 of expert e -> (gate [n, F], up [n, F] or None): views of one GEMM's output for fused
    layouts, two separate GEMM outputs for separate weights (no concatenation copy).  ``save``
    ([n, F2] rows of the training forward's buffer) receives FC1's output before the activation
    overwrites it, in the layout the backward reads (gate|up halves for "separate")."""
    h = expert_linear(xs, w.fc1_of(e), w.transposed)  # [n, 2F] or [n, F]
    if w.fc1_bias:
        h.add_(w.fc1_bias_of(e).to(h.dtype))
    if attrs.gate_up == "separate":
        up = expert_linear(xs, w.fc1_up_of(e), w.transposed)
        if w.fc1_up_bias:
            up.add_(w.fc1_up_bias_of(e).to(up.dtype))
        if save is not None:
            torch.cat([h, up], dim=1, out=save)
        return h, up
    if save is not None:
        save.copy_(h)
    if attrs.gate_up == "none":
        return h, None
    if attrs.gate_up == "interleaved":
        return h[:, 0::2], h[:, 1::2]
    return h.chunk(2, dim=-1)


def _activate(gate: torch.Tensor, up: torch.Tensor | None, attrs: FFNAttrs) -> torch.Tensor:
    """act(gate) * up -> [n, F], in place in gate's storage where the activation allows it."""
    if up is None:
        return _act_inplace(gate, attrs.activation)
    if attrs.activation == "gptoss":
        gate = gate.clamp(max=attrs.limit)
        up = up.clamp(-attrs.limit, attrs.limit)
        return (up + 1).mul_(gate * torch.sigmoid(gate * attrs.alpha))
    if attrs.limit > 0:
        gate.clamp_(max=attrs.limit)
        up.clamp_(-attrs.limit, attrs.limit)
    return _act_inplace(gate, attrs.activation).mul_(up)


def _act_inplace(h: torch.Tensor, name: str) -> torch.Tensor:
    if name == "silu":
        return F.silu(h, inplace=True)
    if name == "relu":
        return h.relu_()
    if name == "gelu":
        return h.copy_(F.gelu(h))
    if name == "gelu_tanh":
        return h.copy_(F.gelu(h, approximate="tanh"))
    raise ValueError(f"unknown activation {name!r}")


def _expert_segment(xs, g, w: ExpertWeights, attrs: FFNAttrs, e: int, out, save=None) -> None:
    """Run expert e on its rows xs [n, H] with weights g [n, 1]; write [n, H] into out (and FC1's
    output [n, F2] into save, when given)."""
    if attrs.weight_on == "input":
        xs = xs * g
    h = _activate(*_fc1(xs, w, attrs, e, save), attrs)  # [n, F]
    if attrs.weight_on == "between":
        h = h * g
    expert_linear(h, w.fc2_of(e), w.transposed, out=out)  # [n, H]
    if w.fc2_bias:
        out.add_(w.fc2_bias_of(e).to(out.dtype))
    if attrs.weight_on == "output":
        out.mul_(g)


# Decode (a few rows per expert) is bound by reading the experts' weights.  One skinny GEMM reads
# ~13-15 GB/s on the 2-core CI VM whether MKL uses 1 or 2 threads; two experts streamed at once
# from two Python threads (the GIL is released inside the GEMM) read ~19 GB/s (8 x [4096, 1024]
# fp32 weights, torch 2.13).  Prefill segments stay serial: their GEMMs already use every core.
DECODE_MAX_ROWS = 16
_POOLS: dict[int, ThreadPoolExecutor] = {}


def _stream_workers(segments) -> int:
    threads = torch.get_num_threads()
    if threads < 2 or len(segments) < 2 or max(hi - lo for _, lo, hi in segments) > DECODE_MAX_ROWS:
        return 1
    return min(threads, len(segments))


def _pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool per size, created on first use (never at import)."""
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="moe_compile_cpu")
    return _POOLS[workers]


def fused_moe_cpu(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    w: ExpertWeights,
    attrs: FFNAttrs,
    fc1_out: torch.Tensor | None = None,  # [T*K, F2]: the training forward's FC1 output, sorted slots
) -> torch.Tensor:
    """y [T, H].  With ``fc1_out`` (training), FC1's output of the i-th valid slot in expert order
    is written to row i, so the backward reads it instead of recomputing FC1."""
    T, H = x.shape
    K = topk_ids.shape[1]
    acc_dtype = compute_dtype(x.dtype)
    if T == 0 or K == 0:
        return x.new_zeros(T, H)
    order, bounds = sort_by_expert(topk_ids, w.num_experts)
    valid = order[bounds[0] : bounds[-1]]  # [S'] slots with an id in [0, E)
    tokens = valid // K  # [S']
    xs = gather_rows(x, tokens)  # [S', H]
    gs = topk_weights.reshape(-1).index_select(0, valid).to(x.dtype)[:, None]  # [S', 1]
    out = cpu_memory.empty(xs.shape, xs.dtype, xs.device)  # [S', H]
    segments = [(e, bounds[e] - bounds[0], bounds[e + 1] - bounds[0]) for e in range(w.num_experts)]
    segments = [(e, lo, hi) for e, lo, hi in segments if hi > lo]

    inference = torch.is_inference_mode_enabled()

    def run(part):
        # Grad and inference modes are thread-local: a pool thread takes the caller's inference mode
        # (its tensors may be inference tensors) and never records autograd history on the weights
        # (the op's own formula handles gradients; the caller runs below autograd already).
        with torch.inference_mode() if inference else torch.no_grad():
            for e, lo, hi in part:
                save = None if fc1_out is None else fc1_out[lo:hi]
                _expert_segment(xs[lo:hi], gs[lo:hi], w, attrs, e, out[lo:hi], save)

    workers = _stream_workers(segments)
    if workers > 1:  # weight streaming: one expert per core at a time (segments write disjoint rows)
        list(_pool(workers).map(run, [segments[i::workers] for i in range(workers)]))
    else:
        run(segments)
    y = cpu_memory.empty((T, H), acc_dtype, x.device).zero_()
    y.index_add_(0, tokens, out.to(acc_dtype))  # [T, H]: the K contributions of each token summed
    return y.to(x.dtype)
