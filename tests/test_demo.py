"""The demo's model through ``model.generate`` under backend="moe": decode steps reuse the compiled
graphs (no recompile per step) and every decode-step MoE call takes the skinny kernel's fast path
(the op's C++ CPU kernel, ``kernels/cpu/decode_op.cpp``, or where that is not built the Python
one, ``kernels/cpu/decode.py: decode_args``), not the general path.  A recompile per step or a
fallback to the general path would cost the demo most of its decode speed without changing a
token, so only these counts show it (speed itself is the demo's and the benchmarks' to measure)."""

import torch

from moe_compile import demo
from moe_compile.kernels.cpu import decode as cpu_decode, decode_op


def test_generate_decodes_on_the_compiled_graphs_and_the_fast_path(monkeypatch):
    from torch._dynamo.testing import CompileCounterWithBackend

    import moe_compile

    model, _ = demo.build_model("qwen3-moe", layers=1)
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    want = demo.generate(model, prompt, 8)

    fast_path = []  # (T, whether decode_args ran the call) per fused-op call
    real_decode_args = cpu_decode.decode_args

    def spy(args, threads):
        y = real_decode_args(args, threads)
        fast_path.append((args[0].shape[0], y is not None))
        return y

    monkeypatch.setattr(cpu_decode, "decode_args", spy)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(moe_compile.backend(inner="eager"))  # the op's path, not Inductor's
    model.compile(backend=counter)
    first = demo.generate(model, prompt, 8)
    # Prefill, the first decode step, then one graph with a dynamic cache length for every later
    # step (Dynamo's automatic dynamic shapes): a recompile per step would add a frame per token.
    assert counter.frame_count <= 3, counter.frame_count
    frames = counter.frame_count
    fast_path.clear()
    in_cpp = decode_op.fast_calls()
    again = demo.generate(model, prompt, 8)
    in_cpp = decode_op.fast_calls() - in_cpp  # decode steps the C++ kernel ran (none reach decode_args then)
    assert counter.frame_count == frames  # the second generate compiles nothing
    decode_calls = [taken for T, taken in fast_path if T == 1]
    assert all(decode_calls) and in_cpp + len(decode_calls) == 7, (in_cpp, fast_path)  # 7 decode steps, 1 MoE layer
    for run in (first, again):
        assert torch.equal(run.tokens, want.tokens)
        assert demo.max_logit_error(run, want) <= demo.LOGITS_TOL


def test_llama_bench_row(tmp_path, capsys):
    """``moe-compile demo --llama-bench PATH``: the demo model written as a GGUF, llama-bench run on
    it with the demo's threads, prompt and tokens (the decode after the prompt's context, as ours),
    and its decode speed printed beside ours.  A stand-in llama-bench records its arguments and
    answers as llama-bench -o json does."""
    import os
    import stat

    import pytest

    pytest.importorskip("gguf")
    fake = tmp_path / "llama-bench"
    fake.write_text("#!/bin/sh\necho \"$@\" >> " + str(tmp_path / "args") + "\n"
                    "echo '[{\"n_prompt\": 16, \"n_gen\": 0, \"avg_ts\": 400.0}, {\"n_prompt\": 0, \"n_gen\": 8, "
                    "\"avg_ts\": 50.0}]'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    model, _ = demo.build_model("qwen3-moe", layers=1)
    runs = [demo.Run(tokens=torch.zeros(1, 24), logits=(), prefill_s=0.1, decode_s=0.01)]  # 100 decode tokens/s
    demo.print_llama_speeds(model, "qwen3-moe", str(fake), 16, 8, 2, {'backend="moe"': runs})
    out = capsys.readouterr().out
    assert "decode 50.0 tokens/s" in out and "2.00x llama.cpp's" in out  # 100 tok/s against 50
    prefill, decode = (line.split() for line in (tmp_path / "args").read_text().splitlines())
    assert prefill[prefill.index("-p") + 1] == "16" and prefill[prefill.index("-n") + 1] == "0"
    assert decode[decode.index("-p") + 1] == "0" and decode[decode.index("-n") + 1] == "8"
    assert decode[decode.index("-d") + 1] == "16" and decode[decode.index("-r") + 1] == "2"
    assert decode[decode.index("-m") + 1].endswith("model-f32.gguf") and not os.path.exists(decode[decode.index("-m") + 1])
