"""The inference op's C++ CPU kernel (kernels/cpu/decode_op.cpp): the calls it runs itself give
the Python fast path's bits; every other call reaches the Python path unchanged (and its errors)."""

import pytest
import torch

from moe_compile.kernels.cpu import decode as cpu_decode, decode_op, skinny as cpu_skinny

from .test_decode import _left_to_general_path, _replace, op_args, reference

pytestmark = pytest.mark.skipif(not cpu_skinny.available(), reason=f"no skinny kernel: {cpu_skinny.unavailable_reason()}")


@pytest.fixture(scope="module")
def installed():
    if not decode_op.install():
        pytest.skip(f"decode_op.cpp not installed: {decode_op.unavailable_reason()}")
    # registered for the CPU key: ahead of the Python kernel (CompositeExplicitAutograd)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("moe_compile::fused_moe_infer", "CPU")


def _op_ran_in_cpp(args):
    before = decode_op.fast_calls()
    y = torch.ops.moe_compile.fused_moe_infer(*args)
    return y, decode_op.fast_calls() - before == 1


@pytest.mark.parametrize("T,H,F,E,K,gate_up,transposed,weight_on,limit,bias,int32", [
    (1, 64, 32, 8, 2, "concat", False, "output", 0.0, False, False),
    (4, 40, 24, 6, 3, "interleaved", True, "between", 0.0, False, True),
    (3, 100, 8, 5, 2, "separate", False, "output", 0.7, True, False),
    (8, 16, 16, 64, 8, "separate", True, "between", 0.0, True, True),
])
def test_cpp_kernel_gives_the_python_fast_paths_bits(installed, T, H, F, E, K, gate_up, transposed, weight_on,
                                                     limit, bias, int32):
    args = op_args(T, H, F, E, K, gate_up, transposed, weight_on, limit, bias, int32)
    with torch.no_grad():
        y, in_cpp = _op_ran_in_cpp(args)
        assert in_cpp
        # the same C kernel behind both: the same bits; fp32 vs the reference as in test_decode
        torch.testing.assert_close(y, cpu_decode.decode_args(args, torch.get_num_threads()), rtol=0, atol=0)
        torch.testing.assert_close(y, reference(args), rtol=1e-5, atol=1e-5)


def _outcome(fn, args):
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 — the error is the outcome to compare
        return type(err)


@pytest.mark.parametrize("name,args", list(_left_to_general_path()), ids=lambda v: v if isinstance(v, str) else "")
def test_cpp_kernel_leaves_other_calls_to_the_python_path(installed, name, args):
    with torch.no_grad():
        before = decode_op.fast_calls()
        got = _outcome(torch.ops.moe_compile.fused_moe_infer, args)
        assert decode_op.fast_calls() == before, name
        want = _outcome(torch.ops.moe_compile.fused_moe_infer_general, args)
    if isinstance(want, torch.Tensor):  # the Python path's result
        # not bit for bit: the general path itself differs by an ulp between calls (a first call
        # packs the weights, later ones read the packs)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # or its error
        assert got is want, name


def test_bad_input_still_gets_the_python_paths_error(installed):
    args = _replace(op_args(2, 32, 16, 4, 2), 0, torch.randn(2, 31))
    with torch.no_grad(), pytest.raises(ValueError, match="hidden size"):
        torch.ops.moe_compile.fused_moe_infer(*args)


def test_a_call_that_needs_gradients_is_refused(installed):
    args = op_args(1, 32, 16, 4, 2)
    args = _replace(args, 0, args[0].requires_grad_())
    with pytest.raises(RuntimeError, match="no backward"):
        torch.ops.moe_compile.fused_moe_infer(*args)


def test_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(decode_op.ENV, "0")
    state = {}
    monkeypatch.setattr(decode_op, "_state", state)
    assert decode_op._install() is False and "turned off" in state["error"]
