"""quant= / accuracy_db= through the backend: the rewrite, the explicit and "auto" variants, the
refusals, the packs.  Kernels: ``reference_kernel`` (a stand-in computing quant.reference_moe with
the kernel contract) so that these pass whatever C kernels this checkout has built; the real
kernels are checked in tests/quant/test_hf_quant.py and tests/kernels/cpu/."""

import pytest
import torch

import moe_compile
from moe_compile.config import MoEConfig
from moe_compile.kernels.cpu import quant as cpu_quant
from moe_compile.quant import selection
from moe_compile.quant.int8 import sqnr_db
from tests.conftest import run_compiled
from tests.quant import reference_kernel

transformers = pytest.importorskip("transformers")

STAND_IN = "tests.quant.reference_kernel"
H = 64


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(cpu_quant, "KERNELS", {"decode": (STAND_IN,), "prefill": (STAND_IN,)})
    cpu_quant.clear()
    reference_kernel.RUNS.clear()
    yield reference_kernel
    cpu_quant.clear()


def mixtral_block(F=128, **over):
    cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=F, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=128,
                                     **over)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval().model.layers[0].mlp


def out(o):
    return o[0] if isinstance(o, tuple) else o


def quant_calls(report_or_gm):
    return [r for r in report_or_gm.rewritten]


def test_config_accepts_the_variants_and_checks_the_budget():
    for name in ("none", "auto", "w16", "w8-int", "w4-int", "mxfp4", "mxfp8", "a8w8-int", "a8w4-int", "a8w8-fp8"):
        assert MoEConfig(quant=name).quant == name
    assert MoEConfig(quant="auto").quant_budget_db() == 30.0
    assert MoEConfig(quant="auto", accuracy_db=20).quant_budget_db() == 20.0
    with pytest.raises(ValueError, match="budget of quant='auto'"):
        MoEConfig(quant="w4-int", accuracy_db=20)
    with pytest.raises(ValueError, match="positive number of dB"):
        MoEConfig(quant="auto", accuracy_db=-1)


@pytest.mark.parametrize("fmt,floor", [("w8-int", 35), ("w4-int", 12), ("a8w8-int", 28)])
def test_explicit_variant_rewrites_and_runs_it(stand_in, fmt, floor):
    block = mixtral_block()
    x = torch.randn(2, 7, H)
    with torch.no_grad():
        want = out(block(x))
        got, report = run_compiled(block, x, quant=fmt)
    (r,) = report.rewritten
    assert r.variant == fmt and f"variant={fmt}" in str(report)
    assert f"quant {fmt}: fixed by the option" in str(report) and "MiB)" in str(report)  # packed bytes
    assert stand_in.RUNS == {fmt: 1}
    assert sqnr_db(want, out(got)) >= floor  # tiny random HF weights: Gaussian, per-layer floors below the MoE test's


def test_explicit_variant_this_cpu_cannot_run_is_an_error(stand_in, monkeypatch):
    monkeypatch.setattr(reference_kernel, "SERVED", ("w8-int", "w4-int"))
    with pytest.raises(Exception, match=r"quant='mxfp4'.*no native kernel.*variants it runs: \['w8-int', 'w4-int'\]"), \
            torch.no_grad():
        run_compiled(mixtral_block(), torch.randn(1, 3, H), quant="mxfp4")


def test_auto_measures_every_native_variant_and_keeps_the_fastest_in_budget(stand_in, monkeypatch):
    monkeypatch.setattr(reference_kernel, "SERVED", ("w16", "w8-int", "w4-int"))
    block = mixtral_block()
    report = moe_compile.explain(block, torch.randn(1, 5, H), quant="auto", accuracy_db=25)
    (r,) = report.rewritten
    assert r.variant == "auto"
    sel = selection.recorded(r.quant_tag)["decode"]
    ran = {c.fmt: c for c in sel.candidates if c.time_ms is not None}
    assert set(ran) == {"none", "w16", "w8-int", "w4-int"}  # the rest: refused as not native
    ok = [c for c in ran.values() if c.sqnr_db >= 25]
    assert sel.chosen == min(ok, key=lambda c: c.time_ms).fmt
    assert ran["w4-int"].sqnr_db < 25 and sel.chosen != "w4-int"
    text = str(report)
    assert f"chose {sel.chosen}" in text and "w4-int: " in text and "over budget" in text
    assert "mxfp4: refused, not native" in text


def test_auto_decode_and_prefill_choose_separately(stand_in):
    """One layer, calls of T = 3 (decode) and 40 (prefill): each regime measured on its first call."""
    from moe_compile.ir import ExpertWeights, FFNAttrs

    E, F = 4, 64
    w = ExpertWeights((torch.randn(E, 2 * F, H) / 8,), (), (torch.randn(E, H, F) / 8,))
    for T in (3, 40, 3, 41):
        x, ids = torch.randn(T, H), torch.randint(0, E, (T, 2))
        y = cpu_quant.run(x, ids, torch.rand(T, 2), w, FFNAttrs(), "auto", 20.0, "layer-regimes")
        assert y.shape == (T, H)
    made = selection.recorded("layer-regimes")
    assert made["decode"].rows == 3 and made["prefill"].rows == 40  # the later calls reuse the choice


def test_auto_with_an_unreachable_budget_keeps_the_unquantized_op(stand_in):
    block = mixtral_block()
    x = torch.randn(1, 5, H)
    report = moe_compile.explain(block, x, quant="auto", accuracy_db=500)
    sel = selection.recorded(report.rewritten[0].quant_tag)["decode"]
    assert sel.chosen == "none" and cpu_quant.stats()["bytes"] == 0  # the candidates' packs were given back


def test_training_graph_keeps_the_unquantized_op(stand_in):
    block = mixtral_block().train()
    x = torch.randn(1, 5, H, requires_grad=True)
    got, report = run_compiled(block, x, quant="w8-int")
    (r,) = report.rewritten
    assert r.variant != "w8-int" and "training graph" in r.quant_note and "training graph" in str(report)
    out(got).sum().backward()
    assert stand_in.RUNS == {}


def test_unquantizable_layouts_are_refused_with_the_reason(stand_in):
    # K not a multiple of the group: F = 80 is not a multiple of 32.
    block = mixtral_block(F=80)
    with torch.no_grad():
        _, report = run_compiled(block, torch.randn(1, 3, H), quant="w4-int")
    (r,) = report.rewritten
    assert "not a multiple of the group" in r.quant_note and "unquantized op runs" in str(report)
    assert stand_in.RUNS == {}


def test_packs_once_per_version_and_empty_cache_frees_them(stand_in):
    block = mixtral_block()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="moe", options={"quant": "w8-int", "inner": "eager"})
    x = torch.randn(1, 4, H)
    with torch.no_grad():
        compiled(x)
        first = cpu_quant.stats()
        compiled(x)
        assert cpu_quant.stats() == first and first["packs"] == 1 and first["bytes"] > 0
        block.experts.down_proj.mul_(2)  # an in-place update: a new version, packed again
        y2 = out(compiled(x))
        torch.testing.assert_close(y2, out(block(x)), rtol=0.05, atol=0.05 * float(y2.abs().max()))
    held = moe_compile.empty_cache()
    assert held["quantized_weights"] > 0 and cpu_quant.stats()["bytes"] == 0


def test_dump_gets_the_auto_choice(stand_in, tmp_path):
    block = mixtral_block()
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="moe", options={"quant": "auto", "inner": "eager", "dump": str(tmp_path)})
    with torch.no_grad():
        compiled(torch.randn(1, 4, H))
    files = [p.name for p in tmp_path.rglob("quant_*_decode.txt")]
    assert files and "chose" in next(tmp_path.rglob("quant_*_decode.txt")).read_text()


def test_auto_keeps_the_packs_of_both_regimes_choices(stand_in):
    """Prefill's measurement gives back what it tried, but not the format decode chose earlier."""
    from moe_compile.ir import ExpertWeights, FFNAttrs

    E, F = 4, 64
    w = ExpertWeights((torch.randn(E, 2 * F, H),), (), (torch.randn(E, H, F),))
    for fmt in ("w4-int", "w8-int", "mxfp4", "w16"):
        cpu_quant.layer_pack(w, FFNAttrs(), fmt)
    cpu_quant._CHOICES[("both", "decode", (), ())] = "w4-int"
    cpu_quant._release_unkept("both", "w8-int", ["none", "w4-int", "w8-int", "mxfp4", "w16"], w)
    assert sorted(k[0] for k in cpu_quant._PACKS) == ["w4-int", "w8-int"]
