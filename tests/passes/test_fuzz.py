"""The pass never raises and never returns a wrong result, whatever surrounds an MoE block.

Two fuzzers, both seeded:
* models: random ops before, between and after one or two MoE blocks of the zoo (every family),
  odd sizes, fp32 or bf16, compiled with ``backend="moe"`` and compared with the model's eager output;
* graphs: a block's Dynamo graph with random nodes' metadata removed or replaced (what a matcher
  reads), handed to the pass directly: it must return a report, and the graph it leaves must
  compute what the original did.
A seeded subset runs by default; ``-m slow`` runs many more cases.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from moe_compile.models import zoo
from moe_compile.api import capture_flags
from moe_compile.passes.pipeline import run_moe_pass
from tests.conftest import rel_err, run_compiled

# Against the model's own eager output, relative to its max: fp32 regions differ by summation order
# only (the random ops around them are computed identically); bf16 rounds every intermediate to 8
# mantissa bits and the fused op accumulates in fp32 — a few bf16 ulps, amplified by the ops after it.
FUZZ_TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2}


def _ops(hidden: int):
    """Shape-keeping [B, S, H] -> [B, S, H] ops a model might put around an MoE block."""
    return [
        ("scale", lambda: Lambda(lambda x: x * 0.5 + 0.1)),
        ("tanh", lambda: Lambda(torch.tanh)),
        ("norm", lambda: nn.LayerNorm(hidden)),
        ("linear", lambda: nn.Linear(hidden, hidden)),
        ("residual-mean", lambda: Lambda(lambda x: x - x.mean(-1, keepdim=True))),
        ("transpose-twice", lambda: Lambda(lambda x: x.transpose(0, 1).contiguous().transpose(0, 1))),
        ("relu", lambda: nn.ReLU()),
        ("topk-features", lambda: Lambda(lambda x: x + x.topk(1, dim=-1).values)),  # a top-k that routes nothing
        ("cumsum", lambda: Lambda(lambda x: x.cumsum(1) / x.shape[1])),
        ("flip", lambda: Lambda(lambda x: x.flip(-1))),
    ]


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _block(rng: random.Random, hidden: int) -> nn.Module:
    ffn = rng.choice([1, 7, 24, 40])
    experts = rng.choice([1, 2, 3, 8])
    top_k = rng.randint(1, experts)
    kind = rng.choice(["modulelist", "modulelist-shared", "deepseek", "gathered", "dense", "mlp-loop"])
    if kind == "modulelist":
        return zoo.ModuleListMoE(hidden, ffn, experts, top_k)
    if kind == "modulelist-shared":
        return zoo.ModuleListMoE(hidden, ffn, experts, top_k, shared=rng.choice([ffn, 16]))
    if kind == "deepseek":
        return zoo.DeepSeekOfficialMoE(hidden, ffn, experts=8, top_k=rng.randint(1, 4), shared=16, groups=4,
                                       topk_groups=2)
    if kind == "gathered":
        return zoo.GatheredMoE(hidden, ffn, experts, top_k)
    if kind == "dense":
        return zoo.DenseMoE(hidden, ffn, experts, top_k=1)
    return zoo.DenseMLPLoop(hidden, ffn, max(experts, 2))


class FuzzedModel(nn.Module):
    """pre ops -> block -> between ops -> (second block) -> post ops."""

    def __init__(self, seed: int):
        super().__init__()
        rng = random.Random(seed)
        self.hidden = rng.choice([8, 17, 32])
        menu = _ops(self.hidden)
        pick = lambda n: nn.ModuleList([rng.choice(menu)[1]() for _ in range(n)])  # noqa: E731
        self.pre, self.between, self.post = pick(rng.randint(0, 2)), pick(rng.randint(0, 2)), pick(rng.randint(0, 2))
        self.blocks = nn.ModuleList([_block(rng, self.hidden) for _ in range(rng.choice([1, 1, 2]))])
        self.tokens = rng.choice([1, 3, 7, 12])
        self.dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16])

    def forward(self, x):
        for op in self.pre:
            x = op(x)
        for i, block in enumerate(self.blocks):
            x = x + block(x)
            for op in self.between if i == 0 else ():
                x = op(x)
        for op in self.post:
            x = op(x)
        return x


def _check_model(seed: int) -> None:
    torch.manual_seed(seed)
    model = FuzzedModel(seed)
    model = model.to(model.dtype).eval()
    x = torch.randn(1, model.tokens, model.hidden, dtype=model.dtype)
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    err = rel_err(got, want)
    assert err <= FUZZ_TOL[model.dtype], f"seed {seed}: error {err:.2e}\n{report}"
    assert all(s.reason for s in report.skipped), f"seed {seed}: a skip without a reason\n{report}"


@pytest.mark.parametrize("seed", range(4))
def test_random_models_never_raise_nor_err(seed):
    _check_model(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4, 80))
def test_random_models_never_raise_nor_err_many(seed):
    _check_model(seed)


# Seed 62 of the slow set found it: a Llama4-style dense block with as many tokens as experts
# (T = E) once had its [E, T] score matrix read as [T, E] (0.1-0.9 relative error).
@pytest.mark.parametrize("experts", [3, 8])
def test_dense_block_with_as_many_tokens_as_experts(experts):
    block = zoo.DenseMoE(32, 24, experts, 1).eval()
    x = torch.randn(1, experts, 32)
    with torch.no_grad():
        got, _ = run_compiled(block, x)
        assert rel_err(got, block(x)) <= FUZZ_TOL[torch.float32]


def _dynamo_graph(model, x):
    """(GraphModule, example inputs) of the first graph Dynamo captures for model(x)."""
    captured = []

    def grab(gm, inputs):
        captured.append((gm, list(inputs)))
        return gm.forward

    torch._dynamo.reset()
    with capture_flags(), torch.no_grad():
        torch.compile(model, backend=grab)(x)
    return captured[0]


def _corrupt(gm, rng: random.Random) -> int:
    """Remove or replace the metadata of random nodes (what the matchers read); returns how many."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    hits = rng.sample(nodes, k=max(1, len(nodes) // rng.choice([3, 6, 12])))
    for node in hits:
        how = rng.choice(["drop", "scalar", "wrong-shape", "stack"])
        if how == "drop":
            node.meta.pop("example_value", None)
        elif how == "scalar":
            node.meta["example_value"] = 3
        elif how == "wrong-shape":
            node.meta["example_value"] = torch.empty(rng.randint(0, 3), 5)
        else:
            node.meta["stack_trace"] = None
    return len(hits)


GRAPH_BLOCKS = [
    lambda: zoo.ModuleListMoE(32, 24, 4, 2),
    lambda: zoo.DeepSeekOfficialMoE(32, 16, 8, 2, shared=16, groups=4, topk_groups=2),
    lambda: zoo.GatheredMoE(32, 24, 4, 2),
    lambda: zoo.DenseMoE(32, 24, 4, 1),
]


def _check_graph(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = GRAPH_BLOCKS[seed % len(GRAPH_BLOCKS)]().eval()
    x = torch.randn(1, 5, 32)
    gm, inputs = _dynamo_graph(model, x)
    with torch.no_grad():
        want = gm.forward(*inputs)
    _corrupt(gm, rng)
    report = run_moe_pass(gm, inputs)  # must not raise
    with torch.no_grad():
        got = gm.forward(*inputs)
    assert rel_err(got[0], want[0]) <= FUZZ_TOL[torch.float32], f"seed {seed}\n{report}"
    assert all(s.reason for s in report.skipped)


@pytest.mark.parametrize("seed", range(4))
def test_corrupted_graphs_never_raise_nor_err(seed):
    _check_graph(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4, 100))
def test_corrupted_graphs_never_raise_nor_err_many(seed):
    _check_graph(seed)
