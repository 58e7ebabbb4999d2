"""kernels/cpu_grad_cache: stacked gradients' memory is reused only once nothing uses it, and the
op's gradients stay equal to the reference's across steps that reuse it."""

import pytest
import torch

from moe_compile.ir import FFNAttrs
from moe_compile.kernels.cpu import grad_cache as cpu_grad_cache
from tests.test_autograd import call_op, call_reference, make_experts, make_routing


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


def _weighted_sum(y):
    return (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).cos()).sum()


@pytest.mark.parametrize("set_to_none", [True, False])
def test_op_gradients_across_steps_that_reuse_memory(monkeypatch, set_to_none):
    """Three backward passes: with ``.grad = None`` between them each must equal the reference
    (the second and third reuse the first's memory); accumulating (``.grad`` kept) must equal
    three times it, so a buffer still held by ``.grad`` was never written over."""
    monkeypatch.setattr(cpu_grad_cache.GRADIENTS, "min_bytes", 0)
    attrs = FFNAttrs()
    roles = make_experts(4, 16, 8, dtype=torch.float32)  # stacked [4, 16, 16] and [4, 16, 8]
    ids, tw = make_routing(24, 4, 2, dtype=torch.float32, used=3)  # expert 3 gets no token: zeros
    x = torch.randn(24, 16)
    ref = {r: [t.detach().clone().requires_grad_(True) for t in ts] for r, ts in roles.items()}
    _weighted_sum(call_reference(x, ids, tw.detach(), ref, attrs)).backward()
    w13, w2 = roles["fc1"][0], roles["fc2"][0]
    ptrs = []
    for _ in range(3):
        if set_to_none:
            w13.grad = w2.grad = None
        _weighted_sum(call_op(x, ids, tw.detach(), roles, attrs, train=True)).backward()
        ptrs.append(w13.grad.data_ptr())
    steps = 1 if set_to_none else 3
    # fp32, same GEMMs in a different order than the reference loop: a few ulps of the gradient's scale.
    torch.testing.assert_close(w13.grad, steps * ref["fc1"][0].grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2.grad, steps * ref["fc2"][0].grad, rtol=1e-5, atol=1e-5)
    if set_to_none:
        assert ptrs[0] == ptrs[1] == ptrs[2]  # the cache's memory was the one reused
    cpu_grad_cache.clear()
