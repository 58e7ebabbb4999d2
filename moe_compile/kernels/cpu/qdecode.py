"""Host side of ``qdecode.c``: a quantized MoE decode step (T <= MAX_ROWS tokens) in one C call.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.
         x [T, H] fp32, ids [T, K] int64, weights [T, K] fp32 -> y [T, H] fp32.
         w1: ``QuantWeight`` of FC1, logical [E, 2F, H] (gate rows, then up rows);
         w2: ``QuantWeight`` of FC2, logical [E, H, F].  Formats (``moe_compile.quant``):

  fmt      data                        scale                   element (e, n, k)
  w16      bf16 / fp16 [E, N, K]       none                    data, fp32 accumulation
  w8-int   int8 [E, N, K]              fp16 [E, N, K/G]        q * scale
  w4-int   uint8 [E, N, K/2]           fp16 [E, N, K/G]        (nibble - 8) * scale
  mxfp4    uint8 [E, N, K/2] e2m1      uint8 e8m0 [E, N, K/32]  e2m1(code) * 2^(scale - 127)
  mxfp8    uint8 [E, N, K] e4m3fn      uint8 e8m0 [E, N, K/32]  e4m3(code) * 2^(scale - 127)
  a8w8-int int8 [E, N, K]              fp16 [E, N, K/G]        q * scale, activations int8 per row
                                                               and block of 32 (group-wise form)
  a8w8-int int8 [E, N, K]              fp32 [E, N, 1]          q * scale, activations int8 per row
                                                               (per-channel form)
  a8w4-int uint8 [E, N, K/2] u = q + 8 fp16 [E, N, K/G]        (u - 8) * scale, activations int8 per
                                                               row and block of 32 (group-wise form)
  a8w4-int uint8 [E, N, K/2] u = q + 8 fp32 [E, N, 1]          (u - 8) * scale, activations int8 per
                                                               row (per-channel MSD form)

  (4-bit: byte j of a row holds element 2j in its low nibble, 2j+1 in its high one.)

Every weight is dequantized exactly (the products q * scale are representable in fp32) and
dotted with fp32 activations, so y equals the format's reference (dequantize, then the fp32 MoE)
up to the order of the fp32 sums.  One exception, for speed: on AVX2 the 4- and 8-bit integer
loops (on AVX-512 w8-int's, and w4-int's with VNNI) take an expert's single row as int16 blocks of 32 (qdecode.c:
quantize_i16; up to ~5e-5 of the output's scale from the reference; ``MOE_COMPILE_QDECODE_I16=0``
turns it off).  The kernel reads the canonical tensors as they are, with one exception: a w4-int
or group-wise a8w4-int role's (w8-int's too) chunk of 1-4 slots of one expert
(every slot at T = 1, most at T <= 16) reads the role's qgemm panels instead (``expert_rows16``: the prefill tiles' 16-row
panels from ``pack_cache``, made there once), one int32 lane per row, each vector unpacked once
for the chunk's slots (qdecode.c: rows16_attach, rows16_chunk; AVX-512 VNNI loops, or AVX2 ones
with the same sums).

``a8w8-int`` / ``a8w4-int`` quantize the activations per row as their reference does (x per token,
FC2's input per slot, ``quantize_per_token_int8``) and sum int8 x int8 / int4 exactly in int32
(``vpmaddubsw``; the a8w4 nibbles u = q + 8 less 8 sum(q_x)), then scale in the reference's order
(acc * s_x) * s_w.  Group-wise a8w4-int and a8w8-int quantize them per row and block of 32
(``quantize_per_block_int8``) and scale each block's exact int32 sum once, (acc_b * s_x,b) * s_w,g:
a8w4 ``vpdpbusd`` 128 elements a step where the CPU has AVX-512 VNNI and K is a multiple of 128,
``vpmaddubsw`` 64 a step otherwise (and under ``MOE_COMPILE_FUSED_ISA=avx2``); a8w8 ``vpdpbusd``
64 a step (K a multiple of 64, VNNI) or ``vpmaddubsw`` with the sign trick 32 a step; G one of 32,
64 or a multiple of 128.  Their results differ from the reference by fp32 rounding alone (each
block's sum is scaled as 4 (a8w4) or 8 (a8w8) exact int32 partials, then summed in another order).  ``a8w8-fp8`` has no CPU kernel.

The C file is built on first use (``cpu_cc``); ``MOE_COMPILE_QDECODE=0`` turns it off.  It runs
AVX-512 where the CPU has it, AVX2 otherwise; ``MOE_COMPILE_FUSED_ISA=avx2`` (the switch
``experts.py`` reads) runs the AVX2 loops on an AVX-512 CPU, to measure what AVX2-only CPUs get.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import torch

from moe_compile.ir import FFNAttrs
from moe_compile.kernels.cpu import cc as cpu_cc, isa as cpu_isa
from moe_compile.kernels.cpu.isa import ISA_AVX2, ISA_AVX512, ISA_ENV  # noqa: F401  (callers name the tiles here)
from moe_compile.quant.common import GROUPED_A8, a8_group_tiles, grouped_a8

ENV = "MOE_COMPILE_QDECODE"
I16_ENV = "MOE_COMPILE_QDECODE_I16"  # "0": one row's activations stay fp32 (qdecode.c: i16_form)
MAX_ROWS = 16  # tokens per call: decode (the prefill kernel takes more)
GROUP_MULTIPLE = 32  # scale groups must span whole 32-element blocks (a 16-byte load of 4-bit codes)
_FORMATS = {"w16-bf16": 1, "w16-fp16": 2, "w8-int": 3, "w4-int": 4, "mxfp4": 5, "mxfp8": 6, "a8w8-int": 7,
            "a8w4-int": 8, "a8w4-int-grouped": 9, "a8w8-int-grouped": 10}  # the C file's FMT_*
SERVED = ("w16", "w8-int", "w4-int", "mxfp4", "mxfp8", "a8w8-int", "a8w4-int")
_NO_KERNEL = ("a8w8-fp8",)
_KERNEL = cpu_cc.Kernel("qdecode", ENV,
                        {"moe_qdecode_run": ([ctypes.c_void_p, ctypes.c_float, ctypes.c_int64], ctypes.c_int),
                         "moe_qdecode_best_isa": ([], ctypes.c_int64),
                         "moe_qdecode_rows16_loop": ([ctypes.c_int64] * 5, ctypes.c_int64),
                         "moe_qdecode_a8g_matmul": ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                                     ctypes.c_int64, ctypes.c_void_p], ctypes.c_int)},
                        "quantized decode is not served by qdecode")


def unavailable_reason(fmt: str) -> str | None:
    """None when this CPU runs ``fmt`` here; else why not."""
    if fmt in _NO_KERNEL:
        return f"qdecode serves {SERVED}; {fmt} has no CPU kernel (no fp8 arithmetic here)"
    if fmt not in SERVED:
        return f"unknown format {fmt!r}; qdecode serves {SERVED}"
    return _kernel_reason()


@functools.cache
def _kernel_reason() -> str | None:
    """Why the kernel cannot run on this machine (asked once), or None."""
    if _KERNEL.lib() is None:
        return f"qdecode kernel unavailable: {_KERNEL.error()}"
    if _KERNEL.lib().moe_qdecode_best_isa() == 0:
        return "qdecode needs AVX2 + FMA + F16C"
    return None


def kernel_address() -> int | None:
    """The address of ``moe_qdecode_run`` (``decode_op.cpp`` calls it directly), None without the kernel."""
    if _kernel_reason() is not None:
        return None
    return ctypes.cast(_KERNEL.lib().moe_qdecode_run, ctypes.c_void_p).value


def role_fields(w, n: int, k: int) -> list[int]:
    """The C side's [data, scale, format code, group] of a role, logically [E, n, k] (checked)."""
    return _role_fields(w, "weight", n, k)


ROWS16 = 16  # rows the rows16 loops' weight interleaves (qdecode.c: rows16_dot_vnni; qgemm's PANEL)


def rows16_runs(w) -> bool:
    """Whether qdecode.c's rows16 loops would run this weight ([E, N, K]: a dense weight at T = 1, an
    expert role at a slot of its own), read from its qgemm panels (``qgemm._code_panels``: 16 rows
    interleaved, 4 bytes a lane): N a multiple of 16, K of 128, G 32, 64 or a multiple of 128, and
    w4-int or w8-int (neither under ``MOE_COMPILE_QDECODE_I16=0``) or group-wise a8w4-int, on
    AVX-512 VNNI or AVX2 (the two ISAs' loops give the same sums, bit for bit).  The C side's own
    answer (``moe_qdecode_rows16_loop``), so the two never disagree."""
    if unavailable_reason(w.fmt) is not None:
        return False
    return bool(_KERNEL.lib().moe_qdecode_rows16_loop(_format_code(w), w.shape[1], w.shape[2], w.group, best_isa()))


def expert_rows16(w, pack_cache) -> tuple | None:
    """An expert role's rows16 panels (data, scale) where ``rows16_runs`` holds: its qgemm pack from
    ``pack_cache``, the very panels the prefill tiles read (made here if no prefill made them yet);
    None otherwise, or without a cache."""
    if pack_cache is None or not rows16_runs(w):
        return None
    from moe_compile.kernels.cpu import qgemm

    p = qgemm.packed(w, pack_cache)
    return p.data, p.scale


def rows16_fields(rows16) -> list[int]:
    """The linear plan's [rows16 data, rows16 scale] pointers (a weight's panels' data [N/16, K/8 x
    64] and scales [N/16, K/G, 16]): 0, 0 without them."""
    return [0, 0] if rows16 is None else [rows16[0].data_ptr(), rows16[1].data_ptr()]


@functools.cache
def best_isa() -> int:
    """ISA_AVX512 where the CPU has it (F, BW, DQ, VL), else ISA_AVX2, or what ``MOE_COMPILE_FUSED_ISA``
    asks for (read once)."""
    return cpu_isa.choose(int(_KERNEL.lib().moe_qdecode_best_isa()))


def _format_code(w) -> int:
    if w.fmt == "w16":
        if w.data.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"qdecode: w16 data must be bf16 or fp16, got {w.data.dtype}")
        return _FORMATS["w16-bf16" if w.data.dtype == torch.bfloat16 else "w16-fp16"]
    if w.fmt in GROUPED_A8 and w.grouped_activations:
        return _FORMATS[f"{w.fmt}-grouped"]
    return _FORMATS[w.fmt]


def _check_role(w, name: str, n: int, k: int) -> None:
    """What a role's format, logical shape and group must be (no tensor read: ``check_call``)."""
    reason = unavailable_reason(w.fmt)
    if reason is not None:
        raise ValueError(f"qdecode: {name}: {reason}")
    if tuple(w.shape[1:]) != (n, k):
        raise ValueError(f"qdecode: {name} must be logically [E, {n}, {k}], got {tuple(w.shape)}")
    if w.fmt != "w16" and (w.group % GROUP_MULTIPLE or k % w.group):
        raise ValueError(f"qdecode: {name} group {w.group} must be a multiple of {GROUP_MULTIPLE} dividing {k}")
    if grouped_a8(w, k) and not a8_group_tiles(w.group):
        raise ValueError(f"qdecode: {name} group-wise {w.fmt} needs a group of 32, 64 or a multiple of 128, "
                         f"got {w.group}")


def check_call(x: torch.Tensor, w1, w2, attrs: FFNAttrs) -> None:
    """Raise ValueError saying why ``run`` cannot take a call of these rows, roles (anything with
    ``fmt``, ``shape``, ``group``) and attributes; return None when it can.  Reads no weight data."""
    T, H = x.shape
    E, F2, _ = w1.shape
    if T > MAX_ROWS:
        raise ValueError(f"qdecode serves at most {MAX_ROWS} tokens per call, got {T} (prefill: qgemm)")
    if attrs.activation != "silu" or attrs.weight_on not in ("output", "between"):
        raise ValueError(f"qdecode runs SwiGLU experts weighted on the output or between, got activation="
                         f"{attrs.activation!r} weight_on={attrs.weight_on!r}")
    _check_role(w1, "w1 (FC1)", F2, H)
    _check_role(w2, "w2 (FC2)", H, F2 // 2)
    if w2.shape[0] != E:
        raise ValueError(f"qdecode: w1 has {E} experts, w2 {w2.shape[0]}")


def _check_weight(w, name: str, n: int, k: int) -> None:
    """The tensors the C side reads: [E, n, k'] contiguous CPU data, contiguous scales."""
    E = w.shape[0]
    packed_k = k // 2 if w.fmt in ("w4-int", "mxfp4", "a8w4-int") else k
    if tuple(w.data.shape) != (E, n, packed_k) or not w.data.is_contiguous() or w.data.device.type != "cpu":
        raise ValueError(f"qdecode: {name} data must be contiguous CPU [{E}, {n}, {packed_k}], got "
                         f"{tuple(w.data.shape)} on {w.data.device}")
    if w.fmt != "w16":
        groups = k // w.group
        if w.scale.numel() != E * n * groups or not w.scale.is_contiguous():
            raise ValueError(f"qdecode: {name} scale must be contiguous [{E}, {n}, {groups}], got {tuple(w.scale.shape)}")


# Weights already checked: id -> (weak reference, the C side's fields).  Checking a weight's
# shapes, dtypes and strides costs ~3-7 us a call, 5-8% of a 4-bit Mixtral decode step's roof;
# a QuantWeight is frozen, so once is enough (the weak reference tells a reused id apart).
_CHECKED: dict[int, tuple] = {}


ROLE_FIELDS = 4  # the C side's W_FIELDS: data, scale, format code, group


def _role_fields(w, name: str, n: int, k: int) -> list[int]:
    """[data, scale, format code, group] of a weight, checked the first time it is seen."""
    hit = _CHECKED.get(id(w))
    if hit is not None and hit[0]() is w and hit[2] == (n, k):
        return hit[1]
    _check_weight(w, name, n, k)
    scale = w.scale.data_ptr() if w.fmt != "w16" else 0
    fields = [w.data.data_ptr(), scale, _format_code(w), w.group if w.fmt != "w16" else w.shape[2]]
    if len(_CHECKED) > 4096:  # weights of dropped models: forget their entries
        for key in [key for key, (ref, _, _) in _CHECKED.items() if ref() is None]:
            del _CHECKED[key]
    _CHECKED[id(w)] = (weakref.ref(w), fields, (n, k))
    return fields


def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w2, attrs: FFNAttrs, pack_cache=None,
        isa: int | None = None, canonical: bool = True) -> torch.Tensor:
    """y [T, H] of a decode step: sum over each token's K slots of weight * FFN_e(x), FFN_e the
    SwiGLU of w1 / w2 dequantized (``attrs.limit`` clamps as in ``kernels/reference.py``; the
    weight multiplies FC2's output, or its input for weight_on "between").  Ids outside [0, E)
    contribute nothing.  ``pack_cache``: the layer's kernel cache, where a 4-bit role's rows16
    panels are found (``expert_rows16``; None: the canonical tensors alone);
    ``isa``: force ISA_AVX2 / ISA_AVX512 (tests), default ``best_isa()``; ``canonical`` False: w1 / w2
    are views of panels in ``pack_cache`` (``qgemm.adopt``), not canonical bytes, and only the
    rows16 loops read them (both roles must have them: ``rows16_runs``)."""
    T, H = x.shape
    E, F2, _ = w1.shape
    F = F2 // 2
    check_call(x, w1, w2, attrs)
    if not (x.dtype == weights.dtype == torch.float32 and x.is_contiguous() and weights.is_contiguous()):
        raise ValueError(f"qdecode: x and weights must be contiguous fp32, got {x.dtype} / {weights.dtype}")
    if ids.dtype != torch.int64 or not ids.is_contiguous() or ids.shape != weights.shape or ids.shape[0] != T:
        raise ValueError(f"qdecode: ids must be contiguous int64 [T, K] like weights {tuple(weights.shape)}, "
                         f"got {ids.dtype} {tuple(ids.shape)}")
    fields = _role_fields(w1, "w1 (FC1)", 2 * F, H) + _role_fields(w2, "w2 (FC2)", H, F)
    isa = isa or best_isa()
    r16 = expert_rows16(w1, pack_cache), expert_rows16(w2, pack_cache)
    if not canonical:
        if None in r16:
            raise ValueError(f"qdecode: {w1.fmt} weights kept as panels alone need the rows16 loops for both roles "
                             f"(rows16_runs: {w1.fmt} group {w1.group}, H={H}, F={F}, this CPU's ISA)")
        fields = [0, *fields[1:ROLE_FIELDS], 0, *fields[ROLE_FIELDS + 1:]]  # no canonical data pointers
    fields += rows16_fields(r16[0]) + rows16_fields(r16[1])
    y = torch.zeros(T, H, dtype=torch.float32)
    plan = [x.data_ptr(), T, H, F, ids.data_ptr(), ids.shape[1], E, weights.data_ptr(), y.data_ptr(),
            int(attrs.weight_on == "between"), isa, *fields]
    status = _KERNEL.lib().moe_qdecode_run((ctypes.c_int64 * len(plan))(*plan), attrs.limit, torch.get_num_threads())
    if status == -1:
        raise MemoryError("qdecode: could not allocate its scratch")
    if status != 0:
        raise RuntimeError(f"qdecode: the kernel refused isa={isa}, formats {w1.fmt} / {w2.fmt} (status {status})")
    return y


def grouped_matmul(x: torch.Tensor, w, e: int, isa: int | None = None) -> torch.Tensor:
    """Test entry: y [T, N] = x [T, K] . W_e^T of a group-wise a8w4-int / a8w8-int weight by the
    decode loops alone (one thread), to compare with the format's ``grouped_matmul``
    (``quant.a8w4_int`` / ``quant.a8w8_int``)."""
    if w.fmt not in GROUPED_A8 or not w.grouped_activations:
        raise ValueError(f"qdecode.grouped_matmul: a group-wise a8w4-int / a8w8-int weight, got {w.fmt} "
                         f"scale {w.scale.dtype}")
    x = x.float().contiguous()
    T, K = x.shape
    N = w.shape[1]
    y = torch.empty(T, N)
    status = _KERNEL.lib().moe_qdecode_a8g_matmul(x.data_ptr(), T, K, w.data[e].data_ptr(), w.scale[e].data_ptr(), N,
                                                  w.group, isa or best_isa(), _format_code(w), y.data_ptr())
    if status != 0:
        raise ValueError(f"qdecode.grouped_matmul refused {w.fmt} T={T} K={K} N={N} group={w.group} (status {status})")
    return y

