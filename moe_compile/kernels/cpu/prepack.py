"""Expert weights prepacked once for CPU prefill: in 16-row panels for the fused experts kernel
(``cpu_experts``) where it takes the call, else in oneDNN's blocked layout for per-expert GEMMs.

Shapes:  W [out, in] one expert's weight of one role (a slice of a stacked [E, out, in] tensor,
         [E, in, out] when transposed, or the model's own per-expert tensor); x [n, in] the rows
         routed to that expert (decode and small experts have their own kernel, ``cpu_decode``).

Why: an MoE's expert GEMMs are many small GEMMs (64 experts x ~64 rows at T=512, K=8).  MKL's
sgemm repacks the weight panel on every call, which at 64 rows costs a quarter of the work; oneDNN
with the weight reordered once into its blocked layout runs them at the dense GEMM's rate.  The
2-core CI VM, fp32, 2 threads, all 64 experts of the fine-grained shape (H=1024, F=512), ~64 rows
each: FC1 MKL 55 ms, oneDNN packed 49 ms, dense roof 49 ms; FC2 MKL 31 ms, packed 23 ms, roof 24.
The price is a second copy of the experts' weights, so packing is automatic only where it pays:

* a role is packed the second time a call sees its tensors unchanged: the same tensor (views are
  tracked through their base), the same data pointer and the same version counter.  A call of the
  inference op (``fused_moe_infer``: no backward will train the weights) packs them at its first
  sight instead, so the compiling call does the one-time work and the next call, a user's first
  timed one, runs at the steady speed (HF ``generate``'s prefill of a 2-layer, 64-expert fp32 model
  on a 2-core EPYC: 5.1 s for the call after compiling, 1.6 s later, before this).  A weight
  updated in place (an optimizer step, ``load_state_dict``, ``copy_``) changes its version and is
  read from the model again; the stale pack is dropped;
* never for a weight the backward computed a gradient for (``mark_trained``): training repacks
  would cost more than they save;
* only fp32 on CPU with oneDNN built in or the fused kernel built, only when the packs fit in half
  of the available memory, and not with ``MOE_COMPILE_PREPACK=0``.  A tensor holds packs of one
  format: a call wanting the other (``cpu_experts.fits`` changed its answer) repacks it.

Writes that bypass the version counter (``weight.data.copy_(...)``) are not seen: call
``moe_compile.kernels.cpu.prepack.clear()`` after them, or turn packing off.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu import experts as cpu_experts, onednn as cpu_onednn

ENV = "MOE_COMPILE_PREPACK"
# Calls that must see a weight unchanged before the one that packs it (tests set 0: pack at once).
UNCHANGED_CALLS_BEFORE_PACKING = 1


def unavailable_reason() -> str | None:
    """Why packed GEMMs are not used in this process, or None when they are (on oneDNN, on the
    fused experts kernel, or both)."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if cpu_onednn.available() or cpu_experts.available():
        return None
    return f"{cpu_onednn.unavailable_reason()}; fused experts kernel: {cpu_experts.unavailable_reason()}"


def available() -> bool:
    return unavailable_reason() is None


def pack(w_out_in: torch.Tensor) -> torch.Tensor:
    """A copy of one expert's [out, in] weight in oneDNN's layout (no batch-size hint: measured as
    fast as the exact row count for 16-256 rows, where a hint of 1 is 25% slower)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(w_out_in.contiguous(), None)


@dataclass
class _Seen:
    """What the last call saw of one weight tensor, and its packs once made."""

    base: weakref.ref  # the tensor, or the base a view was taken of
    data_ptr: int
    version: int
    packs: list | None = None  # one per expert the tensor holds
    fmt: str | None = None  # what the packs are (``_formats``)
    trained: bool = False
    unchanged_calls: int = 0  # earlier calls that saw it as it is now


_SEEN: dict[tuple, _Seen] = {}
_REFUSED = {"memory": 0}  # calls whose packs did not fit the memory budget (``stats``)


def _key(t: torch.Tensor):
    """(identity key, base tensor): views created per call are tracked through their base."""
    base = t._base if t._base is not None else t
    return (id(base), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype), base


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter: changes would go unseen
        return None


def _observe(t: torch.Tensor) -> _Seen | None:
    """Record this call's sight of t: its entry (a new one, without packs, when t changed since the
    last call), or None when changes to t could not be seen."""
    key, base = _key(t)
    version = _version(t)
    if version is None:
        return None
    seen = _SEEN.get(key)
    if seen is not None and seen.base() is base and seen.data_ptr == t.data_ptr() and seen.version == version:
        seen.unchanged_calls += 1
        return seen
    trained = seen is not None and seen.base() is base and seen.trained
    return _new_entry(key, base, t.data_ptr(), version, trained)


def _new_entry(key, base: torch.Tensor, data_ptr: int, version: int, trained: bool) -> _Seen:
    """A fresh entry for key (replacing any), dropped when its base tensor is freed."""
    ref = weakref.ref(base, lambda _ref, key=key: _SEEN.pop(key, None))
    _SEEN[key] = _Seen(ref, data_ptr, version, trained=trained)
    return _SEEN[key]


def _experts_of(t: torch.Tensor, transposed: bool) -> list:
    """[out, in] weights of the experts t holds (a stacked [E, ...] tensor or one expert's 2-D)."""
    mats = list(t) if t.dim() == 3 else [t]
    return [m.t() if transposed else m for m in mats]


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class PackedExperts:
    """Per-expert packed weights of one call's roles (None for an absent role).  ``fused``: panels
    for ``cpu_experts`` (else oneDNN's layout for ``cpu_onednn.linear``)."""

    fc1: list
    fc1_up: list | None
    fc2: list
    fused: bool = False


FUSED, FUSED_DEINTERLEAVED, ONEDNN = "panels", "panels, gate/up de-interleaved", "onednn"


def _formats(x, w: ExpertWeights, attrs: FFNAttrs) -> list | None:
    """The pack format of each tensor of w.fc1, w.fc1_up, w.fc2 (in that order) for this call:
    panels where the fused experts kernel takes it, oneDNN's otherwise; None when neither runs."""
    if cpu_experts.fits(x, w, attrs):
        fc1 = FUSED_DEINTERLEAVED if attrs.gate_up == "interleaved" else FUSED
        return [fc1] * len(w.fc1) + [FUSED] * (len(w.fc1_up) + len(w.fc2))
    if not cpu_onednn.available():
        return None
    return [ONEDNN] * (len(w.fc1) + len(w.fc1_up) + len(w.fc2))


def _pack_tensor(t: torch.Tensor, fmt: str, transposed: bool) -> list:
    if fmt == ONEDNN:
        return [pack(m) for m in _experts_of(t, transposed)]
    return cpu_experts.pack(t, transposed, deinterleave=fmt == FUSED_DEINTERLEAVED)


def lookup(x: torch.Tensor, w: ExpertWeights, attrs: FFNAttrs, first_sight: bool = False) -> PackedExperts | None:
    """The packed weights for this call, packing them now when they have been stable since the
    last call (``first_sight``: at once, an inference call's); None when this call runs on the
    weights as the model holds them.  Panels for the fused experts kernel where it takes the call
    (``cpu_experts.fits``), oneDNN's layout else."""
    roles = [w.fc1, w.fc1_up, w.fc2]
    tensors = [t for role in roles for t in role]
    biases = [t for role in (w.fc1_bias, w.fc1_up_bias, w.fc2_bias) for t in role]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors + biases):
        _forget(tensors)  # e.g. the model moved to another dtype or device: its old packs go
        return None
    if x.dtype != torch.float32 or x.device.type != "cpu" or not available():
        return None
    formats = _formats(x, w, attrs)
    if formats is None:
        return None
    seen = [_observe(t) for t in tensors]  # every tensor is observed, so stability is per call
    wait = 0 if first_sight else UNCHANGED_CALLS_BEFORE_PACKING
    if any(s is None or s.trained or s.unchanged_calls < wait for s in seen):
        return None
    missing = [(t, s, f) for t, s, f in zip(tensors, seen, formats) if s.packs is None or s.fmt != f]
    if missing and sum(t.nbytes for t, _, _ in missing) * 2 > _available_bytes():
        _REFUSED["memory"] += 1
        return None
    for t, s, fmt in missing:
        s.packs, s.fmt = None, None  # a pack in another format goes before the new one is made
        s.packs, s.fmt = _pack_tensor(t, fmt, w.transposed), fmt
    by_role = iter(seen)

    def packs_of(role):
        return [p for _ in role for p in next(by_role).packs] if role else None

    return PackedExperts(packs_of(w.fc1), packs_of(w.fc1_up), packs_of(w.fc2), fused=formats[0] != ONEDNN)


_ROW_COPIES: dict[tuple, tuple] = {}  # _key -> (base ref, data_ptr, version, copy)


def rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dim is contiguous, else a contiguous copy made once per (tensor,
    version) and kept until t's base is freed.  A weight role the passes flip to the op's orientation
    (``transpose(-2, -1)`` of the model's tensor, ``ir.MoESpec.flipped``) reaches the op with stride
    1 in the wrong dim, which the decode kernels do not read (``cpu_decode``): they then read this
    copy.  Inference tensors (no version counter) are used as they are."""
    if t.dim() < 2 or t.stride(-1) == 1:
        return t
    key, base = _key(t)
    version = _version(t)
    if version is None:
        return t
    held = _ROW_COPIES.get(key)
    if held is not None and held[0]() is base and held[1] == t.data_ptr() and held[2] == version:
        return held[3]
    with torch.no_grad():
        copy = t.contiguous()
    ref = weakref.ref(base, lambda _ref, key=key: _ROW_COPIES.pop(key, None))
    _ROW_COPIES[key] = (ref, t.data_ptr(), version, copy)
    return copy


def _forget(tensors) -> None:
    """Drop every entry of these tensors' bases (whatever shape or dtype they were seen with)."""
    bases = {id(_key(t)[1]) for t in tensors}
    for key in [k for k in _SEEN if k[0] in bases]:
        del _SEEN[key]


def mark_trained(tensors) -> None:
    """The backward computed gradients for these weights: they will change every step, so they are
    never packed (and any pack is dropped)."""
    for t in tensors:
        key, base = _key(t)
        seen = _SEEN.get(key)
        if seen is None or seen.base() is not base:
            seen = _new_entry(key, base, 0, -1, trained=True)
        seen.trained, seen.packs = True, None


def clear() -> None:
    """Forget every pack and sighting (after weight writes the version counter does not see)."""
    _SEEN.clear()
    _ROW_COPIES.clear()
    _REFUSED["memory"] = 0


def stats() -> dict:
    """{"tensors": weight tensors with packs, "bytes": their packed size, "refused_for_memory":
    calls that would have packed but whose packs did not fit in half of the available memory}."""
    packed = [s for s in _SEEN.values() if s.packs]
    return {"tensors": len(packed), "bytes": sum(p.numel() * p.element_size() for s in packed for p in s.packs),
            "refused_for_memory": _REFUSED["memory"]}
