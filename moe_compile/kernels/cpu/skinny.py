"""Host side of ``skinny.c``: fp32 expert GEMMs with few rows (decode), at the memory's speed.

Shapes:  a task is one GEMM  y [r, n_out] = x [r, k] @ W^T (+ bias [n_out]),  W as the model holds
         it: [n_out, k] (``F.linear``) or [k, n_out] (``transposed``, ``x @ W``); any r: the op
         sends r <= MAX_ROWS (decode), or more for small experts (``cpu_decode.fits``).
         Every tensor's last dim is contiguous; rows may be strided (views into shared buffers).

The C file is compiled on first use (never at import, ``cpu_cc``) and loaded with ctypes.  It splits
every task's output columns over torch's OpenMP threads (see the C file for why not Python
threads).  Where there is no compiler, no AVX2 or the build fails, ``available()`` is False and
the op keeps its MKL path; ``MOE_COMPILE_SKINNY=0`` turns the kernel off.  Where the CPU has AVX-512
the one-row dot products run in 16 lanes; ``MOE_COMPILE_FUSED_ISA=avx2`` holds the kernel to AVX2
(``kernels/cpu/isa.py``), as it does the others.
"""

from __future__ import annotations

import ctypes
import struct

import torch

from moe_compile.kernels.cpu import cc as cpu_cc, isa as cpu_isa

# Rows of x per expert up to which the kernel beats the MKL path (cpu.expert_linear).  Sweep on the
# 2-core CI VM (fp32, 2 threads, five experts' [4096, 1024] + [1024, 2048] weights not in cache),
# weight read speed in GB/s, kernel / MKL:
#   r=1: 26.5/14.0  r=2: 25.8/21.0  r=4: 18.2/12.6  r=8: 11.4/8.3  r=16: 6.5/8.1  r=32: 4.7/6.4
MAX_ROWS = 8
_TASK_FIELDS = 14  # the C file's TASK_FIELDS
_ACT_FIELDS = 8  # the C file's ACT_FIELDS
_KERNEL = cpu_cc.Kernel("skinny", "MOE_COMPILE_SKINNY",
                        {"moe_skinny_run_parallel": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64],
                         "moe_skinny_ffn_parallel": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float,
                                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64],
                         "moe_skinny_decode": ([ctypes.c_void_p, ctypes.c_float, ctypes.c_int64], ctypes.c_int),
                         "moe_skinny_best_isa": ([], ctypes.c_int64),
                         "moe_skinny_set_isa": ([ctypes.c_int64], ctypes.c_int64)},
                        "using MKL for decode")


def available() -> bool:
    return _KERNEL.lib() is not None


def unavailable_reason() -> str | None:
    return _KERNEL.error()


def fits(t: torch.Tensor) -> bool:
    """Whether a tensor can be handed to the kernel: fp32 on CPU with a contiguous last dim."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and (t.dim() == 0 or t.stride(-1) == 1)


def task(w: int, ldw: int, x: int, ldx: int, y: int, ldy: int, bias: int, rows: int, k: int, n_out: int,
         transposed: bool, x_index: int = 0, y_index: int = 0, scale: int = 0) -> list[int]:
    """One GEMM y [rows, n_out] = x [rows, k] @ W^T (+ bias) as the C side reads it: data pointers
    (0 for none) and row strides in elements, in the C file's field order.  ``x_index`` (int64
    [rows]): x row r is x[x_index[r]].  ``y_index`` (int64 [rows]): accumulate into y[y_index[r]]
    instead of writing y[r].  ``scale`` (fp32 [rows]): multiply row r's result (bias included).
    Plain ints, so a caller with 64 experts builds its tasks without a tensor view per expert."""
    return [w, x, y, bias, rows, k, n_out, ldw, ldx, ldy, int(transposed), x_index, y_index, scale]


def _ptr(t: torch.Tensor | None) -> int:
    return t.data_ptr() if t is not None else 0


def tensor_task(weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None,
                transposed: bool = False, x_index: torch.Tensor | None = None,
                y_index: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> list[int]:
    """``task`` from tensors, shapes and layout checked: weight [n_out, k] ([k, n_out] when
    transposed), x [r, k] (or [N, k] rows picked by x_index [r]), y [r, n_out] (or [M, n_out]
    accumulated into at y_index [r]), bias [n_out], scale [r].  Indices must lie in x's / y's rows.
    The task holds raw pointers: the caller keeps every tensor alive until ``run`` returns."""
    n_out, k = (weight.shape[1], weight.shape[0]) if transposed else tuple(weight.shape)
    r = x_index.shape[0] if x_index is not None else x.shape[0]
    y_rows = y.shape[0] if y_index is not None else r
    parts = [t for t in (weight, x, y, bias, scale) if t is not None]
    indices = [t for t in (x_index, y_index) if t is not None]
    if (
        not all(fits(t) for t in parts) or x.shape[1] != k or tuple(y.shape) != (y_rows, n_out)
        or (bias is not None and tuple(bias.shape) != (n_out,)) or (scale is not None and tuple(scale.shape) != (r,))
        or (y_index is not None and y_index.shape[0] != r)
        or not all(i.dtype == torch.int64 and i.dim() == 1 and i.is_contiguous() for i in indices)
    ):
        raise ValueError(
            f"skinny GEMM: weight {tuple(weight.shape)} (transposed={transposed}) wants fp32 CPU tensors with "
            f"contiguous rows, x [r, {k}], y [r, {n_out}], bias [{n_out}], scale [r] and contiguous int64 row "
            f"indices [r]; got x {tuple(x.shape)} {x.dtype}, y {tuple(y.shape)}, weight {weight.dtype}"
        )
    for index, rows, name in ((x_index, x.shape[0], "x_index"), (y_index, y.shape[0], "y_index")):
        if index is not None and index.numel() and not (0 <= int(index.min()) and int(index.max()) < rows):
            raise ValueError(f"skinny GEMM: {name} must lie in [0, {rows}), got {index.min()}..{index.max()}")
    return task(weight.data_ptr(), weight.stride(0), x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
                _ptr(bias), r, k, n_out, transposed, _ptr(x_index), _ptr(y_index), _ptr(scale))


def swiglu(h: int, ldh: int, a: int, lda: int, rows: int, ffn: int, interleaved: bool, scale: int = 0) -> list[int]:
    """The SwiGLU between ``run_ffn``'s two phases as the C side reads it: h [rows, 2*ffn] (gate |
    up halves, or interleaved) -> a [rows, ffn], row strides ldh / lda in elements, each row times
    scale[r] (fp32 [rows]; 0: none)."""
    return [h, ldh, a, lda, rows, ffn, int(interleaved), scale]


_isa_chosen: list[bool] = []  # the ISA is set once, on the library's first use


def _lib() -> ctypes.CDLL:
    lib = _KERNEL.lib()
    if lib is None:
        raise RuntimeError(f"skinny CPU kernel unavailable: {_KERNEL.error()}")
    if not _isa_chosen:
        lib.moe_skinny_set_isa(cpu_isa.choose(int(lib.moe_skinny_best_isa())))  # MOE_COMPILE_FUSED_ISA=avx2: AVX2
        _isa_chosen.append(True)
    return lib


def use_isa(isa: int) -> int:
    """Run the AVX2 loops (``isa.ISA_AVX2``) or, where the CPU has them, the AVX-512 ones
    (``isa.ISA_AVX512``); returns the setting before."""
    return int(_lib().moe_skinny_set_isa(isa))


def decode_kernel_address() -> int:
    """The address of ``moe_skinny_decode`` (``decode_op.cpp`` calls it directly)."""
    return ctypes.cast(_lib().moe_skinny_decode, ctypes.c_void_p).value


def _packed(fields: list[int]):
    return (ctypes.c_int64 * len(fields))(*fields)


def run(tasks: list[int], threads: int = 1) -> None:
    """Run the tasks (``task`` fields, concatenated), every task's output columns split over
    ``threads`` OpenMP threads (torch's own).  The caller keeps the tensors alive meanwhile."""
    lib = _lib()
    if tasks:
        lib.moe_skinny_run_parallel(_packed(tasks), len(tasks) // _TASK_FIELDS, max(1, threads))


def run_ffn(fc1_tasks: list[int], act: list[int], limit: float, fc2_tasks: list[int], threads: int = 1) -> None:
    """FC1 tasks, then the SwiGLU ``act`` (``swiglu`` fields; gate clamped to <= limit and up to
    [-limit, limit] when limit > 0), then FC2 tasks: one kernel call, the phases in order."""
    assert len(act) == _ACT_FIELDS
    _lib().moe_skinny_ffn_parallel(_packed(fc1_tasks), len(fc1_tasks) // _TASK_FIELDS, _packed(act), limit,
                                   _packed(fc2_tasks), len(fc2_tasks) // _TASK_FIELDS, max(1, threads))


def run_decode(plan: list[int] | bytes, limit: float, threads: int = 1) -> None:
    """A whole decode step on stacked weights (the C file's plan fields, ``cpu_decode``; a list of
    ints or the same packed as native int64 bytes): the slots sorted by expert, FC1, the SwiGLU and
    FC2 + combine into y (zeroed there), in one call."""
    if not isinstance(plan, bytes):
        plan = struct.pack(f"{len(plan)}q", *plan)  # 0.5 us; a ctypes array of 36 ints costs 5
    if _lib().moe_skinny_decode(plan, limit, max(1, threads)) != 0:
        raise MemoryError("skinny decode kernel: could not allocate its scratch")
