"""The fused experts kernel (experts.c) against kernels/reference.py: every layout it takes,
both tiles (AVX2 always, AVX-512 where the CPU has it), odd row counts, thread counts, the panel
layout, and the calls it must refuse."""

import itertools

import pytest
import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu import decode as cpu_decode, experts as cpu_experts, prepack as cpu_prepack
from moe_compile.kernels.reference import fused_moe_reference
from moe_compile.ops.fused_moe import call_fused_moe
from tests.test_ops import make_case

pytestmark = pytest.mark.skipif(not cpu_experts.available(), reason=f"{cpu_experts.unavailable_reason()}")

ISAS = [cpu_experts.ISA_AVX2] + ([cpu_experts.ISA_AVX512] if cpu_experts.available()
                                 and cpu_experts.best_isa() == cpu_experts.ISA_AVX512 else [])
# fp32: the tiles sum over K in another order than the reference's GEMMs, and the SiLU's e^x is a
# polynomial (~2e-7 relative): ~1e-6 relative on these sizes.
TOL = dict(rtol=1e-5, atol=1e-5)
# H = 64: two of the AVX-512 tile's 32-column FC2 blocks, four of AVX2's; F = 48: three 16-row
# panels, so the AVX2 tile's 8-feature FC1 blocks start mid-panel.  T = 37, K = 3 over E = 6
# experts: ~18 rows each, not a multiple of either tile's rows (8, 6).
T, H, F, E, K = 37, 64, 48, 6, 3


@pytest.fixture(autouse=True)
def _packed_at_once(monkeypatch):
    monkeypatch.setattr(cpu_prepack, "UNCHANGED_CALLS_BEFORE_PACKING", 0)
    # These experts are small and some calls decode-sized: the skinny kernel would take them.
    monkeypatch.setattr(cpu_decode, "fits", lambda *args: False)
    monkeypatch.setattr(cpu_decode, "one_call_fits", lambda *args: False)
    cpu_prepack.clear()
    yield
    cpu_prepack.clear()


def run_fused(monkeypatch, isa, x, ids, g, w, attrs, threads=2):
    """The op's result with the fused kernel forced to ``isa`` and ``threads``; asserts it ran."""
    calls, real = [], cpu_experts.run

    def run(*args):  # (x, tokens, scale, packed, w, attrs, bounds, threads)
        calls.append(args)
        return real(*args[:-1], threads, isa=isa)

    monkeypatch.setattr(cpu_experts, "run", run)
    y = call_fused_moe(x, ids, g, w, attrs)
    assert len(calls) == 1, "the fused experts kernel did not run"
    return y


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("gate_up,transposed,stacked,weight_on", list(itertools.product(
    ["concat", "interleaved", "separate"], [False, True], [True, False], ["output", "between"])))
def test_matches_reference(isa, gate_up, transposed, stacked, weight_on, monkeypatch):
    x, ids, g, w = make_case(T, H, F, E, K, gate_up, transposed, stacked)
    attrs = FFNAttrs(gate_up=gate_up, transposed=transposed, weight_on=weight_on)
    torch.testing.assert_close(run_fused(monkeypatch, isa, x, ids, g, w, attrs),
                               fused_moe_reference(x, ids, g, w, attrs), **TOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_clamped_odd_routes_and_thread_counts(isa, threads, monkeypatch):
    # A token routed twice to one expert (its two rows add into the same row of y), ids outside
    # [0, E) (dropped), an expert with no rows, one with a single row, the clamped SwiGLU; three
    # threads split 4 (AVX-512) or 6 (AVX2) FFN blocks unevenly.
    x, _, g, w = make_case(T, H, F, E, K)
    ids = torch.randint(1, E - 1, (T, K))  # expert 0 and E-1: no rows yet
    ids[0] = torch.tensor([2, 2, -1])
    ids[1, 0], ids[2, 2] = E, E - 1
    attrs = FFNAttrs(limit=0.7)
    torch.testing.assert_close(run_fused(monkeypatch, isa, x, ids, g, w, attrs, threads),
                               fused_moe_reference(x, ids, g, w, attrs), **TOL)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 5, 8, 9, 100])
def test_row_counts_around_the_tiles(isa, tokens, monkeypatch):
    # One expert, K = 1: its row count is T, below, at and above both tiles' 6 and 8 rows.
    x, ids, g, w = make_case(tokens, H, F, 1, 1)
    attrs = FFNAttrs()
    torch.testing.assert_close(run_fused(monkeypatch, isa, x, ids, g, w, attrs),
                               fused_moe_reference(x, ids, g, w, attrs), **TOL)


@pytest.mark.parametrize("isa", ISAS)
def test_experts_in_chunks_of_rows(isa, monkeypatch):
    # Rows of one expert run CHUNK_ROWS at a time (5 here, ~18 rows per expert): each chunk's FC2
    # adds into y on its own, and the chunks alternate between the two scratch halves.
    monkeypatch.setattr(cpu_experts, "CHUNK_ROWS", 5)
    x, ids, g, w = make_case(T, H, F, E, K)
    attrs = FFNAttrs()
    torch.testing.assert_close(run_fused(monkeypatch, isa, x, ids, g, w, attrs),
                               fused_moe_reference(x, ids, g, w, attrs), **TOL)


def test_pack_layout():
    # Panel p of an [out, in] weight is [in][16]: element (k, j) is W[16 p + j, k]; transposed
    # weights and de-interleaved gate/up rows pack to the same panels as their [out, in] form.
    w = torch.randn(2, 32, 5)
    packed = cpu_experts.pack(w, transposed=False)
    assert len(packed) == 2
    panels = packed[1].reshape(2, 5, 16)
    torch.testing.assert_close(panels, w[1].reshape(2, 16, 5).transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(cpu_experts.pack(w.transpose(1, 2).contiguous(), transposed=True)[1], packed[1],
                               rtol=0, atol=0)
    interleaved = torch.stack([w[:, :16], w[:, 16:]], 2).reshape(2, 32, 5)  # g0, u0, g1, u1, ...
    torch.testing.assert_close(cpu_experts.pack(interleaved, False, deinterleave=True)[0], packed[0],
                               rtol=0, atol=0)


@pytest.mark.parametrize("change,reason", [
    (dict(weight_on="input"), "routing weight on the input: not linear through the SwiGLU"),
    (dict(activation="gelu"), "not a SwiGLU"),
    (dict(gate_up="none"), "no gate"),
])
def test_refuses_what_it_does_not_compute(change, reason):
    x, ids, g, w = make_case(T, H, F, E, K, change.get("gate_up", "concat"))
    assert cpu_experts.fits(x, w, FFNAttrs())
    assert not cpu_experts.fits(x, w, FFNAttrs(**change)), reason


def test_refuses_biases_unaligned_sizes_and_other_dtypes():
    x, ids, g, w = make_case(T, H, F, E, K, "separate")
    with_bias = ExpertWeights(w.fc1, w.fc1_up, w.fc2, (), (), (torch.randn(E, H),))
    assert not cpu_experts.fits(x, with_bias, FFNAttrs(gate_up="separate"))
    x48, _, _, w48 = make_case(T, 48, F, E, K)  # H = 48: not a whole number of 32-column blocks
    assert not cpu_experts.fits(x48, w48, FFNAttrs())
    x40, _, _, w40 = make_case(T, H, 40, E, K)  # F = 40: not whole 16-row panels
    assert not cpu_experts.fits(x40, w40, FFNAttrs())
    assert not cpu_experts.fits(x.double(), w, FFNAttrs(gate_up="separate"))


def test_unaligned_call_raises_instead_of_computing(monkeypatch):
    # Called directly with sizes the tiles do not divide, the kernel refuses and the host raises:
    # a wrong y is never returned.
    x, ids, g, w = make_case(T, H, 8, E, K)  # F = 8: half a panel
    monkeypatch.setattr(cpu_experts, "fits", lambda *args: True)
    with pytest.raises(RuntimeError, match="refused H=64, F=8"):
        call_fused_moe(x, ids, g, w, FFNAttrs())


def test_a_tensor_holds_packs_of_one_format(monkeypatch):
    # The same weights called with the routing weight on the input (oneDNN's packs) and then on
    # the output (panels): each call matches the reference, and the second replaces the first's
    # packs instead of adding a second copy of the weights.
    from moe_compile.kernels.cpu import onednn as cpu_onednn

    if not cpu_onednn.available():
        pytest.skip(f"no oneDNN: {cpu_onednn.unavailable_reason()}")
    x, ids, g, w = make_case(T, H, F, E, K)
    for weight_on in ("input", "output", "input"):
        attrs = FFNAttrs(weight_on=weight_on)
        torch.testing.assert_close(call_fused_moe(x, ids, g, w, attrs), fused_moe_reference(x, ids, g, w, attrs), **TOL)
        stats = cpu_prepack.stats()
        assert stats["tensors"] == 2 and stats["bytes"] == sum(t.nbytes for t in (*w.fc1, *w.fc2))


def test_isa_switch(monkeypatch):
    # MOE_COMPILE_FUSED_ISA picks the tile; a name it does not know, or AVX-512 on a CPU without
    # it, is an error that says what to set.  (The CPU's own best, whatever the suite runs under.)
    monkeypatch.delenv(cpu_experts.ISA_ENV, raising=False)
    cpu_experts.best_isa.cache_clear()
    best = cpu_experts.best_isa()
    try:
        monkeypatch.setenv(cpu_experts.ISA_ENV, "avx2")
        cpu_experts.best_isa.cache_clear()
        assert cpu_experts.best_isa() == cpu_experts.ISA_AVX2
        monkeypatch.setenv(cpu_experts.ISA_ENV, "sse")
        cpu_experts.best_isa.cache_clear()
        with pytest.raises(ValueError, match="use one of"):
            cpu_experts.best_isa()
        monkeypatch.setenv(cpu_experts.ISA_ENV, "avx512")
        cpu_experts.best_isa.cache_clear()
        if best == cpu_experts.ISA_AVX512:
            assert cpu_experts.best_isa() == cpu_experts.ISA_AVX512
        else:
            with pytest.raises(ValueError, match="no AVX-512"):
                cpu_experts.best_isa()
        monkeypatch.delenv(cpu_experts.ISA_ENV)
        cpu_experts.best_isa.cache_clear()
        assert cpu_experts.best_isa() == best
    finally:
        monkeypatch.undo()  # the suite's own switch back before the cache is refilled
        cpu_experts.best_isa.cache_clear()
