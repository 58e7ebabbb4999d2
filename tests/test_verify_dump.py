"""verify=True compares on the first call; dumps land where asked."""

import os
import warnings

import pytest
import torch

import moe_compile
from moe_compile import zoo
from moe_compile.api import capture_flags
from moe_compile.compiler import VerifyFirstCall


def test_verify_passes_on_a_correct_rewrite():
    model = zoo.ModuleListMoE(experts=4)
    x = torch.randn(1, 5, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = moe_compile.optimize(model, verify=True, inner="eager")(x)
    torch.testing.assert_close(got, model(x))


def test_verify_falls_back_on_mismatch():
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    wrong = VerifyFirstCall(lambda x: [x * 3], gm, [torch.ones(2)], moe_compile.MoEConfig(inner="eager"))
    with pytest.warns(RuntimeWarning, match="falling back"):
        out = wrong(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 2.0))


def test_dump_writes_before_after_report_and_dot(tmp_path):
    model = zoo.GatheredMoE()
    compiled = torch.compile(model, backend="moe", options={"dump": str(tmp_path), "inner": "eager"})
    with capture_flags():
        compiled(torch.randn(1, 4, 64))
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    names = set(os.listdir(folder))
    assert {"before.py", "after.py", "report.txt", "moe_region.dot"} <= names
    assert "fused_moe" in (folder / "after.py").read_text()
    assert "fused_moe" not in (folder / "before.py").read_text()


def test_dump_env_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_COMPILE_DUMP", str(tmp_path))
    compiled = torch.compile(zoo.DenseMoE(), backend="moe", options={"inner": "eager"})
    compiled(torch.randn(1, 3, 64))
    assert any(p.is_dir() for p in tmp_path.iterdir())


def test_decorator_on_forward():
    class Block(zoo.ModuleListMoE):
        @moe_compile.optimize(inner="eager")
        def forward(self, hidden_states):
            return super().forward(hidden_states)

    block = Block(experts=4)
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(block(x), zoo.ModuleListMoE.forward(block, x))


def test_wrong_dtype_to_compiled_model_is_a_clear_error():
    model = zoo.ModuleListMoE(experts=4)
    compiled = torch.compile(model, backend="moe", options={"inner": "eager"})
    with capture_flags():
        compiled(torch.randn(1, 3, 64))
        with pytest.raises(Exception, match="dtype|Double|Float"):
            compiled(torch.randn(1, 3, 64, dtype=torch.float64))
