"""moe_compile.load on a sharded safetensors checkpoint (the Hub's per-expert keys): streamed,
each weight packed as it arrives, logits equal to the reference path."""

import pytest
import torch

import moe_compile  # noqa: E402
from moe_compile import quant  # noqa: E402
from moe_compile.quant.packed import PackedWeight  # noqa: E402
from tests.conftest import rel_err  # noqa: E402
from tests.loading.conftest import transformers  # noqa: E402

TOL_W = 1e-4  # as in test_gguf: rows16 decode rounds activations to int16 blocks


@pytest.fixture
def checkpoint(tiny_model, tmp_path):
    path = tmp_path / "ckpt"
    tiny_model.save_pretrained(path, max_shard_size="600KB")  # several shards, experts split across them
    assert len(list(path.glob("*.safetensors"))) > 2
    return path


def dequantized_copy(model, fmt: str):
    """The model with every expert stack and linear replaced by its ``fmt`` values (the reference path)."""
    ref = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            module = ref.get_submodule(name.rpartition(".")[0])
            if name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3 or \
                    isinstance(module, torch.nn.Linear) and not name.endswith("mlp.gate.weight"):
                w = p if p.dim() == 3 else p[None]
                p.copy_(quant.dequantize(quant.pack(fmt, w, 32)).reshape(p.shape))
    return ref


def test_full_precision_load_is_the_model(tiny_model, checkpoint):
    model = moe_compile.load(str(checkpoint))
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny_model(ids).logits)


@pytest.mark.parametrize("fmt", ["w4-int", "w8-int"])
def test_packed_load_equals_reference(tiny_model, checkpoint, fmt):
    model = moe_compile.load(str(checkpoint), quant=fmt, quant_dense=fmt)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts.gate_up_proj, PackedWeight) and experts.gate_up_proj.fmt == fmt
    assert not isinstance(model.model.layers[0].mlp.gate.weight, PackedWeight)  # routers keep their dtype
    assert not isinstance(model.model.embed_tokens.weight, PackedWeight)
    ref = dequantized_copy(tiny_model, fmt)
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert rel_err(model(ids).logits, ref(ids).logits) < 1e-6
        model.compile(backend="moe")
        for call in (ids, ids[:, :1]):
            assert rel_err(model(call).logits, ref(call).logits) < TOL_W


def test_missing_expert_is_named(checkpoint):
    from safetensors.torch import load_file, save_file

    shard = next(s for s in sorted(checkpoint.glob("*.safetensors")) if any(".experts." in k for k in load_file(s)))
    tensors = load_file(shard)
    victim = next(k for k in tensors if ".experts." in k)
    del tensors[victim]
    save_file(tensors, shard)
    with pytest.raises(ValueError, match=r"experts"):
        moe_compile.load(str(checkpoint))


def test_truncated_shard_names_the_tensor(checkpoint):
    shard = sorted(checkpoint.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"truncated: tensor '"):
        moe_compile.load(str(checkpoint))


def test_bad_arguments_are_refused(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="not a format"):
        moe_compile.load(str(checkpoint), quant="int3")
    with pytest.raises(ValueError, match="neither a .gguf file nor a directory"):
        moe_compile.load(str(tmp_path / "nothing.bin"))
