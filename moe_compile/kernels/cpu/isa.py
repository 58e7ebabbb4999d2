"""The one place where a C kernel's tile is chosen from what the CPU has and what the user asked.

Each kernel's C file reports the best tile this CPU runs (``*_best_isa`` / feature bits read with
``__builtin_cpu_supports``); ``MOE_COMPILE_FUSED_ISA`` then holds every kernel (``experts``,
``qdecode``, ``qgemm``, ``skinny``, ``attention``) to its AVX2 tiles with ``avx2`` — how an
AVX2-only CPU runs, measured on an AVX-512 machine — or insists on AVX-512 with ``avx512`` (an
error where the CPU lacks it).
"""

from __future__ import annotations

import functools
import os

import torch

ISA_AVX2, ISA_AVX512 = 2, 512
ISA_ENV = "MOE_COMPILE_FUSED_ISA"
_NAMES = {"avx2": ISA_AVX2, "avx512": ISA_AVX512}


def asked() -> str:
    """What ``MOE_COMPILE_FUSED_ISA`` asks for ("" when unset); any other value is an error naming the choices."""
    value = os.environ.get(ISA_ENV, "").lower()
    if value and value not in _NAMES:
        raise ValueError(f"{ISA_ENV}={value!r}: use one of {sorted(_NAMES)} (or leave it unset)")
    return value


def choose(native: int, lacking: str = "AVX-512") -> int:
    """The tile to run: ``native`` (the best this CPU runs) unless the environment asks for another;
    asking for more than the CPU has is an error saying what it lacks (``lacking``)."""
    value = asked()
    if not value:
        return native
    if _NAMES[value] > native:
        raise ValueError(f"{ISA_ENV}={value}: this CPU has no {lacking} (use avx2 or leave it unset)")
    return _NAMES[value]


def cpu_flags() -> set:
    """The CPU's feature flags (Linux /proc/cpuinfo), or torch's capability string's words elsewhere."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {torch.backends.cpu.get_cpu_capability().lower()}


PREFILL_BF16_ENV = "MOE_COMPILE_PREFILL_BF16"


def prefill_dtype(fmt: str) -> torch.dtype:
    """A quantized dense linear's prefill GEMM dtype: bf16 where the CPU has AMX-BF16 or AVX-512 BF16
    (oneDNN's bf16 GEMM there is 3-6x its fp32 one; rounding the activations to bf16, 2^-9 relative,
    is far below the weights' own 4- or 8-bit error), fp32 for w16 (its fp16 weights hold ~70 dB,
    which bf16 activations would cap near 50) and on other CPUs.  ``MOE_COMPILE_PREFILL_BF16=0``:
    fp32 always.  ``MOE_COMPILE_FUSED_ISA=avx2`` (how an AVX2-only CPU runs) takes fp32 as such a
    CPU does: oneDNN held to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``) has no bf16 multiply and converts
    instead (a 4-layer Qwen3-MoE's 512-token w4-int prefill on Zen 4 held to AVX2: the dense
    GEMMs 2.18 -> 0.49 s, the prefill 3.80 -> 1.59 s)."""
    if fmt == "w16" or os.environ.get(PREFILL_BF16_ENV) == "0":
        return torch.float32
    return torch.bfloat16 if _native_bf16() else torch.float32


def _native_bf16() -> bool:
    """Whether this run multiplies bf16 natively: the CPU's flags, unless the ISA switch holds every
    kernel to AVX2 (read per call: the switch is an environment variable)."""
    return asked() != "avx2" and _bf16_flags()


@functools.cache
def _bf16_flags() -> bool:
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
