"""The fused MoE operator: ``torch.ops.moe_compile.fused_moe``.

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K experts per token.

Contract (the seed operator ``mega_moe``'s X, E, G, W1, W2 -> Y, with the model's own layouts):

    fused_moe(x [T, H], topk_ids [T, K] int, topk_weights [T, K] float,
              fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias,   # lists of tensors, see below
              gate_up, transposed, activation, limit, alpha, weight_on) -> y [T, H] (x's dtype)

* Each weight role is either ``[W]`` with W stacked 3-D ``[E, out, in]`` (``[E, in, out]`` when
  ``transposed``) or the E per-expert 2-D tensors the model holds (``nn.Linear.weight``).  ``fc1``
  is the gate (or the fused gate/up when ``gate_up`` is "concat"/"interleaved"); ``fc1_up`` is the
  separate up projection ("separate") or empty.  Biases: ``[B]`` stacked ``[E, n]``, E x ``[n]``,
  or empty.  The op never stacks or copies weights per call.
* The non-tensor arguments are ``ir.FFNAttrs``; ``kernels/reference.py`` defines the meaning.
* ids outside [0, E) contribute nothing; T = 0 gives an empty [0, H] result.
* ``fused_moe_train`` takes the same arguments and returns (y, fc1_out): the form the passes emit
  where the graph will be differentiated; on CPU fc1_out keeps FC1's output for the backward
  (``autograd.py``).  Only y is used by the graph.
* ``fused_moe_infer`` is ``fused_moe`` without an autograd formula, the form the passes emit
  where the graph will not be differentiated: registered with ``torch.library.Library`` (no
  Python autograd and wrapper layers), a call costs ~0.15 ms less with the caches cold, 3-4% of
  a Mixtral decode step on CPU.
* The fake implementation keeps T symbolic, so a dynamic-shape graph never recompiles on T.

Registered when ``moe_compile.ops`` is first imported (by the backend, not by
``import moe_compile``); importing it never touches CUDA.
"""

from __future__ import annotations

import torch

from moe_compile.ir import ExpertWeights, FFNAttrs

OP_NAME = "moe_compile::fused_moe"
TRAIN_OP_NAME = "moe_compile::fused_moe_train"
INFER_OP_NAME = "moe_compile::fused_moe_infer"

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ID_DTYPES = (torch.int32, torch.int64)


def check_inputs(x, topk_ids, topk_weights, w: ExpertWeights) -> None:
    """Clear errors for inputs the op cannot take; works on fake tensors (no data access)."""
    if x.dim() != 2:
        raise ValueError(f"fused_moe: x must be [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"fused_moe: x must be a floating tensor, got {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(
            f"fused_moe: topk_ids must be a [T, K] int32/int64 tensor, got {topk_ids.dtype} "
            f"shape {tuple(topk_ids.shape)}"
        )
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"fused_moe: topk_weights must be a floating tensor shaped like topk_ids "
            f"{tuple(topk_ids.shape)}, got {topk_weights.dtype} {tuple(topk_weights.shape)}"
        )
    hidden = w.hidden()
    if x.shape[1] != hidden:
        raise ValueError(f"fused_moe: x has hidden size {x.shape[1]} but the experts expect {hidden}")


def attrs_from_args(gate_up, transposed, activation, limit, alpha, weight_on) -> FFNAttrs:
    return FFNAttrs(gate_up, transposed, activation, limit, alpha, weight_on)


def weights_from_args(fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias, transposed) -> ExpertWeights:
    return ExpertWeights(
        tuple(fc1), tuple(fc1_up), tuple(fc2), tuple(fc1_bias), tuple(fc1_up_bias), tuple(fc2_bias), transposed
    )


def parse_op_args(args):
    """(x, topk_ids, topk_weights, ExpertWeights, FFNAttrs) from the op's 15 arguments in schema
    order (3 tensors, 6 weight roles, 6 statics), inputs checked."""
    x, topk_ids, topk_weights, *roles = args[:9]
    statics = args[9:15]  # gate_up, transposed, activation, limit, alpha, weight_on
    w = weights_from_args(*roles, statics[1])
    check_inputs(x, topk_ids, topk_weights, w)
    attrs = attrs_from_args(*statics)
    _check_widths(w, attrs)
    return x, topk_ids, topk_weights, w, attrs


def _check_widths(w: ExpertWeights, attrs: FFNAttrs) -> None:
    """FC1's output width must be what FC2 reads (2F when gated, F otherwise): a mismatch would
    have the kernels read past FC1's rows."""
    F = w.ffn()
    want = F if attrs.gate_up == "none" else 2 * F
    if w.fc1_width() != want:
        raise ValueError(f"fused_moe: FC1 gives {w.fc1_width()} columns but FC2 takes F={F} "
                         f"(gate_up={attrs.gate_up!r} needs FC1 width {want})")


@torch.library.custom_op(OP_NAME, mutates_args=())
def fused_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    fc1: list[torch.Tensor],
    fc1_up: list[torch.Tensor],
    fc2: list[torch.Tensor],
    fc1_bias: list[torch.Tensor],
    fc1_up_bias: list[torch.Tensor],
    fc2_bias: list[torch.Tensor],
    gate_up: str,
    transposed: bool,
    activation: str,
    limit: float,
    alpha: float,
    weight_on: str,
) -> torch.Tensor:
    x, topk_ids, topk_weights, w, attrs = parse_op_args(
        (x, topk_ids, topk_weights, fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias,
         gate_up, transposed, activation, limit, alpha, weight_on))
    return run_experts(x, topk_ids, topk_weights, w, attrs)


def op_args_schema() -> str:
    """``fused_moe``'s argument list as schema text, "(Tensor x, ..., str weight_on)": the training
    op and the backward op take the same arguments, declared once (in ``fused_moe``'s signature)."""
    schema = str(torch.ops.moe_compile.fused_moe.default._schema)  # "moe_compile::fused_moe(...) -> Tensor"
    return schema[schema.index("(") : schema.rindex(" -> ")]


@torch.library.custom_op(TRAIN_OP_NAME, mutates_args=(), schema=op_args_schema() + " -> (Tensor, Tensor)")
def fused_moe_train(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_moe`` for a forward whose backward will run: (y [T, H], fc1_out).

    On CPU ``fc1_out`` [T*K, F2] holds FC1's output (before the activation) of the valid slots in
    expert-sorted order, so the backward reads it instead of recomputing FC1 (1/3 of the forward's
    FLOPs).  It is what an eager loop keeps for its own backward, in one buffer.  On CUDA it is
    empty: the Triton backward recomputes FC1 inside its fused kernels.  The passes emit this op
    (and use only y) where the compiled graph will be differentiated.  Arguments: ``fused_moe``'s."""
    x, topk_ids, topk_weights, w, attrs = parse_op_args(args)
    fc1_out = _fc1_buffer(x, topk_ids, w)
    if x.device.type != "cpu":
        return run_experts(x, topk_ids, topk_weights, w, attrs), fc1_out
    from moe_compile.kernels.cpu.forward import fused_moe_cpu

    return fused_moe_cpu(x, topk_ids, topk_weights, w, attrs, fc1_out), fc1_out


def _fc1_buffer(x, topk_ids, w: ExpertWeights) -> torch.Tensor:
    """[T*K, F2] in x's dtype on CPU (rows of invalid ids stay unwritten); [0] elsewhere."""
    if x.device.type != "cpu":
        return x.new_empty(0)
    from moe_compile.kernels.cpu import memory as cpu_memory  # huge pages for a real (not fake) buffer

    if isinstance(x, torch._subclasses.FakeTensor):
        return x.new_empty(topk_ids.numel(), w.fc1_width())
    return cpu_memory.empty((topk_ids.numel(), w.fc1_width()), x.dtype, x.device)


@fused_moe_train.register_fake
def _fused_moe_train_fake(*args):
    x, topk_ids, _, w, _ = parse_op_args(args)
    return x.new_empty(x.shape), _fc1_buffer(x, topk_ids, w)


def run_experts(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs, inference: bool = False) -> torch.Tensor:
    """Pick the kernel for the device: Triton on CUDA when available, the CPU path otherwise.
    ``inference``: a call of the op without autograd (``fused_moe_infer``), whose weights no
    backward will train: the CPU path packs them at its first sight (``prepack.lookup``)."""
    if x.is_cuda:
        from moe_compile.kernels import triton_dispatch

        kernel = triton_dispatch.forward_kernel()
        if kernel is not None:
            return kernel(x, topk_ids, topk_weights, w, attrs)
        from moe_compile.kernels.reference import fused_moe_reference

        return fused_moe_reference(x, topk_ids, topk_weights, w, attrs)
    from moe_compile.kernels.cpu.forward import fused_moe_cpu

    return fused_moe_cpu(x, topk_ids, topk_weights, w, attrs, inference=inference)


@fused_moe.register_fake
def _fused_moe_fake(*args):
    x = parse_op_args(args)[0]
    return x.new_empty(x.shape)


_INFER_LIB = torch.library.Library("moe_compile", "FRAGMENT")
_INFER_LIB.define(INFER_OP_NAME.split("::")[1] + op_args_schema() + " -> Tensor")


def _fused_moe_infer(*args) -> torch.Tensor:
    """The Python kernel of ``fused_moe_infer``, registered for every backend.  Its first CPU call
    installs the C++ CPU kernel (``kernels/cpu/decode_op.py``), which then serves CPU calls ahead
    of this one, handing all but plain fp32 decode steps to ``fused_moe_infer_general``."""
    _install_cpu_kernels(args[0])
    return _fused_moe_infer_general(*args)


def _install_cpu_kernels(x) -> None:
    """On a CPU call, build and register the inference ops' C++ CPU kernels (``decode_op.install``
    does it once a process and remembers a failure): later CPU calls then reach C++ first."""
    if x.device.type == "cpu":
        from moe_compile.kernels.cpu import decode_op

        decode_op.install()


def _fused_moe_infer_general(*args) -> torch.Tensor:
    if torch.is_grad_enabled() and _needs_grad(args):  # torch alone would warn at backward, grads missing
        raise RuntimeError("moe_compile::fused_moe_infer has no backward; call moe_compile::fused_moe (or "
                           "run under torch.no_grad()) where gradients must flow through the MoE")
    if not args[0].is_cuda:  # a plain CPU decode step straight to its kernel: see cpu_decode.decode_args
        from moe_compile.kernels.cpu import decode as cpu_decode

        args = _rows_contiguous_roles(args)
        y = cpu_decode.decode_args(args, torch.get_num_threads())
        if y is not None:
            return y
    return run_experts(*parse_op_args(args), inference=True)


def _rows_contiguous_roles(args) -> tuple:
    """The op's arguments with each weight role whose last dim is strided (a role the passes flipped
    to the op's orientation: a ``transpose(-2, -1)`` view of the model's tensor) replaced by its
    contiguous copy, made once per (tensor, version) like the CPU packs (``cpu_prepack.rows_contiguous``)."""
    if all(t.stride(-1) == 1 for role in args[3:6] for t in role):
        return args
    from moe_compile.kernels.cpu import prepack as cpu_prepack

    roles = [[cpu_prepack.rows_contiguous(t) for t in role] for role in args[3:6]]
    return (*args[:3], *roles, *args[6:])


def _needs_grad(args) -> bool:
    tensors = [args[0], args[2], *(t for role in args[3:9] for t in role)]
    return any(t.requires_grad for t in tensors)


# The C++ CPU kernel (decode_op.cpp), once installed, is registered for the CPU key, which takes
# precedence over this Python kernel's CompositeExplicitAutograd registration; its calls that are
# not plain decode steps come back to Python through ``fused_moe_infer_general``.
_INFER_LIB.impl("fused_moe_infer", _fused_moe_infer, "CompositeExplicitAutograd")
_INFER_LIB.define("fused_moe_infer_general" + op_args_schema() + " -> Tensor")
for _key in ("CPU", "CUDA"):
    _INFER_LIB.impl("fused_moe_infer_general", _fused_moe_infer_general, _key)
torch.library.register_fake("moe_compile::fused_moe_infer_general", lib=_INFER_LIB)(_fused_moe_fake)
torch.library.register_fake(INFER_OP_NAME, lib=_INFER_LIB)(_fused_moe_fake)

# ``fused_moe_quant``: ``fused_moe_infer`` plus the quantization the passes chose (inference only,
# CPU): ``quant`` a format name or "auto", ``accuracy_db`` auto's budget, ``tag`` the layer's name
# in explain() (module path and graph).  ``kernels/cpu/quant.py`` packs and dispatches.
QUANT_OP_NAME = "moe_compile::fused_moe_quant"
_INFER_LIB.define(QUANT_OP_NAME.split("::")[1] + op_args_schema()[:-1] + ", str quant, float accuracy_db, str tag) -> Tensor")


def _fused_moe_quant(*args) -> torch.Tensor:
    """The Python kernel of ``fused_moe_quant`` (as ``_fused_moe_infer``: its first CPU call installs
    the C++ CPU kernel, which runs decode steps on layers Python has packed and registered and hands
    every other call to ``fused_moe_quant_general``)."""
    _install_cpu_kernels(args[0])
    return _fused_moe_quant_general(*args)


def _fused_moe_quant_general(*args) -> torch.Tensor:
    *op_args, quant, accuracy_db, tag = args
    x, topk_ids, topk_weights, w, attrs = parse_op_args(op_args)
    from moe_compile.kernels.cpu import quant as cpu_quant

    return cpu_quant.run(x, topk_ids, topk_weights, w, attrs, quant, accuracy_db, tag)


def _fused_moe_quant_fake(*args):
    return parse_op_args(args[:-3])[0].new_empty(args[0].shape)


_INFER_LIB.impl("fused_moe_quant", _fused_moe_quant, "CompositeExplicitAutograd")
_INFER_LIB.define("fused_moe_quant_general" + op_args_schema()[:-1] + ", str quant, float accuracy_db, str tag) -> Tensor")
_INFER_LIB.impl("fused_moe_quant_general", _fused_moe_quant_general, "CPU")
torch.library.register_fake("moe_compile::fused_moe_quant_general", lib=_INFER_LIB)(_fused_moe_quant_fake)
torch.library.register_fake(QUANT_OP_NAME, lib=_INFER_LIB)(_fused_moe_quant_fake)

# Under torch.autocast the op behaves like the Linears it replaces: floating inputs (activations,
# routing weights, expert weights) are cast to the autocast dtype and the op runs with autocast off;
# the result comes back in x's own dtype, as the replaced regions accumulate into ``zeros_like(x)``
# (or cast back with ``.to(x.dtype)``).
_AUTOCAST_LIB = torch.library.Library("moe_compile", "IMPL")


def _autocast_kernel(op, device_type: str, key):
    def kernel(x, topk_ids, topk_weights, fc1, fc1_up, fc2, fc1_bias, fc1_up_bias, fc2_bias, *static):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):
            return t.to(dtype) if t.is_floating_point() else t

        def casts(ts):
            return [cast(t) for t in ts]

        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            out = op(
                cast(x), topk_ids, cast(topk_weights), casts(fc1), casts(fc1_up), casts(fc2),
                casts(fc1_bias), casts(fc1_up_bias), casts(fc2_bias), *static,
            )
        if isinstance(out, tuple):  # fused_moe_train: fc1_out stays in the GEMMs' dtype
            return out[0].to(x.dtype), out[1]
        return out.to(x.dtype)

    return kernel


for _device, _key in (("cpu", torch._C.DispatchKey.AutocastCPU), ("cuda", torch._C.DispatchKey.AutocastCUDA)):
    for _name in ("fused_moe", "fused_moe_train", "fused_moe_infer"):
        _AUTOCAST_LIB.impl(_name, _autocast_kernel(getattr(torch.ops.moe_compile, _name), _device, _key), _key.name)


def call_fused_moe(x, topk_ids, topk_weights, w: ExpertWeights, attrs: FFNAttrs) -> torch.Tensor:
    """Python-friendly entry: the op from an ``ExpertWeights`` and ``FFNAttrs``."""
    return torch.ops.moe_compile.fused_moe(
        x, topk_ids, topk_weights,
        list(w.fc1), list(w.fc1_up), list(w.fc2),
        list(w.fc1_bias), list(w.fc1_up_bias), list(w.fc2_bias),
        attrs.gate_up, attrs.transposed, attrs.activation, attrs.limit, attrs.alpha, attrs.weight_on,
    )
