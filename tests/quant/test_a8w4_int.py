"""a8w4-int: the per-channel form's MSD decomposition equals the plain int8 x int4 integer matmul bit
for bit; the group-wise form's reference scales exact block sums once per block, and its error
stays at or above llama.cpp's q4_0 x q8_0 on the same weights (``quant.ggml``)."""

import pytest
import torch

from moe_compile.quant import QuantWeight, a8w4_int, a8w8_int, ggml, pack
from moe_compile.quant.common import QuantRefusal, pack_nibbles, quantize_per_block_int8, quantize_per_token_int8


def _weight_with_integers(q: torch.Tensor) -> QuantWeight:
    """An a8w4-int weight holding exactly the integers ``q`` [1, N, K], bias as pack computes it."""
    E, N, K = q.shape
    bias = (8 * q.sum(-1)).int()
    return QuantWeight("a8w4-int", pack_nibbles(q + 8), torch.ones(E, N, 1), K, (E, N, K), bias)


@pytest.mark.parametrize("T,N,K", [(1, 3, 8), (7, 5, 64), (123, 17, 256)])
def test_msd_equals_int_matmul_random(T, N, K):
    g = torch.Generator().manual_seed(T * N + K)
    qx = torch.randint(-127, 128, (T, K), generator=g, dtype=torch.int8)
    qw = a8w4_int.pack(torch.randn(2, N, K, generator=g), group_size=None)
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
    qw = a8w4_int.pack(q.float(), group_size=None)
    assert torch.equal(qw.bias, 8 * a8w4_int.integers(qw).sum(-1))


def test_reference_matmul_scales_after_integer_accumulation():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 64, generator=g), torch.randn(1, 4, 64, generator=g)
    qw = a8w4_int.pack(w, group_size=None)
    qx, sx = quantize_per_token_int8(x)
    acc = (qx.long() @ a8w4_int.integers(qw)[0].long().t()).float()
    assert torch.equal(a8w4_int.matmul(x, qw, 0), acc * sx * qw.scale[0].reshape(1, -1))


def sqnr_db(ref: torch.Tensor, y: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - y).pow(2).sum()))


def test_default_is_group_wise_32_and_per_channel_stays_reachable():
    w = torch.randn(2, 4, 128)
    g = pack("a8w4-int", w)
    assert g.grouped_activations and g.group == 32 and g.scale.dtype == torch.float16 and g.bias is None
    assert g.scale.shape == (2, 4, 4) and g.nbytes == 2 * 4 * (64 + 8)  # 4.5 bits a weight, as q4_0
    assert pack("a8w4-int", w, 128).scale.shape == (2, 4, 1)
    pc = a8w4_int.pack(w, group_size=None)
    assert not pc.grouped_activations and pc.group == 128 and pc.bias is not None
    with pytest.raises(QuantRefusal, match="32, 64 or a multiple of 128"):
        a8w4_int.pack(torch.randn(1, 2, 192), group_size=96)
    with pytest.raises(ValueError, match="per-channel form"):
        a8w4_int.msd_matmul(torch.zeros(1, 128, dtype=torch.int8), g, 0)


def test_block_quantizer():
    # One scale per token per 32: max|x| / 127, round half to even, zero blocks exact, NaN non-finite.
    x = torch.randn(3, 96)
    x[0, 32:64] = 0
    x[1, :32] = torch.arange(32) - 15.5  # max 16.5 - ... : halves after scaling are not special
    x[2, 64:] = torch.tensor([127.0, 0.5, 1.5, -2.5] + [0.0] * 28)  # s = 1: exact halves to even
    x[2, 5] = float("nan")
    q, s = quantize_per_block_int8(x)
    assert s.shape == (3, 3) and s[0, 1] == 1 and torch.equal(q[0, 32:64], torch.zeros(32, dtype=torch.int8))
    assert s[2, 2] == 1 and q[2, 64:68].tolist() == [127, 0, 2, -2]
    assert torch.isnan(s[2, 0]) and torch.equal(q[2, :32], torch.zeros(32, dtype=torch.int8))
    assert torch.equal(s[1:2, 1:], x[1:2, 32:].reshape(1, 2, 32).abs().amax(-1) / 127)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_grouped_matmul_scales_each_block_once(group):
    g = torch.Generator().manual_seed(group)
    x, w = torch.randn(5, 256, generator=g), torch.randn(1, 6, 256, generator=g)
    qw = pack("a8w4-int", w, group)
    qx, sx = quantize_per_block_int8(x)
    q = a8w4_int.integers(qw)[0]
    acc = torch.stack([qx[:, b * 32:(b + 1) * 32].long() @ q[:, b * 32:(b + 1) * 32].long().t()
                       for b in range(8)], -1)  # [T, N, B] int64, exact
    assert torch.equal(a8w4_int.block_sums(qx, q), acc.float())
    sw = qw.scale[0].float().repeat_interleave(group // 32, -1)
    want = ((acc.float() * sx[:, None, :]) * sw[None]).sum(-1)
    # the same terms; only the order of the fp32 sum over the 8 blocks may differ
    torch.testing.assert_close(a8w4_int.matmul(x, qw, 0), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_signed_scales_put_the_extreme_on_minus_eight():
    # q4_0's trick: the group's largest-magnitude element lands on -8 (d = max / -8), whatever its sign.
    w = torch.randn(1, 8, 64)
    w[0, 0, 3], w[0, 1, 40] = 5.0, -5.0
    q = a8w4_int.integers(pack("a8w4-int", w))
    assert q[0, 0, 3] == -8 and q[0, 1, 40] == -8


# SQNR floors (dB) of the matmul y = x W^T against fp32, Gaussian W [256, 1024] and x [8, 1024]
# (measured 21.9 / 20.9 / 20.4 / 19.2 for groups 32 / 64 / 128 / per channel; q4_0 x q8_0 21.3),
# and on heavy-tailed (Student-t, 3 degrees) W: 18.1 / 16.2 / 14.4 / 9.5 (q4_0 17.9).
@pytest.mark.parametrize("dist", ["gauss", "t3"])
def test_sqnr_floors_and_q4_0(dist):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(1, 256, 1024, generator=g)
    if dist == "t3":
        w = w / torch.sqrt(torch.distributions.Chi2(3.0).sample((1, 256, 1024)) / 3)
    x = torch.randn(8, 1024, generator=g)
    ref = x @ w[0].t()
    got = {G: sqnr_db(ref, a8w4_int.matmul(x, a8w4_int.pack(w, G), 0)) for G in (32, 64, 128, None)}
    q4_0 = sqnr_db(ref, ggml.matmul_q4_0_q8_0(x, w[0]))
    floors = {"gauss": {32: 21.0, 64: 20.0, 128: 19.5, None: 18.5}, "t3": {32: 16.5, 64: 15.0, 128: 13.0, None: 8.0}}
    for G, floor in floors[dist].items():
        assert got[G] > floor, (G, got)
    assert got[32] >= q4_0 - 0.1, (got[32], q4_0)  # the same bytes, no worse than llama.cpp's 4-bit


def test_q4_0_yardstick_is_ggml_s():
    # quantize_row_q4_0_ref on a hand block: max by magnitude -4 -> d = 0.5, q = trunc(x / d + 8.5).
    w = torch.zeros(32)
    w[:4] = torch.tensor([-4.0, 1.0, 0.25, 3.9])
    q, d = ggml.q4_0(w)
    # 0.25 / 0.5 + 8.5 = 9.0 -> 1 (halves round up); 3.9 / 0.5 + 8.5 = 16.3 -> 15 -> 7
    assert float(d) == 0.5 and q[:4].tolist() == [-8, 2, 1, 7]
    qx, dx = ggml.q8_0(torch.tensor([127.0, 0.5, -0.5, 1.5] + [0.0] * 28))
    assert float(dx) == 1.0 and qx[:4].tolist() == [127, 1, -1, 2]  # roundf: half away from zero
