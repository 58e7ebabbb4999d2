"""Host side of ``qgemm.c``: quantized CPU prefill, every expert's SwiGLU FFN of a call in one C call.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token; S' valid slots
         sorted by expert.  FC1 is the canonical QuantWeight [E, 2F, H] (gate rows, then up rows),
         FC2 [E, H, F] (``moe_compile.quant``'s contract).

Formats:
  a8w8-int / a8w4-int  (per channel) x quantized per token to int8 in the kernel (s =
                       max|x|/127, round half to even), int32 accumulation in an integer GEMM tile (AVX-512 VNNI
                       ``vpdpbusd`` where the CPU has it, AVX2 ``vpmaddubsw`` / ``vpmaddwd``
                       otherwise), y = acc * s_x * s_w, SwiGLU in fp32, FC2's input re-quantized
                       per row, FC2's output weighted into y.  The int32 sums are exact.
  w4-int / mxfp4 / w8-int / w16
                       fp32 activations; each thread dequantizes one 16-row weight panel at a
                       time into a [K][16] fp32 buffer and runs the fp32 tile over the chunk's rows
                       (never a dequantized copy of a whole weight).  Where the CPU has AVX-512
                       BF16, every float format but w16 runs bf16 tiles instead (``bf16_tiles``:
                       the panel and the activations rounded to bf16, fp32 sums; the dense
                       prefill's ``prefill_dtype`` policy and switch).
  a8w4-int / a8w8-int group-wise
                       their own integer semantics on w4-int's / w8-int's panels (the same bytes):
                       x and FC2's input quantized per token and block of 32 in the kernel, each
                       block's int32 sum exact and scaled once, y = sum_b (acc_b s_x) s_w
                       (``block_tiles``: AVX-512 VNNI ``vpdpbusd``, or for a8w4-int AVX2
                       ``vpmaddubsw``).  Elsewhere (a8w8-int on AVX2) and with
                       ``MOE_COMPILE_QGEMM_BLOCK_TILES=0``: the float panels on activations
                       quantized per block and dequantized (x here, FC2's input in the kernel), the
                       reference's result up to fp32 rounding.

Each canonical weight is repacked once (``pack``) into the tiles' panels (``QGemmPack``: the same
bytes as the canonical tensors plus int32 column sums for a8w8) and kept in the caller's
``pack_cache``.  ``MOE_COMPILE_FUSED_ISA=avx2`` (the fp32 fused kernel's switch) runs the AVX2 tiles
on a CPU with AVX-512, to measure what a CPU without it gets.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass

import torch

from moe_compile.ir import FFNAttrs
from moe_compile.kernels.cpu import cc as cpu_cc, isa as cpu_isa, memory as cpu_memory
from moe_compile.kernels.cpu.isa import ISA_AVX2, ISA_AVX512
from moe_compile.quant.common import dequantized_blocks, grouped_a8

ENV = "MOE_COMPILE_QGEMM"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_KERNEL = cpu_cc.Kernel(
    "qgemm", ENV,
    {"moe_qgemm_run": ([_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _I64], _I64),
     "moe_qgemm_run_quantized": ([_PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float, _I64], _I64),
     "moe_qgemm_int_matmul": ([_I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR], _I64),
     "moe_qgemm_dequant_panel": ([_I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR], _I64),
     "moe_qgemm_dequant_kn": ([_I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _I64], _I64),
     "moe_qgemm_quantize": [_PTR, _I64, _I64, _PTR, _PTR, _PTR],
     "moe_qgemm_block_quantize": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR],
     "moe_qgemm_cpu_features": ([], _I64)},
    "quantized prefill is unavailable")
PANEL = 16  # output rows per packed panel (the C file's PANEL)
MAX_TILE_ROWS = 8  # the C file's MR_MAX
H_MULTIPLE, F_MULTIPLE = 32, 16  # FC2's widest unit spans 32 columns of y; FC1's 16 features
FORMAT_CODES = {"a8w8-int": 1, "a8w4-int": 2, "w8-int": 3, "w4-int": 4, "mxfp4": 5, "mxfp8": 8}  # w16: 6 bf16, 7 fp16
INTEGER = ("a8w8-int", "a8w4-int")
GROUPED_PANELS = {"a8w4-int": "w4-int", "a8w8-int": "w8-int"}  # a group-wise a8 form's float panels
FORMATS = (*FORMAT_CODES, "w16")
# Rows of one expert per FC1 -> FC2 step (experts.py's reason: FC1's fp32 scratch is 2 x CHUNK_ROWS x F
# whatever T is, and the weights re-read per extra chunk cost a few % of the arithmetic).
CHUNK_ROWS = 512


def available() -> bool:
    return _KERNEL.lib() is not None


def _features() -> int:
    return int(_KERNEL.lib().moe_qgemm_cpu_features())


def unavailable_reason(fmt: str) -> str | None:
    """None where this CPU runs ``fmt``'s prefill kernel in this module, else why not."""
    if fmt not in FORMATS:
        return f"qgemm has no kernel for {fmt!r} (it runs {', '.join(FORMATS)})"
    return _KERNEL.error()


def best_isa(fmt: str) -> int:
    """The tile ``fmt`` runs on: ISA_AVX512 where the CPU has AVX-512F (float formats, and
    ``"grouped"``: a group-wise a8 form's float panels) or AVX-512 VNNI + BW (integer formats), else
    ISA_AVX2; ``MOE_COMPILE_FUSED_ISA=avx2`` forces AVX2."""
    need = 2 if fmt in INTEGER else 1  # "grouped": the float tiles
    native = ISA_AVX512 if _features() & need == need else ISA_AVX2
    return cpu_isa.choose(native, f"{'AVX-512 VNNI' if fmt in INTEGER else 'AVX-512'} for {fmt}")


BLOCK_TILES_ENV = "MOE_COMPILE_QGEMM_BLOCK_TILES"
ACT_FLOAT, ACT_INT = 1, 2  # the C call's act_blocks: float panels on dequantized blocks / the block tiles


def block_tiles(p, isa: int) -> bool:
    """Whether a call on ``p``'s panels (a QGemmPack or its canonical QuantWeight) at tile ``isa``
    runs the integer block tiles
    (``blocktiles.h``): group-wise a8w4-int (either ISA) or a8w8-int (AVX-512 VNNI) with groups of
    whole 32-element blocks, unless ``MOE_COMPILE_QGEMM_BLOCK_TILES=0``.  Why the default: they
    multiply the stored codes (4 products a lane and instruction) where the float panels
    dequantize every weight first: one MoE layer's 512-token prefill a8w4-int 0.32-0.33 of the
    float panels' time on a 2-core Xeon (AVX-512 VNNI), 0.57-0.66 under the AVX2 switch
    (BENCHMARKS.md, bench_quant_prefill.py).  Group-wise a8w8-int on AVX2 keeps its float panels (8-bit
    products need vpmaddubsw's sign trick and a widening a step there: no faster than fp32)."""
    return _block_fits(p, isa) and os.environ.get(BLOCK_TILES_ENV, "1") != "0"


def _block_fits(p, isa: int) -> bool:
    """Whether the block tiles compute ``p``'s format at ``isa`` at all (block_tiles less the switch)."""
    if not _grouped(p) or p.group % 32 or p.fmt not in ("a8w4-int", "a8w8-int"):
        return False
    return p.fmt == "a8w4-int" or (isa == ISA_AVX512 and bool(_features() & 2))


def bf16_tiles(p: "QGemmPack", isa: int) -> bool:
    """Whether a call on ``p``'s panels runs the bf16 tiles: a float format other than w16 on the
    AVX-512 tile, a CPU with AVX-512 BF16 whose bf16 dot product outruns its fp32 FMA (not an AMX
    CPU: ``_bf16_dot_pays``), and the dense prefill's policy saying bf16 (``isa.prefill_dtype``:
    not with ``MOE_COMPILE_PREFILL_BF16=0`` nor under the AVX2 switch)."""
    if isa != ISA_AVX512 or not float_panels(p) or p.fmt == "w16":
        return False
    return bool(_features() & 4) and _bf16_dot_pays() and cpu_isa.prefill_dtype(p.fmt) == torch.bfloat16


@functools.cache
def _bf16_dot_pays() -> bool:
    """Whether ``vdpbf16ps`` (2 products a lane) beats the fp32 FMA tile on this CPU.  Not where the
    CPU has AMX (Intel Sapphire Rapids and later): there it issues on one port where the FMA
    issues on two, the same products a cycle, and the tiles only add the bf16 rounding and
    conversions: one MoE layer's 512-token prefill, 2-core Xeon with AMX, one process, bf16 / fp32
    tiles w4-int 124 / 87 ms (Mixtral-like), 315 / 236 (Qwen3 shape), mxfp4 111 / 90, 321 / 233
    (BENCHMARKS.md, bench_quant_prefill.py).  On Zen 4 they pay: the experts' w4-int prefill 743 -> 462 ms.  (The dense linears' bf16 GEMMs are oneDNN's, on AMX there: kept.)"""
    return not ({"amx_bf16", "amx_tile"} & cpu_isa.cpu_flags())


@dataclass(frozen=True)
class QGemmPack:
    """One role of all E experts in the tiles' panels (see qgemm.c's header for the byte order).

    data:   uint8 [E, N/16, panel bytes]
    scale:  integer formats fp32 [E, N] (per channel); float formats the group scales in panel
            order [E, N/16, K/G, 16] in the canonical dtype (fp16, or e8m0 bytes for mxfp4);
            w16: empty
    colsum: a8w8-int: int32 [E, N] = sum_k q (undoes vpdpbusd's +128 activation offset)
    """

    fmt: str
    code: int  # the C file's FMT_* value
    data: torch.Tensor
    scale: torch.Tensor
    colsum: torch.Tensor | None
    group: int
    shape: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        extra = self.colsum.nbytes if self.colsum is not None else 0
        return self.data.nbytes + self.scale.nbytes + extra


def _grouped(w) -> bool:
    """Group-wise a8w4-int / a8w8-int (``common.grouped_a8``; a QGemmPack or bare shape by its group)."""
    return grouped_a8(w, w.shape[2])


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> [..., K] nibbles (element 2j low, 2j + 1 high: the contract's order)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def _int_panels(codes: torch.Tensor, four_bit: bool) -> torch.Tensor:
    """One expert's [N, K] codes (int8 q, or nibbles u in [0, 15]) -> the integer tiles' panels,
    uint8 [N/16, panel bytes]: [K/4][16][4] bytes, 4-bit [K/8][16][4] (k%8 >= 4 in the high nibble)."""
    N, K = codes.shape
    u = codes.view(torch.uint8) if codes.dtype == torch.int8 else codes
    if four_bit:
        g = u.reshape(N // PANEL, PANEL, K // 8, 2, 4)
        u = (g[:, :, :, 0] | (g[:, :, :, 1] << 4)).permute(0, 2, 1, 3)  # [N/16, K/8, 16, 4]
    else:
        u = u.reshape(N // PANEL, PANEL, K // 4, 4).permute(0, 2, 1, 3)  # [N/16, K/4, 16, 4]
    return u.reshape(N // PANEL, -1).contiguous()


def _float_panels(t: torch.Tensor) -> torch.Tensor:
    """[..., N, K'] (16-bit weights, or group scales; one expert or a stack) -> [..., N/16, K', 16]
    (column j of a panel contiguous per k), in one copy."""
    N = t.shape[-2]
    return t.reshape(*t.shape[:-2], N // PANEL, PANEL, -1).transpose(-2, -1).contiguous()


def _code_panels(codes: torch.Tensor) -> torch.Tensor:
    """8- or 4-bit codes [..., N, K'] (K' bytes a row, the canonical packing; one expert or a
    stack) -> the float tiles' panels [..., N/16, K'/4, 16, 4]: each 4 bytes of a row side by side
    for the panel's 16 rows, one 64-byte vector whose lane j is row j (8 4-bit or 4 8-bit elements
    a lane).  The same layout qdecode's rows16 loops read, so a dense weight's panels serve its
    T = 1 decode too.  The 4-byte groups move as int32 where the bytes allow it: one copy of
    whole words (a 17 GB model's experts repack ~4x faster than byte by byte)."""
    *lead, N, kb = codes.shape
    words = kb % 4 == 0 and codes.is_contiguous() and codes.data_ptr() % 4 == 0
    if words:
        w32 = codes.view(torch.uint8).view(torch.int32).reshape(*lead, N // PANEL, PANEL, kb // 4)
        return w32.transpose(-2, -1).contiguous().view(torch.uint8).reshape(*lead, N // PANEL, kb // 4, PANEL, 4)
    return codes.reshape(*lead, N // PANEL, PANEL, -1, 4).transpose(-3, -2).contiguous()


def pack(w) -> QGemmPack:
    """The tiles' panels of a canonical QuantWeight (``moe_compile.quant``), expert by expert (the
    only temporaries are one expert's)."""
    E, N, K = w.shape
    if w.fmt not in FORMATS:
        raise ValueError(f"qgemm.pack: no kernel for {w.fmt!r}")
    grouped = _grouped(w)
    if N % PANEL or K % 8:
        raise ValueError(f"qgemm.pack: {w.fmt} weight [{E}, {N}, {K}] needs N a multiple of {PANEL} and K of 8")
    colsum = None
    with torch.no_grad():
        if w.fmt in INTEGER and not grouped:
            four = w.fmt == "a8w4-int"
            data = torch.stack([_int_panels(_unpack_nibbles(d) if four else d, four) for d in w.data])
            scale = w.scale.reshape(E, N).float().contiguous()
            if not four:
                colsum = w.data.sum(dim=2, dtype=torch.int32).contiguous()
        else:  # the whole stack in one copy: no per-expert temporaries, no second copy to stack them
            data = (_float_panels(w.data.view(torch.int16)) if w.fmt == "w16" else _code_panels(w.data))
            data = data.view(torch.uint8).reshape(E, N // PANEL, -1)
            scale = _float_panels(w.scale) if w.fmt != "w16" else torch.empty(0, dtype=torch.float16)
    return QGemmPack(w.fmt, _code(w), data, scale, colsum, w.group, (E, N, K))


def _code(w) -> int:
    """The C file's FMT_* value of a canonical QuantWeight's panels."""
    if _grouped(w):
        return FORMAT_CODES[GROUPED_PANELS[w.fmt]]
    return FORMAT_CODES.get(w.fmt) or (6 if w.data.dtype == torch.bfloat16 else 7)


def code_panels_only(w) -> bool:
    """Whether ``w`` (a canonical QuantWeight) can be kept as its panels alone (``panels_only``):
    a 4- or 8-bit integer-code format whose panels are a byte permutation of its canonical bytes."""
    E, N, K = w.shape
    return (w.fmt in ("w4-int", "w8-int") or (w.fmt == "a8w4-int" and _grouped(w))) and N % PANEL == 0 and K % 8 == 0


def panels_only(w) -> QGemmPack:
    """``pack(w)`` for a weight kept as its panels alone (``code_panels_only``)."""
    if not code_panels_only(w):
        raise ValueError(f"qgemm.panels_only: {w.fmt} group {w.group} [{', '.join(map(str, w.shape))}] is not a "
                         f"4- or 8-bit integer-code weight with N a multiple of {PANEL}")
    return pack(w)


def canonical_from_panels(fmt: str, data: torch.Tensor, scale: torch.Tensor, group: int, shape) -> "QuantWeight":
    """The canonical QuantWeight of panels ``pack`` made of a code format (the inverse permutation of
    ``_code_panels`` and ``_float_panels``): a new tensor, for the reference path only."""
    from moe_compile.quant.common import QuantWeight

    E, N, K = shape
    Kb = K // 2 if fmt in ("w4-int", "a8w4-int") else K
    codes = data.reshape(E, N // PANEL, Kb // 4, PANEL, 4).permute(0, 1, 3, 2, 4).reshape(E, N, Kb)
    codes = codes.view(torch.int8) if fmt in ("w8-int", "a8w8-int") else codes
    scales = scale.reshape(E, N // PANEL, -1, PANEL).transpose(2, 3).reshape(E, N, -1)
    return QuantWeight(fmt, codes.contiguous(), scales.contiguous(), group, (E, N, K))


def adopt(w, p: QGemmPack, pack_cache) -> None:
    """Put panels made elsewhere (a weight kept as its panels alone) in ``pack_cache`` as ``w``'s:
    ``packed(w, pack_cache)`` then finds them instead of packing ``w``."""
    pack_cache[("qgemm", w.fmt, w.data.data_ptr(), tuple(w.shape))] = p


def packed(w, pack_cache) -> QGemmPack:
    """``w``'s panels from ``pack_cache`` (dict-like), packed and stored there on first use."""
    key = ("qgemm", w.fmt, w.data.data_ptr(), tuple(w.shape))
    found = pack_cache.get(key) if pack_cache is not None else None
    if found is None:
        found = pack(w)
        if pack_cache is not None:
            pack_cache[key] = found
    return found


def _expert_table(p1: QGemmPack, p2: QGemmPack):
    """(w1, w2, s1, s2, cs1, cs2) pointers of every expert as an int64 ctypes array [E * 6]."""
    E = p1.shape[0]

    def rows(t):
        return [0] * E if t is None or t.numel() == 0 else [t[e].data_ptr() for e in range(E)]

    flat = [v for six in zip(rows(p1.data), rows(p2.data), rows(p1.scale), rows(p2.scale), rows(p1.colsum),
                             rows(p2.colsum)) for v in six]
    return (ctypes.c_int64 * len(flat))(*flat)


def check_call(x, w1, w2, attrs: FFNAttrs) -> None:
    """Raise a ValueError saying what to change when this kernel cannot compute the call."""
    if w1.fmt != w2.fmt or w1.fmt not in FORMATS:
        raise ValueError(f"qgemm: FC1 {w1.fmt!r} and FC2 {w2.fmt!r} must be one format of {FORMATS}")
    E, N1, H = w1.shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != H or tuple(w2.shape) != (E, H, N1 // 2):
        raise ValueError(f"qgemm: x must be fp32 [T, {H}] and FC2 [{E}, {H}, {N1 // 2}], got x {x.dtype} "
                         f"{tuple(x.shape)}, FC2 {tuple(w2.shape)}")
    if attrs.activation != "silu" or attrs.gate_up == "none" or attrs.weight_on not in ("output", "between"):
        raise ValueError(f"qgemm: runs SwiGLU experts with the routing weight on the output or between "
                         f"(got activation={attrs.activation!r}, weight_on={attrs.weight_on!r})")
    if H % H_MULTIPLE or (N1 // 2) % F_MULTIPLE:
        raise ValueError(f"qgemm: H={H} must be a multiple of {H_MULTIPLE} and F={N1 // 2} of {F_MULTIPLE}")
    if _grouped(w1) != _grouped(w2):
        raise ValueError(f"qgemm: FC1 and FC2 must both be group-wise {w1.fmt} or both per channel")
    if _grouped(w1) and (N1 // 2) % 32:
        raise ValueError(f"qgemm: group-wise {w1.fmt} quantizes FC2's input per 32: F={N1 // 2} must be a multiple of 32")
    if (w1.fmt in INTEGER and not _grouped(w1)) or w1.fmt == "w16":
        return
    for w, K in ((w1, H), (w2, N1 // 2)):  # the panels' scales step a whole group (of byte pairs for 4 bits)
        if w.group < 1 or K % w.group or (w.fmt != "w8-int" and w.group % 2):
            raise ValueError(f"qgemm: {w.fmt} needs a group that divides K={K} (and is even for 4 bits), "
                             f"got {w.group}")


def _scratch(fmt: str, T: int, H: int, F: int, chunk: int):
    """FC1's fp32 output of two chunks, and for integer formats x and FC2's input quantized."""
    rows = chunk + MAX_TILE_ROWS
    a = cpu_memory.empty((2 * rows * F,), torch.float32, torch.device("cpu"))
    if fmt not in INTEGER:
        return a, None
    return a, (torch.empty(T * H, dtype=torch.int8), torch.empty(T), torch.empty(T, dtype=torch.int32),
               torch.empty(rows * F, dtype=torch.int8), torch.empty(rows), torch.empty(rows, dtype=torch.int32))


def run(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w2, attrs: FFNAttrs, pack_cache,
        isa: int | None = None, threads: int | None = None, bf16: bool | None = None,
        block: bool | None = None) -> torch.Tensor:
    """y [T, H] fp32 of the quantized MoE (``quant.reference_moe``'s meaning).  ``x`` [T, H] fp32,
    ``ids`` [T, K] int64 (ids outside [0, E) contribute nothing), ``weights`` [T, K].  ``isa`` /
    ``threads`` / ``bf16`` / ``block``: force a tile / a team size / the bf16 tiles / the integer
    block tiles on or off (tests); default the best, torch's threads, ``bf16_tiles`` and
    ``block_tiles``."""
    from moe_compile.kernels.cpu.forward import sort_by_expert

    check_call(x, w1, w2, attrs)
    T, H = x.shape
    E, F = w1.shape[0], w1.shape[1] // 2
    y = torch.zeros(T, H, dtype=torch.float32)
    if T == 0 or ids.shape[1] == 0:
        return y
    grouped = _grouped(w1)
    isa = isa or best_isa("grouped" if grouped else w1.fmt)
    threads = threads or torch.get_num_threads()
    p1, p2 = packed(w1, pack_cache), packed(w2, pack_cache)
    x = x.contiguous()
    fits = _block_fits(w1, isa) and _block_fits(w2, isa)
    block = fits and block_tiles(w1, isa) if block is None else block
    if block and not fits:
        raise ValueError(f"qgemm: the block tiles run group-wise a8w4-int, or a8w8-int on AVX-512 VNNI, with "
                         f"groups of 32, 64, ...; not {w1.fmt} (group {w1.group}) at isa {isa}")
    if grouped and not block:  # x quantized per block of 32 and dequantized: what the float panels multiply
        x = dequantized_blocks(x)
    order, bounds = sort_by_expert(ids, E)
    valid = order[bounds[0]: bounds[-1]]  # [S'] slots with an id in [0, E)
    tokens = (valid // ids.shape[1]).contiguous()
    scale = weights.reshape(-1).index_select(0, valid).float().contiguous()  # [S']
    rel = [b - bounds[0] for b in bounds]
    chunk = max(1, min(CHUNK_ROWS, max((b - a for a, b in zip(rel, rel[1:])), default=0)))
    a, q = _scratch(GROUPED_PANELS[w1.fmt] if grouped else w1.fmt, T, H, F, chunk)
    qptr = [t.data_ptr() for t in q] if q is not None else [0] * 6
    bf16 = False if block else bf16_tiles(p1, isa) if bf16 is None else bf16
    act = ACT_INT if block else ACT_FLOAT if grouped else 0
    fields = (ctypes.c_int64 * 23)(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), tokens.data_ptr(),
                                   scale.data_ptr(), H, F, w1.group, w2.group, chunk, a.data_ptr(), isa, p1.code,
                                   int(attrs.weight_on == "between"), *qptr, act, int(bf16))
    status = _KERNEL.lib().moe_qgemm_run(fields, _expert_table(p1, p2), (ctypes.c_int64 * len(rel))(*rel),
                                         E, T, attrs.limit, threads)
    if status == -2:
        raise MemoryError("qgemm: no memory for the per-thread dequantization buffers")
    if status != 0:
        raise RuntimeError(f"qgemm: the kernel refused {w1.fmt} H={H}, F={F}, isa={isa} (status {status})")
    return y


def run_quantized_rows(qx: torch.Tensor, sx: torch.Tensor, tokens: torch.Tensor, scale: torch.Tensor, bounds: list,
                       w1, w2, attrs: FFNAttrs, pack_cache, threads: int | None = None) -> torch.Tensor:
    """``run`` on rows that arrive quantized (the expert-parallel int8 dispatch): y [N, H] fp32 =
    sum over slots i of scale[i] * FFN_e(row tokens[i]), e the expert whose ``bounds`` segment holds
    slot i.  ``qx`` [N, H] int8 (quantize_per_token_int8's q; REWRITTEN in place into the tiles'
    form), ``sx`` [N] fp32 its scales, ``tokens`` int64 [S'], ``scale`` fp32 [S'], ``bounds`` the
    E + 1 host segment bounds.  Integer formats (a8w8-int, per-channel a8w4-int) only; the rows are
    never dequantized."""
    if w1.fmt not in INTEGER or _grouped(w1):
        raise ValueError(f"qgemm.run_quantized_rows: integer per-channel formats only (rows quantized per token), got "
                         f"{w1.fmt}{' group-wise (unset MOE_COMPILE_A8W8_GROUP)' if _grouped(w1) else ''}")
    N, H = qx.shape
    E, F = w1.shape[0], w1.shape[1] // 2
    if qx.dtype != torch.int8 or not qx.is_contiguous() or sx.dtype != torch.float32 or sx.numel() != N:
        raise ValueError(f"qgemm.run_quantized_rows: qx int8 [N, H] contiguous and sx fp32 [N], got {qx.dtype} "
                         f"{tuple(qx.shape)}, {sx.dtype} {tuple(sx.shape)}")
    if len(bounds) != E + 1:
        raise ValueError(f"qgemm.run_quantized_rows: {len(bounds)} bounds for {E} experts")
    check_call(torch.empty(0, H), w1, w2, attrs)
    y = torch.zeros(N, H, dtype=torch.float32)
    if N == 0 or bounds[-1] == bounds[0]:
        return y
    isa, threads = best_isa(w1.fmt), threads or torch.get_num_threads()
    p1, p2 = packed(w1, pack_cache), packed(w2, pack_cache)
    rel = [b - bounds[0] for b in bounds]
    chunk = max(1, min(CHUNK_ROWS, max((b - a for a, b in zip(rel, rel[1:])), default=0)))
    a, q = _scratch(w1.fmt, 0, H, F, chunk)  # x's quantized copy is qx / sx themselves
    sums = torch.empty(N, dtype=torch.int32)
    qptr = [qx.data_ptr(), sx.contiguous().data_ptr(), sums.data_ptr()] + [t.data_ptr() for t in q[3:]]
    tokens, scale = tokens.contiguous(), scale.float().contiguous()
    fields = (ctypes.c_int64 * 23)(0, H, y.data_ptr(), y.stride(0), tokens.data_ptr(), scale.data_ptr(), H, F,
                                   w1.group, w2.group, chunk, a.data_ptr(), isa, p1.code,
                                   int(attrs.weight_on == "between"), *qptr, 0, 0)
    status = _KERNEL.lib().moe_qgemm_run_quantized(fields, _expert_table(p1, p2), (ctypes.c_int64 * len(rel))(*rel),
                                                   E, N, attrs.limit, threads)
    if status != 0:
        raise RuntimeError(f"qgemm: the kernel refused {w1.fmt} H={H}, F={F}, isa={isa} (status {status})")
    return y


# ---- test entries: the tiles and the pieces of the run, one at a time ----

def int_matmul(qa: torch.Tensor, p: QGemmPack, e: int, isa: int) -> torch.Tensor:
    """acc [M, N] int32 = qa [M, K] int8 . W_e^T through the integer tiles (exact)."""
    M, K = qa.shape
    N = p.shape[1]
    out = torch.empty(M, N, dtype=torch.int32)
    qa = qa.contiguous()
    cs = p.colsum[e].data_ptr() if p.colsum is not None else None
    status = _KERNEL.lib().moe_qgemm_int_matmul(isa, p.code, qa.data_ptr(), M, K, p.data[e].data_ptr(), cs, N,
                                                out.data_ptr())
    if status != 0:
        raise RuntimeError(f"qgemm.int_matmul refused {p.fmt} M={M} K={K} N={N} isa={isa} (status {status})")
    return out


def dequantized_rows(p: QGemmPack, e: int, isa: int) -> torch.Tensor:
    """Expert e's whole weight [N, K] fp32 through the kernel's panel dequantization (tests only)."""
    E, N, K = p.shape
    out = torch.empty(N // PANEL, K, PANEL)
    scales = p.scale[e].data_ptr() if p.scale.numel() else None
    for panel in range(N // PANEL):
        if _KERNEL.lib().moe_qgemm_dequant_panel(isa, p.code, p.data[e].data_ptr(), scales, panel, K, p.group,
                                                 out[panel].data_ptr()) != 0:
            raise RuntimeError(f"qgemm.dequantized_rows: isa {isa} is not on this CPU")
    return out.transpose(1, 2).reshape(N, K)


def float_panels(w) -> bool:
    """Whether w (a canonical QuantWeight or its QGemmPack) packs into float-format panels (w16,
    w8-int, w4-int, mxfp4, mxfp8, a8w4-int / a8w8-int group-wise): those ``dequantized_weight`` reads."""
    return w.fmt not in INTEGER or _grouped(w)


def dequantized_weight(p: QGemmPack, e: int, dtype: torch.dtype = torch.float32,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Expert e's weight [N, K] in fp32 or bf16 (rounded to nearest even), dequantized from its
    float panels in one threaded C pass: a dense prefill GEMM's operand (kernels/cpu/dense.py).
    The result is the transpose of a contiguous [K, N] tensor (``.t()`` of it is contiguous): what
    the C pass writes with whole-vector stores and torch's GEMM reads as ``x @ w.t()`` without a
    copy.  ``out``: a contiguous tensor of dtype with at least N K elements to write into (its
    first N K), instead of a new one."""
    if not float_panels(p) or dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"qgemm.dequantized_weight: {p.fmt} panels as {dtype} are not served")
    E, N, K = p.shape
    if out is None:
        out = torch.empty(K, N, dtype=dtype)
    elif out.dtype != dtype or not out.is_contiguous() or out.numel() < N * K:
        raise ValueError(f"qgemm.dequantized_weight: out must be a contiguous {dtype} tensor of at least {N * K} "
                         f"elements, got {out.dtype} {tuple(out.shape)}")
    else:
        out = out.view(-1)[: N * K].view(K, N)
    scales = p.scale[e].data_ptr() if p.scale.numel() else None
    isa = best_isa("grouped" if _grouped(p) else p.fmt)
    status = _KERNEL.lib().moe_qgemm_dequant_kn(isa, p.code, p.data[e].data_ptr(), scales, N, K, p.group,
                                                out.data_ptr(), int(dtype == torch.bfloat16),
                                                torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"qgemm.dequantized_weight: {p.fmt} refused (status {status})")
    return out.t()


def quantize_rows(x: torch.Tensor):
    """(q int8 [n, K], s fp32 [n], sum int32 [n]) by the kernel's per-token quantizer."""
    x = x.float().contiguous()
    n, K = x.shape
    q, s, total = torch.empty(n, K, dtype=torch.int8), torch.empty(n), torch.empty(n, dtype=torch.int32)
    _KERNEL.lib().moe_qgemm_quantize(x.data_ptr(), n, K, q.data_ptr(), s.data_ptr(), total.data_ptr())
    return q, s, total


def block_quantized_rows(x: torch.Tensor, bits8: bool = False):
    """(q int8 [n, K], s fp32 [n, K/32], off int32 [n, K/32]) by the block tiles' quantizer, q read
    back from its quads (for 4-bit weights elements 8c + 0, 2, 4, 6 then 8c + 1, 3, 5, 7; for 8-bit
    ones in order, offset by 128); tests only."""
    x = x.float().contiguous()
    n, K = x.shape
    quads, s, off = torch.empty(n, K // 4, dtype=torch.int32), torch.empty(n, K // 32), torch.empty(n, K // 32, dtype=torch.int32)
    _KERNEL.lib().moe_qgemm_block_quantize(x.data_ptr(), n, K, int(bits8), quads.data_ptr(), s.data_ptr(), off.data_ptr())
    if bits8:
        return (quads.view(torch.uint8).reshape(n, K).to(torch.int16) - 128).to(torch.int8), s, off
    paired = quads.view(torch.int8).reshape(n, K // 8, 2, 4)  # [c][low / high nibbles' elements][i]
    q = paired.transpose(2, 3).reshape(n, K)  # element 8c + 2i + h at [c][i][h]
    return q, s, off
