"""Fast CPU path of the fused MoE op.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token, S = T*K slots,
         S' the slots whose id lies in [0, E), F2 = FC1 width (2F gated, F for gate_up "none").

Plan (one host sync, no per-call weight copies):
  0. an inference decode step (T <= cpu_skinny.MAX_ROWS, fp32, SwiGLU, stacked weights) is one
     call of the skinny C kernel that sorts the slots itself (``cpu_decode.decode``); else
  1. one stable sort of the S flat expert ids -> slots grouped by expert, contiguous segments;
     ``searchsorted`` gives the segment bounds (ids outside [0, E) fall outside every segment;
     on the host for S <= HOST_SORT_MAX_SLOTS);
  2. decode (fp32, <= cpu_skinny.MAX_ROWS rows per expert) and small experts
     (``cpu_decode.SMALL_EXPERT_FLOPS``): ``_fused_decode``, the skinny C kernel for all experts
     (FC1, SwiGLU, FC2 in one call where the activation allows), reading x by token and adding
     each slot's weighted FC2 output into y (``cpu_decode``);
  3. prefill, fp32 inference on packed weights (``cpu_prepack``): SwiGLU experts without biases
     (``cpu_experts.fits``) in one call of the fused experts kernel, FC1 + SwiGLU + FC2 + combine
     (``cpu_experts``); the others ``_packed_experts``: oneDNN GEMMs expert by expert from x's
     rows to y's (gather, SwiGLU, combine on ``cpu_rows``' C loops);
  4. large experts on stacked weights without biases that oneDNN does not run (bf16): the S'
     valid slots' token rows gathered once -> xs [S', H], FC1 and FC2 as one native grouped GEMM
     each (``torch._grouped_mm``), the activation once over all rows, the routing weight, one
     ``index_add_`` into an fp32 [T, H] accumulator;
  5. otherwise (the training forward among them) ``_chunked_experts``: consecutive experts a
     chunk (<= CHUNK_ROWS rows) at a time, their rows gathered into the call's workspace (GEMMs
     on oneDNN for fp32, ``expert_linear``):
       FC1   per expert, a GEMM on the expert's own weight (a view of the stacked tensor or the
             model's per-expert tensor) written into the chunk's rows of h [n, F2];
       act   once for the chunk (elementwise work per expert costs more than its arithmetic when
             64 experts get ~64 rows each);
       FC2   per expert, written into its rows of the chunk's output, weighted and added into
             the fp32 [T, H] accumulator with ``index_add_``.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch
import torch.nn.functional as F

from moe_compile.ir import ExpertWeights, FFNAttrs, is_stacked
from moe_compile.kernels.cpu import decode as cpu_decode, experts as cpu_experts, memory as cpu_memory, onednn as cpu_onednn, prepack as cpu_prepack, rows as cpu_rows
from moe_compile.kernels.reference import compute_dtype, gated_activation


def gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] for [N, H] t into a fresh buffer (huge pages when large, see cpu_memory)."""
    out = cpu_memory.empty((index.shape[0], t.shape[1]), t.dtype, t.device)
    return torch.index_select(t, 0, index, out=out)


# Up to this many slots (T*K) the sort runs on the host: one read of the ids and one small tensor
# instead of sort, arange, searchsorted and a read of the bounds, which cost ~70-110 us a decode
# step with the caches cold after the weights streamed through them (fine-grained E=64 K=8 T=4).
HOST_SORT_MAX_SLOTS = 256


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Flat slot order grouped by expert (stable) and the host list of E+1 segment bounds: slots
    bounds[e]..bounds[e+1] of the order have id e; ids < 0 sort before bounds[0], ids >= E after."""
    flat = topk_ids.reshape(-1)  # [S]
    if flat.numel() <= HOST_SORT_MAX_SLOTS:
        return _sort_on_host(flat, num_experts)
    sorted_ids, order = torch.sort(flat, stable=True)  # [S], [S]
    edges = torch.arange(num_experts + 1, dtype=sorted_ids.dtype, device=flat.device)
    bounds = torch.searchsorted(sorted_ids, edges).tolist()  # E+1 ints: the only host sync
    return order, bounds


def _sort_on_host(flat: torch.Tensor, num_experts: int):
    ids = flat.tolist()  # the only host sync, as on the device path
    order = sorted(range(len(ids)), key=ids.__getitem__)  # Python's sort is stable
    sorted_ids = [ids[i] for i in order]
    bounds = [bisect.bisect_left(sorted_ids, e) for e in range(num_experts + 1)]
    return torch.tensor(order, dtype=torch.int64, device=flat.device), bounds


# Segments of at most this many rows are computed as W [out, in] @ x^T [in, n] instead of
# x @ W^T: the same FLOPs and weight reads, but MKL runs the first form faster for skinny x.
# Sweep on the 2-core AVX-512 CI VM, torch 2.13, 2 threads, fp32, W@x^T speed-up over x@W^T
# for [out, in] = [4096, 1024] / [1024, 2048] / [1024, 512]:
#   n=2: 3.7/1.4/1.4x   n=4: 1.7/1.8/1.3x   n=8: 0.9/0.9/0.7x   n=16..64: 1.3-2.2x
#   n=96..256: 1.1-1.7x   n=512..1024: 0.9-1.1x (no clear winner: keep the usual form)
SKINNY_ROWS = 256


def expert_linear(x, weight, transposed: bool, out=None):
    """x [n, in] times the expert's weight as stored -> [n, out] (no copy of the weight): oneDNN
    for fp32 (``cpu_onednn``: 10-25% faster than either MKL form below at every size measured),
    MKL otherwise."""
    w_out_in = weight.t() if transposed else weight  # [out, in] view
    if w_out_in.dtype != x.dtype:
        w_out_in = w_out_in.to(x.dtype)
    if cpu_onednn.fits(x, w_out_in):
        y = cpu_onednn.linear(x, w_out_in)
        return y if out is None else out.copy_(y)
    if x.shape[0] > SKINNY_ROWS:
        return torch.mm(x, w_out_in.t(), out=out)
    y = torch.mm(w_out_in, x.t()).t()  # [n, out], a transposed view of [out, n]
    # Into a shared buffer's rows: the copy costs less than the slower GEMM form (n=64..128, E=8..64,
    # weights not in cache: 25-35 ms either way for FC2 over all experts, skinny + copy never slower).
    return y if out is None else out.copy_(y)


def _fc1_into(xs, w: ExpertWeights, e: int, h) -> None:
    """FC1 of expert e on its rows xs [n, H], written into h [n, F2] (gate|up halves when the up
    projection is a separate weight, the layout the backward reads from the training buffer)."""
    first = h[:, : h.shape[1] // 2] if w.fc1_up else h
    expert_linear(xs, w.fc1_of(e), w.transposed, out=first)
    if w.fc1_bias:
        first.add_(w.fc1_bias_of(e).to(h.dtype))
    if w.fc1_up:
        up = h[:, h.shape[1] // 2 :]
        expert_linear(xs, w.fc1_up_of(e), w.transposed, out=up)
        if w.fc1_up_bias:
            up.add_(w.fc1_up_bias_of(e).to(h.dtype))


def _gate_up(h: torch.Tensor, attrs: FFNAttrs):
    """(gate [n, F], up [n, F] or None): views of FC1's output h [n, F2] in its layout."""
    if attrs.gate_up == "none":
        return h, None
    if attrs.gate_up == "interleaved":
        return h[:, 0::2], h[:, 1::2]
    half = h.shape[1] // 2
    return h[:, :half], h[:, half:]  # slices: chunk() costs ~20 us a call (split, narrow), 64 a forward


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


def _fc2_into(a, w: ExpertWeights, e: int, out) -> None:
    """FC2 of expert e on its rows a [n, F] written into out [n, H], with its bias."""
    expert_linear(a, w.fc2_of(e), w.transposed, out=out)
    if w.fc2_bias:
        out.add_(w.fc2_bias_of(e).to(out.dtype))


# Rows per chunk of consecutive experts (prefill): the chunk's [n, F2] and [n, F] temporaries stay
# a few MiB whatever T is.
CHUNK_ROWS = 512
# Decode: every expert has <= cpu_skinny.MAX_ROWS rows, so one chunk of this many covers a decode
# step (one kernel call per FC) up to T = 512 at K = 8.
DECODE_CHUNK_ROWS = 4096


def expert_chunks(bounds: list, base: int, max_rows: int) -> list:
    """[(lo, hi, experts)]: row ranges [lo, hi) (relative to ``base``) of consecutive experts with
    tokens, grouped while their rows fit in ``max_rows`` (a larger expert is a chunk of its own);
    ``experts`` = [(e, lo, hi)] with rows relative to the chunk."""
    chunks, group = [], []

    def close():
        lo, hi = group[0][1], group[-1][2]
        chunks.append((lo, hi, [(e, a - lo, b - lo) for e, a, b in group]))

    for e in range(len(bounds) - 1):
        lo, hi = bounds[e] - base, bounds[e + 1] - base
        if hi == lo:
            continue
        if group and hi - group[0][1] > max_rows:
            close()
            group = []
        group.append((e, lo, hi))
    if group:
        close()
    return chunks


def chunk_workspace(chunks: list, dtype: torch.dtype, device) -> cpu_memory.Workspace:
    """The scratch buffers of one call, sized for its largest chunk (``expert_chunks``)."""
    return cpu_memory.Workspace(max((hi - lo for lo, hi, _ in chunks), default=0), dtype, device)


def segment_rows(bounds: list) -> list:
    """Row counts of the experts with tokens, from the sort's segment bounds."""
    return [hi - lo for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


# Prefill on weights that are not packed (cpu_prepack: the first call, the training forward, bf16)
# and not on oneDNN either (bf16, or MOE_COMPILE_ONEDNN=0): large experts on stacked weights without
# biases run each FC as one call of torch's native grouped GEMM (``torch._grouped_mm``, the kernel
# HF transformers' grouped_mm experts call on CPU): faster than per-expert MKL GEMMs from Python at
# E=8, F=2048 (fp32, torch 2.13, 2-core CI VM, medians of 5: T=512 97 vs 142 ms, T=2048 338 vs
# 337 ms), slower than per-expert oneDNN GEMMs (T=512 127 vs 85 ms, T=2048 428 vs 293 ms).  Small
# experts run faster chunked (E=64, F=512, MKL: T=512 146 vs 171 ms); the cut is on the largest
# expert's FC1 output, [rows, F2] elements.
GROUPED_MIN_FC1_ELEMENTS = 384 * 1024
_GROUPED_DTYPES = (torch.float32, torch.bfloat16)


def grouped_gemm_fits(x, w: ExpertWeights, rows: list) -> bool:
    """Whether ``_grouped_experts`` runs these experts: one stacked tensor per role, no biases,
    weights in x's dtype, large experts (GROUPED_MIN_FC1_ELEMENTS), and no oneDNN for them."""
    roles = (w.fc1, w.fc2, *((w.fc1_up,) if w.fc1_up else ()))
    stacked = all(is_stacked(role) and role[0].dtype == x.dtype for role in roles)
    return (
        hasattr(torch, "_grouped_mm") and x.device.type == "cpu" and stacked
        and not (w.fc1_bias or w.fc1_up_bias or w.fc2_bias) and x.dtype in _GROUPED_DTYPES
        and max(rows, default=0) * w.fc1_width() > GROUPED_MIN_FC1_ELEMENTS
        and not cpu_onednn.fits(x, w.fc1[0])
    )


def _grouped_experts(xin, g, w: ExpertWeights, attrs: FFNAttrs, bounds: list, base: int):
    """All experts' FFN over the sorted rows xin [S', H] by two grouped GEMMs -> [S', H]."""
    offs = torch.tensor(bounds[1:], dtype=torch.int32) - base  # [E]: each expert's end row

    def grouped(rows, stacked):  # stacked [E, out, in] (or [E, in, out] when transposed)
        return torch._grouped_mm(rows, stacked if w.transposed else stacked.transpose(-2, -1), offs=offs)

    h = grouped(xin, w.fc1[0])  # [S', F2], or the gate [S', F] when up is a separate weight
    if w.fc1_up:
        a = _activate(h, grouped(xin, w.fc1_up[0]), attrs)  # [S', F]
    else:
        a = _activate(*_gate_up(h, attrs), attrs)  # [S', F]
    if attrs.weight_on == "between":
        a = a * g
    return grouped(a.contiguous(), w.fc2[0])  # [S', H]; interleaved: a is a strided view of h


def _packed_experts(x, tokens, g, w: ExpertWeights, packed: cpu_prepack.PackedExperts, attrs: FFNAttrs, bounds):
    """y [T, H]: every expert's FFN on its packed weights, expert by expert, straight from x's rows
    to y's.  Nothing is [S', H]-sized: buffers that large are fresh pages every call (glibc trims
    them back to the kernel), and faulting in two of them took ~30 ms of a ~110 ms call at the
    fine-grained shape, T=512 (2-core CI VM).  Each expert's rows stay in cache between steps.
    The row work between the GEMMs runs on ``cpu_rows``' C loops where they apply."""
    y = torch.zeros_like(x)  # [T, H]
    base = bounds[0]
    # g scales FC2's input where that equals scaling its output (no FC2 bias): [n, F] < [n, H].
    scale_a = attrs.weight_on == "between" or (attrs.weight_on == "output" and not w.fc2_bias)
    scale_out = attrs.weight_on == "output" and not scale_a
    rows = _slot_rows(x, y, tokens, g)
    # The C loops write each expert's gathered rows and activation into buffers reused expert after
    # expert (two allocations fewer per expert: ~0.5 ms of a fine-grained T=512 call).
    ws = cpu_memory.Workspace(max(segment_rows(bounds), default=0), x.dtype, x.device) if rows is not None else None
    experts = [(e, bounds[e] - base, bounds[e + 1] - base) for e in range(len(bounds) - 1) if bounds[e + 1] > bounds[e]]
    gathered = attrs.weight_on == "input"
    xe = _gather_expert(rows, x, tokens, g, experts[0][1], experts[0][2], gathered, ws) if experts else None
    done = None  # (lo, hi, FC2 output) of the previous expert, added into y by the next row step
    step = _RowStep(rows, ws, x, y, tokens, g, attrs, scale_a, scale_out)
    for i, (e, lo, hi) in enumerate(experts):
        h = cpu_onednn.linear(xe, packed.fc1[e], w.fc1_bias_of(e))  # [n, F2], or the gate [n, F]
        if packed.fc1_up is not None:
            gate, up = h, cpu_onednn.linear(xe, packed.fc1_up[e], w.fc1_up_bias_of(e))
        else:
            gate, up = _gate_up(h, attrs)
        a, xe = step.run(done, (lo, hi, gate, up), experts[i + 1] if i + 1 < len(experts) else None)  # [n, F]
        done = (lo, hi, cpu_onednn.linear(a, packed.fc2[e], w.fc2_bias_of(e)))  # [n, H]
    if done is not None:
        _combine_expert(rows, y, done[2], tokens, g, done[0], done[1], scale_out)
    return y


@dataclasses.dataclass(frozen=True)
class _RowStep:
    """The row work between one expert's GEMMs in ``_packed_experts``: the previous expert's combine
    into y, this expert's activation, the next expert's gathered rows (FC1 has read the current
    ones).  One call of the C loops (``cpu_rows.SlotRows.step``) where the SwiGLU runs there: one
    OpenMP region instead of three, ~1-2 ms of a fine-grained T=512 call with 64 experts."""

    rows: cpu_rows.SlotRows | None
    ws: cpu_memory.Workspace | None
    x: torch.Tensor
    y: torch.Tensor
    tokens: torch.Tensor
    g: torch.Tensor
    attrs: FFNAttrs
    scale_a: bool
    scale_out: bool

    def run(self, done, current, following):
        """(a [n, F], the following expert's gathered rows or None).  ``done``: (lo, hi, FC2 output)
        or None; ``current``: (lo, hi, gate, up) of FC1's output; ``following``: (e, lo, hi) or None."""
        lo, hi, gate, up = current
        gathered = self.attrs.weight_on == "input"
        if self.rows is None or not _c_swiglu(self.attrs, gate, up):
            if done is not None:
                _combine_expert(self.rows, self.y, done[2], self.tokens, self.g, done[0], done[1], self.scale_out)
            a = _expert_activation(gate, up, self.g, lo, hi, self.attrs, self.scale_a)
            xe = (_gather_expert(self.rows, self.x, self.tokens, self.g, following[1], following[2], gathered, self.ws)
                  if following is not None else None)
            return a, xe
        rows, a = self.rows, self.ws.take("a", hi - lo, gate.shape[1])
        xe = self.ws.take("xs", following[2] - following[1], self.x.shape[1]) if following is not None else None
        rows.step(add=rows.add_fields(done[0], done[1], done[2], self.scale_out) if done is not None else None,
                  swiglu=rows.swiglu_fields(lo, hi, gate, up, a, self.scale_a),
                  gather=rows.gather_fields(following[1], following[2], xe, gathered) if xe is not None else None)
        return a, xe


def _slot_rows(x, y, tokens, g) -> cpu_rows.SlotRows | None:
    """The C row loops for this call, or None where they do not apply (the loop uses torch's ops)."""
    if x.dtype != torch.float32 or x.stride(-1) != 1 or not cpu_rows.available():
        return None
    return cpu_rows.SlotRows(x, y, tokens, g.reshape(-1), torch.get_num_threads())


def _gather_expert(rows, x, tokens, g, lo: int, hi: int, scaled: bool, ws=None):
    """x's rows of slots [lo, hi) -> [n, H] (times g for weight_on "input"): the workspace's "xs"
    rows on the C loops, fresh otherwise."""
    if rows is not None:
        return rows.gather(lo, hi, ws.take("xs", hi - lo, x.shape[1]), scaled)
    xe = x.index_select(0, tokens[lo:hi])
    return xe.mul_(g[lo:hi]) if scaled else xe


def _c_swiglu(attrs: FFNAttrs, gate, up) -> bool:
    """Whether the C loops compute this activation: SwiGLU, unclamped, on contiguous halves."""
    return attrs.activation == "silu" and attrs.limit == 0 and up is not None and gate.stride(-1) == 1


def _expert_activation(gate, up, g, lo: int, hi: int, attrs: FFNAttrs, scaled: bool):
    """act(gate) * up [n, F] of one expert's FC1 output (times g when ``scaled``) on torch's ops, in
    place in the expert's own fresh FC1 output: what the C loops do not compute (``_c_swiglu``)."""
    a = _activate(gate, up, attrs)
    return a.mul_(g[lo:hi]) if scaled else a


def _combine_expert(rows, y, ye, tokens, g, lo: int, hi: int, scaled: bool) -> None:
    """y[token] += ye's row of each slot in [lo, hi) (times g for weight_on "output" with a bias)."""
    if rows is not None:
        rows.add(lo, hi, ye, scaled)
        return
    if scaled:
        ye.mul_(g[lo:hi])
    y.index_add_(0, tokens[lo:hi], ye)


def _run_chunk(xin, g, w: ExpertWeights, attrs: FFNAttrs, experts, out, h, ws, keep_h: bool):
    """Rows of one chunk: xin [n, H] (already scaled for weight_on "input"), g [n, 1]; FC1 into
    h [n, F2], activation, FC2 into out [n, H].  ``keep_h``: h is the training forward's saved
    FC1 output and must not be overwritten by the activation (it goes to ``ws`` instead)."""
    for e, lo, hi in experts:
        _fc1_into(xin[lo:hi], w, e, h[lo:hi])
    a = _chunk_activation(h, g, attrs, ws if keep_h else None)  # [n, F]
    for e, lo, hi in experts:
        _fc2_into(a[lo:hi], w, e, out[lo:hi])


def _chunk_activation(h, g, attrs: FFNAttrs, ws=None):
    """act(gate) * up of a chunk's FC1 output h [n, F2] -> [n, F] (times g [n, 1] for "between"):
    in h's own storage, or, with a workspace (h must be kept), in its buffer "a"."""
    a = activation_into(h, attrs, ws) if ws is not None else _activate(*_gate_up(h, attrs), attrs)
    return a * g if attrs.weight_on == "between" else a


def activation_into(h, attrs: FFNAttrs, ws: cpu_memory.Workspace):
    """act(gate) * up [n, F] of h [n, F2], h left as it is; SwiGLU into the workspace buffer "a"
    (F.silu's own kernel: the same bits as the in-place forward), other activations fresh."""
    if attrs.gate_up == "none" or attrs.activation != "silu" or attrs.limit > 0:
        return gated_activation(h, attrs)
    gate, up = _gate_up(h, attrs)
    a = ws.take("a", gate.shape[0], gate.shape[1]).copy_(gate)
    return F.silu(a, inplace=True).mul_(up)


def _fused_decode(x, tokens, gs, w: ExpertWeights, attrs: FFNAttrs, bounds: list, fc1_out):
    """Decode-sized experts on the skinny kernel (``cpu_decode``) -> y [T, H] (x's dtype, fp32).
    FC1 reads x's rows by token (no gathered copy unless weight_on is "input"), FC2 adds each
    slot's weighted output into its token's row of y: no [S', H] buffer, weighting or index_add
    (each a torch call costing ~30-50 us with the caches cold after streaming the weights)."""
    threads = torch.get_num_threads()
    gathered = attrs.weight_on == "input"
    xin = gather_rows(x, tokens).mul_(gs) if gathered else x
    scale = gs.reshape(-1) if attrs.weight_on == "output" else None  # [S']
    y = torch.zeros_like(x)  # [T, H]
    chunks = expert_chunks(bounds, bounds[0], DECODE_CHUNK_ROWS)
    ws = chunk_workspace(chunks, x.dtype, x.device)
    one_call = fc1_out is None and cpu_decode.swiglu_fits(attrs)  # inference: FC1, SwiGLU, FC2 in one call
    for lo, hi, rel in chunks:
        h = fc1_out[lo:hi] if fc1_out is not None else ws.take("h", hi - lo, w.fc1_width())
        x_rows, x_index = (xin[lo:hi], None) if gathered else (x, tokens[lo:hi])
        if one_call:
            a = ws.take("a", hi - lo, w.ffn())
            between = gs[lo:hi].reshape(-1) if attrs.weight_on == "between" else None
            cpu_decode.ffn(x_rows, x_index, w, attrs, rel, h, a, y, tokens[lo:hi],
                           scale[lo:hi] if scale is not None else None, between, threads)
        else:
            cpu_decode.fc1(x_rows, x_index, w, rel, h, threads)
            a = _chunk_activation(h, gs[lo:hi], attrs, ws if fc1_out is not None else None)
            a = a if a.stride(-1) == 1 else a.contiguous()  # interleaved gate/up: strided views
            cpu_decode.fc2_combine(a, w, rel, y, tokens[lo:hi], scale[lo:hi] if scale is not None else None,
                                   threads)
    return y


def fused_moe_cpu(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    w: ExpertWeights,
    attrs: FFNAttrs,
    fc1_out: torch.Tensor | None = None,  # [T*K, F2]: the training forward's FC1 output, sorted slots
    inference: bool = False,  # no backward will train these weights: pack them at first sight
) -> torch.Tensor:
    """y [T, H].  With ``fc1_out`` (training), FC1's output of the i-th valid slot in expert order
    is written to row i, so the backward reads it instead of recomputing FC1."""
    T, H = x.shape
    K = topk_ids.shape[1]
    acc_dtype = compute_dtype(x.dtype)
    if T == 0 or K == 0:
        return x.new_zeros(T, H)
    if fc1_out is None and cpu_decode.one_call_fits(x, topk_ids, topk_weights, w, attrs):
        return cpu_decode.decode(x, topk_ids, topk_weights, w, attrs, torch.get_num_threads())
    order, bounds = sort_by_expert(topk_ids, w.num_experts)
    base = bounds[0]
    valid = order[base : bounds[-1]]  # [S'] slots with an id in [0, E)
    tokens = valid // K  # [S']
    gs = topk_weights.reshape(-1).index_select(0, valid).to(x.dtype)[:, None]  # [S', 1]
    if cpu_decode.fits(x, w, bounds):
        return _fused_decode(x, tokens, gs, w, attrs, bounds, fc1_out)
    packed = cpu_prepack.lookup(x, w, attrs, first_sight=inference) if fc1_out is None else None
    if packed is not None and packed.fused:
        return cpu_experts.run(x, tokens, gs, packed, w, attrs, bounds, torch.get_num_threads())
    if packed is not None:
        return _packed_experts(x, tokens, gs, w, packed, attrs, bounds)
    if fc1_out is not None or not grouped_gemm_fits(x, w, segment_rows(bounds)):
        return _chunked_experts(x, tokens, gs, w, attrs, bounds, fc1_out)
    xs = gather_rows(x, tokens)  # [S', H]
    if attrs.weight_on == "input":
        xs.mul_(gs)
    out = _grouped_experts(xs, gs, w, attrs, bounds, base)  # [S', H]
    if attrs.weight_on == "output":
        out.mul_(gs)
    y = cpu_memory.empty((T, H), acc_dtype, x.device).zero_()
    y.index_add_(0, tokens, out.to(acc_dtype))  # [T, H]: the K contributions of each token summed
    return y.to(x.dtype)


def _chunked_experts(x, tokens, gs, w: ExpertWeights, attrs: FFNAttrs, bounds: list, fc1_out):
    """y [T, H] a chunk of sorted rows at a time: gathered from x, through the chunk's experts
    and added into y, in the call's workspace.  No [S', H] buffer: two of them (the gathered rows
    and the FFN output) were the training forward's largest temporaries, 128 MiB at the
    fine-grained shape, T=2048, and they set the step's peak once the stacked gradients'
    memory is kept between steps (``cpu_grad_cache``)."""
    T, H = x.shape
    acc_dtype = compute_dtype(x.dtype)
    y = torch.zeros(T, H, dtype=acc_dtype, device=x.device)
    chunks = expert_chunks(bounds, bounds[0], CHUNK_ROWS)
    ws = chunk_workspace(chunks, x.dtype, x.device)
    for lo, hi, rel in chunks:
        n, g = hi - lo, gs[lo:hi]
        xs = torch.index_select(x, 0, tokens[lo:hi], out=ws.take("xs", n, H))  # [n, H]
        if attrs.weight_on == "input":
            xs.mul_(g)
        h = fc1_out[lo:hi] if fc1_out is not None else ws.take("h", n, w.fc1_width())
        out = ws.take("out", n, H)
        _run_chunk(xs, g, w, attrs, rel, out, h, ws, fc1_out is not None)
        if attrs.weight_on == "output":
            out.mul_(g)
        y.index_add_(0, tokens[lo:hi], out.to(acc_dtype))  # the K contributions of each token summed
    return y.to(x.dtype)
