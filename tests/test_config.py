import pytest
import torch

import moe_compile
from moe_compile.models import zoo
from moe_compile.config import MoEConfig


def test_defaults_keep_model_numerics():
    cfg = MoEConfig()
    assert cfg.quant == "none" and cfg.inner == "inductor" and cfg.verify is False


def test_unknown_option_lists_valid_ones():
    with pytest.raises(ValueError, match="valid options are .*verify"):
        MoEConfig.from_options({"verfy": True})


def test_bad_values_are_rejected():
    with pytest.raises(ValueError, match="inner"):
        MoEConfig(inner="tvm")
    with pytest.raises(ValueError, match="quant"):
        MoEConfig(quant="int3")
    with pytest.raises(TypeError, match="verify"):
        MoEConfig(verify="yes")
    with pytest.raises(TypeError, match="save_fc1"):
        MoEConfig(save_fc1="no")


def test_config_is_frozen():
    with pytest.raises(Exception):
        MoEConfig().verify = True


def test_unknown_option_through_torch_compile():
    model = zoo.ModuleListMoE(experts=4)
    compiled = torch.compile(model, backend="moe", options={"bogus": 1})
    with pytest.raises(Exception, match="bogus"):
        compiled(torch.randn(1, 3, 64))


def test_decorator_rejects_unknown_option():
    with pytest.raises(ValueError, match="valid options"):
        moe_compile.optimize(nonsense=True)


def test_import_does_not_initialise_cuda():
    import subprocess
    import sys

    code = "import moe_compile, torch; print(torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
