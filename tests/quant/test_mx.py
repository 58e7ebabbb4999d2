"""MX: e8m0 scales and e2m1 / e4m3 encodings against hand-computed cases."""

import pytest
import torch

from moe_compile.quant import dequantize, pack
from moe_compile.quant import mx


def test_e2m1_codes_by_hand():
    # magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 are codes 0..7; midpoints go to the even code.
    v = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -6.0, -0.1, -1.5])
    expected = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 2, 4, 4, 6, 6, 7, 15, 8, 11]
    assert mx.e2m1_encode(v).tolist() == expected
    assert mx.e2m1_decode(torch.tensor(expected[:8])).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert mx.e2m1_decode(torch.tensor([15, 11, 9])).tolist() == [-6, -1.5, -0.5]


def test_e4m3_bits_by_hand():
    # 1.0 = 0 0111 000; 448 = 0 1111 110 (the largest finite); -2 = 1 1000 000;
    # 2^-9 = the smallest subnormal 0 0000 001; 2^-10 ties to 0 (even); 1.0625 ties to 1.0, 1.1875 to 1.25.
    v = torch.tensor([1.0, 448.0, 1000.0, -2.0, 2.0**-9, 2.0**-10, 1.0625, 1.1875, -448.0])
    assert mx.e4m3_encode(v).tolist() == [0x38, 0x7E, 0x7E, 0xC0, 0x01, 0x00, 0x38, 0x3A, 0xFE]
    assert mx.e4m3_decode(torch.tensor([0x38, 0x7E, 0xC0, 0x01], dtype=torch.uint8)).tolist() == [1.0, 448.0, -2.0, 2.0**-9]


@pytest.mark.parametrize("fmt,amax,code", [
    ("mxfp4", 6.0, 127),     # 6 / 6 = 1 = 2^0
    ("mxfp4", 6.1, 128),     # just above: rounds up to 2^1 so nothing saturates
    ("mxfp4", 3.0, 126),     # 3 / 6 = 2^-1
    ("mxfp4", 1.0, 125),     # 1/6 -> ceil(log2) = -2
    ("mxfp8", 448.0, 127),
    ("mxfp8", 1.0, 119),     # 1/448 = 2^-8.8 -> 2^-8
    ("mxfp8", 2.0**-130, 1), # below the floor: code 1 (2^-126, an fp32 normal)
])
def test_e8m0_scale_by_hand(fmt, amax, code):
    w = torch.zeros(1, 1, 32)
    w[0, 0, 5] = -amax
    qw = pack(fmt, w)
    assert qw.scale.tolist() == [[[code]]]


def test_zero_block_gets_scale_one():
    assert pack("mxfp8", torch.zeros(1, 1, 64)).scale.tolist() == [[[127, 127]]]


def test_mxfp4_block_by_hand():
    """Block max 12 -> scale 2 (code 128); elements 12/2 = 6, 1/2 = .5, -3/2 = -1.5 (ties none)."""
    w = torch.zeros(1, 1, 32)
    w[0, 0, :4] = torch.tensor([12.0, 1.0, -3.0, 5.0])  # 5 / 2 = 2.5: a tie, goes to 2 (even code)
    qw = pack("mxfp4", w)
    assert qw.scale.tolist() == [[[128]]]
    assert qw.data[0, 0, :2].tolist() == [0x7 | (0x1 << 4), 0xB | (0x4 << 4)]  # low nibble first
    assert dequantize(qw)[0, 0, :4].tolist() == [12.0, 1.0, -3.0, 4.0]


def test_e8m0_values():
    assert mx.e8m0_value(torch.tensor([127, 128, 0, 254], dtype=torch.uint8)).tolist() == [1.0, 2.0, 2.0**-127, 2.0**127]
    assert torch.isnan(mx.e8m0_value(torch.tensor([255], dtype=torch.uint8))).all()  # OCP: 255 is NaN, as in qdecode
