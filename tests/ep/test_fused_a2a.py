"""fused_moe_ep on the "a2a" transport (ep_dispatch -> local experts on the receive window ->
ep_combine): forward and every gradient equal to kernels/reference.py on the whole problem, no
torch scalar read on the forward or the backward, and a model calling it compiles fullgraph;
"a2a-dedup" (a token once per rank it reaches) equal to the reference and its bytes cut."""

from __future__ import annotations

import pytest
import torch

from tests.ep.harness import run_world

# fp32: the same FFN in another row grouping and summation order, ~1e-7 relative (1e-5 leaves
# room for reassociation at any size); bf16: the inputs and weights are bf16 and every result is
# rounded to bf16 once (2^-8 = 4e-3 per rounding, a few of them compound): 3e-2.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _scenarios(world):
    T = 7
    return [
        ("uniform", [T] * world, "uniform", torch.float32),
        ("everything_to_rank0", [T] * world, "rank0", torch.float32),  # the other ranks' experts get nothing
        ("unequal_T", [3 + 4 * r for r in range(world)], "uniform", torch.float32),
        ("T0_on_rank1", [T if r != 1 else 0 for r in range(world)], "uniform", torch.float32),
        ("rank1_empty", [T] * world, "rank1_empty", torch.float32),  # rank 1's experts get no row
        # rank 0 (1 token) receives far more rows than its kept buffer R*T*min(K, E_l) holds
        ("overflow_rank0", [1] + [12] * (world - 1), "rank0", torch.float32),
        ("bf16", [T] * world, "uniform", torch.bfloat16),
        ("bf16_everything_to_rank0", [T] * world, "rank0", torch.bfloat16),
        ("bf16_T0_on_rank1", [T if r != 1 else 0 for r in range(world)], "uniform", torch.bfloat16),
        ("bf16_unequal_T", [3 + 4 * r for r in range(world)], "uniform", torch.bfloat16),
        ("bf16_rank1_empty", [T] * world, "rank1_empty", torch.bfloat16),
    ]


def _per_scenario(res, scenarios):
    """(rank, name, result) of every scenario on every rank, after asserting that each rank's
    worker ran to its end."""
    for rank, (status, out) in res.items():
        assert status == "ok", out
        for name, *_ in scenarios:
            yield rank, name, out[name]


def _each_scenario_equal(res, scenarios):
    """(rank, name, result) of every scenario, after asserting that its output and every gradient
    are within the dtype's TOL of the reference."""
    dtypes = {name: dtype for name, _, _, dtype in scenarios}
    for rank, name, got in _per_scenario(res, scenarios):
        for key in ("y", "dx", "dg", "dw1", "dw2"):
            assert got[key] <= TOL[dtypes[name]], f"rank {rank}, {name}: {key} off by {got[key]:.2e}"
        yield rank, name, got


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_forward_backward_equal_reference_without_scalar_reads(world):
    scenarios = _scenarios(world)
    res = run_world(world, "tests.ep.a2a_workers.fused_scenarios", scenarios, timeout=300)
    for rank, name, got in _each_scenario_equal(res, scenarios):
        zero = {"_local_scalar_dense": 0, "tolist": 0}
        assert got["scalar_reads"] == (zero, zero), f"rank {rank}, {name}: scalar reads {got['scalar_reads']}"
        # the forward kept its received rows: the backward sends [dy | g] (H + 1 wide), not [x | dy | g];
        # except on a rank with T = 0 (its kept buffer R*T*min(K, E_l) = 0 rows) that receives rows:
        # that rank alone keeps nothing, and its sources send it x again in a second exchange
        # (every rank takes part: the verdicts are the same everywhere)
        short = 1 if "T0" in name else 0 if "overflow" in name else None  # the rank whose buffer is short
        assert got["kept"] == (rank != short), f"rank {rank}, {name}: kept {got['kept']}"
        dy_row = got["H"] * got["itemsize"] + 4
        want = [dy_row] if short is None else [dy_row, got["H"] * got["itemsize"]]
        assert got["bwd_dispatch_row_bytes"] == want, (rank, name, got)


@pytest.mark.dist
def test_max_tokens_keeps_rows_with_T0_and_unequal_T():
    """With the receive bound ``max_tokens`` (rows per rank) every rank's kept buffer is that
    bound, known before tracing: a rank with T = 0, or fewer tokens than its peers, keeps what it
    receives too, and every backward sends [dy | g] alone — still equal to the reference."""
    scenarios = [s for s in _scenarios(2) if s[0] in ("T0_on_rank1", "unequal_T", "bf16_T0_on_rank1")]
    res = run_world(2, "tests.ep.a2a_workers.fused_scenarios", scenarios, "a2a", 0, 64, timeout=300)
    for rank, name, got in _each_scenario_equal(res, scenarios):
        assert got["kept"], f"rank {rank}, {name}: kept nothing"
        assert got["bwd_dispatch_row_bytes"] == [got["H"] * got["itemsize"] + 4], (rank, name, got)


@pytest.mark.dist
def test_dedup_forward_backward_equal_reference():
    keep = ("uniform", "everything_to_rank0", "unequal_T", "T0_on_rank1", "bf16")  # the a2a test has the rest
    scenarios = [s for s in _scenarios(2) if s[0] in keep]
    res = run_world(2, "tests.ep.a2a_workers.fused_scenarios", scenarios, "a2a-dedup", timeout=300)
    for _ in _each_scenario_equal(res, scenarios):
        pass


def test_dedup_cuts_dispatch_bytes_at_k8_e64():
    from moe_compile.ep.fused_dedup import dispatch_bytes

    # 64 experts, top-8, 2 ranks: almost every token reaches both ranks, 2 rows instead of 8
    # (+ 8K bytes of ids and weights a row): ~0.25x of the one-row-per-slot dispatch.
    ids = torch.rand(512, 64, generator=torch.Generator().manual_seed(0)).topk(8, dim=1).indices
    dedup, plain = dispatch_bytes(ids, 2, 32, 1024 * 4)
    assert dedup <= 0.6 * plain, (dedup, plain)
    assert dedup >= 0.25 * plain  # never fewer rows than one per (token, rank) it reaches


@pytest.mark.dist
def test_fullgraph_compiles_without_capture_scalar_outputs():
    res = run_world(2, "tests.ep.a2a_workers.fullgraph", timeout=300)
    for rank, (status, out) in res.items():
        assert status == "ok", out
        err, rows = out
        assert err <= 1e-6, f"rank {rank}: compiled differs from eager by {err:.2e}"
        # eager and AOTAutograd alike: the forward's kept rows reach the backward, which sends [dy | g]
        assert rows == [[32 * 4 + 4]] * 2, rows


@pytest.mark.dist
def test_int8_dispatch_into_a8w8_experts_equals_the_single_device_op():
    """int8 rows + scales go straight into the a8w8-int experts: the single-device a8w8-int op's
    result (the same quantizer, kernel and pack; only the order of the K-sum differs: fp32, 1e-5)
    and a8w8's accuracy against fp32 (>= 30 dB SQNR), with no torch scalar read."""
    T = 7
    scenarios = [("uniform", [T, T], "uniform"), ("everything_to_rank0", [T, T], "rank0"),
                 ("T0_on_rank1", [T, 0], "uniform")]
    res = run_world(2, "tests.ep.a2a_workers.int8_scenarios", scenarios, timeout=300)
    for rank, name, got in _per_scenario(res, scenarios):
        assert got["vs_a8w8"] <= 1e-5, f"rank {rank}, {name}: {got['vs_a8w8']:.2e} off the a8w8-int op"
        assert got["sqnr_db"] >= 30.0, f"rank {rank}, {name}: SQNR {got['sqnr_db']:.1f} dB against fp32"
        assert got["scalar_reads"] == {"_local_scalar_dense": 0, "tolist": 0}, got["scalar_reads"]


def _packed_scenarios(world, T=9):
    """(name, Ts, routing) of the packed-kernel tests (fp32: the packed kernel's dtype)."""
    return [("uniform", [T] * world, "uniform"), ("everything_to_rank0", [T] * world, "rank0"),
            ("unequal_T", [3 + 8 * r for r in range(world)], "uniform"),
            ("T0_on_rank1", [T if r != 1 else 0 for r in range(world)], "uniform"),
            ("rank1_empty", [T] * world, "rank1_empty")]


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_in_place_forward_with_packed_experts_equals_reference(world):
    """The experts read the receive window where the rows lie (the packed fp32 kernel, once over
    every expert's rows of all sources) and this rank's own rows in x; FC2's epilogue stores each
    peer's row times its gate into its source's return window, and the source sums its slots:
    equal to the reference (fp32: 1e-5, as above), no scalar read."""
    scenarios = _packed_scenarios(world)
    res = run_world(world, "tests.ep.a2a_workers.packed_forward", scenarios, timeout=300)
    for rank, name, got in _per_scenario(res, scenarios):
        # every rank's third call: prepacked, so its experts store their peers' rows, times the gate,
        # straight into the sources' return windows ("FC2 into"), reading its own rows in x
        assert got["in_place"] and got["packed"] and got["fc2_into"], f"rank {rank}, {name}: not FC2 into: {got}"
        assert got["y"] <= 1e-5, f"rank {rank}, {name}: y off by {got['y']:.2e}"
        assert got["scalar_reads"] == {"_local_scalar_dense": 0, "tolist": 0}, got["scalar_reads"]


@pytest.mark.dist
@pytest.mark.slow
def test_copying_path_without_the_c_kernel(monkeypatch):
    """Without ep_copy.c (MOE_COMPILE_EP_COPY=0) the a2a op takes its copying path: still equal to
    the reference, and its backward sends [x | dy | g] (the forward kept nothing)."""
    monkeypatch.setenv("MOE_COMPILE_EP_COPY", "0")
    scenarios = [s for s in _scenarios(2) if s[0] in ("uniform", "T0_on_rank1")]
    res = run_world(2, "tests.ep.a2a_workers.fused_scenarios", scenarios, timeout=300)
    for _, _, got in _each_scenario_equal(res, scenarios):
        assert not got["kept"] and got["bwd_dispatch_row_bytes"] == [2 * got["H"] * got["itemsize"] + 4], got


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_training_with_frozen_packed_experts_equals_reference(world):
    """Experts frozen, inputs and gates trained (fine-tuning around a frozen MoE): from the third
    call the weights are prepacked, yet the backward's dx and dg must still equal the reference's
    (fp32: 1e-5, as above) with no scalar read."""
    scenarios = _packed_scenarios(world)
    res = run_world(world, "tests.ep.a2a_workers.packed_training", scenarios, timeout=300)
    for rank, name, got in _per_scenario(res, scenarios):
        # every rank's third call ran the packed experts with FC2 into the return windows
        assert got["packed"] and got["fc2_into"], f"rank {rank}, {name}: not the packed path: {got}"
        for key in ("y", "dx", "dg"):
            assert got[key] <= 1e-5, f"rank {rank}, {name}: {key} off by {got[key]:.2e} ({got})"
        has_tokens = next(Ts for n, Ts, _ in scenarios if n == name)[rank] > 0
        assert got["dx_nonzero"] == has_tokens, f"rank {rank}, {name}: dx all zero with tokens, or not without"
        assert got["scalar_reads"] == {"_local_scalar_dense": 0, "tolist": 0}, got["scalar_reads"]
