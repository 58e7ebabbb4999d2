"""The backward sends only dy: the training op's forward keeps the rows it received as outputs
(``moe_compile/ep/keep.py``), so eager autograd and AOTAutograd hand them to the backward.

* symm and collectives transports: every gradient equal to ``kernels/reference.py`` (tolerances as
  ``test_fused_a2a``), the backward's dispatch row dy + g only (H * itemsize + 4 bytes, where it
  was [x | dy]), cut in as many pieces as the forward's.
* a compiled training step (Dynamo -> the backend's rewrite -> AOTAutograd) of an all-to-all EP
  block: the rewritten graph calls ``fused_moe_ep_train``, y and every gradient (input, router,
  each expert weight) equal to the global reference, the backward sends only [dy | g].
Where a rank's kept buffer (R * T * min(K, E_l) rows: static shapes) cannot hold what it
received — a rank with T = 0, or fewer tokens than its peers send it — these transports keep on
no rank and x travels again (the a2a transport decides per rank: ``test_fused_a2a``): still
equal, and the test says which case it is.
"""

from __future__ import annotations

import pytest
import torch

from tests.ep.harness import run_world
from tests.ep.test_fused_a2a import TOL, _each_scenario_equal, _scenarios

pytestmark = pytest.mark.dist

QUICK = ("uniform", "T0_on_rank1", "bf16_everything_to_rank0")  # the slow test runs every scenario
TRANSPORTS = ("symm", "collectives")


def _check_sent(res, scenarios, chunks):
    for tr in TRANSPORTS:
        per_transport = {r: (status, out[tr] if status == "ok" else out) for r, (status, out) in res.items()}
        for rank, name, got in _each_scenario_equal(per_transport, scenarios):
            width, _, pieces = got["sent"]["backward"]
            # rank 1's buffer holds 0 rows (T0), rank 0's fewer than it receives (overflow): these
            # transports keep on every rank or none, so nobody keeps and [x | dy] travels
            fits = "T0" not in name and "overflow" not in name
            assert width == got["H"] * got["itemsize"] * (1 if fits else 2) + 4, (tr, rank, name, got["sent"])
            assert pieces == got["sent"]["forward"][2] and chunks in (0, pieces), (tr, rank, name, got["sent"])


@pytest.fixture(scope="module")
def world2():
    """One spawn for the default tests: (quick scenarios, their results per rank)."""
    scenarios = [s for s in _scenarios(2) if s[0] in QUICK]
    res = run_world(2, "tests.ep.train_workers.kept_checks", scenarios, TRANSPORTS, 3, COMPILED, timeout=300)
    return scenarios, res


def _part(res, key):
    return {r: (status, out[key] if status == "ok" else out) for r, (status, out) in res.items()}


def test_heap_and_collectives_backward_sends_only_dy_chunked_like_the_forward(world2):
    scenarios, res = world2
    _check_sent(_part(res, "op"), scenarios, 3)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_heap_and_collectives_backward_every_scenario(world):
    scenarios = _scenarios(world)
    res = run_world(world, "tests.ep.a2a_workers.transports_scenarios", scenarios, TRANSPORTS, 0, timeout=600)
    _check_sent(res, scenarios, 0)


COMPILED = [("uniform", [6, 6], "uniform", "float32")]
COMPILED_SLOW = [("everything_to_rank0", [6, 6], "rank0", "float32"), ("rank1_empty", [6, 6], "rank1_empty", "float32"),
                 ("unequal_T", [5, 7], "uniform", "float32"), ("bf16", [6, 6], "uniform", "bfloat16"),
                 ("bf16_everything_to_rank0", [6, 6], "rank0", "bfloat16")]


def _check_compiled(res, cases, world):
    for rank, (status, out) in res.items():
        assert status == "ok", out
        for name, Ts, _, dtype in cases:
            got = out[name]
            assert got["rewritten"] == 1 and got["ops"] == ["moe_compile.fused_moe_ep_train.default"], (rank, got)
            tol = TOL[getattr(torch, dtype)]
            assert max(got["errs"].values()) <= tol, (rank, name, got["errs"])
            row, x_row = got["H"] * got["itemsize"] + 4, got["H"] * got["itemsize"]
            # equal T: every rank's buffer holds what it can receive, so [dy | g]; unequal T: a rank
            # with fewer tokens than its peers may overflow its buffer, then [x | dy | g] everywhere
            allowed = [[row]] if len(set(Ts)) == 1 else [[row], [row + x_row]]
            assert got["bwd_dispatch_row_bytes"] in allowed, (rank, name, got["bwd_dispatch_row_bytes"])


def test_compiled_training_step_keeps_rows_and_equals_reference(world2):
    _check_compiled(_part(world2[1], "compiled"), COMPILED, 2)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_compiled_training_step_every_scenario(world):
    cases = COMPILED_SLOW if world == 2 else COMPILED + COMPILED_SLOW
    if world == 4:
        cases = [(n, [Ts[0]] * 4 if len(set(Ts)) == 1 else [3, 5, 7, 9], r, d) for n, Ts, r, d in cases]
    res = run_world(world, "tests.ep.train_workers.compiled_training", cases, timeout=600)
    _check_compiled(res, cases, world)
