"""kernels/cpu_rows: the C row loops of the prefill path against torch's ops on the same rows."""

import ctypes
import os
import shutil
import time

import pytest
import torch
import torch.nn.functional as F

from moe_compile.kernels.cpu import rows as cpu_rows
from tests.conftest import run_python

needs_kernels = pytest.mark.skipif(not cpu_rows.available(), reason=f"no row kernels: {cpu_rows.unavailable_reason()}")


def _rows(T=9, H=20, S=13, threads=2, seed=0):
    """x [T, H] as a view with a row stride > H, y [T, H], tokens [S] with repeats, scale [S]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H + 3, generator=g)[:, :H]
    tokens = torch.randint(0, T, (S,), generator=g)
    tokens[:3] = 4  # the same token three times in a row: the combine must not race
    return cpu_rows.SlotRows(x, torch.randn(T, H, generator=g), tokens, torch.rand(S, generator=g), threads)


@needs_kernels
@pytest.mark.parametrize("scaled", [False, True])
def test_gather(scaled):
    rows = _rows()
    out = torch.full((7, 20), float("nan"))
    rows.gather(3, 10, out, scaled)
    want = rows.x[rows.tokens[3:10]] * (rows.scale[3:10, None] if scaled else 1)
    assert torch.equal(out, want)  # a copy (times one float): exact


@needs_kernels
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_add_with_repeated_tokens(scaled, threads):
    rows = _rows(threads=threads)
    y0 = rows.y.clone()
    src = torch.randn(10, 20)
    rows.add(0, 10, src, scaled)
    want = y0.index_add_(0, rows.tokens[:10], src * (rows.scale[:10, None] if scaled else 1))
    # One add per element, in slot order in both (FMA contraction may round the scaled product
    # once instead of twice): 1 ulp-level.
    torch.testing.assert_close(rows.y, want, rtol=1e-6, atol=1e-6)


# fp32 SwiGLU: the C loop's exp polynomial and torch's Sleef expf are both within ~1-2 ulp of
# exp; measured max relative difference ~3e-7 on normal(0, 3) inputs.
@needs_kernels
@pytest.mark.parametrize("f", [1, 8, 21])  # all tail, one vector, vectors + tail
@pytest.mark.parametrize("scaled", [False, True])
def test_swiglu_matches_torch(f, scaled):
    rows = _rows(S=12)
    h = torch.randn(5, 2 * f) * 3
    h[0, : min(f, 4)] = torch.tensor([-100.0, -88.0, 88.0, 100.0])[: min(f, 4)]  # clamped exp range
    gate, up = h[:, :f], h[:, f:]
    out = rows.swiglu(2, 7, gate, up, torch.empty(5, f), scaled)
    want = F.silu(gate) * up * (rows.scale[2:7, None] if scaled else 1)
    torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-30)


@needs_kernels
def test_swiglu_in_place_and_nan_passes_through():
    rows = _rows()
    h = torch.randn(4, 32)
    h[1, 3] = float("nan")  # a NaN in a vector lane must not be clamped into a number
    want = F.silu(h[:, :16]) * h[:, 16:]
    gate = h[:, :16]
    out = rows.swiglu(0, 4, gate, h[:, 16:], gate)
    assert out.data_ptr() == h.data_ptr()
    torch.testing.assert_close(out, want, rtol=2e-6, atol=1e-30, equal_nan=True)
    assert torch.isnan(out[1, 3])


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_step_does_add_swiglu_and_gather_in_one_call(threads):
    # The prefill loop's step between two GEMMs: one expert's add, the next one's SwiGLU and the
    # one after's gather, each equal to the call on its own.
    rows = _rows(threads=threads)
    y0, src, h = rows.y.clone(), torch.randn(4, 20), torch.randn(5, 2 * 12)
    a, xe = torch.empty(5, 12), torch.empty(3, 20)
    rows.step(add=rows.add_fields(0, 4, src, True), swiglu=rows.swiglu_fields(4, 9, h[:, :12], h[:, 12:], a),
              gather=rows.gather_fields(9, 12, xe, True))
    torch.testing.assert_close(rows.y, y0.index_add_(0, rows.tokens[:4], src * rows.scale[:4, None]),
                               rtol=1e-6, atol=1e-6)  # as test_add_with_repeated_tokens
    torch.testing.assert_close(a, F.silu(h[:, :12]) * h[:, 12:], rtol=2e-6, atol=1e-30)  # as test_swiglu_matches_torch
    assert torch.equal(xe, rows.x[rows.tokens[9:12]] * rows.scale[9:12, None])


@needs_kernels
def test_bad_operands_are_refused():
    rows = _rows()
    with pytest.raises(ValueError, match=r"out must be an fp32 CPU \[7, 20\]"):
        rows.gather(3, 10, torch.empty(6, 20))
    with pytest.raises(ValueError, match="contiguous rows"):
        rows.add(0, 2, torch.empty(20, 2).t())
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 9\)"):
        cpu_rows.SlotRows(rows.x, rows.y, torch.tensor([0, 9]), torch.ones(2), 1)
    with pytest.raises(ValueError, match="tokens must be contiguous int64"):
        cpu_rows.SlotRows(rows.x, rows.y, torch.tensor([0, 1], dtype=torch.int32), torch.ones(2), 1)
    with pytest.raises(ValueError, match=r"scale must be contiguous fp32 \[2\]"):
        cpu_rows.SlotRows(rows.x, rows.y, torch.tensor([0, 1]), torch.ones(3), 1)


def test_turned_off_by_env():
    code = ("from moe_compile.kernels.cpu import rows as cpu_rows; "
            "assert not cpu_rows.available() and 'MOE_COMPILE_ROWS=0' in cpu_rows.unavailable_reason()")
    done = run_python(code, **{cpu_rows.ENV: "0"})
    assert done.returncode == 0, done.stderr


def test_builds_prune_week_old_builds_of_other_sources(tmp_path, monkeypatch):
    # A new build (a changed C file) removes that kernel's builds untouched for a week, and only those.
    from moe_compile.kernels.cpu import cc as cpu_cc

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("MOE_COMPILE_CACHE", str(tmp_path))
    old, recent, other = tmp_path / "rows_0ld.so", tmp_path / "rows_recent.so", tmp_path / "skinny_0ld.so"
    for f in (old, recent, other):
        f.write_bytes(b"")
    week_ago = time.time() - cpu_cc.STALE_AFTER_S - 60
    for f in (old, other):
        os.utime(f, (week_ago, week_ago))
    built = cpu_cc._build("rows", b"void moe_rows_nothing(void) {}\n")
    assert built.exists() and recent.exists() and other.exists() and not old.exists()


def test_shared_header_is_built_with_the_source_and_hashed(tmp_path, monkeypatch):
    # simd.h sits beside each kernel's source when it is built, and a change to it rebuilds.
    from moe_compile.kernels.cpu import cc as cpu_cc

    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("MOE_COMPILE_CACHE", str(tmp_path))
    source = b'#include "h.h"\nint moe_value(void) { return VALUE; }\n'
    one, two = (cpu_cc._build("probe", source, {"h.h": b"#define VALUE %d\n" % v}) for v in (1, 2))
    assert one != two
    for lib, value in ((one, 1), (two, 2)):
        assert ctypes.CDLL(str(lib)).moe_value() == value
