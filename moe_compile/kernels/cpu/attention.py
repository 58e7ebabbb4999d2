"""Loading the decode attention kernel: ``attention.c`` (the arithmetic) behind
``attention_op.cpp`` (the C++ CPU kernel of ``moe_compile::decode_attention``, no Python per call).

Built and armed on the op's first CPU call, never at import.  ``MOE_COMPILE_ATTENTION=0`` turns it
off (every call is torch's SDPA, ``moe_compile.ops.decode_attention``); so does a CPU without AVX2 or a
machine without a C/C++ compiler, with one warning saying why.
"""

from __future__ import annotations

import ctypes
import os

import torch

from moe_compile.kernels.cpu import cc as cpu_cc, isa as cpu_isa

ENV = "MOE_COMPILE_ATTENTION"
MAX_ROWS = 16  # query rows a call may have: decode, and a few speculative tokens
_KERNEL = cpu_cc.Kernel("attention", ENV, {
    "moe_decode_attention": ([ctypes.c_void_p, ctypes.c_double, ctypes.c_int64], ctypes.c_int),
    "moe_attention_best_isa": ([], ctypes.c_int64),
    "moe_attention_set_isa": ([ctypes.c_int64], ctypes.c_int64),
}, "decode attention runs torch's SDPA")
# "installed": True, or "error": why not (asked once a process).
_state: dict[str, object] = {}


def install() -> bool:
    """Build, load and arm ``attention_op.cpp`` once per process; whether it serves calls."""
    return cpu_cc.install_once(_state, _install, "attention_op", "decode attention runs torch's SDPA")


def _install() -> bool:
    lib_c = _KERNEL.lib()
    if lib_c is None or os.environ.get(ENV) == "0":
        _state["error"] = _KERNEL.error() or f"turned off by {ENV}=0"
        return False
    use_isa(cpu_isa.choose(int(lib_c.moe_attention_best_isa())))  # MOE_COMPILE_FUSED_ISA=avx2 holds it to AVX2
    path = str(cpu_cc.build_torch_library("attention_op"))
    torch.ops.load_library(path)  # registers the CPU kernel; unarmed, it sends every call to SDPA
    lib = ctypes.CDLL(path)
    lib.moe_attention_op_set_kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.moe_attention_op_fast_calls.restype = ctypes.c_int64
    lib.moe_attention_op_set_kernel(ctypes.cast(lib_c.moe_decode_attention, ctypes.c_void_p).value, MAX_ROWS)
    _state["lib"] = lib
    return True


def unavailable_reason() -> str | None:
    """Why the kernel does not serve calls in this process (None when it does)."""
    install()
    return None if _state.get("installed") else str(_state.get("error"))


def fast_calls() -> int:
    """How many calls attention.c has served in this process (0 before it is installed)."""
    lib = _state.get("lib")
    return int(lib.moe_attention_op_fast_calls()) if lib is not None else 0


def use_isa(isa: int) -> int:
    """Run attention.c's AVX2 blocks (``isa.ISA_AVX2``) or, where the CPU has them, its AVX-512
    ones (``isa.ISA_AVX512``); returns the setting before.  The kernel must have built."""
    return int(_KERNEL.lib().moe_attention_set_isa(isa))
