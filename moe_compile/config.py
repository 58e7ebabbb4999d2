"""MoEConfig: the one frozen, validated configuration of the backend.

Every surface (``torch.compile(..., options=...)``, ``moe_compile.backend(...)``,
``@moe_compile.optimize(...)``, ``explain(..., **options)``) funnels its options through
``MoEConfig.from_options`` so that an unknown key or a bad value fails the same way everywhere,
with a message that lists what is accepted.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping
from typing import Any

INNER_COMPILERS = ("inductor", "eager")
# "none" keeps the model's numerics; "auto" picks per device and per call size (docs/quantization.md);
# the rest name one format of moe_compile/quant (the same names as quant.common.FORMATS).
QUANT_POLICIES = ("none", "auto", "w16", "w8-int", "w4-int", "mxfp4", "mxfp8", "a8w8-int", "a8w4-int", "a8w8-fp8")
# The dense linears' formats (attention, lm_head, shared experts, dense MLPs; kernels/cpu/dense.py):
# "none" keeps each weight's own dtype (still on the decode kernels at small T), "same" takes
# ``quant``'s format, the rest name one format.  No "auto": a dense layer has no MoE output to
# calibrate against, so its format is always the user's explicit choice.
QUANT_DENSE_POLICIES = ("none", "same", "w16", "w8-int", "w4-int", "mxfp4", "mxfp8", "a8w8-int", "a8w4-int")
DEFAULT_ACCURACY_DB = 30.0
DUMP_ENV = "MOE_COMPILE_DUMP"


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Options of the ``moe`` backend.

    verify:        run the original region and the fused op on the first real inputs and compare;
                   a mismatch keeps the original region for that graph and warns with the error.
    dump:          directory for graph dumps (before/after code, report, DOT/SVG); ``None`` reads
                   the ``MOE_COMPILE_DUMP`` environment variable at compile time.
    inner:         what compiles the rewritten graph: ``"inductor"`` (default) or ``"eager"``.
    quant:         quantization of inference MoE layers: ``"none"`` (default: the model's numerics),
                   a format name (``"w4-int"``, ``"a8w8-int"``, ...: that variant, an error if this
                   device has no native kernel for it), or ``"auto"`` (the fastest native variant
                   whose MoE output stays within ``accuracy_db`` of the unquantized op, measured
                   on the first real call).  Training graphs keep the unquantized op.
    accuracy_db:   ``"auto"``'s budget: the least SQNR (dB) of a layer's output against the
                   unquantized op; ``None`` means DEFAULT_ACCURACY_DB (30 dB).  Only with "auto".
    min_experts:   smallest expert count worth rewriting (a 1-expert "MoE" is just an MLP, but the
                   op handles it; the default rewrites everything that matches).
    quant_dense:   format of every other linear of an inference graph that reads a model weight
                   (attention q/k/v/o, shared experts, dense MLPs, lm_head): ``"none"`` (default:
                   the weight's own dtype; fp32 / bf16 still run on moe_compile's decode kernels at
                   T <= 16, which read them at the memory's speed), a format name (``"w8-int"``,
                   ``"a8w4-int"``, ...), or ``"same"`` (``quant``'s format).  Routers (a linear
                   whose output picks experts) always keep their dtype: a quantized router
                   changes which experts run.  docs/dense-layers.md has the table.
    save_fc1:      training graphs keep FC1's output [T*K, 2F] per MoE layer for the backward (the
                   default: fastest); ``False`` recomputes it in the backward instead — that much
                   less memory, ~1/5 more expert FLOPs per step.
    """

    verify: bool = False
    dump: str | None = None
    inner: str = "inductor"
    quant: str = "none"
    accuracy_db: float | None = None
    min_experts: int = 1
    save_fc1: bool = True
    quant_dense: str = "none"

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
        self._check_accuracy_db()
        self._check_quant_dense()
        if not isinstance(self.min_experts, int) or self.min_experts < 1:
            raise ValueError(f"MoEConfig.min_experts must be an int >= 1, got {self.min_experts!r}")
        if not isinstance(self.save_fc1, bool):
            raise TypeError(f"MoEConfig.save_fc1 must be a bool, got {self.save_fc1!r}")

    def _check_accuracy_db(self) -> None:
        if self.accuracy_db is None:
            return
        if isinstance(self.accuracy_db, bool) or not isinstance(self.accuracy_db, (int, float)) or not self.accuracy_db > 0:
            raise ValueError(f"MoEConfig.accuracy_db must be a positive number of dB (e.g. 30), got {self.accuracy_db!r}")
        if self.quant != "auto":
            raise ValueError(f"MoEConfig.accuracy_db is the budget of quant='auto'; with quant={self.quant!r} "
                             f"it would be ignored: drop it or set quant='auto'")

    def _check_quant_dense(self) -> None:
        if self.quant_dense not in QUANT_DENSE_POLICIES:
            raise ValueError(f"MoEConfig.quant_dense={self.quant_dense!r} is not available; choose one of "
                             f"{QUANT_DENSE_POLICIES}")
        if self.quant_dense == "same" and self.quant in ("none", "auto", "a8w8-fp8"):
            raise ValueError(f"MoEConfig.quant_dense='same' takes quant's format, but quant={self.quant!r} names "
                             f"none a dense layer can run: name the dense format (e.g. quant_dense='w8-int')")

    def dense_format(self) -> str:
        """The dense linears' format in effect ("none" or a format name)."""
        return self.quant if self.quant_dense == "same" else self.quant_dense

    def quant_budget_db(self) -> float:
        """The accuracy budget in effect for quant="auto"."""
        return float(self.accuracy_db) if self.accuracy_db is not None else DEFAULT_ACCURACY_DB

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
                f"unknown moe_compile option(s) {unknown}{_did_you_mean(unknown)}; valid options are "
                f"{list(cls.field_names())}"
            )
        if "dump" in merged and merged["dump"] is not None:
            merged["dump"] = os.fspath(merged["dump"])
        return cls(**merged)

    def dump_dir(self) -> str | None:
        """The dump directory in effect: the option, else the environment variable, else None."""
        return self.dump or os.environ.get(DUMP_ENV) or None


def split_options(options: Mapping[str, Any] | None = None, mode: str | None = None) -> tuple[dict, dict]:
    """(moe_compile's options, Inductor's config patches) from ``torch.compile``'s ``options=`` and
    ``mode=``: a key that is a ``MoEConfig`` field is moe_compile's; one that names an Inductor
    config entry (``max_autotune``, ``"triton.cudagraphs"``, ...), or comes from ``mode``
    (``torch._inductor.list_mode_options``), goes to Inductor when it compiles the rewritten graph.
    Anything else — a misspelt ``verfy`` in particular — is an error naming the closest options."""
    own, inductor, unknown = {}, {}, []
    if mode not in (None, "default"):
        inductor.update(_mode_options(mode))
    for key, value in dict(options or {}).items():
        if key in MoEConfig.field_names():
            own[key] = value
        elif _is_inductor_option(key):
            inductor[key.replace("-", "_")] = value
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(
            f"unknown option(s) {sorted(unknown)}{_did_you_mean(unknown)}; valid options are moe_compile's "
            f"{list(MoEConfig.field_names())}, and any torch._inductor.config entry (e.g. 'max_autotune') is "
            f"passed to Inductor"
        )
    return own, inductor


def _did_you_mean(unknown) -> str:
    hints = [f"{key!r} -> {close[0]!r}" for key in unknown
             if (close := difflib.get_close_matches(key, MoEConfig.field_names(), n=1, cutoff=0.6))]
    return f" (did you mean moe_compile's {', '.join(hints)}?)" if hints else ""


def _inductor_keys() -> frozenset[str]:
    from torch._inductor import config as inductor_config  # imported when options are read, not at import

    return frozenset(inductor_config.get_config_copy())


def _is_inductor_option(key: str) -> bool:
    return isinstance(key, str) and key.replace("-", "_") in _inductor_keys()


def _mode_options(mode: str) -> dict:
    import torch._inductor

    try:
        return dict(torch._inductor.list_mode_options(mode))
    except RuntimeError as exc:
        raise ValueError(f"torch.compile mode={mode!r} is unknown to Inductor: {exc}") from None
