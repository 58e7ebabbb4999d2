"""Training through the rewrite: gradients equal eager's, and a short training run tracks eager."""

import copy

import pytest
import torch

from moe_compile.models import zoo
from moe_compile.api import capture_flags
from moe_compile.compiler import collecting_reports
from tests.conftest import rel_err
from tests.test_hf_models import H, configs, hf_block

transformers = pytest.importorskip("transformers")

# Gradient tolerances (relative to each gradient's max magnitude): fp32 differs from eager only in
# summation order (K contributions and expert segments are summed in another order) — 1e-5;
# bf16 rounds every intermediate to 8 mantissa bits on both sides, in different places — 3e-2.
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def grads_after_step(model, x, compiled: bool, inner="eager"):
    model = copy.deepcopy(model).train()
    fn = model
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(model, backend="moe", options={"inner": inner})
    with capture_flags(), collecting_reports() as report:
        out = fn(x)
        out = out[0] if isinstance(out, tuple) else out
        (out.float().square().mean()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, report


def assert_same_training_step(model, x, dtype, inner="eager", family=None):
    want_out, want, _ = grads_after_step(model, x, compiled=False)
    got_out, got, report = grads_after_step(model, x, compiled=True, inner=inner)
    assert len(report.rewritten) == 1 and (family is None or report.rewritten[0].family == family)
    assert rel_err(got_out, want_out) <= GRAD_TOL[dtype]
    assert set(got) == set(want)
    for name in want:
        assert rel_err(got[name], want[name]) <= GRAD_TOL[dtype], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls,family", [(zoo.ModuleListMoE, "loop"), (zoo.DeepSeekOfficialMoE, "loop"),
                                        (zoo.GatheredMoE, "gathered"), (zoo.DenseMoE, "dense")])
def test_family_gradients_match_eager(cls, family, dtype):
    model = cls().to(dtype)
    assert_same_training_step(model, torch.randn(2, 7, 64, dtype=dtype), dtype, family=family)


def test_sorted_family_gradients_bf16():
    model = zoo.SortedMoE().to(torch.bfloat16)
    assert_same_training_step(model, torch.randn(2, 7, 64, dtype=torch.bfloat16), torch.bfloat16, family="sorted")


def test_gradients_under_aot_autograd_and_inductor():
    model = zoo.ModuleListMoE(experts=4)
    assert_same_training_step(model, torch.randn(1, 6, 64), torch.float32, inner="inductor", family="loop")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_hf_block_gradients_match_eager(name, impl, dtype):
    block = hf_block(name, impl, dtype)
    assert_same_training_step(block, torch.randn(2, 5, H, dtype=dtype), dtype)


def test_frozen_experts_get_no_gradient():
    model = zoo.ModuleListMoE(experts=4)
    for p in model.experts.parameters():
        p.requires_grad_(False)
    _, grads, report = grads_after_step(model, torch.randn(1, 5, 64), compiled=True)
    assert len(report.rewritten) == 1
    assert all(not n.startswith("experts.") for n in grads) and "gate.weight" in grads


@pytest.mark.parametrize("grad_cache", [False, True])
def test_thirty_steps_track_eager(grad_cache, monkeypatch):
    # grad_cache: every stacked expert weight's gradient on memory kept between steps
    # (kernels/cpu_grad_cache; by default only >= 32 MiB ones): still equal to eager, and reused.
    from moe_compile.kernels.cpu import grad_cache as cpu_grad_cache

    cpu_grad_cache.clear()
    if grad_cache:
        monkeypatch.setattr(cpu_grad_cache.GRADIENTS, "min_bytes", 0)
    cfg = configs()["mixtral"]
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 128, (2, 12))

    def train(compiled: bool):
        model = copy.deepcopy(base).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fn = model
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(model, backend="moe", options={"inner": "eager"})
        losses = []
        with capture_flags():
            for _ in range(30):
                loss = fn(input_ids=ids, labels=ids).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
        return losses, model

    want_losses, want_model = train(False)
    got_losses, got_model = train(True)
    # fp32: per-step differences start at ~1e-7 (summation order) and Adam amplifies them slowly;
    # 1e-4 relative per step and 1e-3 on the parameters after 30 steps still catch any wrong gradient
    # (a missing routing-weight gradient moves the loss by >1e-2 within a few steps).
    for step, (a, b) in enumerate(zip(got_losses, want_losses)):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)
    assert want_losses[-1] < want_losses[0] * 0.9  # the run actually trains
    for (name, p), q in zip(got_model.named_parameters(), want_model.parameters()):
        assert rel_err(p.detach(), q.detach()) <= 1e-3, name
    # zero_grad() frees each step's gradients before the next backward: one buffer per stacked
    # weight was enough (a second one would mean the first was never found free again).
    stacked = sum(p.nbytes for n, p in got_model.named_parameters() if "experts" in n and p.dim() == 3)
    assert cpu_grad_cache.held_bytes() == (stacked if grad_cache else 0)
    cpu_grad_cache.clear()


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_autocast_bf16_with_fp32_master_weights(inner):
    # fp32 parameters, bf16 compute under torch.autocast: the op casts like the Linears it
    # replaces and returns x's dtype; both sides round GEMM inputs to bf16 (3e-2, see GRAD_TOL).
    model = zoo.ModuleListMoE(experts=4)
    x = torch.randn(2, 5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_out, want, _ = grads_after_step(model, x, compiled=False)
        got_out, got, report = grads_after_step(model, x, compiled=True, inner=inner)
    assert len(report.rewritten) == 1
    assert got_out.dtype == want_out.dtype == torch.float32
    assert rel_err(got_out, want_out) <= GRAD_TOL[torch.bfloat16]
    for name in want:
        assert got[name].dtype == torch.float32
        assert rel_err(got[name], want[name]) <= GRAD_TOL[torch.bfloat16], name


@pytest.mark.parametrize("training,save_fc1", [(True, True), (False, True), (True, False)],
                         ids=["train", "no_grad", "train_recompute"])
def test_training_graph_saves_fc1_and_inference_graph_does_not(training, save_fc1, tmp_path):
    # A graph that will be differentiated gets fused_moe_train (its backward reads the saved FC1
    # output) unless save_fc1=False asks to recompute it (the plain op); under no_grad the op
    # without autograd (fused_moe_infer) runs and nothing extra is kept.  Gradients match eager
    # either way.
    torch._dynamo.reset()
    model = zoo.ModuleListMoE(experts=4)
    eager = copy.deepcopy(model)
    options = {"dump": str(tmp_path), "inner": "eager", "save_fc1": save_fc1}
    compiled = torch.compile(model, backend="moe", options=options)
    x = torch.randn(1, 6, 64)
    with capture_flags(), torch.set_grad_enabled(training):
        out = compiled(x)
        want = eager(x)
    assert rel_err(out, want) <= GRAD_TOL[torch.float32]
    (after,) = [p.read_text() for p in tmp_path.rglob("after.py")]
    op = ("fused_moe_train.default" if save_fc1 else "fused_moe.default") if training else "fused_moe_infer.default"
    assert op in after and ("fused_moe_train" in after) == (training and save_fc1)
    if training:
        out.square().mean().backward()
        want.square().mean().backward()
        for (name, got), (_, ref) in zip(model.named_parameters(), eager.named_parameters()):
            assert rel_err(got.grad, ref.grad) <= GRAD_TOL[torch.float32], name
