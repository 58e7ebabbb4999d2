"""Host side of ``experts.c``: every expert's SwiGLU FFN of a CPU prefill call in one C call.

Shapes:  T tokens, H hidden, F expert FFN width, E experts; S' valid slots sorted by expert,
         expert e owning rows [bounds[e], bounds[e+1]) (relative to bounds[0]) of ``tokens`` [S']
         and ``scale`` [S'].

The weights run packed in 16-row panels (``pack``), made once by ``cpu_prepack`` like oneDNN's
packs and in their place where ``fits`` says this kernel takes the call: fp32, SwiGLU (clamped or
not), gate and up concatenated, interleaved or separate, the routing weight on the output or
between activation and FC2, no biases, H a multiple of 32 and F of 16.  The tile is AVX-512 where
the CPU has it, AVX2 otherwise: both beat the per-expert oneDNN loop with its row steps (2-core CI
VM, fp32, 2 threads, medians of 10; ``benchmarks/bench_cpu_moe.py`` has the model-level figures):

  fine-grained T=512       AVX-512 65 ms, AVX2 71, oneDNN loop 82 (dense-GEMM roof 69)
  same, oneDNN held to AVX2 (as on a CPU without AVX-512): AVX2 80, oneDNN loop 94
  Mixtral T=2048, oneDNN held to AVX2:                     AVX2 263, oneDNN loop 286
  (the last two with the AVX2 tile before it read A tile-packed: it is 3-6% faster now)

Built on first use (``cpu_cc``); where it cannot be, or ``MOE_COMPILE_FUSED=0``, ``fits`` is False
and prefill keeps the oneDNN loop.  ``MOE_COMPILE_FUSED_ISA=avx2`` runs the AVX2 tile on a CPU with
AVX-512 (to measure what a CPU without it gets).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu import cc as cpu_cc, isa as cpu_isa, memory as cpu_memory
from moe_compile.kernels.cpu.isa import ISA_AVX2, ISA_AVX512, ISA_ENV  # noqa: F401  (callers name the tiles here)

ENV = "MOE_COMPILE_FUSED"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_KERNEL = cpu_cc.Kernel(
    "experts", ENV,
    {"moe_experts_run": ([_PTR, _PTR, _PTR, _I64, ctypes.c_float, _I64], _I64),
     "moe_experts_pack": [_PTR, _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _I64],
     "moe_experts_best_isa": ([], _I64)},
    "prefill keeps oneDNN GEMMs per expert")
PANEL = 16  # output rows per packed panel (the C file's PANEL)
MAX_TILE_ROWS = 8  # the C file's MR_MAX
H_MULTIPLE, F_MULTIPLE = 32, 16  # FC2's widest tile spans 32 columns of y; FC1's 16 features
_GATE_UPS = ("concat", "interleaved", "separate")
# Rows of one expert per FC1 -> FC2 step: the scratch for FC1's output is 2 x CHUNK_ROWS x F
# whatever T is (4 MiB at F=1024; an expert's whole [n, F] would be ~1 GiB for a real Mixtral,
# F=14336, at T=32k), and the weights re-read per extra chunk cost ~3% of its arithmetic.
CHUNK_ROWS = 512


def available() -> bool:
    return _KERNEL.lib() is not None


def unavailable_reason() -> str | None:
    return _KERNEL.error()




@functools.cache
def best_isa() -> int:
    """ISA_AVX512 where the CPU has it, else ISA_AVX2, or what ``MOE_COMPILE_FUSED_ISA`` asks for
    (asked once: ``run`` reads it every call)."""
    return cpu_isa.choose(int(_KERNEL.lib().moe_experts_best_isa()))


def fits(x: torch.Tensor, w: ExpertWeights, attrs: FFNAttrs) -> bool:
    """Whether this kernel runs these experts (see the module docstring); weights fp32 on CPU."""
    if not (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1):
        return False
    if attrs.activation != "silu" or attrs.gate_up not in _GATE_UPS or attrs.weight_on not in ("output", "between"):
        return False
    if w.fc1_bias or w.fc1_up_bias or w.fc2_bias or bool(w.fc1_up) != (attrs.gate_up == "separate"):
        return False
    roles = [t for role in (w.fc1, w.fc1_up, w.fc2) for t in role]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in roles):
        return False
    return w.hidden() % H_MULTIPLE == 0 and w.ffn() % F_MULTIPLE == 0 and available()


def pack(t: torch.Tensor, transposed: bool, deinterleave: bool = False) -> list[torch.Tensor]:
    """The experts' weights held in t (stacked [E, out, in], or one expert's [out, in]; [.., in,
    out] when ``transposed``) in panels, one 1-D view per expert into a single new tensor.
    ``deinterleave``: rows (gate0, up0, gate1, up1, ...) are packed as all gates, then all ups."""
    stacked = t if t.dim() == 3 else t.unsqueeze(0)
    if transposed:
        stacked = stacked.transpose(1, 2)  # [E, out, in] view, no copy: the C side takes strides
    if deinterleave:
        stacked = torch.cat([stacked[:, 0::2], stacked[:, 1::2]], 1)  # a one-time copy, at packing
    count, out, inner = stacked.shape
    if out % PANEL:
        raise ValueError(f"cpu_experts.pack: {out} output rows is not a whole number of {PANEL}-row panels")
    packed = torch.empty(count, out * inner, dtype=torch.float32)
    with torch.no_grad():
        _KERNEL.lib().moe_experts_pack(stacked.data_ptr(), count, stacked.stride(0), stacked.stride(1),
                                       stacked.stride(2), out, inner, packed.data_ptr(), torch.get_num_threads())
    return list(packed)


def _expert_table(packed, hidden: int, ffn: int):
    """(gate, up, down) pointers of every expert as an int64 ctypes array [E * 3]."""
    up_offset = 4 * ffn * hidden  # concatenated: up's panels follow gate's F / 16
    ups = ([p.data_ptr() for p in packed.fc1_up] if packed.fc1_up is not None
           else [p.data_ptr() + up_offset for p in packed.fc1])
    flat = [ptr for triple in zip((p.data_ptr() for p in packed.fc1), ups, (p.data_ptr() for p in packed.fc2))
            for ptr in triple]
    return (ctypes.c_int64 * len(flat))(*flat)


def run(x, tokens, scale, packed, w: ExpertWeights, attrs: FFNAttrs, bounds: list, threads: int,
        isa: int | None = None, x_at: torch.Tensor | None = None, y_at: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, H] = sum over each token's slots of scale * FFN_e(x[token]).  ``tokens`` int64 [S'],
    ``scale`` [S'] or [S', 1] fp32, ``packed`` ``cpu_prepack.PackedExperts`` of panels, ``bounds``
    the E+1 host segment bounds of the sort.  ``isa``: force a tile (tests); default the best.
    ``x_at`` / ``y_at`` int64 [S'] (the expert-parallel op's rows by address): where nonzero, the
    address slot i's x row is read at (H fp32) / its output row, scale * FFN_e, is stored at
    (instead of added into y[token]); the caller keeps those rows alive and apart."""
    T, H = x.shape
    F = w.ffn()
    isa = isa or best_isa()
    scale = scale.reshape(-1)
    if tokens.dtype != torch.int64 or not tokens.is_contiguous() or scale.dtype != torch.float32 \
            or not scale.is_contiguous() or scale.shape != tokens.shape:
        raise ValueError(f"cpu_experts.run: tokens must be contiguous int64 [S'] and scale contiguous fp32 [S'], got "
                         f"{tokens.dtype} {tuple(tokens.shape)} and {scale.dtype} {tuple(scale.shape)}")
    for name, at in (("x_at", x_at), ("y_at", y_at)):
        if at is not None and (at.dtype != torch.int64 or not at.is_contiguous() or at.shape != tokens.shape):
            raise ValueError(f"cpu_experts.run: {name} must be contiguous int64 {tuple(tokens.shape)}, got "
                             f"{at.dtype} {tuple(at.shape)}")
    y = torch.zeros(T, H, dtype=torch.float32)
    rel = [b - bounds[0] for b in bounds]
    chunk = max(1, min(CHUNK_ROWS, max((b - a for a, b in zip(rel, rel[1:])), default=0)))
    # FC1's output of two chunks (the C side's layout: its tiles' rows rounded up).
    scratch = cpu_memory.empty((2 * (chunk + MAX_TILE_ROWS) * F,), torch.float32, x.device)
    fields = (ctypes.c_int64 * 13)(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), tokens.data_ptr(),
                                   scale.data_ptr(), H, F, chunk, scratch.data_ptr(), isa,
                                   0 if x_at is None else x_at.data_ptr(), 0 if y_at is None else y_at.data_ptr())
    status = _KERNEL.lib().moe_experts_run(fields, _expert_table(packed, H, F), (ctypes.c_int64 * len(rel))(*rel),
                                           len(rel) - 1, attrs.limit, threads)
    if status == -2:
        raise MemoryError(f"cpu_experts: no memory for {4 * (chunk + MAX_TILE_ROWS) * H} B of packed rows")
    if status != 0:
        raise RuntimeError(f"cpu_experts: the kernel refused H={H}, F={F}, isa={isa} (status {status})")
    return y
