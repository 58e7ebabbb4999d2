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


# ---- fused_moe_quant: decode calls on layers Python has packed and registered ----

def _quant_case(E=8, H=256, F=128, K=2, T=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    W1, W2 = torch.randn(E, 2 * F, H, generator=g) * 0.05, torch.randn(E, H, F, generator=g) * 0.05
    x, gates = torch.randn(T, H, generator=g), torch.rand(T, K, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, ids, gates, W1, W2


def _quant_args(x, ids, gates, W1, W2, fmt, tag="layer", b2=()):
    return (x, ids, gates, [W1], [], [W2], [], [], list(b2), "concat", False, "silu", 0.0, 1.702, "output", fmt, 20.0,
            tag)


def _quant_reference(fmt, x, ids, gates, W1, W2):
    from moe_compile import quant
    from moe_compile.ir import FFNAttrs

    return quant.reference_moe(x, ids, gates, quant.pack(fmt, W1), quant.pack(fmt, W2), FFNAttrs())


def _quant_ran_in_cpp(args):
    before = decode_op.fast_calls()
    with torch.no_grad():
        y = torch.ops.moe_compile.fused_moe_quant(*args)
    return y, decode_op.fast_calls() - before == 1


@pytest.mark.parametrize("fmt", ["w16", "w8-int", "w4-int", "mxfp4", "mxfp8", "a8w8-int", "a8w4-int"])
def test_quant_decode_runs_in_cpp_once_registered(installed, fmt):
    from moe_compile.kernels.cpu import qdecode

    if qdecode.unavailable_reason(fmt):
        pytest.skip(qdecode.unavailable_reason(fmt))
    x, ids, gates, W1, W2 = _quant_case()
    args = _quant_args(x, ids, gates, W1, W2, fmt, tag=f"layer-{fmt}")
    first, in_cpp = _quant_ran_in_cpp(args)
    assert not in_cpp  # the first call packs, in Python, and registers the packs
    second, in_cpp = _quant_ran_in_cpp(args)
    assert in_cpp
    torch.testing.assert_close(second, first, rtol=0, atol=0)  # the same qdecode kernel behind both
    # qdecode against its format's reference, as test_qdecode holds it (its tolerance says why)
    from tests.kernels.cpu.test_qdecode import tolerance

    want = _quant_reference(fmt, x, ids, gates, W1, W2)
    atol = tolerance(fmt, qdecode.best_isa()) * want.abs().max().item()
    torch.testing.assert_close(second, want, rtol=1e-5, atol=atol)


def test_quant_decode_sees_in_place_updates_and_other_tensors(installed):
    x, ids, gates, W1, W2 = _quant_case()
    args = _quant_args(x, ids, gates, W1, W2, "w8-int", tag="updated")
    _quant_ran_in_cpp(args)
    assert _quant_ran_in_cpp(args)[1]
    with torch.no_grad():
        W1.mul_(-2.0)  # an in-place update: the registered packs are stale
    y, in_cpp = _quant_ran_in_cpp(args)
    assert not in_cpp
    want = _quant_reference("w8-int", x, ids, gates, W1, W2)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=_w8_tolerance() * want.abs().max().item())
    assert _quant_ran_in_cpp(args)[1]  # registered again with the new packs
    # another model's tensors under the same tag (same shapes): not the registered ones
    x2, ids2, gates2, V1, V2 = _quant_case(seed=1)
    y, in_cpp = _quant_ran_in_cpp(_quant_args(x2, ids2, gates2, V1, V2, "w8-int", tag="updated"))
    assert not in_cpp
    want = _quant_reference("w8-int", x2, ids2, gates2, V1, V2)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=_w8_tolerance() * want.abs().max().item())


def _w8_tolerance() -> float:
    from moe_compile.kernels.cpu import qdecode
    from tests.kernels.cpu.test_qdecode import tolerance

    return tolerance("w8-int", qdecode.best_isa())


def test_quant_calls_the_cpp_kernel_does_not_take(installed):
    import moe_compile

    x, ids, gates, W1, W2 = _quant_case(T=20)  # prefill: qgemm, in Python
    _quant_ran_in_cpp(_quant_args(x, ids, gates, W1, W2, "w8-int", tag="others"))
    assert not _quant_ran_in_cpp(_quant_args(x, ids, gates, W1, W2, "w8-int", tag="others"))[1]
    x, ids, gates, W1, W2 = _quant_case()
    args = _quant_args(x, ids, gates, W1, W2, "w8-int", tag="others")
    _quant_ran_in_cpp(args)
    assert not _quant_ran_in_cpp(_replace(args, 1, ids.int()))[1]  # int32 ids: Python casts them
    assert not _quant_ran_in_cpp(_replace(args, 16, 25.0))[1]  # another budget: another registration
    moe_compile.empty_cache()  # forgets the registrations with the packs
    assert not _quant_ran_in_cpp(args)[1]


@pytest.mark.parametrize("fmt", ["w4-int", "a8w4-int", "w8-int"])
def test_quant_decode_in_cpp_reads_the_rows16_panels(installed, fmt):
    """The registered layer hands the C++ kernel its roles' rows16 panels too: at T = 1 (every slot
    alone in its expert) the C++ call gives the Python call's bits, and zeros once the panels alone
    are zeroed (4-bit: u = 8 codes)."""
    from moe_compile import quant as formats
    from moe_compile.kernels.cpu import qdecode, qgemm, quant

    if not qdecode.rows16_runs(formats.pack(fmt, torch.randn(1, 16, 128))):
        pytest.skip(f"{fmt}'s rows16 loop does not run here (it needs AVX2, and int16 blocks for w4-int / w8-int)")
    x, ids, gates, W1, W2 = _quant_case(T=1)
    args = _quant_args(x, ids, gates, W1, W2, fmt, tag=f"rows16-{fmt}")
    first, in_cpp = _quant_ran_in_cpp(args)
    assert not in_cpp
    second, in_cpp = _quant_ran_in_cpp(args)
    assert in_cpp and torch.equal(second, first)
    layer = next(p for p in quant._PACKS.values() if p.refs[0]() is W1 and p.w1.fmt == fmt)
    panels = [v for v in layer.kernel_cache.values() if isinstance(v, qgemm.QGemmPack)]
    assert len(panels) == 2 and qdecode.rows16_runs(layer.w1)
    panels[0].data.fill_(0 if fmt == "w8-int" else 0x88)
    zeroed, in_cpp = _quant_ran_in_cpp(args)
    assert in_cpp and torch.equal(zeroed, torch.zeros_like(zeroed))
