"""Shared fixtures: compile a model with the moe backend and see what it rewrote."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import pytest
import torch

import moe_compile
from moe_compile.api import capture_flags
from moe_compile.compiler import collecting_reports

# Tolerances against the model's own eager output (relative to the output's max magnitude):
# fp32 paths differ only in summation order; bf16 rounds intermediates to 8 mantissa bits in a
# different order than eager (and the op accumulates in fp32), so a few bf16 ulps are expected.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.double().abs().max().item()
    return (got.double() - want.double()).abs().max().item() / max(scale, 1e-30)


def run_compiled(model, *inputs, inner="eager", dynamic=None, **options):
    """(output, report) of ``torch.compile(model, backend="moe")`` on inputs."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="moe", dynamic=dynamic, options={"inner": inner, **options})
    with collecting_reports() as report, capture_flags():
        out = compiled(*inputs)
    return out, report


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    moe_compile.last_report()  # a test's last_report() holds its own graphs, not those an earlier test left unasked
    yield
    torch._dynamo.reset()


@contextlib.contextmanager
def kernel_isa(use_isa, isa: int):
    """A C kernel held to ``isa`` by its setter ``use_isa`` (which returns the setting before) for the
    block, the setting restored after; skipped where the CPU does not run that ISA."""
    before = use_isa(isa)
    try:
        if use_isa(isa) != isa:
            pytest.skip("this CPU has no AVX-512")
        yield isa
    finally:
        use_isa(before)


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """``python -c code`` in a fresh process with these environment variables added (import-time
    and first-use behaviour: builds, switches read from the environment)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


__all__ = ["TOL", "rel_err", "run_compiled", "run_python", "moe_compile"]


def routing_ids(mode: str, T: int, K: int, E: int, gen: torch.Generator) -> torch.Tensor:
    """[T, K] expert ids for kernel tests: "random", "one_expert" (all on the last expert),
    "sparse" (experts 0 and E-1 only), anything else: ids outside [0, E) mixed in (they contribute
    nothing and get a zero routing gradient)."""
    if mode == "random":
        return torch.randint(0, E, (T, K), generator=gen)
    if mode == "one_expert":
        return torch.full((T, K), E - 1, dtype=torch.long)
    if mode == "sparse":
        return torch.randint(0, 2, (T, K), generator=gen) * (E - 1)
    return torch.randint(-1, E + 1, (T, K), generator=gen)


def compiled_with_fused_call(model, x):
    """(compiled output, eager output, the fused op's node in the rewritten graph): model(x) through
    backend="moe" (inner eager) under the capture flags, the rewritten graph kept for inspection."""
    import moe_compile
    from moe_compile.api import capture_flags

    moe, graphs = moe_compile.backend(inner="eager"), []

    def grab(gm, inputs):
        graphs.append(gm)
        return moe(gm, inputs)  # rewrites gm in place

    torch._dynamo.reset()
    with torch.no_grad(), capture_flags():
        want = model(x)
        got = torch.compile(model, backend=grab)(x)
    call = next(n for g in graphs for n in g.graph.nodes if "fused_moe" in str(n.target))
    return got, want, call


def tiny_qwen3_moe_lm(**config):
    """A 2-layer HF Qwen3-MoE causal LM (hidden 64, 4 experts, top-2, 4/2 heads of 16, vocab 128) with
    random weights from seed 0, in eval mode; ``config`` overrides or adds config fields.  The caller
    has checked that transformers imports (``pytest.importorskip``)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", **{**dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                               num_experts=4, num_experts_per_tok=2, max_position_embeddings=64), **config})
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()
