"""The fused op's CPU path against kernels/reference.py, on every layout and odd shape."""

import itertools

import pytest
import torch

from moe_compile.ir import ExpertWeights, FFNAttrs
from moe_compile.kernels.cpu import rows as cpu_rows
from moe_compile.kernels.reference import fused_moe_reference
from moe_compile.ops.fused_moe import call_fused_moe


def make_case(T, H, F, E, K, gate_up="concat", transposed=False, stacked=True, dtype=torch.float32, bias=False):
    n1 = F if gate_up in ("separate", "none") else 2 * F

    def shape(out, inp):
        return (inp, out) if transposed else (out, inp)

    w1 = torch.randn(E, *shape(n1, H), dtype=dtype) / H**0.5
    w2 = torch.randn(E, *shape(H, F), dtype=dtype) / F**0.5
    up = torch.randn(E, *shape(F, H), dtype=dtype) / H**0.5 if gate_up == "separate" else None
    if stacked:
        w = ExpertWeights((w1,), (up,) if up is not None else (), (w2,), transposed=transposed)
    else:
        w = ExpertWeights(tuple(w1), tuple(up) if up is not None else (), tuple(w2), transposed=transposed)
    x = torch.randn(T, H, dtype=dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
    g = torch.rand(T, K, dtype=dtype)
    return x, ids, g, w


def record_skinny_calls(monkeypatch) -> list:
    """The list the skinny kernel's calls append their thread counts to (``run`` and ``run_ffn``)."""
    from moe_compile.kernels.cpu import skinny as cpu_skinny

    calls = []
    real, real_ffn, real_decode = cpu_skinny.run, cpu_skinny.run_ffn, cpu_skinny.run_decode
    monkeypatch.setattr(cpu_skinny, "run", lambda tasks, threads=1: (calls.append(threads), real(tasks, threads)))
    monkeypatch.setattr(cpu_skinny, "run_ffn", lambda *args: (calls.append(args[-1]), real_ffn(*args)))
    monkeypatch.setattr(cpu_skinny, "run_decode", lambda *args: (calls.append(args[-1]), real_decode(*args)))
    return calls


def force_cpu_path(monkeypatch, path: str) -> list:
    """"skinny": decode-sized experts on the skinny kernel (cpu_skinny), two threads, stacked
    weights in one call that sorts the slots itself (cpu_decode.decode), per-expert ones sorted in
    Python, chunks of at most 4 rows; "skinny_sorted": every layout the second way; "chunked": per-expert GEMMs (oneDNN on plain weights for fp32) in chunks of at
    most 4 rows, so that experts share chunks and one expert's rows can exceed a chunk; "mkl": the
    same on MKL (MOE_COMPILE_ONEDNN=0); "packed": oneDNN GEMMs on weights packed at their first
    call (cpu_prepack), the row work between them on the C loops (cpu_rows) where they build;
    "packed_torch_rows": the same with that row work on torch's ops.  Returns the list the skinny
    kernel's calls or the packed GEMMs (and C combines) are recorded into (checked by the caller)."""
    from moe_compile.kernels.cpu import forward as cpu, decode as cpu_decode, onednn as cpu_onednn, prepack as cpu_prepack, rows as cpu_rows, skinny as cpu_skinny

    calls = []
    if path.startswith("skinny") and not cpu_skinny.available():
        pytest.skip(f"no skinny kernel: {cpu_skinny.unavailable_reason()}")
    if path.startswith("packed") and not cpu_prepack.available():
        pytest.skip(f"no packed GEMMs: {cpu_prepack.unavailable_reason()}")
    if path.startswith("skinny"):
        if path == "skinny_sorted":
            monkeypatch.setattr(cpu_decode, "one_call_fits", lambda *args: False)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
        monkeypatch.setattr(cpu, "DECODE_CHUNK_ROWS", 4)
        return record_skinny_calls(monkeypatch)
    monkeypatch.setattr(cpu_decode, "fits", lambda *args: False)
    monkeypatch.setattr(cpu_decode, "one_call_fits", lambda *args: False)
    monkeypatch.setattr(cpu, "CHUNK_ROWS", 4)
    if path.startswith("packed"):
        monkeypatch.setattr(cpu_prepack, "UNCHANGED_CALLS_BEFORE_PACKING", 0)
        real_linear, real_add = cpu_onednn.linear, cpu_rows.SlotRows.add

        def linear(x, weight, bias=None):
            if weight.is_mkldnn:
                calls.append("packed")
            return real_linear(x, weight, bias)

        def add(self, *args, **kwargs):
            calls.append("rows")
            return real_add(self, *args, **kwargs)

        monkeypatch.setattr(cpu_onednn, "linear", linear)
        monkeypatch.setattr(cpu_rows.SlotRows, "add", add)
        if path == "packed_torch_rows":
            monkeypatch.setattr(cpu_rows, "available", lambda: False)
        return calls
    monkeypatch.setattr(cpu_prepack, "lookup", lambda *args, **kwargs: None)
    if path == "mkl":
        monkeypatch.setenv(cpu_onednn.ENV, "0")
    return calls


PATHS = ["skinny", "skinny_sorted", "chunked", "mkl", "packed", "packed_torch_rows"]


# fp32: the CPU path sums experts in a different order than the reference: ~1e-6 relative.
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("gate_up,transposed,weight_on,stacked", list(itertools.product(
    ["concat", "interleaved", "separate", "none"], [False, True], ["output", "between", "input"], [True, False])))
def test_cpu_matches_reference_all_layouts(gate_up, transposed, weight_on, stacked, path, monkeypatch):
    calls = force_cpu_path(monkeypatch, path)
    x, ids, g, w = make_case(7, 16, 12, 5, 2, gate_up, transposed, stacked)
    attrs = FFNAttrs(gate_up=gate_up, transposed=transposed, weight_on=weight_on)
    torch.testing.assert_close(call_fused_moe(x, ids, g, w, attrs), fused_moe_reference(x, ids, g, w, attrs),
                               rtol=1e-5, atol=1e-5)
    assert (path in ("skinny", "skinny_sorted", "packed", "packed_torch_rows")) == bool(calls)
    assert ("rows" in calls) == (path == "packed" and cpu_rows.available())


@pytest.mark.parametrize("path,weight_on", [("skinny", "output"), ("packed", "output"), ("packed", "input"),
                                            ("packed_torch_rows", "output"), ("packed_torch_rows", "input")])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_paths_with_biases(stacked, transposed, path, weight_on, monkeypatch):
    # Every role with a bias (separate up projection too): added per expert, from a stacked [E, n]
    # tensor or E tensors [n].  With an FC2 bias the routing weight of weight_on "output" scales
    # FC2's output, not its input (the C combine's scaled form on the packed path).
    calls = force_cpu_path(monkeypatch, path)
    x, ids, g, w = make_case(5, 16, 12, 6, 2, "separate", transposed, stacked)
    biases = [torch.randn(6, n) for n in (12, 12, 16)]
    if not stacked:
        biases = [tuple(b) for b in biases]
    else:
        biases = [(b,) for b in biases]
    w = ExpertWeights(w.fc1, w.fc1_up, w.fc2, *biases, transposed=transposed)
    attrs = FFNAttrs(gate_up="separate", transposed=transposed, weight_on=weight_on)
    torch.testing.assert_close(call_fused_moe(x, ids, g, w, attrs), fused_moe_reference(x, ids, g, w, attrs),
                               rtol=1e-5, atol=1e-5)
    assert calls


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("weight_on", ["output", "input"])
def test_small_experts_run_on_the_skinny_kernel_at_any_row_count(stacked, transposed, weight_on, monkeypatch):
    # ~40 rows per expert: more than cpu_skinny.MAX_ROWS and than one block of the kernel's rows
    # (4 in the dot form, 16 in the transposed form), on experts far below SMALL_EXPERT_FLOPS.
    from moe_compile.kernels.cpu import skinny as cpu_skinny

    if not cpu_skinny.available():
        pytest.skip(f"no skinny kernel: {cpu_skinny.unavailable_reason()}")
    calls = record_skinny_calls(monkeypatch)
    x, ids, g, w = make_case(60, 16, 12, 3, 2, "separate", transposed, stacked)
    biases = [torch.randn(3, n) for n in (12, 12, 16)]
    w = ExpertWeights(w.fc1, w.fc1_up, w.fc2, *[(b,) if stacked else tuple(b) for b in biases], transposed=transposed)
    attrs = FFNAttrs(gate_up="separate", transposed=transposed, weight_on=weight_on)
    torch.testing.assert_close(call_fused_moe(x, ids, g, w, attrs), fused_moe_reference(x, ids, g, w, attrs),
                               rtol=1e-5, atol=1e-5)  # fp32, another summation order: ~1e-6
    assert calls


def test_only_small_or_decode_sized_experts_take_the_skinny_kernel():
    from moe_compile.kernels.cpu import forward as cpu, decode as cpu_decode, skinny as cpu_skinny

    if not cpu_skinny.available():
        pytest.skip(f"no skinny kernel: {cpu_skinny.unavailable_reason()}")

    def fits(T, H, F, E, K):
        x, ids, _, w = make_case(T, H, F, E, K)
        return cpu_decode.fits(x, w, cpu.sort_by_expert(ids, E)[1])

    assert fits(64, 16, 12, 2, 1)  # 32 rows per expert of 3 kFLOP per row
    assert fits(2, 256, 512, 4, 2)  # decode: at most 2 rows per expert
    # 16-32 rows of 1.6 MFLOP per row: 25-50 MFLOP per expert, above SMALL_EXPERT_FLOPS.
    assert not fits(64, 256, 512, 4, 2)


@pytest.mark.parametrize("T,E,K", [(0, 4, 2), (1, 4, 2), (1, 1, 1), (7, 1, 1), (123, 8, 1), (64, 64, 6), (3, 16, 8)])
def test_odd_shapes(T, E, K):
    x, ids, g, w = make_case(T, 24, 20, E, K)
    attrs = FFNAttrs()
    out = call_fused_moe(x, ids, g, w, attrs)
    assert out.shape == (T, 24)
    torch.testing.assert_close(out, fused_moe_reference(x, ids, g, w, attrs), rtol=1e-5, atol=1e-5)


def test_all_tokens_on_one_expert_and_empty_experts():
    x, _, g, w = make_case(33, 16, 8, 6, 1)
    ids = torch.full((33, 1), 4)
    attrs = FFNAttrs()
    torch.testing.assert_close(call_fused_moe(x, ids, g, w, attrs), fused_moe_reference(x, ids, g, w, attrs))


@pytest.mark.parametrize("activation,limit", [("gelu", 0.0), ("gelu_tanh", 0.0), ("relu", 0.0), ("silu", 0.5),
                                              ("gptoss", 0.5)])
@pytest.mark.parametrize("path", PATHS)
def test_activations(activation, limit, path, monkeypatch):
    calls = force_cpu_path(monkeypatch, path)
    x, ids, g, w = make_case(9, 16, 12, 4, 2, "interleaved")
    attrs = FFNAttrs(gate_up="interleaved", activation=activation, limit=limit)
    torch.testing.assert_close(call_fused_moe(x, ids, g, w, attrs), fused_moe_reference(x, ids, g, w, attrs),
                               rtol=1e-5, atol=1e-5)
    assert (path in ("skinny", "skinny_sorted", "packed", "packed_torch_rows")) == bool(calls)
    assert ("rows" in calls) == (path == "packed" and cpu_rows.available())


@pytest.mark.parametrize("path", PATHS)
def test_no_slot_in_range_gives_zeros_and_zero_grads(path, monkeypatch):
    # An expert-parallel rank whose tokens all went to other ranks: every id is the sentinel E, no
    # expert has a row (no chunk at all), the output is zero and so are all gradients.
    force_cpu_path(monkeypatch, path)
    x, ids, g, w = make_case(5, 16, 8, 4, 2)
    ids.fill_(4)
    x.requires_grad_(True)
    w = ExpertWeights(tuple(torch.nn.Parameter(t.clone()) for t in w.fc1), (), (torch.nn.Parameter(w.fc2[0].clone()),))
    out = call_fused_moe(x, ids, g, w, FFNAttrs())
    assert torch.equal(out, torch.zeros(5, 16))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.fc1[0].grad, torch.zeros_like(w.fc1[0]))


def test_out_of_range_ids_contribute_nothing():
    x, ids, g, w = make_case(6, 16, 8, 4, 2)
    ids[0, 1] = 4  # sentinel (E): dropped by the op, like HF's expert-parallel sentinel
    kept = fused_moe_reference(x[:1], ids[:1, :1], g[:1, :1], w, FFNAttrs())
    out = call_fused_moe(x, ids, g, w, FFNAttrs())
    torch.testing.assert_close(out[:1], kept)


# bf16: the op computes GEMMs in bf16 with fp32 accumulation, the reference all in fp32;
# outputs differ by bf16 rounding of the intermediate activation (~1e-2 relative).
def test_bf16_close_to_fp32_reference():
    x, ids, g, w = make_case(17, 32, 24, 6, 2, dtype=torch.bfloat16)
    out = call_fused_moe(x, ids, g, w, FFNAttrs())
    want = fused_moe_reference(x, ids, g, w, FFNAttrs())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_bad_inputs_have_clear_errors():
    x, ids, g, w = make_case(4, 16, 8, 4, 2)
    with pytest.raises(TypeError, match="topk_ids must be"):
        call_fused_moe(x, ids.float(), g, w, FFNAttrs())
    with pytest.raises(ValueError, match="hidden size"):
        call_fused_moe(torch.randn(4, 15), ids, g, w, FFNAttrs())
    with pytest.raises(TypeError, match="topk_weights"):
        call_fused_moe(x, ids, g[:, :1], w, FFNAttrs())
    with pytest.raises(ValueError, match="activation"):
        FFNAttrs(activation="swish2")


def test_fake_impl_keeps_tokens_symbolic():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    x, ids, g, w = make_case(5, 16, 8, 4, 2)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        fx_ = mode.from_tensor(x)
        out = call_fused_moe(fx_, mode.from_tensor(ids), mode.from_tensor(g),
                             ExpertWeights(tuple(mode.from_tensor(t) for t in w.fc1), (),
                                           tuple(mode.from_tensor(t) for t in w.fc2)), FFNAttrs())
    assert tuple(out.shape) == (5, 16)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_op_respects_the_callers_grad_mode(mode):
    # The op must behave the same under each grad mode of the caller, and never record history on
    # the weights (its own backward formula computes their gradients).
    x, ids, g, w = make_case(3, 32, 24, 8, 2)
    w = ExpertWeights(tuple(torch.nn.Parameter(t) for t in w.fc1), (), tuple(torch.nn.Parameter(t) for t in w.fc2))
    want = fused_moe_reference(x, ids, g, w, FFNAttrs()).detach()
    if mode == "inference_mode":
        with torch.inference_mode():
            out = call_fused_moe(x, ids, g, w, FFNAttrs())
    elif mode == "no_grad":
        with torch.no_grad():
            out = call_fused_moe(x, ids, g, w, FFNAttrs())
    else:
        out = call_fused_moe(x, ids, g, w, FFNAttrs())
        out.sum().backward()
        assert w.fc1[0].grad is not None
    torch.testing.assert_close(out.detach(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["grouped", "serial_mkl", "serial"])
@pytest.mark.parametrize("weight_on", ["output", "between", "input"])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("gate_up", ["concat", "interleaved", "separate", "none"])
def test_segments_longer_than_skinny_rows(gate_up, transposed, weight_on, path, monkeypatch):
    # 300 rows on each of 2 experts: prefill-sized.  "grouped": stacked weights through torch's
    # grouped GEMM (cpu.grouped_gemm_fits, without oneDNN); "serial_mkl" (per-expert weights, MKL):
    # FC1/FC2 write straight into the chunk's rows with out= past cpu.SKINNY_ROWS (a column half of
    # the FC1 buffer for the separate up projection); "serial": the same GEMMs on oneDNN.
    from moe_compile.kernels.cpu import forward as cpu, decode as cpu_decode, onednn as cpu_onednn

    monkeypatch.setattr(cpu, "GROUPED_MIN_FC1_ELEMENTS", 0)
    monkeypatch.setattr(cpu_decode, "fits", lambda *args: False)  # tiny experts: not the small-expert kernel
    if path != "serial":
        monkeypatch.setenv(cpu_onednn.ENV, "0")
    grouped = []
    real = cpu._grouped_experts
    monkeypatch.setattr(cpu, "_grouped_experts", lambda *args: (grouped.append(1), real(*args))[1])
    x, ids, g, w = make_case(300, 16, 12, 2, 2, gate_up, transposed, stacked=path == "grouped")
    attrs = FFNAttrs(gate_up=gate_up, transposed=transposed, weight_on=weight_on)
    torch.testing.assert_close(call_fused_moe(x, ids, g, w, attrs), fused_moe_reference(x, ids, g, w, attrs),
                               rtol=1e-5, atol=1e-5)
    assert bool(grouped) == (path == "grouped")



@pytest.mark.parametrize("T,K,E", [(1, 1, 1), (4, 2, 8), (5, 8, 64), (300, 6, 16)])
def test_host_sort_matches_torch_sort(T, K, E, monkeypatch):
    # Small slot counts sort on the host (cpu.HOST_SORT_MAX_SLOTS): the same stable order and
    # bounds as torch.sort + searchsorted, ids outside [0, E) (dropped slots) included.
    from moe_compile.kernels.cpu import forward as cpu

    ids = torch.randint(-2, E + 2, (T, K), generator=torch.Generator().manual_seed(T))
    host_order, host_bounds = cpu._sort_on_host(ids.reshape(-1), E)
    monkeypatch.setattr(cpu, "HOST_SORT_MAX_SLOTS", -1)
    order, bounds = cpu.sort_by_expert(ids, E)
    assert torch.equal(host_order, order) and host_bounds == bounds
    assert len(bounds) == E + 1 and bounds[0] == int((ids < 0).sum()) and bounds[-1] == int((ids < E).sum())


# A decode step on stacked weights runs as one kernel call that sorts the slots itself
# (cpu_decode.decode).  Its sort must drop ids outside [0, E) (-1, the sentinel E), keep a token
# whose K picks repeat an expert as two rows, read int32 ids, and its tasks must carry every
# expert's biases and the clamp.  fp32, another summation order than the reference: ~1e-6.
@pytest.mark.parametrize("gate_up,transposed,weight_on,int32,limit", [
    ("concat", False, "output", False, 0.0), ("separate", True, "between", True, 0.0),
    ("interleaved", False, "output", True, 0.5), ("separate", False, "output", False, 0.5)])
def test_decode_in_one_call(gate_up, transposed, weight_on, int32, limit, monkeypatch):
    from moe_compile.kernels.cpu import decode as cpu_decode, skinny as cpu_skinny

    if not cpu_skinny.available():
        pytest.skip(f"no skinny kernel: {cpu_skinny.unavailable_reason()}")
    calls = record_skinny_calls(monkeypatch)
    T, H, F, E, K = 6, 16, 12, 5, 3
    x, ids, g, w = make_case(T, H, F, E, K, gate_up, transposed)
    ids[0, 1], ids[2, 0], ids[3, 2] = -1, E, ids[3, 0]  # dropped, dropped, a repeated pick
    n1 = F if gate_up == "separate" else 2 * F
    biases = (torch.randn(E, n1), torch.randn(E, F) if gate_up == "separate" else None, torch.randn(E, H))
    w = ExpertWeights(w.fc1, w.fc1_up, w.fc2, *[(b,) if b is not None else () for b in biases], transposed=transposed)
    attrs = FFNAttrs(gate_up=gate_up, transposed=transposed, weight_on=weight_on, limit=limit)
    ids = ids.int() if int32 else ids
    assert cpu_decode.one_call_fits(x, ids, g, w, attrs)
    torch.testing.assert_close(call_fused_moe(x, ids, g, w, attrs), fused_moe_reference(x, ids.long(), g, w, attrs),
                               rtol=1e-5, atol=1e-5)
    assert calls == [torch.get_num_threads()]  # one call: run_decode


def test_infer_op_matches_and_refuses_a_backward():
    # fused_moe_infer (what the passes emit where no backward runs) has no autograd formula: it
    # must give fused_moe's result, and refuse inputs that want gradients instead of leaving them
    # silently missing.
    x, ids, g, w = make_case(5, 16, 8, 4, 2, stacked=False)
    args = (x, ids, g, list(w.fc1), list(w.fc1_up), list(w.fc2), [], [], [], "concat", False, "silu", 0.0, 0.0, "output")
    want = fused_moe_reference(x, ids, g, w, FFNAttrs())
    torch.testing.assert_close(torch.ops.moe_compile.fused_moe_infer(*args), want, rtol=1e-5, atol=1e-5)
    w.fc2[1].requires_grad_(True)
    with torch.no_grad():
        torch.testing.assert_close(torch.ops.moe_compile.fused_moe_infer(*args), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="has no backward; call moe_compile::fused_moe"):
        torch.ops.moe_compile.fused_moe_infer(*args)
