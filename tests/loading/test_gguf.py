"""moe_compile.load on GGUF files: llama.cpp's blocks kept exactly, logits equal to the same model
with the file's weights dequantized (the reference path), clear errors for bad files."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import moe_compile  # noqa: E402
from moe_compile.models import llamacpp  # noqa: E402
from moe_compile.quant.packed import PackedWeight  # noqa: E402
from tests.conftest import rel_err  # noqa: E402
from tests.loading.conftest import tiny_config, transformers  # noqa: E402

# rows16 decode loops quantize a row's activations to int16 blocks: ~1e-5 of the output's scale
# where every other fp32 path differs from eager only in summation order
TOL_W = 1e-4
# a8 formats quantize activations to int8 per block of 32 (llama.cpp's q8_0), eager does not
TOL_A8 = 3e-2


def reference(path: str, **config) -> torch.nn.Module:
    """The file's model with every tensor dequantized by the gguf package into fp32 (plain eager)."""
    cfg = tiny_config(**config)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    with torch.no_grad():
        for name, param in llamacpp.gguf_tensors(model):
            t = tensors[name]
            param.copy_(torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(param.shape))
    return model


@pytest.fixture(params=["Q4_0", "Q8_0"])
def gguf_file(request, tiny_model, tmp_path):
    path = str(tmp_path / f"m-{request.param}.gguf")
    llamacpp.write_gguf(tiny_model, path, weights=request.param)
    return path


def test_blocks_are_kept_exactly(gguf_file):
    """Every q4_0 / q8_0 weight holds the file's values exactly (no fp32 round trip)."""
    model = moe_compile.load(gguf_file)
    ref = dict(llamacpp.gguf_tensors(reference(gguf_file)))
    ours = dict(llamacpp.gguf_tensors(model))
    packed = [n for n, p in model.named_parameters() if isinstance(p, PackedWeight)]
    assert len(packed) == 2 * 6 + 2  # per layer q, k, v, o and two expert stacks; embeddings, lm_head
    for name, want in ref.items():
        got = ours[name]
        got = got.dequantize() if isinstance(got, PackedWeight) else got  # gate / up halves: slices, dequantized
        assert torch.equal(torch.as_tensor(got).float(), want.float()), name


def test_logits_equal_reference_eager_and_compiled(gguf_file):
    model, ref = moe_compile.load(gguf_file), reference(gguf_file)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref(ids).logits) < 1e-6  # the same values through the same eager ops
        model.compile(backend="moe")
        for call in (ids, ids[:, :1], ids[:1, :3]):  # prefill (qgemm), one row (rows16), a few rows
            assert rel_err(model(call).logits, ref(call).logits) < TOL_W
    report = moe_compile.last_report()
    assert report.rewritten and all("loaded packed" in r.variant for r in report.rewritten)


def test_the_proof_dequantizes_only_the_experts_it_routes_to(tmp_path, monkeypatch):
    # 40 experts: the proof of a packed stack reaches a spread of 16 of them (prove.proof_experts),
    # each op dequantizing only the experts with tokens, never the whole [40, N, K] stack; the
    # compiled model still equals the dequantized reference.
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(num_experts=40)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    path = str(tmp_path / "m40.gguf")
    llamacpp.write_gguf(model, path, weights="Q4_0")
    loaded, ref = moe_compile.load(path), reference(path, num_experts=40)
    largest, dequantize = [0], PackedWeight.dequantize

    def recording(self):
        out = dequantize(self)
        if not isinstance(out, torch._subclasses.FakeTensor):  # Dynamo's shape propagation holds no memory
            largest[0] = max(largest[0], out.shape[0] if out.dim() == 3 else 1)
        return out

    monkeypatch.setattr(PackedWeight, "dequantize", recording)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        loaded.compile(backend="moe")
        assert rel_err(loaded(ids).logits, ref(ids).logits) < TOL_W
    assert len(moe_compile.last_report().rewritten) == 2
    assert 0 < largest[0] <= 16  # experts dequantized at once: the routed ones, not all 40


def test_a8w4_runs_the_same_bytes_with_int8_activations(tiny_model, tmp_path):
    path = str(tmp_path / "m.gguf")
    llamacpp.write_gguf(tiny_model, path, weights="Q4_0")
    model = moe_compile.load(path, quant="a8w4-int", quant_dense="a8w4-int")
    assert model.model.layers[0].mlp.experts.down_proj.fmt == "a8w4-int"
    ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        eager = model(ids).logits
        model.compile(backend="moe")
        assert rel_err(model(ids).logits, eager) < TOL_A8


def test_other_block_types_are_converted_with_their_error(tiny_model, tmp_path):
    path = str(tmp_path / "m.gguf")
    llamacpp.write_gguf(tiny_model, path, weights="Q5_0")
    model = moe_compile.load(path)
    rows = model.moe_compile_load.tensors
    converted = [r for r in rows if r.stored == "q5_0"]
    assert converted and all(r.kept.startswith("w4-int") and 15 < r.sqnr_db < 60 for r in converted)
    assert "worst SQNR" in str(model.moe_compile_load)
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():  # one more 4-bit rounding than the file's own weights: near, not equal
        assert rel_err(model(ids).logits, reference(path)(ids).logits) < 0.2


def test_state_dict_to_and_explain(gguf_file):
    model = moe_compile.load(gguf_file)
    sd = model.state_dict()
    assert isinstance(sd["model.layers.1.mlp.experts.gate_up_proj"], PackedWeight)
    half = model.to(torch.bfloat16)
    w = half.model.layers[0].self_attn.q_proj.weight
    assert isinstance(w, PackedWeight) and w.dtype == torch.bfloat16
    assert torch.equal(w.dequantize().float(), model.model.layers[0].self_attn.q_proj.weight.dequantize().float())
    text = str(moe_compile.explain(model.to(torch.float32), torch.randint(0, 256, (1, 4))))
    assert "model.layers.1.mlp.experts" in text


def test_truncated_file_names_the_tensor(tiny_model, tmp_path):
    path = tmp_path / "m.gguf"
    llamacpp.write_gguf(tiny_model, str(path), weights="Q4_0")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(ValueError, match=r"truncated.*'output\.weight'|output\.weight.*truncated"):
        moe_compile.load(str(path))


def test_mismatched_file_names_the_tensor(tiny_model, tmp_path):
    """A header that does not describe its tensors (here: twice the experts) is refused."""
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "qwen3moe")
    llamacpp._add_header(w, tiny_config(num_experts=8), gguf.LlamaFileType.ALL_F32)
    for name, tensor in llamacpp.gguf_tensors(tiny_model):
        w.add_tensor(name, tensor.detach().float().contiguous().numpy())
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_gate_inp\.weight"):
        moe_compile.load(path)


def test_unknown_architecture_is_refused(tmp_path):
    path = str(tmp_path / "m.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="'llama' GGUF"):
        moe_compile.load(path)
