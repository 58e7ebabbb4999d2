"""GPU lane: HF tiny MoE blocks through backend="moe" on CUDA (the Triton kernels end to end)."""

import pytest
import torch

from tests.conftest import rel_err, run_compiled
from tests.test_hf_models import FAMILY, H, first, hf_block

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gpt_oss", "phimoe"])
def test_hf_block_on_cuda(name, impl):
    block = hf_block(name, impl, torch.bfloat16).cuda()
    x = torch.randn(2, 33, H, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        want = first(block(x))
        got, report = run_compiled(block, x, inner="inductor")
    assert [r.family for r in report.rewritten] == [FAMILY[impl]]
    # bf16 on both sides with different accumulation orders: a few bf16 ulps of the output scale.
    assert rel_err(first(got), want) <= 3e-2
