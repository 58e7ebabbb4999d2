"""Host side of ``decode_op.cpp``: the inference ops' CPU kernels in C++, installed on first use.

The op's Python kernel (``ops._fused_moe_infer``, registered for every backend) calls
``install()`` on its first CPU call.  That builds ``decode_op.cpp`` against this torch (~5 s,
once per torch version and source: ``cpu_cc`` caches it), loads it, which registers its CPU
kernel ahead of the Python one, and hands it the address of ``skinny.c``'s decode kernel.  From
then on a plain fp32 decode step (``cpu_decode.decode_args``'s checks) runs with no Python
between the dispatcher and the C kernel; every other CPU call goes on to
``fused_moe_infer_general`` (the Python path).  Cold caches, 2-core EPYC: the op's cost beside
the kernel drops from ~106 us to ~30 us (BENCHMARKS.md, "fp32 decode vs llama.cpp").

The same file holds ``fused_moe_quant``'s CPU kernel: ``kernels/cpu/quant.py`` registers a layer's
packs after its first decode call in qdecode (``register_quant_layer``), and later decode calls
on those very weights, unchanged, run qdecode from C++ (~0.25 ms of Python and dispatch saved a
call with cold caches).

Where there is no C++ compiler, the build fails or ``MOE_COMPILE_DECODE_OP=0``, nothing is
registered: the Python kernel keeps serving every call (``decode_args`` is its own fast path),
with the same results.
"""

from __future__ import annotations

import ctypes
import os

import torch

from moe_compile.kernels.cpu import cc as cpu_cc, skinny as cpu_skinny

ENV = "MOE_COMPILE_DECODE_OP"
_state: dict[str, object] = {}  # "installed": True, or "error": why not (asked once per process)


def install() -> bool:
    """Build, load and arm the C++ kernel once per process; whether it is serving calls."""
    return cpu_cc.install_once(_state, _install, "decode_op", "the op's Python kernel serves CPU decode")


def unavailable_reason() -> str | None:
    """Why the C++ kernel is not serving calls (None once installed; "not installed yet" before)."""
    return None if _state.get("installed") else str(_state.get("error", "not installed yet"))


def _install() -> bool:
    if os.environ.get(ENV, "1") == "0":
        _state["error"] = f"turned off by {ENV}=0"
        return False
    if not cpu_skinny.available():
        _state["error"] = f"the skinny kernel is unavailable: {cpu_skinny.unavailable_reason()}"
        return False
    path = str(cpu_cc.build_torch_library("decode_op"))
    torch.ops.load_library(path)  # registers the CPU kernel; unarmed, it sends every call to the Python path
    lib = ctypes.CDLL(path)  # the same handle
    lib.moe_decode_op_set_kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.moe_decode_op_set_kernel(cpu_skinny.decode_kernel_address(), cpu_skinny.MAX_ROWS)
    lib.moe_decode_op_fast_calls.restype = ctypes.c_int64
    from moe_compile.kernels.cpu import qdecode

    if qdecode.kernel_address() is not None:  # else every quantized call stays in Python
        lib.moe_decode_op_set_quant_kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.moe_decode_op_set_quant_kernel(qdecode.kernel_address(), qdecode.MAX_ROWS)
    _state["lib"] = lib
    return True


def register_quant_layer(tag: str, quant: str, accuracy_db: float, weights: list, packs: list, fields: list,
                         gate_up: str, transposed: bool, isa: int, experts: int, hidden: int, ffn: int) -> bool:
    """Hand a layer's decode packs to the C++ kernel (``kernels/cpu/quant.py``, after a decode call
    that ran in qdecode): ``weights`` the model's tensors the packs were made from (fc1, fc1_up if
    separate, fc2), ``packs`` the tensors qdecode reads, ``fields`` its role fields.  Whether the
    C++ kernel will serve the layer's next decode calls."""
    if not _state.get("installed"):
        return False
    torch.ops.moe_compile.quant_decode_register(tag, quant, accuracy_db, weights, packs, fields, gate_up, transposed,
                                                isa, experts, hidden, ffn)
    return True


def forget_quant_layers() -> None:
    """Drop every registered layer and the packs it held (``moe_compile.empty_cache()``)."""
    if _state.get("installed"):
        torch.ops.moe_compile.quant_decode_forget()


def fast_calls() -> int:
    """How many calls the C++ kernel has run itself in this process (0 before it is installed)."""
    lib = _state.get("lib")
    return int(lib.moe_decode_op_fast_calls()) if lib is not None else 0
