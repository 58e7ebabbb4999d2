"""Dense linears on CPU: every weight a decode step reads outside the experts (attention q/k/v/o,
shared experts, dense MLPs, lm_head), at the memory's speed and in the format the user asked for.

Shapes:  T rows (tokens), K input width, N output width.
         x [T, K] float, weight [N, K] (``F.linear``'s layout), bias [N] or None -> y [T, N].

Why: a whole MoE model's decode step reads as many bytes outside its experts as inside them
(Qwen3-30B-A3B-shaped, 4 layers: attention + lm_head 564 MB of 1.16 GB fp32).  torch's fp32 GEMM
reads one row's weights at 50-90% of the memory's speed, and its int8 / int4 weight-only kernels
(``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``, what torchao composes on CPU) at 1-10%
(``benchmarks/bench_dense_cpu.py``).  A dense linear is the E = 1, no-activation case of the MoE
decode kernels, so it runs on them:

  format        T <= 16 (decode)                                   T > 16 (prefill)
  none, fp32    skinny.c (T <= ``SKINNY_ROWS``), else torch        torch (MKL / oneDNN)
  none, bf16    qdecode.c w16 on the model's own bf16 weight       torch
  a format      qdecode.c ``moe_qdecode_linear`` on the packed     the packed weight dequantized,
                weight (the loops of a decode step's FC2)          then torch's GEMM

Packing: a weight is packed once per (tensor, version) into the canonical ``moe_compile.quant``
format ([1, N, K]) and kept here (``stats`` / ``clear``); an in-place update repacks it.  The first
prefill call adds qgemm's panels of it (the same bytes, 16 rows interleaved).  A w4-int or
group-wise a8w4-int weight gets them at once: its T = 1 calls read them (qdecode's rows16 loops,
AVX-512 VNNI or AVX2), 15-25% faster from memory than the row loops on the pack with VNNI (lm_head
[32000, 2048] 1.6 -> 1.3 ms, 2-core Zen 4); so does a w8-int weight.
``stats()["dense_panel_bytes"]``: what the panels hold.
Results: fp32 and w16 equal ``x @ W^T`` up to the order of fp32 sums; a format equals its
reference (``quant.matmul`` on the packed weight) as a decode step's FC2 does.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import weakref

import torch
import torch.nn.functional as F

from moe_compile.kernels.cpu import cc as cpu_cc, isa as cpu_isa, qdecode, skinny
from moe_compile.kernels.cpu.isa import PREFILL_BF16_ENV, prefill_dtype  # noqa: F401  (the policy lives in isa.py)

DECODE_ROWS = qdecode.MAX_ROWS
# Rows up to which skinny.c beats torch's fp32 GEMM at these widths (bench_dense_cpu.py); the
# qdecode loops take any T <= DECODE_ROWS.
SKINNY_ROWS = 8
FORMATS = ("w16", "w8-int", "w4-int", "mxfp4", "mxfp8", "a8w8-int", "a8w4-int")

OP_ENV = "MOE_COMPILE_DENSE_OP"  # "0": no C++ kernel, every call through Python (same results)
# (id(weight), fmt, group) -> _Packed: one pack per weight and format.  A weak reference tells a
# reused id apart; the version an in-place update.
_PACKS: dict[tuple, "_Packed"] = {}


class _Packed:
    __slots__ = ("ref", "version", "qweight", "rows16", "fields", "panels")

    def __init__(self, weight: torch.Tensor, fmt: str, group: int | None):
        from moe_compile import quant

        # the pack goes when the weight does (a dropped model's packs are not kept)
        self.ref = weakref.ref(weight, functools.partial(_drop, (id(weight), fmt, group), self))
        self.version = weight._version
        with torch.no_grad():
            self.qweight = quant.pack(fmt, weight.detach().float().unsqueeze(0), group)
        N, K = weight.shape
        # qgemm's panels of the weight: made by the first prefill call, or now where T = 1 calls
        # read them (rows16: w4-int, w8-int, a8w4-int: qdecode.rows16_runs); the other decode calls read the pack
        self.panels, self.rows16 = None, None
        if qdecode.rows16_runs(self.qweight):
            self.panels = _float_panels(self.qweight)
            if self.panels is not False:
                self.rows16 = (self.panels.data[0], self.panels.scale[0])
        self.fields = qdecode.role_fields(self.qweight, N, K) + qdecode.rows16_fields(self.rows16)
        if _op_state.get("installed"):  # later decode calls on this weight: from C++ (dense_op.cpp)
            keep = [self.qweight.data, self.qweight.scale, *(self.rows16 or ())]
            torch.ops.moe_compile.dense_register(weight, fmt, group or 0, keep, self.fields)

    def fresh(self, weight: torch.Tensor) -> bool:
        return self.ref() is weight and self.version == weight._version


def _drop(key: int, pack: "_Packed", _ref) -> None:
    if _PACKS.get(key) is pack:
        del _PACKS[key]
    if _op_state.get("installed"):
        torch.ops.moe_compile.dense_prune()


class _LoadedPack(_Packed):
    """A weight that is packed already (a ``PackedWeight``): the same fields and panels as
    ``_Packed``, made from its QuantWeight instead of a full-precision weight.  ``panels`` given:
    the weight is kept as qgemm's panels alone (``qweight`` a view of them, not canonical bytes),
    read by the rows16 loops at T = 1 and dequantized from them for every other T."""

    canonical: bool

    def __init__(self, qweight, owner: torch.Tensor, panels=None):  # noqa: super().__init__ packs; this one has the pack
        self.ref, self.version, self.qweight = weakref.ref(owner), None, qweight
        N, K = qweight.shape[1:]
        self.canonical = panels is None
        self.panels, self.rows16 = panels, None
        if qdecode.rows16_runs(qweight):
            if self.panels is None:
                self.panels = _float_panels(qweight)
            if self.panels is not False:
                self.rows16 = (self.panels.data[0], self.panels.scale[0])
        fields = qdecode.role_fields(qweight, N, K)
        self.fields = (fields if self.canonical else [0, *fields[1:]]) + qdecode.rows16_fields(self.rows16)


_LOADED: dict[tuple, _LoadedPack] = {}  # (data pointer, fmt, group) -> the pack of a loaded weight


def linear_packed(x: torch.Tensor, qweight, bias: torch.Tensor | None, owner: torch.Tensor,
                  panels=None) -> torch.Tensor:
    """``linear`` on a weight that is packed already: ``qweight`` a canonical [1, N, K] QuantWeight,
    or with ``panels`` (its qgemm panels) a view of those panels (``_LoadedPack``); ``owner`` the
    tensor holding its bytes (the pack is kept while it lives)."""
    key = (owner.data_ptr(), qweight.fmt, qweight.group)
    pack = _LOADED.get(key)
    if pack is None or pack.ref() is not owner:
        pack = _LOADED[key] = _LoadedPack(qweight, owner, panels)
        weakref.finalize(owner, _LOADED.pop, key, None)
    return _linear_on_pack(x, pack, bias)


def packed(weight: torch.Tensor, fmt: str, group: int | None = None) -> _Packed:
    """The weight's pack in ``fmt``, made on first use and again after an in-place update."""
    key = (id(weight), fmt, group)
    hit = _PACKS.get(key)
    if hit is not None and hit.fresh(weight):
        return hit
    _PACKS[key] = hit = _Packed(weight, fmt, group)
    return hit


def clear() -> None:
    _PACKS.clear()
    _SCRATCH.__dict__.pop("buffers", None)  # this thread's prefill weight buffers
    if _op_state.get("installed"):
        torch.ops.moe_compile.dense_forget()


# The C++ CPU kernel (dense_op.cpp): "installed": True, or "error": why not (asked once a process).
_op_state: dict[str, object] = {}


def install() -> bool:
    """Build, load and arm ``dense_op.cpp`` once per process (the op's first CPU call); whether it
    serves calls.  Where it cannot be built, the Python kernel serves every call, same results."""
    return cpu_cc.install_once(_op_state, _install, "dense_op", "dense linears go through Python")


def _install() -> bool:
    why = f"turned off by {OP_ENV}=0" if os.environ.get(OP_ENV) == "0" else \
        None if skinny.available() else "no skinny kernel"
    if why:
        _op_state["error"] = why
        return False
    path = str(cpu_cc.build_torch_library("dense_op"))
    torch.ops.load_library(path)  # registers the CPU kernel; unarmed, it sends every call to Python
    lib = ctypes.CDLL(path)
    lib.moe_dense_op_set_kernels.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                             ctypes.c_int64]
    lib.moe_dense_op_fast_calls.restype = ctypes.c_int64
    skinny_fn = ctypes.cast(skinny._lib().moe_skinny_run_parallel, ctypes.c_void_p).value
    linear_fn = _linear_kernel()
    linear_addr = ctypes.cast(linear_fn, ctypes.c_void_p).value if linear_fn is not None and \
        qdecode.unavailable_reason("w16") is None else None
    lib.moe_dense_op_set_kernels(skinny_fn, SKINNY_ROWS, linear_addr, DECODE_ROWS if linear_addr else 0,
                                 qdecode.best_isa() if linear_addr else 0)
    _op_state["lib"] = lib
    return True


def fast_calls() -> int:
    """How many calls the C++ kernel has run itself in this process (0 before it is installed)."""
    lib = _op_state.get("lib")
    return int(lib.moe_dense_op_fast_calls()) if lib is not None else 0


def stats() -> dict:
    live = [p for p in _PACKS.values() if p.ref() is not None]
    nbytes = sum(p.qweight.data.nbytes + p.qweight.scale.nbytes for p in live)
    panels = sum(p.panels.nbytes for p in live if p.panels is not None and p.panels is not False)
    scratch = sum(b.nbytes for b in getattr(_SCRATCH, "buffers", {}).values())
    return {"dense_packs": len(live), "dense_pack_bytes": nbytes, "dense_panel_bytes": panels,
            "dense_prefill_scratch_bytes": scratch}


def unavailable_reason(fmt: str) -> str | None:
    """None when ``fmt`` runs natively here for dense linears; else why not."""
    if fmt not in FORMATS:
        return f"dense linears run {FORMATS}, not {fmt!r}"
    return qdecode.unavailable_reason(fmt) or _linear_reason()


@functools.cache
def _linear_reason() -> str | None:
    if _linear_kernel() is None:
        return "qdecode.c has no moe_qdecode_linear entry"
    return None


@functools.cache
def _linear_kernel():
    lib = qdecode._KERNEL.lib()
    fn = getattr(lib, "moe_qdecode_linear", None) if lib is not None else None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int
    return fn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fmt: str = "none",
           group: int | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ weight [N, K]^T (+ bias), weight read in ``fmt`` ("none": its
    own dtype).  The result has x's dtype."""
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"dense linear: x [..., {weight.shape[-1] if weight.dim() == 2 else '?'}] and weight "
                         f"[N, K] expected, got x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    lead, (N, K) = x.shape[:-1], weight.shape
    x2 = x.reshape(-1, K)
    if fmt == "none":
        return _linear_native(x2, weight, bias).reshape(*lead, N)
    return _linear_on_pack(x, packed(weight, fmt, group), bias)


def _linear_on_pack(x: torch.Tensor, pack: "_Packed", bias: torch.Tensor | None) -> torch.Tensor:
    """y [..., N] of a packed weight: the decode loops for T <= DECODE_ROWS rows, else prefill."""
    N, K = pack.qweight.shape[1:]
    lead, x2 = x.shape[:-1], x.reshape(-1, K)
    T = x2.shape[0]
    if 0 < T <= DECODE_ROWS and (getattr(pack, "canonical", True) or (T == 1 and pack.rows16)):
        y = _decode(x2, pack, N, K).to(x.dtype)
        if bias is not None:
            y += bias
    else:
        y = _prefill(x2, pack, bias).to(x.dtype)
    return y.reshape(*lead, N)


def _prefill(x2: torch.Tensor, pack: "_Packed", bias: torch.Tensor | None) -> torch.Tensor:
    """y [T, N] fp32 of a prefill-size call: the packed weight dequantized for this call only (in
    C from qgemm's panels where they serve it, else by the format's reference), then torch's GEMM —
    in bf16 where the CPU multiplies bf16 natively (``prefill_dtype``), else fp32."""
    from moe_compile import quant
    from moe_compile.kernels.cpu import qgemm

    dtype = prefill_dtype(pack.qweight.fmt)
    if pack.panels is None:
        pack.panels = _float_panels(pack.qweight)
    if pack.panels is not False:
        # a GEMM that autograd records keeps its weight for the backward: not the kept buffer then
        recorded = torch.is_grad_enabled() and x2.requires_grad
        w = qgemm.dequantized_weight(pack.panels, 0, dtype, None if recorded else _weight_scratch(pack.qweight.shape, dtype))
    else:
        w = quant.dequantize(pack.qweight)[0].to(dtype)  # [N, K], this call only
    y = F.linear(x2.to(dtype), w).float()
    return y if bias is None else y + bias.float()


# A prefill call's dequantized weight goes into a buffer kept per thread and dtype, up to this size
# (bigger ones, e.g. an lm_head over every prompt token, are made per call).  Why: made per call, a
# weight's fresh pages were faulted in on every call (the allocator gives large blocks back), which
# cost as much as the dequantization itself ([4096, 2048] bf16, 16 MiB: 1.8 ms into a kept buffer,
# 2.6-3.4 ms into a new one, 2-core Xeon VM).
SCRATCH_BYTES = 64 << 20
_SCRATCH = threading.local()


def _weight_scratch(shape, dtype: torch.dtype) -> torch.Tensor | None:
    """This thread's kept buffer for a dequantized [N, K] weight of dtype (grown as needed), or None
    when the weight is over SCRATCH_BYTES.  Each call's weight is read by its GEMM before the next
    call overwrites it; a thread of its own gets a buffer of its own."""
    numel = shape[-2] * shape[-1]
    if numel * dtype.itemsize > SCRATCH_BYTES:
        return None
    kept = getattr(_SCRATCH, "buffers", None)
    if kept is None:
        kept = _SCRATCH.buffers = {}
    buf = kept.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = kept[dtype] = torch.empty(numel, dtype=dtype)
    return buf


def _float_panels(qweight):
    """qgemm's float panels of the weight (the same bytes, another order), or False where qgemm
    does not serve it (no kernel, N not a multiple of 16, an integer-tile format)."""
    from moe_compile.kernels.cpu import qgemm

    N, K = qweight.shape[1:]
    if qgemm.unavailable_reason(qweight.fmt) is not None or N % qgemm.PANEL or K % 8 \
            or not qgemm.float_panels(qweight):
        return False
    return qgemm.pack(qweight)


def _linear_native(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The weight in its own dtype: the decode kernels where they take it, torch otherwise."""
    T = x2.shape[0]
    if 0 < T <= SKINNY_ROWS and skinny.fits(weight) and skinny.fits(x2) and weight.is_contiguous() \
            and (bias is None or skinny.fits(bias)) and skinny.available():
        y = torch.empty(T, weight.shape[0], dtype=torch.float32)
        skinny.run(skinny.tensor_task(weight, x2, y, bias), torch.get_num_threads())  # strided rows: no copy
        return y
    if 0 < T <= DECODE_ROWS and weight.dtype == torch.bfloat16 and weight.is_contiguous() \
            and unavailable_reason("w16") is None:
        y = _decode(x2, _Bf16View(weight), *weight.shape).to(x2.dtype)
        return y if bias is None else y + bias
    return F.linear(x2, weight, bias)


class _Bf16View:
    """A model's own bf16 weight read as the w16 format's [1, N, K] data (no copy, no pack)."""

    def __init__(self, weight: torch.Tensor):
        # group = K; no rows16 copy
        self.fields = [weight.data_ptr(), 0, qdecode._FORMATS["w16-bf16"], weight.shape[1], *qdecode.rows16_fields(None)]


def _decode(x2: torch.Tensor, pack, N: int, K: int) -> torch.Tensor:
    """y [T, N] fp32 from qdecode.c's linear loops."""
    T = x2.shape[0]
    xf = x2.float().contiguous()
    y = torch.empty(T, N, dtype=torch.float32)
    plan = [xf.data_ptr(), T, K, N, y.data_ptr(), qdecode.best_isa(), *pack.fields]
    status = _linear_kernel()((ctypes.c_int64 * len(plan))(*plan), torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"dense linear: the qdecode kernel refused a [{N}, {K}] weight (status {status})")
    return y
