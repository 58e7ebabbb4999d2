"""oneDNN GEMMs (cpu_onednn) on expert weights as the model holds them, against float64 torch."""

import pytest
import torch

from moe_compile.kernels.cpu import onednn as cpu_onednn

pytestmark = pytest.mark.skipif(not cpu_onednn.available(), reason=f"{cpu_onednn.unavailable_reason()}")

# fp32 GEMM against a float64 reference, K <= 96 terms of O(1): a few ulps of the sum.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,k,out", [(1, 7, 5), (9, 33, 17), (64, 96, 40)])
@pytest.mark.parametrize("weight_layout", ["out_in", "transposed_view"])
@pytest.mark.parametrize("strided_x", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(n, k, out, weight_layout, strided_x, bias):
    # "transposed_view": the model stores [in, out] and the GEMM gets the [out, in] view of it.
    w = torch.randn(out, k) if weight_layout == "out_in" else torch.randn(k, out).t()
    x = torch.randn(n, 2 * k)[:, ::2] if strided_x else torch.randn(n, k)  # interleaved gate/up views
    b = torch.randn(out) if bias else None
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    got = cpu_onednn.linear(x, w, b)
    assert got.shape == (n, out) and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, **TOL)


def test_fits_only_fp32_cpu_and_honours_the_switch(monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    assert cpu_onednn.fits(x, w)
    assert not cpu_onednn.fits(x.bfloat16(), w.bfloat16())
    assert not cpu_onednn.fits(x.double(), w.double())
    monkeypatch.setenv(cpu_onednn.ENV, "0")
    assert not cpu_onednn.fits(x, w) and cpu_onednn.unavailable_reason() == f"{cpu_onednn.ENV}=0"
