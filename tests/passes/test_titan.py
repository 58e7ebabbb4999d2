"""torchtitan's MoE spellings (tests/passes/titan.py) through backend="moe".

One rank: every configuration is rewritten and equals eager.  Two gloo ranks: the expert-parallel
layer (routing scores applied after the combine all-to-all) is rewritten and equals eager.

Tolerance: torchtitan computes its grouped GEMMs in bf16 (fp32 master weights cast per call); the
op computes in bf16 too but accumulates the K slots in fp32 in another order, so compiled and
eager differ by a few bf16 ulps: 3e-2 of the output's max.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import rel_err, run_compiled
from tests.passes import titan

BF16_TOL = 3e-2

CONFIGS = {
    "sigmoid-bias": dict(),
    "softmax-renorm-K3-shared": dict(score_func="softmax", route_norm=True, top_k=3, shared_ffn=64),
    "group-limited": dict(groups=4, limited_groups=2, route_norm=True, route_scale=2.5),
    "gpt-oss": dict(gpt_oss=True, score_func="softmax"),
    "K1-one-token": dict(top_k=1),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_torchtitan_moe_rewritten_on_one_rank(name):
    model = titan.MoE(**CONFIGS[name])
    x = torch.randn(2, 1 if name == "K1-one-token" else 5, 64)
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    assert [r.family for r in report.rewritten] == ["sorted"], str(report)
    if name == "gpt-oss":
        r = report.rewritten[0]
        assert (r.gate_up, r.activation, r.biases) == ("interleaved", "gptoss", ("fc1", "fc2")), str(report)
    assert rel_err(got, want) <= BF16_TOL


def run_ep(rank: int, world: int) -> dict:
    from moe_compile.api import capture_flags
    from moe_compile.compiler import collecting_reports

    torch._dynamo.reset()
    model = titan.EPMoE(experts=8, top_k=2, seed=0)
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(100 + rank))
    with torch.no_grad():
        want = model(x)
        compiled = torch.compile(model, backend="moe", options={"inner": "eager"})
        with capture_flags(), collecting_reports() as report:
            got = compiled(x)
    return {"rewritten": [(r.family, r.world_size) for r in report.rewritten],
            "skipped": [s.reason for s in report.skipped], "err": rel_err(got, want), "text": str(report)}


@pytest.mark.dist
def test_torchtitan_ep_layer_on_two_gloo_ranks():
    from tests.ep.harness import run_world

    results = run_world(2, "tests.passes.test_titan.run_ep", timeout=240.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value["rewritten"] == [("expert_parallel", 2)], value["text"]
        assert value["err"] <= BF16_TOL, (rank, value["err"], value["text"])
