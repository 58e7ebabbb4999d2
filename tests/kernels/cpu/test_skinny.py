"""The skinny CPU kernel (kernels/cpu/skinny.c) against torch, on odd shapes, and its build."""

import itertools
import math

import pytest
import torch

from moe_compile.kernels.cpu import skinny as cpu_skinny
from moe_compile.kernels.cpu.isa import ISA_AVX2, ISA_AVX512
from tests.conftest import kernel_isa, run_python

needs_kernel = pytest.mark.skipif(not cpu_skinny.available(), reason=f"no skinny kernel: {cpu_skinny.unavailable_reason()}")


def _strided(rows: int, cols: int, pad: int) -> torch.Tensor:
    """[rows, cols] fp32 view of a wider buffer (row stride cols + pad), as the op's chunk buffers are."""
    return torch.randn(rows, cols + pad)[:, pad:]


@pytest.fixture(params=[ISA_AVX2, ISA_AVX512], ids=["avx2", "avx512"])
def isa(request):
    """The kernel held to AVX2, then (where the CPU has it) with its AVX-512 one-row loop."""
    if not cpu_skinny.available():
        pytest.skip(f"no skinny kernel: {cpu_skinny.unavailable_reason()}")
    with kernel_isa(cpu_skinny.use_isa, request.param) as isa:
        yield isa


# fp32 against a float64 product: the kernel sums in blocks of 8/16 lanes, torch in its own order;
# with unit-scale inputs and k <= 1100 the difference stays ~1e-5 of the output's scale.
@needs_kernel
# More rows than decode sends (cpu_skinny.MAX_ROWS) come from small experts (cpu_decode.fits).  One
# row with k past 64 and not a multiple of it: the AVX-512 one-row loop's steps and its tail.
@pytest.mark.parametrize("rows,k,n_out", [(1, 1, 1), (1, 200, 33), (1, 1100, 40), (2, 7, 9), (3, 33, 17), (5, 16, 300),
                                          (9, 8, 2), (11, 13, 7), (16, 1100, 40)])
@pytest.mark.parametrize("transposed,bias,threads", list(itertools.product([False, True], [False, True], [1, 2, 3])))
def test_kernel_matches_torch(rows, k, n_out, transposed, bias, threads, isa):
    w = _strided(k, n_out, 3) if transposed else _strided(n_out, k, 3)  # rows padded: ldw != width
    x = _strided(rows, k, 5)
    buf = torch.full((rows, n_out + 4), float("nan"))
    y = buf[:, 2 : 2 + n_out]  # the columns around y must stay NaN
    b = torch.randn(n_out) if bias else None
    cpu_skinny.run(cpu_skinny.tensor_task(w, x, y, b, transposed), threads)
    w_out_in = w.t() if transposed else w
    want = x.double() @ w_out_in.double().t() + (b.double() if bias else 0)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * max(1.0, want.abs().max().item()))
    assert torch.isnan(buf[:, :2]).all() and torch.isnan(buf[:, 2 + n_out :]).all()  # nothing outside y


@needs_kernel
def test_many_tasks_in_one_call():
    # One call per FC: every expert's task in one list, each part of the columns on its own thread.
    ws = [torch.randn(24, 40) for _ in range(6)]
    xs = [torch.randn(r, 40) for r in (1, 2, 0, 3, 1, 4)]
    ys = [torch.empty(x.shape[0], 24) for x in xs]
    tasks = sum((cpu_skinny.tensor_task(w, x, y) for w, x, y in zip(ws, xs, ys) if x.shape[0]), [])
    cpu_skinny.run(tasks, threads=2)
    for w, x, y in zip(ws, xs, ys):
        torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("transposed,threads", list(itertools.product([False, True], [1, 2, 3])))
def test_row_indices_scale_and_accumulate(transposed, threads):
    # The MoE combine inside the kernel: rows read from x by token, results scaled and added into
    # the token's row of y -- several rows of one task and rows of different tasks (a token's K
    # experts) hit the same y row, which must sum, not race.
    T, k, n_out = 5, 40, 19
    x, y = torch.randn(T, k), torch.randn(T, n_out)
    tasks, keep, want = [], [], y.double().clone()  # tasks hold raw pointers: keep their tensors alive
    for rows in ([0, 3, 3, 1], [3, 4], [0], [0, 3, 3, 1, 2, 4, 0, 1, 3, 2, 2]):  # the last: a small expert's rows
        w = torch.randn(k, n_out) if transposed else torch.randn(n_out, k)
        b, idx = torch.randn(n_out), torch.tensor(rows)
        scale = torch.rand(len(rows))
        keep.append((w, b, idx, scale))
        tasks += cpu_skinny.tensor_task(w, x, y, b, transposed, x_index=idx, y_index=idx, scale=scale)
        w_out_in = (w.t() if transposed else w).double()
        want.index_add_(0, idx, scale.double()[:, None] * (x.double()[idx] @ w_out_in.t() + b.double()))
    cpu_skinny.run(tasks, threads)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _swiglu_reference(h, F, interleaved, limit, scale):
    gate, up = (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, :F], h[:, F:])
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up * (scale[:, None] if scale is not None else 1)


# FC1 -> SwiGLU -> FC2 + combine in one call, against torch in float64.  FC1's rows are scaled
# from 0.003 to 40, so the gate spans |g| < 0.1 (where silu's error is exp's) to about 120 (past
# exp8's clamp at -87.3/88.7 and the limit of 7); F = 21 is not a multiple of the 8-lane blocks.  fp32
# rounding of a few products and the kernels' e^x (simd.h, ~2e-7 relative): 1e-5 relative per
# element (a coefficient of e^x off by 1% fails it).
@needs_kernel
@pytest.mark.parametrize("interleaved,limit,between,threads", list(itertools.product(
    [False, True], [0.0, 7.0], [False, True], [1, 2, 3])))
def test_ffn_in_one_call(interleaved, limit, between, threads):
    T, H, F, rows = 5, 40, 21, 4
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(T, H, generator=g), torch.randn(2 * F, H, generator=g), torch.randn(H, F, generator=g)
    w1 *= torch.logspace(math.log10(0.003), math.log10(40), 2 * F)[torch.randperm(2 * F, generator=g), None]
    tokens = torch.tensor([3, 0, 3, 1])  # token 3 twice: two slots add into one row of y
    scale, mid = torch.rand(rows, generator=g), torch.rand(rows, generator=g) if between else None
    h, a, y = torch.empty(rows, 2 * F), torch.empty(rows, F), torch.randn(T, H, generator=g)
    want = y.double().clone()
    fc1 = cpu_skinny.tensor_task(w1, x, h, x_index=tokens)
    fc2 = cpu_skinny.tensor_task(w2, a, y, y_index=tokens, scale=scale)
    act = cpu_skinny.swiglu(h.data_ptr(), h.stride(0), a.data_ptr(), a.stride(0), rows, F, interleaved,
                            mid.data_ptr() if between else 0)
    cpu_skinny.run_ffn(fc1, act, limit, fc2, threads)
    h_want = x.double()[tokens] @ w1.double().t()
    assert h_want.min() < -88 and h_want.max() > 88 and (h_want.abs() < 0.1).any()  # exp's clamps, silu's middle
    a_want = _swiglu_reference(h_want, F, interleaved, limit, mid.double() if between else None)
    want.index_add_(0, tokens, (a_want @ w2.double().t()) * scale.double()[:, None])
    torch.testing.assert_close(a.double(), a_want, rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_bad_task_has_clear_error():
    with pytest.raises(ValueError, match=r"wants fp32 CPU tensors.*x \[r, 8\]"):
        cpu_skinny.tensor_task(torch.randn(4, 8), torch.randn(2, 7), torch.empty(2, 4))
    with pytest.raises(ValueError, match="fp32"):
        cpu_skinny.tensor_task(torch.randn(4, 8).half(), torch.randn(2, 8).half(), torch.empty(2, 4).half())
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_skinny.tensor_task(torch.randn(8, 4).t(), torch.randn(2, 8), torch.empty(2, 4))
    with pytest.raises(ValueError, match="int64 row"):
        cpu_skinny.tensor_task(torch.randn(4, 8), torch.randn(3, 8), torch.empty(2, 4), x_index=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"x_index must lie in \[0, 3\)"):
        cpu_skinny.tensor_task(torch.randn(4, 8), torch.randn(3, 8), torch.empty(2, 4), x_index=torch.tensor([0, 3]))


@needs_kernel
def test_builds_into_a_fresh_cache(tmp_path):
    # A new machine: nothing cached, the first use compiles (never the import) and the result loads.
    code = ("import os, pathlib; import moe_compile.kernels.cpu.skinny as s; "
            "d = pathlib.Path(os.environ['MOE_COMPILE_CACHE']); assert not d.exists(); "
            "assert s.available(), s.unavailable_reason(); print(len(list(d.glob('skinny_*.so'))))")
    done = run_python(code, MOE_COMPILE_CACHE=str(tmp_path / "cache"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1"


def test_turned_off_by_env_and_op_still_correct():
    # MOE_COMPILE_SKINNY=0: the kernel is unavailable and decode falls back to the MKL path.
    code = ("import torch; from moe_compile.kernels import reference; from moe_compile.kernels.cpu import skinny as cpu_skinny; from moe_compile.ops.fused_moe import call_fused_moe; "
            "from moe_compile.ir import ExpertWeights, FFNAttrs; "
            "assert not cpu_skinny.available() and 'MOE_COMPILE_SKINNY' in cpu_skinny.unavailable_reason(); "
            "w = ExpertWeights((torch.randn(4, 16, 8),), (), (torch.randn(4, 8, 8),)); x = torch.randn(3, 8); "
            "ids = torch.tensor([[0, 1], [1, 2], [3, 0]]); g = torch.rand(3, 2); "
            "torch.testing.assert_close(call_fused_moe(x, ids, g, w, FFNAttrs()), "
            "reference.fused_moe_reference(x, ids, g, w, FFNAttrs()), rtol=1e-5, atol=1e-5)")
    done = run_python(code, MOE_COMPILE_SKINNY="0")
    assert done.returncode == 0, done.stderr


def test_decode_scratch_failure_raises(monkeypatch):
    # The one-call decode allocates a few KiB of scratch in C; if that fails it computes nothing,
    # so the host must raise instead of returning the zeroed output.
    class NoScratch:
        def moe_skinny_decode(self, *args):
            return -1

    monkeypatch.setattr(cpu_skinny, "_lib", lambda: NoScratch())
    with pytest.raises(MemoryError, match="scratch"):
        cpu_skinny.run_decode([0] * 4, 0.0, 2)
