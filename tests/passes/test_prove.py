"""passes/prove: which hypothesis a proof keeps when more than one fits the region."""

import pytest
import torch

import moe_compile
from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.reference import fused_moe_reference
from moe_compile.passes import prove
from tests.conftest import rel_err, tiny_qwen3_moe_lm
from tests.test_ops import make_case

E, K = 6, 2


def _proof(attrs_true: FFNAttrs, candidates: list[FFNAttrs], dtype=torch.bfloat16, scale=0.03):
    """run_proof on a region that computes ``attrs_true`` in fp32 and rounds its output to ``dtype``
    (as HF's CPU grouped_mm fallback does) over hypotheses that differ only in their attrs; returns
    the chosen attrs (or None), the error and the tolerance.  ``scale``: x's scale; small
    activations keep the slopes' outputs close (sigmoid(a g) ~ 1/2 + a g / 4)."""
    x, _, _, w = make_case(9, 32, 24, E, K, "interleaved", transposed=True, dtype=dtype)
    x = x * scale

    def region(x_, ids, g, *params):
        w32 = ExpertWeights(tuple(t.float() for t in w.fc1), (), tuple(t.float() for t in w.fc2), transposed=True)
        return fused_moe_reference(x_.float(), ids, g.float(), w32, attrs_true).to(dtype)

    hyps = [prove.Hypothesis(w, a, ((), (), ())) for a in candidates]
    best, err, tol = prove.run_proof(region, x, torch.empty(9, K, dtype=torch.int64), torch.empty(9, K, dtype=dtype), [], [], hyps,
                                     K, E, None)
    return (best.attrs if best else None), err, tol


def test_a_clearly_closer_later_hypothesis_wins_at_bf16():
    # GPT-OSS's default slope (tried first) also passes bf16's tolerance for a region whose slope is
    # 1.25; the proof must keep looking and take the exact one.
    true = FFNAttrs("interleaved", True, "gptoss", 0.5, 1.25)
    default = FFNAttrs("interleaved", True, "gptoss", 0.5, 1.702)
    chosen, err, tol = _proof(true, [default, true])
    assert chosen == true and err < tol
    wrong_alone, wrong_err, _ = _proof(true, [default])
    assert wrong_alone == default and wrong_err > 2 * err  # what the proof used to keep


def test_structurally_equal_hypotheses_keep_the_first():
    # Weighting FC2's input or its output is the same function up to rounding: order decides.
    out = FFNAttrs("interleaved", True, "silu", 0.0, weight_on="output")
    between = FFNAttrs("interleaved", True, "silu", 0.0, weight_on="between")
    assert _proof(between, [out, between], torch.float32)[0] == out
    assert _proof(out, [between, out], torch.float32)[0] == between


def test_nothing_fits():
    true = FFNAttrs("interleaved", True, "gptoss", 0.5, 1.25)
    chosen, err, tol = _proof(true, [FFNAttrs("interleaved", True, "relu")], torch.float32)
    assert chosen is None and err > tol


def _three_layer_qwen3_moe():
    pytest.importorskip("transformers")
    model = tiny_qwen3_moe_lm(num_hidden_layers=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)  # real scores: from_config's near-zero router ties
    return model


@pytest.mark.parametrize("odd_layer", [False, True])
def test_repeated_layers_are_proven_once(monkeypatch, odd_layer):
    """Layers that are one region repeated are proven once per graph; a layer whose experts compute
    something else (here GELU for SiLU) is a different region, proven on its own and so rewritten
    as what it computes: a memo keyed too loosely would give it SiLU and the logits would differ."""
    model = _three_layer_qwen3_moe()
    if odd_layer:
        model.model.layers[1].mlp.experts.act_fn = torch.nn.GELU()
    proofs = []
    real = prove.run_proof
    monkeypatch.setattr(prove, "run_proof", lambda *a, **k: proofs.append(1) or real(*a, **k))
    ids = torch.randint(0, 128, (2, 5))
    with torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend="moe")(ids).logits
    report = moe_compile.last_report()
    assert len(proofs) == (2 if odd_layer else 1)
    assert len(report.rewritten) == 3
    assert [r.activation for r in report.rewritten] == ["silu", "gelu" if odd_layer else "silu", "silu"]
    assert rel_err(got, want) < 1e-4  # fp32: summation order only


def test_packed_proofs_reach_a_spread_of_experts():
    # Packed stacks are proven on max(16, 2K) experts, the first and last among them; plain ones
    # (and stacks that small) on every expert.
    from moe_compile.passes.prove import proof_experts

    spread = proof_experts(128, 8, packed=True)
    assert len(spread) == 16 and spread[0] == 0 and spread[-1] == 127 and bool((spread.diff() > 0).all())
    assert len(proof_experts(128, 12, packed=True)) == 24
    assert torch.equal(proof_experts(128, 8, packed=False), torch.arange(128))
    assert torch.equal(proof_experts(12, 2, packed=True), torch.arange(12))
