"""verify=True compares on the first call; dumps land where asked."""

import os
import shutil
import struct
import warnings

import pytest
import torch

import moe_compile
from moe_compile.models import zoo
from moe_compile.dump import collapse_paths
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
    assert {"before.py", "after.py", "report.txt", "moe_region_0.dot"} <= names
    assert "fused_moe" in (folder / "after.py").read_text()
    assert "fused_moe" not in (folder / "before.py").read_text()


def _dump_mixtral_style(tmp_path):
    """The dump folder of an 8-expert ModuleList block (HF v4 Mixtral's spelling)."""
    model = zoo.ModuleListMoE(hidden=64, ffn=96, experts=8, top_k=2).eval()
    with torch.no_grad(), capture_flags():
        torch.compile(model, backend="moe", options={"dump": str(tmp_path), "inner": "eager"})(torch.randn(1, 5, 64))
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    return folder


def test_region_picture_shows_the_region_before_the_rewrite(tmp_path):
    dot = (_dump_mixtral_style(tmp_path) / "moe_region_0.dot").read_text()
    # The stages of the region as the graph held it, in order, then the fused op beside it.
    stages = [dot.index(f'label="{name}') for name in ("ROUTER", "TOP-K", "DISPATCH", "EXPERTS", "COMBINE")]
    assert stages == sorted(stages)
    for label in ("family   loop", "E=8  K=2  H=64  F=96", "gate_up=separate", "variant  a16w16", "proof    rel. error",
                  "experts[0..7].gate_proj.weight  8 x [96, 64]", "experts[0..7].down_proj.weight  8 x [64, 96]",
                  "reads gate.weight", "torch.where(mask[e])", "index_add_ x8"):
        assert label in dot, label
    # Module paths, not Dynamo's placeholder names; one node for the 24 expert weights.
    assert "l_self_modules" not in dot
    assert dot.count("gate_proj.weight") == 1


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed")
def test_region_picture_renders_readable_png_and_svg(tmp_path):
    folder = _dump_mixtral_style(tmp_path)
    width, height = _png_size(folder / "moe_region_0.png")
    # Readable at natural size: the old after-only picture of this block was a 17747 x 254 strip.
    assert 400 <= width <= 2000 and 300 <= height <= 2000, (width, height)
    svg = (folder / "moe_region_0.svg").read_text()
    assert "COMBINE" in svg and "fused_moe" in svg


def test_region_picture_of_an_hf_qwen3_moe_layer(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2, vocab_size=128)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        torch.compile(model, backend="moe", options={"dump": str(tmp_path), "inner": "eager"})(
            torch.randint(0, 128, (1, 6)))
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    dot = (folder / "moe_region_0.dot").read_text()
    # HF v5 keeps stacked experts and sorts by expert: the sorted family, weights named by module path.
    for label in ("model.layers.0.mlp.experts (sorted, E=8, K=2)", "ROUTER", "reads model.layers.0.mlp.gate.weight",
                  "TOP-K", "DISPATCH", "EXPERTS", "COMBINE", "model.layers.0.mlp.experts.gate_up_proj  [8, 96, 64]",
                  "E=8  K=2  H=64  F=48"):
        assert label in dot, label
    if shutil.which("dot"):
        assert _png_size(folder / "moe_region_0.png")[0] <= 2000


def test_collapse_paths():
    paths = [f"model.layers.0.mlp.experts.{e}.w1.weight" for e in range(8)]
    assert collapse_paths(paths) == "model.layers.0.mlp.experts[0..7].w1.weight"
    assert collapse_paths(["experts.0.w", "experts.2.w"]) == "experts[0,2].w"
    assert collapse_paths(["a.w", "b.w"]) == "a.w (+1 more)"
    assert collapse_paths(["experts.gate_up_proj"]) == "experts.gate_up_proj"


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


class TakesTokens(zoo.GatheredMoE):
    """forward(x) on [T, H] itself: the region's x is the graph's input, named x by the user too."""

    def forward(self, x):
        weights, ids = torch.topk(self.gate(x).softmax(-1), self.top_k, dim=-1)
        h = torch.nn.functional.silu(torch.einsum("ti,tkoi->tko", x, self.w1[ids]))
        h = h * torch.einsum("ti,tkoi->tko", x, self.w3[ids])
        return torch.einsum("tki,tk->ti", torch.einsum("tko,tkio->tki", h, self.w2[ids]), weights)


def test_input_box_names_x_once_and_after_py_has_no_huge_line(tmp_path):
    with torch.no_grad(), capture_flags():
        torch.compile(TakesTokens(), backend="moe", options={"dump": str(tmp_path), "inner": "eager"})(torch.randn(4, 64))
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    x_box = next(ln for ln in (folder / "moe_region_0.dot").read_text().splitlines() if ln.startswith("  x ["))
    assert 'label="x [4, 64] float32\\l"' in x_box, x_box  # not "x [4, 64] float32\lx\l"
    after = (folder / "after.py").read_text()
    compile(after, "after.py", "exec")  # still Python
    assert "fused_moe" in after and max(len(ln) for ln in after.splitlines()) <= 160


def test_wrap_code_breaks_a_fused_call_and_its_frees_and_keeps_strings_whole():
    from moe_compile.dump import wrap_code

    names = [f"l_self_modules_experts_modules_{i}_weight_" for i in range(40)]
    line = (f"    y = torch.ops.moe_compile.fused_moe_infer.default(x, ids, [{', '.join(names)}], 'a, b', 0.0);  "
            f"{' = '.join(['x', *names])} = None")
    wrapped = wrap_code(line)
    compile("def forward(x, ids):\n" + wrapped, "after.py", "exec")  # the wrapped lines still parse
    assert max(len(ln) for ln in wrapped.splitlines()) <= 110 and "'a, b'" in wrapped
    # the same tokens, only re-laid: the call, then the frees on their own lines
    assert wrapped.replace("\\\n", " ").split() == line.replace(";  ", "\n").split()
