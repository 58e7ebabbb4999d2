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

from tests.conftest import rel_err, run_compiled
from tests.passes import spellings

FP32_TOL, BF16_TOL = 2e-5, 3e-2


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
