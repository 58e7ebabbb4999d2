"""MoEConfig: the one frozen, validated configuration of the backend.

Every surface (``torch.compile(..., options=...)``, ``moe_compile.backend(...)``,
``@moe_compile.optimize(...)``, ``explain(..., **options)``) funnels its options through
``MoEConfig.from_options`` so that an unknown key or a bad value fails the same way everywhere,
with a message that lists what is accepted.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

INNER_COMPILERS = ("inductor", "eager")
# Room for "auto", "a8w8-int", ... (docs/architecture.md#devices-and-variants); only "none" is built.
QUANT_POLICIES = ("none",)
DUMP_ENV = "MOE_COMPILE_DUMP"


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Options of the ``moe`` backend.

    verify:        run the original region and the fused op on the first real inputs and compare;
                   a mismatch keeps the original region for that graph and warns with the error.
    dump:          directory for graph dumps (before/after code, report, DOT/SVG); ``None`` reads
                   the ``MOE_COMPILE_DUMP`` environment variable at compile time.
    inner:         what compiles the rewritten graph: ``"inductor"`` (default) or ``"eager"``.
    quant:         quantization policy; only ``"none"`` (keep the model's numerics) exists today.
    min_experts:   smallest expert count worth rewriting (a 1-expert "MoE" is just an MLP, but the
                   op handles it; the default rewrites everything that matches).
    save_fc1:      training graphs keep FC1's output [T*K, 2F] per MoE layer for the backward (the
                   default: fastest); ``False`` recomputes it in the backward instead — that much
                   less memory, ~1/5 more expert FLOPs per step.
    """

    verify: bool = False
    dump: str | None = None
    inner: str = "inductor"
    quant: str = "none"
    min_experts: int = 1
    save_fc1: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.verify, bool):
            raise TypeError(f"MoEConfig.verify must be a bool, got {self.verify!r}")
        if self.dump is not None and not isinstance(self.dump, (str, os.PathLike)):
            raise TypeError(f"MoEConfig.dump must be a directory path or None, got {self.dump!r}")
        if self.inner not in INNER_COMPILERS:
            raise ValueError(f"MoEConfig.inner must be one of {INNER_COMPILERS}, got {self.inner!r}")
        if self.quant not in QUANT_POLICIES:
            raise ValueError(
                f"MoEConfig.quant={self.quant!r} is not available; choose one of {QUANT_POLICIES}"
            )
        if not isinstance(self.min_experts, int) or self.min_experts < 1:
            raise ValueError(f"MoEConfig.min_experts must be an int >= 1, got {self.min_experts!r}")
        if not isinstance(self.save_fc1, bool):
            raise TypeError(f"MoEConfig.save_fc1 must be a bool, got {self.save_fc1!r}")

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_options(cls, options: MoEConfig | Mapping[str, Any] | None = None, **kwargs) -> MoEConfig:
        """Build a config from a mapping and/or keywords; unknown keys raise with the valid list."""
        if isinstance(options, MoEConfig):
            return dataclasses.replace(options, **kwargs) if kwargs else options
        merged = {**dict(options or {}), **kwargs}
        unknown = sorted(set(merged) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown moe_compile option(s) {unknown}; valid options are {list(cls.field_names())}"
            )
        if "dump" in merged and merged["dump"] is not None:
            merged["dump"] = os.fspath(merged["dump"])
        return cls(**merged)

    def dump_dir(self) -> str | None:
        """The dump directory in effect: the option, else the environment variable, else None."""
        return self.dump or os.environ.get(DUMP_ENV) or None
