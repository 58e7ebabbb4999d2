"""The dense linear operator: ``torch.ops.moe_compile.dense_linear``.

Shapes:  x [..., K], weight [N, K] (``F.linear``'s layout), bias [N] or None -> y [..., N] (x's dtype).

    dense_linear(x, weight, bias, fmt, group) -> y

``fmt`` is "none" (the weight's own dtype) or a ``moe_compile.quant`` format the weight is read in
(packed once per (weight, version), ``kernels/cpu/dense.py``); ``group`` 0 means the format's
default.  The pass ``passes/linears.py`` emits it for the linears of inference graphs (no
backward: the graph is not differentiated).  CPU only; on other devices it is ``F.linear`` on the
weight as the format would dequantize it.  Registered when ``moe_compile.ops`` is imported (by the
backend, not by ``import moe_compile``).
"""

from __future__ import annotations

import torch

OP_NAME = "moe_compile::dense_linear"
_LIB = torch.library.Library("moe_compile", "FRAGMENT")
_LIB.define("dense_linear(Tensor x, Tensor weight, Tensor? bias, str fmt, int group) -> Tensor")


def _dense_linear(x, weight, bias, fmt, group):
    """The Python kernel, registered for every backend.  Its first CPU call installs the C++ CPU
    kernel (``kernels/cpu/dense.py: install``), which then serves decode-size CPU calls ahead of
    this one and hands the rest to ``dense_linear_general``."""
    if x.device.type == "cpu":
        from moe_compile.kernels.cpu import dense

        dense.install()
    return _dense_linear_general(x, weight, bias, fmt, group)


def _dense_linear_general(x, weight, bias, fmt, group):
    if x.device.type != "cpu":
        from moe_compile import quant

        if fmt != "none":
            weight = quant.dequantize(quant.pack(fmt, weight.float().unsqueeze(0), group or None))[0].to(x.dtype)
        return torch.nn.functional.linear(x, weight, bias)
    from moe_compile.kernels.cpu import dense

    return dense.linear(x, weight, bias, fmt, group or None)


def _dense_linear_fake(x, weight, bias, fmt, group):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_LIB.impl("dense_linear", _dense_linear, "CompositeExplicitAutograd")
_LIB.define("dense_linear_general(Tensor x, Tensor weight, Tensor? bias, str fmt, int group) -> Tensor")
for _key in ("CPU", "CUDA"):
    _LIB.impl("dense_linear_general", _dense_linear_general, _key)
torch.library.register_fake(OP_NAME, lib=_LIB)(_dense_linear_fake)
torch.library.register_fake("moe_compile::dense_linear_general", lib=_LIB)(_dense_linear_fake)
