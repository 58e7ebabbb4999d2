"""Pack -> dequantize round trips, group boundaries, and the reference matmuls."""

import pytest
import torch

from moe_compile.quant import FORMATS, dequantize, matmul, pack, wint

# Largest error of one dequantized element relative to its group's max, per format: half a step
# of the grid for int8 (1/254, + fp16 rounding of the scale for w8-int); for int4 the scale search
# may clip the largest elements to 7 steps of max/12, an error of at most 5/12 of the max; the
# element format's half ulp for floats (bf16 2^-9, e4m3 2^-4 at the top of the block's range,
# e2m1 1 between 4 and 6 while the scaled block max lies in (4, 6]: at most 1/4 of it).
MAX_ERR_OF_GROUP_MAX = {"w16": 2**-8, "w8-int": 0.5 / 127 + 1e-3, "w4-int": 5 / 12 + 1e-3,
                        "mxfp4": 1 / 4 + 1e-6, "mxfp8": 2**-4 * 1.01, "a8w8-int": 0.5 / 127 + 1e-6,
                        "a8w4-int": 5 / 12 + 1e-6, "a8w8-fp8": 2**-4 * 1.01}


def _group(fmt: str, K: int) -> int:
    return 32 if fmt in ("w8-int", "w4-int", "mxfp4", "mxfp8", "a8w4-int") else K


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_is_within_half_a_step(fmt):
    w = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(1))
    qw = pack(fmt, w)
    d = dequantize(qw)
    assert d.shape == w.shape and d.dtype == torch.float32
    G = _group(fmt, 128)
    gmax = w.reshape(3, 5, -1, G).abs().amax(-1, keepdim=True)
    err = (d - w).reshape(3, 5, -1, G).abs()
    assert bool((err <= MAX_ERR_OF_GROUP_MAX[fmt] * gmax).all()), float((err / gmax).max())


@pytest.mark.parametrize("fmt", ["w4-int", "a8w4-int"])
def test_int4_scale_search_never_loses_to_max_over_7(fmt):
    """The least-squares search includes s = max/7, so no group's squared error exceeds it."""
    w = torch.randn(4, 8, 256, generator=torch.Generator().manual_seed(6))
    G = _group(fmt, 256)
    wg = w.reshape(4, 8, -1, G)
    s = wg.abs().amax(-1, keepdim=True) / 7
    plain = (wg - (wg / s).round().clamp(-8, 7) * s).pow(2).sum(-1)
    searched = (wg - dequantize(pack(fmt, w)).reshape(wg.shape)).pow(2).sum(-1)
    tol = 2e-3  # the chosen scale is rounded to fp16
    assert bool((searched <= plain * (1 + tol) + 1e-9).all())
    assert float(searched.sum()) < 0.9 * float(plain.sum())  # and it buys something (-20% at G = 32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_of_dequantized_is_a_fixed_point(fmt):
    """Packing what a pack dequantizes to reproduces the same numbers (the grid holds them)."""
    w = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(2))
    d = dequantize(pack(fmt, w))
    assert torch.allclose(dequantize(pack(fmt, d)), d, rtol=0, atol=1e-6 * float(d.abs().max()))


@pytest.mark.parametrize("fmt", ["w8-int", "w4-int", "mxfp4", "mxfp8"])
def test_groups_are_independent(fmt):
    """Scales cover exactly 32 consecutive elements: a huge value in group 1 leaves groups 0 and 2
    exact to their own grid."""
    w = torch.randn(1, 2, 96, generator=torch.Generator().manual_seed(3))
    w_spiked = w.clone()
    w_spiked[:, :, 32:64] *= 1000
    d, d_spiked = dequantize(pack(fmt, w)), dequantize(pack(fmt, w_spiked))
    assert torch.equal(d[:, :, :32], d_spiked[:, :, :32]) and torch.equal(d[:, :, 64:], d_spiked[:, :, 64:])


@pytest.mark.parametrize("group", [32, 64, 128])
def test_wint_group_parameter(group):
    w = torch.randn(1, 3, 256)
    qw = pack("w8-int", w, group=group)
    assert qw.group == group and qw.scale.shape == (1, 3, 256 // group)
    s = w.reshape(1, 3, -1, group).abs().amax(-1) / 127
    assert torch.equal(qw.scale, s.half())  # w8-int: max / 127 rounded to fp16


def test_w4_int_integers_and_scales():
    w = torch.tensor([[[7.0, -7.0, 3.0, 0.0] + [1.0] * 28]])
    qw = pack("w4-int", w)
    assert qw.scale.dtype == torch.float16
    q = wint.integers(qw)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    assert torch.equal(dequantize(qw), w)  # integers on a scale of 1 are exact


def test_zero_weights_dequantize_to_zero():
    for fmt in FORMATS:
        assert torch.equal(dequantize(pack(fmt, torch.zeros(1, 2, 64))), torch.zeros(1, 2, 64)), fmt


@pytest.mark.parametrize("fmt", ["w16", "w8-int", "w4-int", "mxfp4", "mxfp8"])
def test_weight_only_matmul_is_x_times_dequantized(fmt):
    """Weight-only formats: fp32 activations times the dequantized weight."""
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(2, 6, 64, generator=g), torch.randn(7, 64, generator=g)
    qw = pack(fmt, w)
    torch.testing.assert_close(matmul(x, qw, 1), x @ dequantize(qw)[1].t(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fmt", ["a8w8-int", "a8w4-int", "a8w8-fp8"])
def test_activation_quantized_matmul_error(fmt):
    """a8 formats: the product's error against fp32 x @ W^T stays at the format's level (dB)."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(1, 64, 256, generator=g), torch.randn(9, 256, generator=g)
    y, ref = matmul(x, pack(fmt, w), 0), x @ w[0].t()
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum())
    assert float(sqnr) > {"a8w8-int": 35, "a8w4-int": 17, "a8w8-fp8": 27}[fmt]
