"""Every pattern family (docs/architecture.md#pattern-families), written as model code does, against the
model's own eager."""

import pytest
import torch

from moe_compile.models import zoo
from tests.conftest import TOL, rel_err, run_compiled

CASES = [
    ("loop", zoo.ModuleListMoE, {}),
    ("loop", zoo.DeepSeekOfficialMoE, {}),
    ("loop", zoo.DeepSeekStyleBlock, {"hidden": 64, "ffn": 32, "experts": 16, "top_k": 6, "shared": 64}),
    ("gathered", zoo.GatheredMoE, {}),
    ("dense", zoo.DenseMoE, {}),
    ("dense", zoo.DenseMoE, {"top_k": 2}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,cls,kwargs", CASES, ids=[f"{c[0]}-{c[1].__name__}" for c in CASES])
def test_family_matches_eager(family, cls, kwargs, dtype):
    model = cls(**kwargs).to(dtype)
    hidden = kwargs.get("hidden", 64)
    x = torch.randn(2, 7, hidden, dtype=dtype)
    want = model(x)
    got, report = run_compiled(model, x)
    assert [r.family for r in report.rewritten] == [family]
    assert rel_err(got, want) <= TOL[dtype]


def test_sorted_family_bf16():
    # torch._grouped_mm traces only in bf16 on CPU (docs/architecture.md#facts-about-the-stack), so family B
    # is a bf16 model.
    model = zoo.SortedMoE().to(torch.bfloat16)
    x = torch.randn(2, 9, 64, dtype=torch.bfloat16)
    want = model(x)
    got, report = run_compiled(model, x)
    assert [r.family for r in report.rewritten] == ["sorted"]
    assert rel_err(got, want) <= TOL[torch.bfloat16]


def test_report_fields():
    model = zoo.ModuleListMoE(hidden=64, ffn=96, experts=8, top_k=2)
    report = __import__("moe_compile").explain(model, torch.randn(1, 5, 64))
    (entry,) = report.rewritten
    assert (entry.family, entry.num_experts, entry.top_k, entry.hidden, entry.ffn) == ("loop", 8, 2, 64, 96)
    assert entry.variant == "a16w16" and entry.source == "experts"
    assert "rewritten" in str(report) and "family=loop" in str(report)


def test_inductor_inner_compiler():
    model = zoo.DeepSeekOfficialMoE()
    x = torch.randn(1, 6, 64)
    got, report = run_compiled(model, x, inner="inductor")
    assert len(report.rewritten) == 1
    assert rel_err(got, model(x)) <= TOL[torch.float32]
