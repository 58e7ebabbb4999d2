"""Randomized MoE spellings (tests/passes/spellings.py) through backend="moe".

For every case: the compiled output equals the block's own eager output (never a wrong result);
where the op's semantics cover the block every MoE layer is rewritten; otherwise each layer is
refused with a non-empty reason.  A seeded subset runs by default, more cases under ``-m slow``.

Tolerance, relative to the output's max: fp32 blocks differ from eager only in summation order
(2e-5, as tests.conftest.TOL); blocks that compute in bf16 (bf16 models, torchtitan's bf16 casts
around fp32 master weights, bf16 experts under an fp32 router) round every intermediate in another order than the op, which
accumulates in fp32: a few bf16 ulps over up to two layers, 3e-2.
"""

from __future__ import annotations

import pytest
import torch

import moe_compile
from moe_compile.models import zoo
from moe_compile.api import capture_flags
from moe_compile.compiler import collecting_reports
from moe_compile.passes.clusters import inside_router, is_id_source
from tests.conftest import rel_err
from tests.passes import other_spellings, spellings

FP32_TOL, BF16_TOL = 2e-5, 3e-2


def run_compiled(model, *inputs, dynamic=None):
    """(output, report) of backend="moe" (inner eager) on inputs; asserts that every top-k of every compiled
    graph has an outcome: inside a rewritten region, or a skip with a non-empty reason."""
    torch._dynamo.reset()
    moe, topks = moe_compile.backend(inner="eager"), []

    def counting(gm, inputs):
        topks.append(sum(is_id_source(n) and not inside_router(n) for n in gm.graph.nodes))
        return moe(gm, inputs)

    with collecting_reports() as report:  # capture_flags(compiled): the flags, and the fallback where they raise
        out = capture_flags(torch.compile(model, backend=counting, dynamic=dynamic))(*inputs)
    assert all(s.reason.strip() for s in report.skipped), f"a refusal without a reason\n{report}"
    for graph, n in enumerate(topks):
        outcomes = sum(r.graph == graph for r in report.rewritten) + sum(s.graph == graph for s in report.skipped)
        assert outcomes >= n, f"graph {graph}: {n} top-k(s), {outcomes} outcome(s)\n{report}"
    return out, report


def check(case: spellings.Case) -> None:
    model, x = spellings.build(case)
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    err = rel_err(got, want)
    assert err <= (BF16_TOL if spellings.computes_in_bf16(case) else FP32_TOL), f"{case}: wrong result, rel. err {err:.2e}\n{report}"
    assert all(s.reason.strip() for s in report.skipped), f"{case}: a refusal without a reason\n{report}"
    covered = spellings.covered(case)
    if covered is True:
        assert len(report.rewritten) == case.layers, f"{case}: {len(report.rewritten)} of {case.layers} rewritten\n{report}"
    elif covered is not None:
        assert not report.rewritten, f"{case}: rewritten although {covered}\n{report}"
        word = {"capacity": "capacity", "expert_choice": "expert-choice"}[case.family]
        assert any(word in s.reason for s in report.skipped), f"{case}: the refusal does not say why\n{report}"
    if len(report.rewritten) < case.layers:
        assert report.skipped, f"{case}: a layer neither rewritten nor refused with a reason\n{report}"


DEFAULT = spellings.random_cases(seed=15, n=20)
SLOW = spellings.random_cases(seed=1015, n=150)


@pytest.mark.parametrize("case", DEFAULT, ids=str)
def test_generated_spelling(case):
    check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=str)
def test_generated_spelling_slow(case):
    check(case)


ZOO = [(zoo.ModuleListMoE, torch.float32), (zoo.DeepSeekOfficialMoE, torch.float32), (zoo.HashRoutedMoE, torch.float32),
       (zoo.SortedMoE, torch.bfloat16), (zoo.GatheredMoE, torch.float32), (zoo.DenseMoE, torch.float32),
       (zoo.DenseMLPLoop, torch.float32), (zoo.TopKNotRouting, torch.float32), (zoo.BincountSplitMoE, torch.float32)]


@pytest.mark.parametrize("cls, dtype", ZOO, ids=lambda v: getattr(v, "__name__", str(v)))
def test_zoo_every_topk_has_an_outcome(cls, dtype):
    model = cls().to(dtype)
    x = torch.randn(1, 5, 64, dtype=dtype)
    inputs = (x, torch.randint(0, 50, (1, 5))) if cls is zoo.HashRoutedMoE else (x,)
    with torch.no_grad():
        want = model(*inputs)
        got, _ = run_compiled(model, *inputs)
    assert rel_err(got, want) <= (BF16_TOL if dtype == torch.bfloat16 else FP32_TOL)


# Other codebases' spellings (tests/passes/other_spellings.py): each is the op's semantics, so it is never
# computed differently from eager, and is rewritten where the pass now proves it (REWRITTEN), else
# refused with a reason.  Alone and in a 2-layer stack with attention; bf16 under -m slow.
REWRITTEN = ("contiguous", "onehot_scatter", "dropout_eval", "top1_max", "top1_argmax", "sorted_gather", "all_mask_loop",
             "sorted_gather_k1", "all_gather", "bsk_where", "fused_views", "dbrx_chunk", "dbrx_index", "jetmoe",
             "linear_all", "einsum_ehf")


def check_other(name: str, layers: int, attention: bool, dtype=torch.float32) -> None:
    model, x = other_spellings.build(name, layers, attention, dtype)
    with torch.no_grad():
        want = model(x)
        got, report = run_compiled(model, x)
    err = rel_err(got, want)
    assert err <= (BF16_TOL if dtype == torch.bfloat16 else FP32_TOL), f"{name}: wrong result, rel. err {err:.2e}\n{report}"
    if name in REWRITTEN:
        assert len(report.rewritten) == layers, f"{name}: {len(report.rewritten)} of {layers} rewritten\n{report}"
    else:
        assert any(REFUSED[name] in s.reason for s in report.skipped), f"{name}: not refused as expected\n{report}"


# Not rewritten yet, and why (none left in this set).
REFUSED: dict[str, str] = {}


OTHER = [(name, 1, False) for name in other_spellings.SPELLINGS] + [
    (name, 2, True) for name in ("sorted_gather_k1",)]  # the second layer's proof at K = 1; all under -m slow


@pytest.mark.parametrize("name, layers, attention", OTHER, ids=str)
def test_other_spelling(name, layers, attention):
    check_other(name, layers, attention)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", other_spellings.SPELLINGS)
def test_other_spelling_stacked_slow(name, dtype):
    check_other(name, 2, True, dtype)


def test_dropout_in_training_is_refused_with_its_reason():
    model, x = other_spellings.build("dropout_eval")
    _, report = run_compiled(model.train(), x)
    assert not report.rewritten and any("Dropout in training" in s.reason for s in report.skipped), report
