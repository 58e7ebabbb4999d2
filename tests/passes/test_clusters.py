"""Grouping expert FFNs by the top-k that routes them, in deep models.

Every layer after the first depends on every earlier top-k through the residual stream, and a
shared expert (or a dense first layer) can be exactly as wide as the routed experts: a top-k must
hold its own layer's experts and nothing else.
"""

import pytest
import torch
import torch.nn as nn

from moe_compile.models import zoo
from moe_compile.passes.clusters import find_clusters, group_by_topk
from moe_compile.passes.graph import Deps
from tests.conftest import TOL, rel_err, run_compiled

H, F, E = 64, 32, 8


class Stack(nn.Module):
    """``layers`` residual blocks: a dense SwiGLU first layer of the experts' width, then MoE blocks
    (each with a shared expert of the experts' width), as decoder stacks write them."""

    def __init__(self, block, layers=3):
        super().__init__()
        self.dense = zoo.SwiGLU(H, F)
        self.blocks = nn.ModuleList([block() for _ in range(layers - 1)])

    def forward(self, x):  # [B, S, H]
        x = x + self.dense(x)
        for block in self.blocks:
            x = x + block(x)
        return x


BLOCKS = {
    "modulelist": lambda: zoo.ModuleListMoE(H, F, E, top_k=2, shared=F),
    "deepseek_official": lambda: zoo.DeepSeekOfficialMoE(H, F, E, top_k=2, shared=F, groups=4, topk_groups=2),
}


@pytest.mark.parametrize("block", list(BLOCKS))
def test_each_layer_of_a_deep_loop_model_is_rewritten(block):
    model = Stack(BLOCKS[block])
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    assert [r.source for r in report.rewritten] == [f"blocks.{i}.experts" for i in range(2)], report
    assert all(r.num_experts == E for r in report.rewritten)
    assert rel_err(got, want) <= TOL[torch.float32]


def test_a_top_k_holds_only_its_own_layers_experts():
    # Traced without the rewrite: each top-k's candidate is exactly its layer's E experts; the
    # dense layer and the shared experts (same width, same graph region) stay unrouted.
    from moe_compile.api import capture_flags

    model = Stack(BLOCKS["modulelist"])
    groups = []

    def backend(gm, inputs):  # Dynamo drops the graph's input metadata once the backend returns
        groups.append(group_by_topk(gm.graph, Deps(gm.graph), find_clusters(gm.graph)))
        return gm.forward

    torch._dynamo.reset()
    with capture_flags():
        torch.compile(model, backend=backend)(torch.randn(1, 3, H))
    ((candidates, unrouted),) = groups
    assert [len(c.clusters) for c in candidates] == [E, E]
    assert len(unrouted) == 1 + 2  # the dense layer and one shared expert per MoE layer
