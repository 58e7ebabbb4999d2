"""Every MoE model type of the installed transformers through backend="moe" (tests/hf_moe_models.py
finds them and holds the expected outcome of each): eager's logits, every MoE layer rewritten where
the type is eligible, and for the others the reason the report gives.

Default run: one compile per type at one shape (composite types: the check that their text stack
is the type tested).  Under ``-m slow``: a second input shape (which recompiles) and greedy
``generate`` for the causal LMs.
"""

import pathlib
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests import hf_moe_models as hf  # noqa: E402
from tests.conftest import rel_err  # noqa: E402

transformers.logging.set_verbosity_error()

ROOT = pathlib.Path(__file__).resolve().parents[1]
TYPES = list(hf.discover())
OWN = [t for t in TYPES if hf.discover()[t] is None]
COMPOSITE = [t for t in TYPES if hf.discover()[t] is not None]

# fp32 logits after 2 layers: the fused op sums the K contributions and the experts' rows in another
# order than HF's experts (~1 ulp per MoE layer), which attention, norms and the LM head carry a
# few-fold (measured up to ~6e-7 on these configs); a wrong expert, weight or shared expert moves
# the logits by ~1e-1.
LOGIT_TOL = 1e-4


def compiled(model):
    torch._dynamo.reset()
    return torch.compile(model, backend="moe", options={"inner": "eager"})


def run(fn, kwargs):
    from moe_compile.api import capture_flags
    from moe_compile.compiler import collecting_reports

    # The wrapped form, as @optimize runs a model: where Dynamo fails under the capture flags on what
    # plain torch.compile traces (a .tolist() of unbacked sizes), the call runs again without them.
    with torch.no_grad(), collecting_reports() as report:
        out = capture_flags(fn)(**kwargs)
    return out, report


def check_outcome(model_type: str, n_moe: int, report) -> None:
    expected = hf.OUTCOMES.get(model_type)
    skips = [s.reason for s in report.skipped]
    observed = (f"{len(report.rewritten)} of {n_moe} MoE layers rewritten; skipped: "
                + ("; ".join(skips) if skips else "none"))
    if expected is None:
        if n_moe and len(report.rewritten) == n_moe:
            warnings.warn(f"{model_type} is not in OUTCOMES of tests/hf_moe_models.py: add it as 'rewritten'")
            return
        pytest.fail(f"new MoE model type {model_type!r}: add it to OUTCOMES (and EXTRA if its tiny config needs "
                    f"knobs) in tests/hf_moe_models.py, then regenerate docs/models.md; observed: {observed}")
    if expected == hf.REWRITTEN:
        assert n_moe >= 1, f"the tiny {model_type} has no MoE layer: fix its knobs in EXTRA"
        assert len(report.rewritten) == n_moe, observed
        # one rewrite per layer: a frame Dynamo resumed after a graph break names its experts relative
        # to the layer ("mlp.experts"), in one graph per layer
        assert len({(r.source, r.graph) for r in report.rewritten}) == n_moe, observed
    else:
        assert not report.rewritten or len(report.rewritten) < n_moe, f"expected a refusal, {observed}"
        assert any(hf.reason_of(expected) in s for s in skips), f"expected {expected!r}; {observed}"


def tiny_or_xfail(model_type):
    expected = hf.OUTCOMES.get(model_type)
    if not isinstance(expected, hf.NoTinyModel):
        return hf.tiny_model(model_type)
    try:
        model, n_moe = hf.tiny_model(model_type)
        kwargs = hf.inputs(model, model_type, 1, 5)
        with torch.no_grad():
            model(**kwargs)
    except Exception as exc:  # noqa: BLE001 — the table says this tiny config does not work yet
        pytest.xfail(f"{expected.why} ({type(exc).__name__}: {str(exc)[:200]})")
    if n_moe == 0:
        pytest.xfail(expected.why)
    pytest.fail(f"the tiny {model_type} now builds: record its outcome in OUTCOMES of tests/hf_moe_models.py")


@pytest.mark.parametrize("model_type", OWN)
def test_moe_type_matches_eager_with_its_outcome(model_type):
    model, n_moe = tiny_or_xfail(model_type)
    kwargs = hf.inputs(model, model_type, 2, 9)
    with torch.no_grad():
        want = hf.main_output(model(**kwargs))
    got, report = run(compiled(model), kwargs)
    assert rel_err(hf.main_output(got), want) <= LOGIT_TOL
    check_outcome(model_type, n_moe, report)


@pytest.mark.parametrize("model_type", COMPOSITE)
def test_composite_type_runs_through_its_text_stack(model_type):
    # The MoE layers of a vision-language / omni model are its text model's: that type is tested.
    sub = hf.discover()[model_type]
    assert hf.discover().get(sub, "absent") is None, f"{model_type}'s text stack {sub} is not tested"
    assert hf.OUTCOMES.get(model_type) == f"via {sub}", (
        f"add {model_type!r}: 'via {sub}' to OUTCOMES in tests/hf_moe_models.py and regenerate docs/models.md")


@pytest.mark.slow
@pytest.mark.parametrize("model_type", OWN)
def test_moe_type_second_shape_and_generate(model_type):
    model, n_moe = tiny_or_xfail(model_type)
    fn = compiled(model)
    for batch, seq in ((2, 9), (1, 13)):  # the second shape recompiles (dynamic sizes)
        kwargs = hf.inputs(model, model_type, batch, seq)
        with torch.no_grad():
            want = hf.main_output(model(**kwargs))
        got, report = run(fn, kwargs)
        assert rel_err(hf.main_output(got), want) <= LOGIT_TOL, (batch, seq)
    if report.graphs:  # the recompiled graph has the same outcome
        check_outcome(model_type, n_moe, report)
    if hf.model_kind(model_type) == "causal":
        ids = hf.inputs(model, model_type, 1, 6)["input_ids"]
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=3, do_sample=False)
            model.compile(backend="moe", options={"inner": "eager"})
            got = model.generate(ids, max_new_tokens=3, do_sample=False)
        assert torch.equal(got, want)


def test_every_discovered_type_has_an_outcome():
    missing = [t for t in TYPES if t not in hf.OUTCOMES]
    assert not missing, f"add these MoE model types to OUTCOMES in tests/hf_moe_models.py: {missing}"


def test_docs_models_table_matches_outcomes():
    want = hf.models_markdown()
    got = (ROOT / "docs" / "models.md").read_text()
    assert got == want, "docs/models.md is stale: python -m tests.hf_moe_models > docs/models.md"


def test_readme_tested_models_match_outcomes():
    text = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- tested-models:begin -->\n(.*?)<!-- tested-models:end -->", text, re.S)
    if match is None:
        pytest.skip("README.md has no tested-models markers yet")
    assert match.group(1) == hf.readme_lines(), "README's tested models list is stale: hf_moe_models.readme_lines()"
