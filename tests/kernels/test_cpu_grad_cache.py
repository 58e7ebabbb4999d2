"""kernels/cpu_grad_cache: stacked gradients' memory is reused only once nothing uses it, and the
op's gradients stay equal to the reference's across steps that reuse it."""

import pytest
import torch

from moe_compile import ops  # noqa: F401  registers the op and its backward
from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels import cpu_grad_cache
from moe_compile.kernels.reference import fused_moe_reference


def test_memory_is_reused_once_the_gradient_is_freed():
    cache = cpu_grad_cache.GradCache(min_bytes=0)
    w = torch.randn(4, 8, 16)
    first = cache.take(w)
    assert first.shape == w.shape and first.dtype == w.dtype
    ptr = first.data_ptr()
    del first
    assert cache.take(w).data_ptr() == ptr


def test_a_live_gradient_is_never_written_over():
    cache = cpu_grad_cache.GradCache(min_bytes=0)
    w = torch.randn(4, 8, 16)
    kept = [cache.take(w) for _ in range(cpu_grad_cache.SLOTS + 1)]  # all slots in use, then a fresh one
    assert len({t.data_ptr() for t in kept}) == len(kept)
    for i, t in enumerate(kept):
        t.fill_(i)
    assert all(torch.all(t == i) for i, t in enumerate(kept))
    assert cache.held_bytes() == cpu_grad_cache.SLOTS * w.nbytes  # the fresh one is not kept


def test_an_entry_goes_with_its_weight():
    cache = cpu_grad_cache.GradCache(min_bytes=0)
    w = torch.randn(4, 8, 16)
    cache.take(w)
    del w
    other = torch.randn(2, 8, 16)
    cache.take(other)
    assert cache.held_bytes() == other.nbytes


def test_small_weights_and_the_switch_get_plain_tensors(monkeypatch):
    w = torch.randn(4, 8, 16)
    cache = cpu_grad_cache.GradCache(min_bytes=w.nbytes + 1)
    cache.take(w)
    assert cache.held_bytes() == 0
    monkeypatch.setenv(cpu_grad_cache.ENV, "0")
    cache.min_bytes = 0
    cache.take(w)
    assert cache.held_bytes() == 0


def _stacked_problem(seed=0, T=24, H=16, F=8, E=4, K=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E - 1, (T, K), generator=g)  # expert E-1 gets no token: its rows must be zeros
    tw = torch.rand(T, K, generator=g)
    w13 = torch.nn.Parameter(torch.randn(E, 2 * F, H, generator=g) / H**0.5)
    w2 = torch.nn.Parameter(torch.randn(E, H, F, generator=g) / F**0.5)
    return x, ids, tw, w13, w2


def _op_loss(x, ids, tw, w13, w2):
    y = torch.ops.moe_compile.fused_moe_train(
        x, ids, tw, [w13], [], [w2], [], [], [], "concat", False, "silu", 0.0, 1.702, "output")[0]
    return (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).cos()).sum()


def _reference_grads(x, ids, tw, w13, w2):
    a, b = w13.detach().clone().requires_grad_(True), w2.detach().clone().requires_grad_(True)
    y = fused_moe_reference(x, ids, tw, ExpertWeights(fc1=(a,), fc1_up=(), fc2=(b,)), FFNAttrs())
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).cos()).sum().backward()
    return a.grad, b.grad


@pytest.mark.parametrize("set_to_none", [True, False])
def test_op_gradients_across_steps_that_reuse_memory(monkeypatch, set_to_none):
    """Three backward passes: with ``.grad = None`` between them each must equal the reference
    (the second and third reuse the first's memory); accumulating (``.grad`` kept) must equal
    three times it, so a buffer still held by ``.grad`` was never written over."""
    monkeypatch.setattr(cpu_grad_cache.GRADIENTS, "min_bytes", 0)
    x, ids, tw, w13, w2 = _stacked_problem()
    want13, want2 = _reference_grads(x, ids, tw, w13, w2)
    ptrs = []
    for _ in range(3):
        if set_to_none:
            w13.grad = w2.grad = None
        _op_loss(x, ids, tw, w13, w2).backward()
        ptrs.append(w13.grad.data_ptr())
    steps = 1 if set_to_none else 3
    # fp32, same GEMMs in a different order than the reference loop: a few ulps of the gradient's scale.
    torch.testing.assert_close(w13.grad, steps * want13, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2.grad, steps * want2, rtol=1e-5, atol=1e-5)
    if set_to_none:
        assert ptrs[0] == ptrs[1] == ptrs[2]  # the cache's memory was the one reused
    cpu_grad_cache.clear()
