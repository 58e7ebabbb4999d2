"""Host side of ``rows.c``: gather, SwiGLU and combine rows between the prefill loop's GEMMs.

Shapes:  T tokens, H hidden, F expert FFN width, S' valid slots sorted by expert; an expert's
         slots are rows [lo, hi) of ``tokens`` [S'] (their token) and ``scale`` [S'] (their
         routing weight).

``SlotRows`` checks one call's fixed operands once (x, y, tokens, scale), then each step takes an
expert's row range and its own fresh, contiguous buffers: the per-expert loop pays one ctypes call
(~2 us) per step instead of torch's argument checks and dispatch.  Built on first use
(``cpu_cc``); where it cannot be (no compiler, no AVX2) or ``MOE_COMPILE_ROWS=0``, ``available()``
is False and the loop keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from moe_compile.kernels.cpu import cc as cpu_cc

ENV = "MOE_COMPILE_ROWS"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_KERNEL = cpu_cc.Kernel("rows", ENV, {"moe_rows_step": [_PTR, _PTR, _PTR, _I64]},  # add, swiglu, gather fields
                        "using torch ops")


def available() -> bool:
    return _KERNEL.lib() is not None


def unavailable_reason() -> str | None:
    return _KERNEL.error()


def _check_rows(t: torch.Tensor, rows: int, width: int, name: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != (rows, width) or t.stride(1) != 1:
        raise ValueError(f"cpu_rows: {name} must be an fp32 CPU [{rows}, {width}] tensor with contiguous rows, "
                         f"got {t.dtype} {t.device.type} {tuple(t.shape)} strides {t.stride()}")


@dataclasses.dataclass(frozen=True)
class SlotRows:
    """One call's operands: x [T, H] (rows gathered from), y [T, H] (rows added into), tokens [S']
    int64 in [0, T), scale [S'] fp32.  ``threads``: torch's intra-op thread count."""

    x: torch.Tensor
    y: torch.Tensor
    tokens: torch.Tensor
    scale: torch.Tensor
    threads: int

    def __post_init__(self) -> None:
        T, H = self.x.shape
        _check_rows(self.x, T, H, "x")
        _check_rows(self.y, T, H, "y")
        S = self.tokens.shape[0]
        if self.tokens.dtype != torch.int64 or self.tokens.dim() != 1 or not self.tokens.is_contiguous():
            raise ValueError(f"cpu_rows: tokens must be contiguous int64 [S'], got {self.tokens.dtype} {tuple(self.tokens.shape)}")
        if self.scale.dtype != torch.float32 or tuple(self.scale.shape) != (S,) or not self.scale.is_contiguous():
            raise ValueError(f"cpu_rows: scale must be contiguous fp32 [{S}], got {self.scale.dtype} {tuple(self.scale.shape)}")
        # The C loops index x and y by these values: one bad token would write outside y.
        if S and not (0 <= int(self.tokens.min()) and int(self.tokens.max()) < T):
            raise ValueError(f"cpu_rows: tokens must lie in [0, {T}), got {int(self.tokens.min())}..{int(self.tokens.max())}")
        if _KERNEL.lib() is None:
            raise RuntimeError(f"cpu_rows: kernels unavailable ({_KERNEL.error()})")

    def _scale_at(self, lo: int, scaled: bool) -> int:
        return self.scale.data_ptr() + 4 * lo if scaled else 0

    def _tokens_at(self, lo: int) -> int:
        return self.tokens.data_ptr() + 8 * lo

    def gather_fields(self, lo: int, hi: int, out: torch.Tensor, scaled: bool = False) -> list[int]:
        """out [hi-lo, H] = x[tokens[lo:hi]] (times scale[lo:hi] per row when ``scaled``)."""
        H = self.x.shape[1]
        _check_rows(out, hi - lo, H, "out")
        return [out.data_ptr(), out.stride(0), self.x.data_ptr(), self.x.stride(0), self._tokens_at(lo),
                self._scale_at(lo, scaled), hi - lo, H]

    def swiglu_fields(self, lo: int, hi: int, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor,
                      scaled: bool = False) -> list[int]:
        """out [hi-lo, F] = silu(gate) * up (times scale[lo:hi] per row when ``scaled``); gate, up
        [hi-lo, F] may be views of one FC1 output, out may be gate itself."""
        n, f = out.shape
        for t, name in ((gate, "gate"), (up, "up"), (out, "out")):
            _check_rows(t, hi - lo, f, name)
        return [out.data_ptr(), out.stride(0), gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0),
                self._scale_at(lo, scaled), n, f]

    def add_fields(self, lo: int, hi: int, src: torch.Tensor, scaled: bool = False) -> list[int]:
        """y[tokens[lo:hi]] += src [hi-lo, H] (times scale[lo:hi] per row when ``scaled``)."""
        H = self.y.shape[1]
        _check_rows(src, hi - lo, H, "src")
        return [self.y.data_ptr(), self.y.stride(0), src.data_ptr(), src.stride(0), self._tokens_at(lo),
                self._scale_at(lo, scaled), hi - lo, H]

    def step(self, add: list[int] | None = None, swiglu: list[int] | None = None,
             gather: list[int] | None = None) -> None:
        """Any of an add, a SwiGLU and a gather (``*_fields``) in one call of the C loops.  They
        must touch disjoint memory (y; the SwiGLU's buffers; the gather's output)."""
        fields = [(ctypes.c_int64 * len(f))(*f) if f else None for f in (add, swiglu, gather)]
        _KERNEL.lib().moe_rows_step(*fields, self.threads)

    def gather(self, lo: int, hi: int, out: torch.Tensor, scaled: bool = False) -> torch.Tensor:
        self.step(gather=self.gather_fields(lo, hi, out, scaled))
        return out

    def swiglu(self, lo: int, hi: int, gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor,
               scaled: bool = False) -> torch.Tensor:
        self.step(swiglu=self.swiglu_fields(lo, hi, gate, up, out, scaled))
        return out

    def add(self, lo: int, hi: int, src: torch.Tensor, scaled: bool = False) -> None:
        self.step(add=self.add_fields(lo, hi, src, scaled))
