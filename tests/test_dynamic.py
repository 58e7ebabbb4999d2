"""Dynamic token counts run without recompiling after the first dynamic compile."""

import pytest
import torch

from moe_compile import zoo
from moe_compile.api import capture_flags
from tests.conftest import TOL, rel_err


@pytest.mark.parametrize("cls", [zoo.ModuleListMoE, zoo.GatheredMoE])
def test_token_counts_share_one_graph(cls):
    from torch._dynamo.testing import CompileCounterWithBackend

    import moe_compile

    model = cls()
    counter = CompileCounterWithBackend(moe_compile.backend(inner="eager"))
    compiled = torch.compile(model, backend=counter, dynamic=True)
    with capture_flags():
        for T in (1, 7, 64, 513):
            x = torch.randn(1, T, 64)
            assert rel_err(compiled(x), model(x)) <= TOL[torch.float32]
    # Dynamo specialises a size of 1 (its 0/1 rule), so T=1 gets its own graph; the dynamic graph
    # compiled at T=7 then serves 64 and 513 without another compile.
    assert counter.frame_count == 2
    assert any("fused_moe" in str(n.target) for g in counter.graphs for n in g.graph.nodes)
