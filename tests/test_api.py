"""api.empty_cache: the memory the CPU op keeps between calls is given back, and nothing is lost."""

import pytest
import torch

import moe_compile
from moe_compile.ir import FFNAttrs
from moe_compile.kernels.cpu import decode as cpu_decode, grad_cache as cpu_grad_cache, prepack as cpu_prepack
from moe_compile.kernels.reference import fused_moe_reference
from moe_compile.ops.fused_moe import call_fused_moe
from tests.test_ops import make_case


@pytest.mark.skipif(not cpu_prepack.available(), reason=f"{cpu_prepack.unavailable_reason()}")
def test_empty_cache_gives_back_packs_and_gradient_buffers(monkeypatch):
    monkeypatch.setattr(cpu_prepack, "UNCHANGED_CALLS_BEFORE_PACKING", 0)
    monkeypatch.setattr(cpu_decode, "SMALL_EXPERT_FLOPS", 0)  # these tiny experts: on the packed path
    monkeypatch.setattr(cpu_grad_cache.GRADIENTS, "min_bytes", 0)
    cpu_prepack.clear()
    cpu_grad_cache.clear()
    moe_compile.empty_cache()  # nothing left from earlier tests (dense and quantized packs)
    x, ids, g, w = make_case(48, 32, 24, 4, 2)
    call_fused_moe(x, ids, g, w, FFNAttrs())
    grad = cpu_grad_cache.GRADIENTS.take(w.fc1[0])
    packed, kept = cpu_prepack.stats()["bytes"], cpu_grad_cache.held_bytes()
    assert packed > 0 and kept == w.fc1[0].nbytes
    assert moe_compile.empty_cache() == {"packed_weights": packed, "gradient_buffers": kept, "quantized_weights": 0,
                                        "dense_weights": 0, "dense_prefill_scratch": 0}
    assert cpu_prepack.stats()["bytes"] == 0 and cpu_grad_cache.held_bytes() == 0
    grad.fill_(1.0)  # a gradient handed out before stays the caller's
    assert torch.all(grad == 1.0)
    # fp32, another summation order than the reference: ~1e-6 relative.
    torch.testing.assert_close(call_fused_moe(x, ids, g, w, FFNAttrs()), fused_moe_reference(x, ids, g, w, FFNAttrs()),
                               rtol=1e-5, atol=1e-5)
