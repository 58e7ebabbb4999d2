"""The packed weight's validation, the per-token int8 quantizer, nibble order, group refusals."""

import pytest
import torch

from moe_compile.quant import FORMATS, QuantRefusal, QuantWeight, pack, quantize_per_token_int8
from moe_compile.quant import int8 as ep_int8
from moe_compile.quant.common import pack_nibbles, unpack_nibbles


def test_per_token_int8_rounds_half_to_even_and_keeps_zero_rows():
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    q, s = quantize_per_token_int8(x)
    assert s.shape == (2, 1) and s[0, 0] == 1.0 and s[1, 0] == 1.0  # zero row: scale 1
    assert q.tolist() == [[127, 0, 2, -2, -127], [0, 0, 0, 0, 0]]


def test_per_token_int8_range_and_error():
    x = torch.randn(33, 100) * torch.logspace(-3, 3, 33)[:, None]
    q, s = quantize_per_token_int8(x)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert bool(((q.float() * s - x).abs() <= s / 2 + 1e-6 * x.abs()).all())


def test_ep_dispatch_quantizer_is_the_same_function():
    x = torch.randn(9, 40)
    q, s = ep_int8.quantize(x)
    q2, s2 = quantize_per_token_int8(x)
    assert torch.equal(q, q2) and torch.equal(s, s2[:, 0])


def test_nibble_order_low_nibble_first():
    packed = pack_nibbles(torch.tensor([[1, 2, 15, 0]]))
    assert packed.tolist() == [[0x21, 0x0F]]
    assert unpack_nibbles(packed).tolist() == [[1, 2, 15, 0]]


@pytest.mark.parametrize("fmt", ["w8-int", "w4-int", "mxfp4", "mxfp8"])
def test_k_not_multiple_of_group_is_refused(fmt):
    with pytest.raises(QuantRefusal, match="not a multiple of the group"):
        pack(fmt, torch.randn(1, 4, 48))  # 48 is not a multiple of 32


@pytest.mark.parametrize("fmt", ["a8w4-int", "w4-int"])
def test_odd_k_is_refused_for_four_bits(fmt):
    with pytest.raises(QuantRefusal, match="even K|multiple of the group"):
        pack(fmt, torch.randn(1, 4, 33), **({"group": 33} if fmt == "w4-int" else {}))


def test_group_is_a_parameter_only_where_it_exists():
    assert pack("w4-int", torch.randn(1, 2, 128), group=64).scale.shape == (1, 2, 2)
    with pytest.raises(ValueError, match="group is fixed"):
        pack("mxfp4", torch.randn(1, 2, 128), group=64)


def test_quant_weight_rejects_wrong_shapes():
    with pytest.raises(ValueError, match="data must be"):
        QuantWeight("w8-int", torch.zeros(1, 2, 16, dtype=torch.int8), torch.ones(1, 2, 1, dtype=torch.float16), 32, (1, 2, 32))
    with pytest.raises(ValueError, match="bias"):
        QuantWeight("a8w4-int", torch.zeros(1, 2, 16, dtype=torch.uint8), torch.ones(1, 2, 1), 32, (1, 2, 32))
    with pytest.raises(ValueError, match="fmt"):
        QuantWeight("int3", torch.zeros(1), torch.ones(1), 1, (1, 1, 1))


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_bytes(fmt):
    qw = pack(fmt, torch.randn(2, 8, 64))
    bits = {"w16": 16, "w8-int": 8 + 0.5, "w4-int": 4 + 0.5, "mxfp4": 4 + 0.25, "mxfp8": 8 + 0.25,
            "a8w8-int": 8, "a8w4-int": 4 + 0.5, "a8w8-fp8": 8}[fmt]
    per_row = {"a8w8-int": 4, "a8w8-fp8": 4}.get(fmt, 0)  # fp32 scale (a8w4-int: fp16 per 32, no bias)
    assert qw.nbytes == 2 * 8 * (64 * bits / 8 + per_row)
