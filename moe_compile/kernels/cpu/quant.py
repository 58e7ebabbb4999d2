"""Quantized CPU path of the fused MoE op (``fused_moe_quant``): pack once, pick the kernel, and
for ``quant="auto"`` measure and choose.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

* Packing: each layer's experts are packed into canonical ``QuantWeight``s (``moe_compile.quant``)
  once per (tensors, version); a weight updated in place (its version changes) is packed again.
  Packs hold quantized bytes only — the op never keeps a full-precision copy of the experts (a
  layer that runs quantized has its fp32 prefill packs, ``kernels/cpu/prepack.py``, dropped).
  ``moe_compile.empty_cache()`` frees them all (``clear``); ``stats`` reports their bytes.
* Kernels: a call of T <= ``DECODE_ROWS`` rows is a decode step, served by ``qdecode`` (weight-only
  formats streamed and dequantized in registers) or else by ``qgemm``; larger calls are prefill,
  served by ``qgemm`` (int8 tiles for a8 formats, a panel dequantized at a time for the others).
  A format is native here when one of those modules runs it on this CPU for this layer's shape.
* ``quant="auto"`` decides once per (layer shape, regime, budget, device): on the first call of a
  regime (decode / prefill) of the first layer of a shape, every native format and the unquantized
  op run on the call's own inputs — once to pack and give the output whose SQNR against the
  unquantized op's is recorded, then ``TIMING_RUNS[regime]`` timed rounds interleaved across the
  candidates (the starting one rotating), each candidate's time its median over rounds relative to
  each round's level (``time_interleaved``) — and
  ``quant.selection.choose`` keeps the fastest within the budget unless a more accurate one is within
  5% of it.  That decision (``_DECISIONS``) is shared by every later layer of the same shape in any
  graph of this process, recompiles included: such a layer only checks the chosen format's SQNR on
  its own first call (and runs the unquantized op if its weights miss the budget).  Decode and
  prefill may run different formats: the op switches by T alone.  ``moe_compile.empty_cache()``
  forgets the decisions.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import statistics
import time
import weakref

import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.quant import selection
from moe_compile.quant.common import FORMATS, QuantRefusal, QuantWeight, check_group
from moe_compile.quant.formats import default_group
from moe_compile.quant.int8 import sqnr_db
from moe_compile.quant.layout import pack_moe, refusal

DECODE_ROWS = 16  # qdecode's MAX_ROWS: the decode kernel's largest call
# auto: timed rounds per candidate, interleaved (after one untimed call that packs).  Decode calls
# cost ~0.1-1 ms, so more rounds are cheap; on a loaded 2-core VM (load 11) a best of 3 run one
# candidate after another varied 3-5x between candidates of equal bytes, which interleaving and
# the median (a spike lands on one round of every candidate alike) remove.
TIMING_RUNS = {"decode": 9, "prefill": 3}
# Kernel modules per regime, in order of preference (the issue-17 kernel engineers' modules).
KERNELS = {"decode": ("qdecode", "qgemm"), "prefill": ("qgemm",)}


def regime(T: int) -> str:
    return "decode" if T <= DECODE_ROWS else "prefill"


def _kernel_module(name: str):
    """``kernels/cpu/<name>.py`` (or the module a dotted name gives), or why it cannot be imported."""
    try:
        return importlib.import_module(name if "." in name else f"moe_compile.kernels.cpu.{name}"), None
    except ImportError as exc:
        return None, f"kernels/cpu/{name}.py is not available ({exc})"


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The canonical logical shape of one role, what a kernel's ``check_call`` reads."""

    fmt: str
    shape: tuple
    group: int


def _shape_refusal(mod, fmt: str, E: int, H: int, F: int) -> str | None:
    """Why ``mod`` cannot run this layer's shape in ``fmt`` (its own check), or None."""
    check = getattr(mod, "check_call", None)
    if check is None:
        return None
    w1 = _Shape(fmt, (E, 2 * F, H), default_group(fmt, H))
    w2 = _Shape(fmt, (E, H, F), default_group(fmt, F))
    try:
        check(torch.empty(0, H), w1, w2, FFNAttrs())
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def kernel_for(fmt: str, reg: str, E: int, H: int, F: int):
    """(module, None) of the kernel that runs ``fmt`` natively in regime ``reg``, or (None, why not).
    Asked once per (format, regime, shape, kernel list): the kernels' availability is settled on
    first use, and the checks cost ~15 us a call, a tenth of a 4-bit decode step's roof."""
    key = (fmt, reg, E, H, F, KERNELS[reg])
    if key not in _KERNEL_FOR:
        _KERNEL_FOR[key] = _find_kernel(fmt, reg, E, H, F)
    return _KERNEL_FOR[key]


_KERNEL_FOR: dict = {}


def _find_kernel(fmt: str, reg: str, E: int, H: int, F: int):
    reasons = []
    try:
        check_group(H, default_group(fmt, H), fmt)
        check_group(F, default_group(fmt, F), fmt)
    except QuantRefusal as exc:
        return None, str(exc)
    for name in KERNELS[reg]:
        mod, why = _kernel_module(name)
        why = why or mod.unavailable_reason(fmt) or _shape_refusal(mod, fmt, E, H, F)
        if why is None:
            return mod, None
        reasons.append(f"{name}: {why}")
    return None, "; ".join(reasons)


def native_formats(E: int, H: int, F: int) -> dict:
    """{fmt: {regime: kernel name or None}} for every format, and {fmt: reason} of those not native."""
    native, refused = {}, {}
    for fmt in FORMATS:
        found = {}
        for reg in KERNELS:
            mod, why = kernel_for(fmt, reg, E, H, F)
            found[reg] = mod.__name__.rsplit(".", 1)[-1] if mod else None
            if mod is None:
                refused.setdefault(fmt, f"{reg}: {why}")
        if any(found.values()):
            native[fmt] = found
    return native, refused


def check_explicit(fmt: str, E: int, H: int, F: int) -> None:
    """An explicit variant must run natively on this CPU (both regimes): else a ValueError naming
    the variants that do.  Never a silent fallback."""
    native, refused = native_formats(E, H, F)
    if fmt in native and all(native[fmt].values()):
        return
    runs = [f for f, regs in native.items() if all(regs.values())]
    raise ValueError(
        f"moe_compile quant={fmt!r}: this CPU has no native kernel for it at H={H}, F={F} "
        f"({refused.get(fmt) or 'one regime lacks a kernel'}); variants it runs: {runs or 'none'} "
        f"(or quant='auto' / 'none')"
    )


# ---- packs: one per (layer tensors, version, format) ----


@dataclasses.dataclass
class _LayerPack:
    refs: tuple  # weakrefs to the model's tensors the pack was made from
    versions: tuple
    w1: QuantWeight
    w2: QuantWeight
    kernel_cache: dict  # the kernels' own repacked tiles (``pack_cache`` of their ``run``)

    def nbytes(self) -> int:
        tiles = sum(int(getattr(v, "nbytes", 0)) for v in self.kernel_cache.values())
        return self.w1.nbytes + self.w2.nbytes + tiles


_PACKS: dict = {}  # (fmt, data pointers) -> _LayerPack


def _tensors(w: ExpertWeights) -> list:
    return [*w.fc1, *w.fc1_up, *w.fc2]


def _versions(ts) -> tuple:
    return tuple(t._version for t in ts)


def layer_pack(w: ExpertWeights, attrs: FFNAttrs, fmt: str) -> _LayerPack:
    """The layer's packs in ``fmt``, made on first use and again after an in-place update."""
    ts = _tensors(w)
    key = (fmt, tuple(t.data_ptr() for t in ts))
    found = _PACKS.get(key)
    if found is not None and all(r() is t for r, t in zip(found.refs, ts)) and found.versions == _versions(ts):
        return found
    with torch.no_grad():
        w1, w2 = pack_moe(fmt, w, attrs)
    found = _LayerPack(tuple(weakref.ref(t) for t in ts), _versions(ts), w1, w2, {})
    _PACKS[key] = found
    return found


def stats() -> dict:
    """Bytes of every quantized pack held (canonical tensors and the kernels' tiles), and layers."""
    return {"bytes": sum(p.nbytes() for p in _PACKS.values()), "packs": len(_PACKS)}


def clear() -> None:
    """Drop every pack and every auto choice (``moe_compile.empty_cache()``); rebuilt on next use."""
    from moe_compile.kernels.cpu import decode_op

    _PACKS.clear()
    _CHOICES.clear()
    _DECISIONS.clear()
    _REGISTERED.clear()
    _KERNEL_FOR.clear()
    decode_op.forget_quant_layers()


def _drop_fp32_packs(w: ExpertWeights) -> None:
    """A layer that runs quantized keeps no fp32 prefill packs (auto's timing of the unquantized
    op may have made them)."""
    from moe_compile.kernels.cpu import prepack as cpu_prepack

    cpu_prepack._forget(_tensors(w))


# ---- the op ----


def _run_format(fmt, reg, x, ids, weights, w, attrs):
    """(y in x's dtype, the layer's pack, the kernel module that ran it)."""
    E, H, F = w.num_experts, w.hidden(), w.ffn()
    mod, why = kernel_for(fmt, reg, E, H, F)
    if mod is None:
        raise ValueError(f"moe_compile quant={fmt!r}: no native kernel for the {reg} regime (T={x.shape[0]}): {why}")
    p = layer_pack(w, attrs, fmt)
    y = mod.run(x.float().contiguous(), ids.long().contiguous(), weights.float().contiguous(), p.w1, p.w2, attrs,
                p.kernel_cache)
    return y.to(x.dtype), p, mod


def _unquantized(x, ids, weights, w, attrs) -> torch.Tensor:
    from moe_compile.kernels.cpu.forward import fused_moe_cpu

    return fused_moe_cpu(x, ids, weights, w, attrs)


_CHOICES: dict = {}  # (tag, regime, data pointers, versions) -> the format this layer runs, or "none"
_DECISIONS: dict = {}  # decision_key(...) -> the Selection measured on the first layer of that shape


def run(x, ids, weights, w: ExpertWeights, attrs: FFNAttrs, quant: str, accuracy_db: float, tag: str) -> torch.Tensor:
    """y [T, H] in x's dtype: the op in format ``quant`` (or auto's choice for this call's regime)."""
    reason = refusal(w, attrs)
    if reason:  # the passes refuse these; a direct call gets the same answer
        raise ValueError(f"fused_moe_quant: {reason}")
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    reg = regime(x.shape[0])
    fmt = quant if quant != "auto" else _auto_choice(x, ids, weights, w, attrs, accuracy_db, tag, reg)
    if fmt == "none":
        return _unquantized(x, ids, weights, w, attrs)
    y, pack, mod = _run_format(fmt, reg, x, ids, weights, w, attrs)
    if quant != "auto":
        selection.note_packed(tag, pack.nbytes())
    if reg == "decode":
        _register_decode(tag, quant, accuracy_db, mod, pack, w, attrs)
    return y


_REGISTERED: dict = {}  # (tag, quant, accuracy_db) -> the _LayerPack handed to decode_op.cpp


def _register_decode(tag: str, quant: str, accuracy_db: float, mod, p: _LayerPack, w: ExpertWeights,
                     attrs: FFNAttrs) -> None:
    """Hand this layer's packs ``p`` to the C++ kernel (``decode_op``) once they served a decode call
    in ``mod`` = qdecode, so its next decode calls skip Python.  Per-expert weight lists and biases
    stay here."""
    from moe_compile.kernels.cpu import decode_op, qdecode

    if mod is not qdecode or w.fc1_bias or w.fc1_up_bias or w.fc2_bias:
        return
    if len(w.fc1) != 1 or len(w.fc2) != 1 or len(w.fc1_up) > 1:
        return
    E, H, F = w.num_experts, w.hidden(), w.ffn()
    key = (tag, quant, accuracy_db)
    if _REGISTERED.get(key) is p:
        return
    isa = qdecode.best_isa()
    panels = [qdecode.expert_rows16(q, p.kernel_cache) for q in (p.w1, p.w2)]
    packs = [t for q in (p.w1, p.w2) for t in (q.data, q.scale) if t is not None]
    packs += [t for r16 in panels if r16 is not None for t in r16]
    fields = qdecode.role_fields(p.w1, 2 * F, H) + qdecode.role_fields(p.w2, H, F)
    fields += qdecode.rows16_fields(panels[0]) + qdecode.rows16_fields(panels[1])
    if decode_op.register_quant_layer(tag, quant, accuracy_db, _tensors(w), packs, fields, attrs.gate_up,
                                      w.transposed, isa, E, H, F):
        _REGISTERED[key] = p


def decision_key(x, ids, w: ExpertWeights, attrs: FFNAttrs, budget: float, reg: str) -> tuple:
    """What one auto decision covers: the layer's shape (E, H, F, experts per token, layout and
    activation), the regime, the budget, and the device (CPU model, kernel ISA switch, threads)."""
    shape = (w.num_experts, w.hidden(), w.ffn(), ids.shape[1], x.dtype, attrs)
    return shape, reg, float(budget), _device()


def _device() -> tuple:
    from moe_compile.kernels.cpu import isa as cpu_isa

    return _cpu_model(), os.environ.get(cpu_isa.ISA_ENV, ""), torch.get_num_threads()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            return next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        return ""


def _auto_choice(x, ids, weights, w, attrs, budget, tag, reg) -> str:
    ts = _tensors(w)
    key = (tag, reg, tuple(t.data_ptr() for t in ts), _versions(ts))
    if key not in _CHOICES:
        dk = decision_key(x, ids, w, attrs, budget, reg)
        decided = _DECISIONS.get(dk)
        if decided is None:
            sel = _DECISIONS[dk] = _measure(x, ids, weights, w, attrs, budget, tag, reg)
        else:
            sel = _adopt(decided, x, ids, weights, w, attrs, budget, tag, reg)
        _CHOICES[key] = _keep(sel, w, attrs)
    return _CHOICES[key]


def _keep(sel: selection.Selection, w: ExpertWeights, attrs: FFNAttrs) -> str:
    """Give back what the measurement packed beyond the choice; record the Selection; the format."""
    _release_unkept(sel.tag, sel.chosen, [c.fmt for c in sel.candidates], w)
    if sel.chosen != "none":
        _drop_fp32_packs(w)
        sel = dataclasses.replace(sel, packed_bytes=layer_pack(w, attrs, sel.chosen).nbytes())
    selection.record(sel)
    return sel.chosen


def _timed(label: str, fn) -> float:
    """Seconds one call of ``fn`` takes (``TIMER``: tests put a simulated noisy clock here)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


TIMER = _timed


def time_interleaved(fns: dict, runs: int) -> tuple[dict, dict]:
    """({name: output of its untimed first call}, {name: ms}) over ``runs`` rounds, each round one
    call of every candidate, the first of the round rotating.  A candidate's ms: the median over
    rounds of its time divided by the round's median time (the load that round saw), times the
    median of those round levels — a load that changes between rounds cancels, and a call
    preempted in one round is an outlier the median drops."""
    names = list(fns)
    outs = {n: fns[n]() for n in names}  # packs, and the output whose SQNR is recorded
    rounds = []
    for r in range(runs):
        got = {}
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            got[n] = TIMER(n, fns[n])
        rounds.append(got)
    levels = [statistics.median(got.values()) for got in rounds]
    level = statistics.median(levels)
    return outs, {n: statistics.median(got[n] / lv for got, lv in zip(rounds, levels)) * level * 1e3 for n in names}


def _measure(x, ids, weights, w, attrs, budget, tag, reg) -> selection.Selection:
    """Every native candidate on this call's inputs, timed interleaved; the Selection ``choose`` makes."""
    E, H, F = w.num_experts, w.hidden(), w.ffn()
    fns, notes, refused = {"none": lambda: _unquantized(x, ids, weights, w, attrs)}, {}, {}
    for fmt in FORMATS:
        mod, why = kernel_for(fmt, reg, E, H, F)
        if mod is None:
            refused[fmt] = f"not native: {why}"
            continue
        fns[fmt] = lambda fmt=fmt: _run_format(fmt, reg, x, ids, weights, w, attrs)[0]
        notes[fmt] = f"kernels/cpu/{mod.__name__.rsplit('.', 1)[-1]}"
    with torch.no_grad():
        outs, ms = time_interleaved(fns, TIMING_RUNS[reg])
    ref = outs["none"].float()
    cands = [selection.Candidate("none", float("inf"), ms["none"], "unquantized op (kernels/cpu/forward.py)")]
    for fmt in FORMATS:
        if fmt in refused:
            cands.append(selection.Candidate(fmt, None, None, refused[fmt]))
        else:
            cands.append(selection.Candidate(fmt, sqnr_db(ref, outs[fmt].float()), ms[fmt], notes[fmt]))
    return selection.choose(tag, reg, x.shape[0], budget, cands, runs=TIMING_RUNS[reg])


def _adopt(decided: selection.Selection, x, ids, weights, w, attrs, budget, tag, reg) -> selection.Selection:
    """This layer takes the shape's decision; its own SQNR in the chosen format is checked once (a
    layer whose weights miss the budget runs the unquantized op, and says so)."""
    sel = dataclasses.replace(decided, tag=tag, shared_from=decided.shared_from or decided.tag, packed_bytes=0)
    if decided.chosen == "none":
        return sel
    with torch.no_grad():
        ref = _unquantized(x, ids, weights, w, attrs).float()
        got = _run_format(decided.chosen, reg, x, ids, weights, w, attrs)[0].float()
    sq = sqnr_db(ref, got)
    if sq >= budget:
        return dataclasses.replace(sel, margin=f"{sel.margin}; {decided.chosen} measures {sq:.1f} dB on this layer")
    _release_unkept(tag, "none", [decided.chosen], w)
    return dataclasses.replace(sel, chosen="none", margin=(
        f"the shape's choice {decided.chosen} measures {sq:.1f} dB on this layer, under the {budget:g} dB "
        f"budget: the unquantized op runs here"))


def _release_unkept(tag: str, chosen: str, tried, w: ExpertWeights) -> None:
    """Give back the packs of the formats tried that neither this choice nor the layer's other
    regime's choice keeps."""
    kept = {chosen} | {fmt for key, fmt in _CHOICES.items() if key[0] == tag}
    ptrs = tuple(t.data_ptr() for t in _tensors(w))
    for fmt in tried:
        if fmt not in kept:
            _PACKS.pop((fmt, ptrs), None)
