"""Prepacked expert weights (cpu_prepack): packed on the second sight of unchanged weights (the
inference op's at the first), results equal to the reference, and never stale: in-place updates,
trained weights, freed weights."""

import gc
import itertools

import pytest
import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu import prepack as cpu_prepack, skinny as cpu_skinny
from moe_compile.kernels.reference import fused_moe_reference
from moe_compile.ops.fused_moe import call_fused_moe
from tests.test_ops import make_case

pytestmark = pytest.mark.skipif(not cpu_prepack.available(), reason=f"{cpu_prepack.unavailable_reason()}")

# fp32: oneDNN's blocked GEMM sums in another order than the reference's: ~1e-6 relative.
TOL = dict(rtol=1e-5, atol=1e-5)
# 48 tokens x K=2 over 4 experts: ~24 rows each, above the decode kernel's 8 (decode never packs).
# Experts this small would take the skinny kernel too (cpu_decode.SMALL_EXPERT_FLOPS): the fixture
# leaves it only decode-sized calls.
T, H, F, E, K = 48, 32, 24, 4, 2


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    from moe_compile.kernels.cpu import decode as cpu_decode

    monkeypatch.setattr(cpu_decode, "SMALL_EXPERT_FLOPS", 0)
    cpu_prepack.clear()
    yield
    cpu_prepack.clear()


def call_twice(x, ids, g, w, attrs):
    """(first, second) results; asserts the first ran unpacked and the second packed."""
    first = call_fused_moe(x, ids, g, w, attrs)
    assert cpu_prepack.stats()["tensors"] == 0
    second = call_fused_moe(x, ids, g, w, attrs)
    assert cpu_prepack.stats()["tensors"] > 0
    return first, second


def test_inference_op_packs_at_first_sight():
    # fused_moe_infer's weights are trained by no backward: its first call packs them, so the call
    # that compiles a model does the one-time work (a user's first timed call then runs at speed);
    # the autograd op's first call still runs unpacked (call_twice above).
    x, ids, g, w = make_case(T, H, F, E, K)
    attrs = FFNAttrs()
    args = (x, ids, g, list(w.fc1), list(w.fc1_up), list(w.fc2), [], [], [], attrs.gate_up, attrs.transposed,
            attrs.activation, attrs.limit, attrs.alpha, attrs.weight_on)
    with torch.no_grad():
        first = torch.ops.moe_compile.fused_moe_infer(*args)
    assert cpu_prepack.stats()["tensors"] > 0
    torch.testing.assert_close(first, fused_moe_reference(x, ids, g, w, attrs), **TOL)


@pytest.mark.parametrize("gate_up,transposed,stacked,weight_on", list(itertools.product(
    ["concat", "interleaved", "separate", "none"], [False, True], [True, False], ["output", "between", "input"])))
def test_packed_call_matches_reference(gate_up, transposed, stacked, weight_on):
    x, ids, g, w = make_case(T, H, F, E, K, gate_up, transposed, stacked)
    attrs = FFNAttrs(gate_up=gate_up, transposed=transposed, weight_on=weight_on)
    want = fused_moe_reference(x, ids, g, w, attrs)
    for got in call_twice(x, ids, g, w, attrs):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("stacked", [True, False])
def test_packed_call_with_biases(stacked):
    x, ids, g, w = make_case(T, H, F, E, K, "separate", False, stacked)
    biases = [torch.randn(E, n) for n in (F, F, H)]
    biases = [(b,) if stacked else tuple(b) for b in biases]
    w = ExpertWeights(w.fc1, w.fc1_up, w.fc2, *biases)
    attrs = FFNAttrs(gate_up="separate")
    want = fused_moe_reference(x, ids, g, w, attrs)
    for got in call_twice(x, ids, g, w, attrs):
        torch.testing.assert_close(got, want, **TOL)


def test_in_place_update_is_read_from_the_model():
    x, ids, g, w = make_case(T, H, F, E, K)
    attrs = FFNAttrs()
    call_twice(x, ids, g, w, attrs)
    with torch.no_grad():
        w.fc2[0][1].mul_(-3.0)  # one expert's weight, through a view: the version counter is shared
    torch.testing.assert_close(call_fused_moe(x, ids, g, w, attrs), fused_moe_reference(x, ids, g, w, attrs), **TOL)
    assert cpu_prepack.stats()["tensors"] == 1  # fc2's stale pack dropped, fc1's kept


def test_replaced_storage_is_read_from_the_model():
    x, ids, g, w = make_case(T, H, F, E, K)
    attrs = FFNAttrs()
    call_twice(x, ids, g, w, attrs)
    w.fc1[0].data = torch.randn_like(w.fc1[0])  # new storage: new data pointer, version counter kept
    torch.testing.assert_close(call_fused_moe(x, ids, g, w, attrs), fused_moe_reference(x, ids, g, w, attrs), **TOL)


def test_views_made_per_call_are_tracked_through_their_base():
    x, ids, g, w = make_case(T, H, F, E, K)
    stacked1, stacked2 = w.fc1[0], w.fc2[0]
    attrs = FFNAttrs()

    def per_expert_views():  # what a graph that slices a stacked parameter hands the op each call
        return ExpertWeights(tuple(stacked1.unbind(0)), (), tuple(stacked2.unbind(0)))

    call_fused_moe(x, ids, g, per_expert_views(), attrs)
    got = call_fused_moe(x, ids, g, per_expert_views(), attrs)
    assert cpu_prepack.stats()["tensors"] == 2 * E
    torch.testing.assert_close(got, fused_moe_reference(x, ids, g, w, attrs), **TOL)


def test_trained_weights_are_never_packed():
    # The backward computes weight gradients: those weights change every step, packing would not pay.
    x, ids, g, w = make_case(T, H, F, E, K)
    for t in (*w.fc1, *w.fc2):
        t.requires_grad_(True)
    attrs = FFNAttrs()
    for _ in range(3):
        call_fused_moe(x, ids, g, w, attrs).sum().backward()
    assert cpu_prepack.stats()["tensors"] == 0


def test_frozen_experts_pack_while_inputs_train():
    # Gradients for x only (experts frozen): the weights do not change, so they are packed.
    x, ids, g, w = make_case(T, H, F, E, K)
    x.requires_grad_(True)
    attrs = FFNAttrs()
    for _ in range(2):
        y = call_fused_moe(x, ids, g, w, attrs)
        y.sum().backward()
    assert cpu_prepack.stats()["tensors"] == 2
    torch.testing.assert_close(y, fused_moe_reference(x, ids, g, w, attrs), **TOL)


def test_weights_moved_to_another_dtype_drop_their_packs():
    # module.to(dtype) swaps each parameter's data in place: the same tensor objects, new data.
    x, ids, g, w = make_case(T, H, F, E, K)
    call_twice(x, ids, g, w, FFNAttrs())
    for t in (*w.fc1, *w.fc2):
        t.data = t.data.double()
    call_fused_moe(x.double(), ids, g.double(), w, FFNAttrs())
    assert cpu_prepack.stats()["tensors"] == 0


def test_freed_weights_free_their_packs():
    x, ids, g, w = make_case(T, H, F, E, K)
    call_twice(x, ids, g, w, FFNAttrs())
    del w
    gc.collect()
    assert cpu_prepack.stats()["tensors"] == 0


def test_inference_tensors_are_not_packed():
    # Inference tensors have no version counter: an in-place change could not be seen.
    with torch.inference_mode():
        x, ids, g, w = make_case(T, H, F, E, K)
        for _ in range(2):
            got = call_fused_moe(x, ids, g, w, FFNAttrs())
    assert cpu_prepack.stats()["tensors"] == 0
    torch.testing.assert_close(got, fused_moe_reference(x, ids, g, w, FFNAttrs()), **TOL)


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setenv(cpu_prepack.ENV, "0")
    assert "MOE_COMPILE_PREPACK=0" in cpu_prepack.unavailable_reason()
    x, ids, g, w = make_case(T, H, F, E, K)
    for _ in range(2):
        call_fused_moe(x, ids, g, w, FFNAttrs())
    assert cpu_prepack.stats()["tensors"] == 0


def test_not_packed_beyond_the_memory_budget(monkeypatch):
    monkeypatch.setattr(cpu_prepack, "_available_bytes", lambda: 1024)
    x, ids, g, w = make_case(T, H, F, E, K)
    for _ in range(2):
        got = call_fused_moe(x, ids, g, w, FFNAttrs())
    assert cpu_prepack.stats()["tensors"] == 0 and cpu_prepack.stats()["refused_for_memory"] == 1
    torch.testing.assert_close(got, fused_moe_reference(x, ids, g, w, FFNAttrs()), **TOL)


@pytest.mark.skipif(not cpu_skinny.available(), reason="decode runs on MKL without the skinny kernel")
def test_decode_sized_calls_are_not_packed():
    x, ids, g, w = make_case(2, H, F, E, K)  # <= 2 rows per expert: the decode kernel's calls
    for _ in range(2):
        call_fused_moe(x, ids, g, w, FFNAttrs())
    assert cpu_prepack.stats()["tensors"] == 0
