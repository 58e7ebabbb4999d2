"""The one place where a C kernel's tile is chosen from what the CPU has and what the user asked.

Each kernel's C file reports the best tile this CPU runs (``*_best_isa`` / feature bits read with
``__builtin_cpu_supports``); ``MOE_COMPILE_FUSED_ISA`` then holds every kernel (``experts``,
``qdecode``, ``qgemm``, ``skinny``, ``attention``) to its AVX2 tiles with ``avx2`` — how an
AVX2-only CPU runs, measured on an AVX-512 machine — or insists on AVX-512 with ``avx512`` (an
error where the CPU lacks it).
"""

from __future__ import annotations

import os

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
