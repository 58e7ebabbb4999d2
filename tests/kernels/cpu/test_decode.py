"""The inference op's decode fast path (kernels/cpu/decode.py: decode_args) against the reference,
and the calls it must leave to the general path."""

import pytest
import torch

from moe_compile.ops import fused_moe as ops
from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu import decode as cpu_decode, skinny as cpu_skinny
from moe_compile.kernels.reference import fused_moe_reference

needs_kernel = pytest.mark.skipif(not cpu_skinny.available(), reason=f"no skinny kernel: {cpu_skinny.unavailable_reason()}")


def op_args(T, H, F, E, K, gate_up="concat", transposed=False, weight_on="output", limit=0.0, bias=False,
            int32=False):
    """The op's 15 arguments of a random case (stacked roles), with a dropped and a repeated pick."""
    n1 = F if gate_up == "separate" else 2 * F

    def shape(out, inp):
        return (E, inp, out) if transposed else (E, out, inp)

    fc1 = [torch.randn(shape(n1, H)) / H**0.5]
    fc1_up = [torch.randn(shape(F, H)) / H**0.5] if gate_up == "separate" else []
    fc2 = [torch.randn(shape(H, F)) / F**0.5]
    biases = ([torch.randn(E, n1)], [torch.randn(E, F)] if fc1_up else [], [torch.randn(E, H)]) if bias else ([], [], [])
    x = torch.randn(T, H)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ids[0, 0] = -1  # a dropped slot
    if T > 1 and K > 1:
        ids[1, 1] = ids[1, 0]  # one expert picked twice by a token
    ids = ids.int() if int32 else ids
    g = torch.rand(T, K)
    return (x, ids, g, fc1, fc1_up, fc2, *biases, gate_up, transposed, "silu", limit, 1.702, weight_on)


def reference(args):
    x, ids, g, fc1, fc1_up, fc2, b1, b1_up, b2, gate_up, transposed, act, limit, alpha, weight_on = args
    w = ExpertWeights(tuple(fc1), tuple(fc1_up), tuple(fc2), tuple(b1), tuple(b1_up), tuple(b2), transposed)
    return fused_moe_reference(x, ids.long(), g, w, FFNAttrs(gate_up, transposed, act, limit, alpha, weight_on))


# fp32 against the reference's fp32 (another summation order, K <= 8 terms per token): ~1e-6 of
# the output's scale; 1e-5 leaves room for H = 100.
@needs_kernel
@pytest.mark.parametrize("T,H,F,E,K,gate_up,transposed,weight_on,limit,bias,int32", [
    (1, 64, 32, 8, 2, "concat", False, "output", 0.0, False, False),
    (4, 40, 24, 6, 3, "interleaved", True, "between", 0.0, False, True),
    (3, 100, 8, 5, 2, "separate", False, "output", 0.7, True, False),
    (8, 16, 16, 64, 8, "separate", True, "between", 0.0, True, True),
    (7, 33, 12, 3, 3, "concat", True, "output", 0.5, True, False),
])
def test_fast_path_matches_reference(T, H, F, E, K, gate_up, transposed, weight_on, limit, bias, int32):
    args = op_args(T, H, F, E, K, gate_up, transposed, weight_on, limit, bias, int32)
    with torch.no_grad():
        fast = cpu_decode.decode_args(args, torch.get_num_threads())
        assert fast is not None  # the fast path took it
        torch.testing.assert_close(fast, reference(args), rtol=1e-5, atol=1e-5)
        # the op itself, and the general path: the same kernel, so the same bits
        torch.testing.assert_close(torch.ops.moe_compile.fused_moe_infer(*args), fast, rtol=0, atol=0)
        torch.testing.assert_close(ops.run_experts(*ops.parse_op_args(args)), fast, rtol=0, atol=0)


def _replace(args, i, value):
    return args[:i] + (value,) + args[i + 1:]


def _left_to_general_path():
    """(name, args) of calls the fast path must not take: each differs from a plain one in one way."""
    base = op_args(2, 32, 16, 4, 2)
    x, ids, g, fc1, fc1_up, fc2 = base[:6]
    yield "too many rows", op_args(cpu_skinny.MAX_ROWS + 1, 32, 16, 4, 2)
    yield "bf16 x", _replace(base, 0, x.bfloat16())
    yield "strided x", _replace(base, 0, torch.randn(2, 64)[:, ::2])
    yield "per-expert weights", _replace(base, 3, list(fc1[0]))
    yield "weight on the input", _replace(base, 14, "input")
    yield "gelu", _replace(base, 11, "gelu")
    yield "ungated", _replace(_replace(base, 9, "none"), 3, [fc1[0][:, :16]])
    yield "fc1 of another hidden size", _replace(base, 3, [torch.randn(4, 32, 40)])
    yield "fc1 of another width", _replace(base, 3, [torch.randn(4, 30, 32)])
    yield "fc2 transposed by mistake", _replace(base, 5, [fc2[0].transpose(1, 2).contiguous()])
    yield "fc1 experts differ", _replace(base, 3, [torch.randn(5, 32, 32)])
    yield "ids of other rows", _replace(base, 1, ids[:1])
    yield "non-contiguous ids", _replace(base, 1, torch.randint(0, 4, (2, 4))[:, ::2])
    yield "float64 routing weights", _replace(base, 2, g.double())
    yield "bias of the wrong width", _replace(base, 8, [torch.randn(4, 31)])
    yield "up bias without up", _replace(base, 7, [torch.randn(4, 16)])


@needs_kernel
@pytest.mark.parametrize("name,args", list(_left_to_general_path()), ids=lambda v: v if isinstance(v, str) else "")
def test_leaves_other_calls_to_the_general_path(name, args):
    with torch.no_grad():
        assert cpu_decode.decode_args(args, 2) is None, name


def test_bad_shapes_still_get_the_general_paths_error():
    # A fast path that bailed out must not hide the op's own error for bad input.
    args = _replace(op_args(2, 32, 16, 4, 2), 0, torch.randn(2, 31))
    with torch.no_grad(), pytest.raises(ValueError, match="hidden size"):
        torch.ops.moe_compile.fused_moe_infer(*args)
