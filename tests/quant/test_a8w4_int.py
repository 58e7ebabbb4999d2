"""a8w4-int: the MSD decomposition equals the plain int8 x int4 integer matmul bit for bit."""

import pytest
import torch

from moe_compile.quant import QuantWeight, a8w4_int, a8w8_int, pack
from moe_compile.quant.common import pack_nibbles, quantize_per_token_int8


def _weight_with_integers(q: torch.Tensor) -> QuantWeight:
    """An a8w4-int weight holding exactly the integers ``q`` [1, N, K], bias as pack computes it."""
    E, N, K = q.shape
    bias = (8 * q.sum(-1)).int()
    return QuantWeight("a8w4-int", pack_nibbles(q + 8), torch.ones(E, N, 1), K, (E, N, K), bias)


@pytest.mark.parametrize("T,N,K", [(1, 3, 8), (7, 5, 64), (123, 17, 256)])
def test_msd_equals_int_matmul_random(T, N, K):
    g = torch.Generator().manual_seed(T * N + K)
    qx = torch.randint(-127, 128, (T, K), generator=g, dtype=torch.int8)
    qw = pack("a8w4-int", torch.randn(2, N, K, generator=g))
    for e in range(2):
        plain = a8w8_int.int_matmul(qx, a8w4_int.integers(qw)[e])
        assert torch.equal(a8w4_int.msd_matmul(qx, qw, e), plain)


@pytest.mark.parametrize("a", [-127, 0, 127, -1, 1, -16, 16, -112])
@pytest.mark.parametrize("b", [-8, 7, 0, -1])
def test_msd_extreme_values(a, b):
    """Every activation/weight corner: the digits stay in [-8, 7] and the products are exact."""
    K = 64
    qx = torch.full((2, K), a, dtype=torch.int8)
    q = torch.full((1, 3, K), b, dtype=torch.int32)
    q[0, 1, ::2] = 7  # one row mixing both weight extremes
    q[0, 1, 1::2] = -8
    qw = _weight_with_integers(q)
    hi, lo = a8w4_int.msd_digits(qx)
    assert int(hi.min()) >= -8 and int(hi.max()) <= 7 and int(lo.min()) >= -8 and int(lo.max()) <= 7
    assert torch.equal(16 * hi.int() + lo.int() + 8, qx.int())
    expected = (qx.long() @ q[0].long().t()).int()
    assert torch.equal(a8w4_int.msd_matmul(qx, qw, 0), expected)


def test_bias_is_eight_times_row_sum():
    q = torch.randint(-8, 8, (2, 6, 32), dtype=torch.int32)
    qw = pack("a8w4-int", q.float())
    assert torch.equal(qw.bias, 8 * a8w4_int.integers(qw).sum(-1))


def test_reference_matmul_scales_after_integer_accumulation():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 64, generator=g), torch.randn(1, 4, 64, generator=g)
    qw = pack("a8w4-int", w)
    qx, sx = quantize_per_token_int8(x)
    acc = (qx.long() @ a8w4_int.integers(qw)[0].long().t()).float()
    assert torch.equal(a8w4_int.matmul(x, qw, 0), acc * sx * qw.scale[0].reshape(1, -1))
