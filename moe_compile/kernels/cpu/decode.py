"""Decode-sized and small experts on CPU: every expert's FC as one task of the skinny kernel
(``cpu_skinny``).

Shapes:  x [T, H] read by token index (or xs [n, H] rows already gathered), h [n, F2] FC1's
         output, a [n, F] activations, y [T, H] the combined output; experts = [(e, lo, hi)] row
         ranges of the chunk's sorted slots (``fits``: decode-sized or small experts); tokens [n] int64.

The tasks are built from plain integers (data pointer + row offset), not per-expert tensor views:
with 64 experts the views (weight, rows in, rows out, bias) cost ~0.3 ms a call, a twentieth of
a decode step.
"""

from __future__ import annotations

import struct

import torch

from moe_compile.ir import ExpertWeights, FFNAttrs, is_stacked
from moe_compile.kernels.cpu import skinny as cpu_skinny

_FP32_BYTES = 4


def _role_table(role: tuple, stacked_dim: int):
    """e -> (data pointer, row stride in elements) of expert e's 2-D weight (or 1-D bias; stride 0);
    (0, 0) for every expert when the role is absent."""
    if not role:
        return lambda e: (0, 0)
    if is_stacked(role, stacked_dim):
        base, step, ld = _role_fields(role)
        return lambda e: (base + e * step, ld)
    return lambda e: (role[e].data_ptr(), role[e].stride(0) if stacked_dim == 3 else 0)


# Small experts run here at any row count: the GEMM path (cpu_prepack / cpu_onednn) pays ~120 us
# of fixed cost per expert (three GEMM calls, the row loops, Python), this kernel runs a chunk's
# experts in one call at ~60-80 GFLOP/s.  Op alone, fp32, 2 threads, 2-core CI VM, separate
# gate/up, packed GEMMs / this kernel, ms (MFLOP per expert):
#   E=64 K=6 H=256 F=128: T=64 (1.2) 7.6 / 2.3, T=256 (4.7) 8.9 / 5.2, T=1024 (18.9) 15.5 / 18.0;
#   E=64 K=6 H=512 F=256 T=256 (18.9) 18.6 / 19.4;  E=8 K=2 H=256 F=512 T=256 (50) 4.1 / 6.2.
SMALL_EXPERT_FLOPS = 8e6


def _small_experts(x, w: ExpertWeights, rows: list) -> bool:
    """Whether the touched experts average at most SMALL_EXPERT_FLOPS (FC1 and FC2 together)."""
    flops = 2 * sum(rows) / len(rows) * x.shape[1] * (w.fc1_width() + w.ffn())
    return flops <= SMALL_EXPERT_FLOPS


def fits(x, w: ExpertWeights, bounds: list) -> bool:
    """Whether these experts run here: decode-sized (at most MAX_ROWS rows each) or small
    (SMALL_EXPERT_FLOPS), and x and the weights and biases of the experts with tokens fp32 on
    CPU with contiguous rows and one shape per role (as the model holds them; only touched
    experts are checked)."""
    touched = [e for e in range(len(bounds) - 1) if bounds[e + 1] > bounds[e]]
    if not touched:
        return False
    rows = [bounds[e + 1] - bounds[e] for e in touched]
    if max(rows) > cpu_skinny.MAX_ROWS and not _small_experts(x, w, rows):
        return False
    if not cpu_skinny.fits(x) or not cpu_skinny.available():
        return False
    roles = ((w.fc1, 3), (w.fc1_up, 3), (w.fc2, 3), (w.fc1_bias, 2), (w.fc1_up_bias, 2), (w.fc2_bias, 2))
    for role, stacked_dim in roles:
        tensors = role if is_stacked(role, stacked_dim) else [role[e] for e in touched if role]
        if not all(cpu_skinny.fits(t) and t.shape == tensors[0].shape for t in tensors):
            return False
    return True


def _offset(t, lo: int) -> int:
    """Data pointer of t[lo] for a 1-D contiguous tensor (0 for None)."""
    return t.data_ptr() + lo * t.element_size() if t is not None else 0


def _fc_tasks(weights, biases, x, x_index, y, y_col: int, y_index, scale, experts, transposed: bool, fields: list):
    """Append one task per expert (e, lo, hi): rows lo..hi of x (or x[x_index[lo:hi]]) times W_e^T
    plus b_e, written to y[lo:hi, y_col:] (or, with y_index, scaled by scale[lo:hi] and added to
    y[y_index[lo:hi]])."""
    wt, bt = _role_table(weights, 3), _role_table(biases, 2)
    w0 = weights[0][0] if is_stacked(weights) else weights[0]
    n_out, k = (w0.shape[1], w0.shape[0]) if transposed else (w0.shape[0], w0.shape[1])
    x_ptr, ldx, y_ptr, ldy = x.data_ptr(), x.stride(0), y.data_ptr() + y_col * _FP32_BYTES, y.stride(0)
    for e, lo, hi in experts:
        w_ptr, ldw = wt(e)
        x_rows = x_ptr if x_index is not None else x_ptr + lo * ldx * _FP32_BYTES
        y_rows = y_ptr if y_index is not None else y_ptr + lo * ldy * _FP32_BYTES
        fields += cpu_skinny.task(
            w_ptr, ldw, x_rows, ldx, y_rows, ldy, bt(e)[0], hi - lo, k, n_out, transposed,
            _offset(x_index, lo), _offset(y_index, lo), _offset(scale, lo),
        )


def _fc1_tasks(x, x_index, w: ExpertWeights, experts, h) -> list[int]:
    fields: list[int] = []
    _fc_tasks(w.fc1, w.fc1_bias, x, x_index, h, 0, None, None, experts, w.transposed, fields)
    if w.fc1_up:
        _fc_tasks(w.fc1_up, w.fc1_up_bias, x, x_index, h, h.shape[1] // 2, None, None, experts, w.transposed, fields)
    return fields


def _fc2_tasks(a, w: ExpertWeights, experts, y, tokens, scale) -> list[int]:
    fields: list[int] = []
    _fc_tasks(w.fc2, w.fc2_bias, a, None, y, 0, tokens, scale, experts, w.transposed, fields)
    return fields


def fc1(x, x_index, w: ExpertWeights, experts, h, threads: int) -> None:
    """FC1 of every expert of the chunk into h [n, F2] (gate | up halves when up is separate):
    expert rows are x[x_index[lo:hi]] (x [T, H], x_index the chunk's tokens) or, without an
    index, x[lo:hi] (x the chunk's gathered rows)."""
    cpu_skinny.run(_fc1_tasks(x, x_index, w, experts, h), threads)


def fc2_combine(a, w: ExpertWeights, experts, y, tokens, scale, threads: int) -> None:
    """FC2 of every expert of the chunk, each slot's row added into its token's row of y [T, H]:
    y[tokens[i]] += scale[i] * (W2_e a[i] + b2_e) (scale None: 1).  a [n, F] with contiguous rows;
    tokens [n] int64 and scale [n] fp32 contiguous.  No race: each thread owns a column range."""
    cpu_skinny.run(_fc2_tasks(a, w, experts, y, tokens, scale), threads)


def swiglu_fits(attrs: FFNAttrs) -> bool:
    """Whether ``ffn`` computes this activation: SiLU-gated (clamped or not), gate and up in FC1's
    output (halves or interleaved).  GELU, ReLU, GPT-OSS's and ungated FFNs take fc1 / torch /
    fc2_combine."""
    return attrs.activation == "silu" and attrs.gate_up != "none"


def ffn(x, x_index, w: ExpertWeights, attrs: FFNAttrs, experts, h, a, y, tokens, scale, between, threads: int) -> None:
    """``fc1``, the SwiGLU (``swiglu_fits``) and ``fc2_combine`` in one kernel call: h [n, F2] and
    a [n, F] are the chunk's buffers (contiguous rows), ``between`` [n] fp32 the routing weights
    multiplying a's rows (weight_on "between") or None; the rest as for fc1 and fc2_combine."""
    act = cpu_skinny.swiglu(h.data_ptr(), h.stride(0), a.data_ptr(), a.stride(0), h.shape[0], a.shape[1],
                            attrs.gate_up == "interleaved", _offset(between, 0))
    cpu_skinny.run_ffn(_fc1_tasks(x, x_index, w, experts, h), act, attrs.limit,
                       _fc2_tasks(a, w, experts, y, tokens, scale), threads)


_ROLES = (("fc1", 3), ("fc1_up", 3), ("fc2", 3), ("fc1_bias", 2), ("fc1_up_bias", 2), ("fc2_bias", 2))  # the C order


def one_call_fits(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs) -> bool:
    """Whether ``decode`` runs this call: decode-sized (T <= MAX_ROWS), SiLU-gated (``swiglu_fits``)
    with the routing weight on the output or between, fp32 x and routing weights, contiguous ids,
    every weight role stacked ([E, out, in] / [E, in, out], biases [E, n]) with contiguous rows.
    Per-expert tensors and small experts take ``fits`` / ``ffn`` after the sort in Python."""
    if x.shape[0] > cpu_skinny.MAX_ROWS or not swiglu_fits(attrs) or attrs.weight_on == "input":
        return False
    if topk_ids.dtype not in (torch.int32, torch.int64) or not topk_ids.is_contiguous():
        return False
    if not (cpu_skinny.fits(x) and cpu_skinny.fits(topk_weights) and topk_weights.is_contiguous()):
        return False
    roles = [(getattr(w, name), dim) for name, dim in _ROLES]
    if not all(not role or (is_stacked(role, dim) and cpu_skinny.fits(role[0])) for role, dim in roles):
        return False
    return cpu_skinny.available()


def _role_fields(role) -> list[int]:
    """(base pointer, bytes between experts, row stride in elements; 0 for a bias) of a stacked
    role; zeros if absent."""
    if not role:
        return [0, 0, 0]
    t = role[0]
    return [t.data_ptr(), t.stride(0) * _FP32_BYTES, t.stride(1) if t.dim() == 3 else 0]


def _plan(x, topk_ids, topk_weights, y, roles, num_experts: int, hidden: int, ffn: int, up_separate: bool,
          transposed: bool, interleaved: bool, between: bool) -> bytes:
    """The C file's plan of one decode step (``moe_skinny_decode``), packed as native int64s;
    ``roles``: the six roles in the C order (``_ROLES``), each () or one stacked tensor."""
    T, K = topk_ids.shape
    plan = [
        x.data_ptr(), x.stride(0), topk_ids.data_ptr(), int(topk_ids.dtype == torch.int32),
        topk_weights.data_ptr(), T, K, num_experts, y.data_ptr(), y.stride(0), hidden, ffn,
        int(up_separate), int(transposed), int(interleaved), int(between),
    ]
    for role in roles:
        plan += _role_fields(role)
    return struct.pack(f"{len(plan)}q", *plan)


def decode(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, threads: int):
    """y [T, H] of a decode step (``one_call_fits``) in one call of the skinny kernel, which sorts
    the slots by expert itself: no sort, index tensors or task lists in Python."""
    y = torch.empty_like(x)  # zeroed by the kernel
    roles = [getattr(w, name) for name, _ in _ROLES]
    plan = _plan(x, topk_ids, topk_weights, y, roles, w.num_experts, w.hidden(), w.ffn(), bool(w.fc1_up),
                 w.transposed, attrs.gate_up == "interleaved", attrs.weight_on == "between")
    cpu_skinny.run_decode(plan, attrs.limit, threads)
    return y


# The op's own fast path (``decode_args``): with the caches cold after a step's weights streamed
# through them, parsing the op's arguments into ``ExpertWeights`` / ``FFNAttrs``, the generic
# checks and dispatch cost ~100 us of a ~160 us call at H=64 (2-core EPYC, medians of 100,
# BENCHMARKS.md "fixed cost"); a Mixtral T=1 step streams its weights in ~0.5 ms.
_FAST_GATE_UPS = {"concat": False, "interleaved": True, "separate": False}  # -> interleaved
_FAST_WEIGHT_ON = {"output": False, "between": True}  # -> between


def decode_args(args, threads: int):
    """y [T, H] of a decode step straight from the op's 15 arguments (schema order), or None where
    the call is not the common one this path takes and checks itself: fp32 on CPU, T <= MAX_ROWS,
    SiLU-gated, weight on the output or between, every role one stacked tensor of the shape its
    layout implies, contiguous ids / routing weights.  None sends the call down the general path,
    which checks everything (and raises for bad input): the two give the same bits (``decode``).
    Each tensor is asked for as few attributes as possible: with cold caches each costs ~1 us."""
    x, ids, gates, fc1, fc1_up, fc2, b1, b1_up, b2, gate_up, transposed, activation, limit, _alpha, weight_on = args
    interleaved, between = _FAST_GATE_UPS.get(gate_up), _FAST_WEIGHT_ON.get(weight_on)
    if activation != "silu" or interleaved is None or between is None or not limit >= 0:
        return None
    if len(fc1) != 1 or len(fc2) != 1 or len(fc1_up) != (gate_up == "separate") or len(b1_up) > len(fc1_up):
        return None
    if x.dtype is not _F32 or not x.is_cpu or len(x.shape) != 2:
        return None
    (T, H), x_strides = x.shape, x.stride()
    if not 0 < T <= cpu_skinny.MAX_ROWS or x_strides[1] != 1:
        return None
    if len(ids.shape) != 2 or ids.shape[0] != T or ids.shape[1] == 0 or ids.dtype not in _IDS or not ids.is_cpu:
        return None
    if gates.dtype is not _F32 or gates.shape != ids.shape or not gates.is_cpu or not (ids.is_contiguous() and gates.is_contiguous()):
        return None
    w2 = fc2[0]
    w2_shape = w2.shape
    if len(w2_shape) != 3:
        return None
    E, F = w2_shape[0], w2_shape[1 if transposed else 2]
    n1 = F if fc1_up else 2 * F
    fc1_shape = (E, H, n1) if transposed else (E, n1, H)
    shapes = (fc1_shape, fc1_shape, (E, F, H) if transposed else (E, H, F), (E, n1), (E, F), (E, H))
    plan = [x.data_ptr(), x_strides[0], ids.data_ptr(), int(ids.dtype is torch.int32), gates.data_ptr(), T,
            ids.shape[1], E, 0, H, H, F, int(bool(fc1_up)), int(transposed), int(interleaved), int(between)]
    for role, shape in zip((fc1, fc1_up, fc2, b1, b1_up, b2), shapes):
        if not role:
            plan += (0, 0, 0)
            continue
        t = role[0]
        if len(role) != 1 or t.dtype is not _F32 or not t.is_cpu or t.shape != shape:
            return None
        strides = t.stride()
        if strides[-1] != 1:
            return None
        plan += (t.data_ptr(), strides[0] * _FP32_BYTES, strides[1] if len(shape) == 3 else 0)
    if not cpu_skinny.available():
        return None
    y = x.new_empty((T, H))  # zeroed by the kernel
    plan[8] = y.data_ptr()  # P_Y; P_LDY = H
    cpu_skinny.run_decode(struct.pack(f"{len(plan)}q", *plan), limit, threads)
    return y


_F32 = torch.float32
_IDS = (torch.int64, torch.int32)
