"""a8w8-int's two forms (quant/a8w8_int.py): group-wise (fp16 scales per group of K, activations int8
per block of 32, each block's int32 sum scaled once) and per channel (the seed's, the default)."""

from __future__ import annotations

import pytest
import torch

from moe_compile import quant
from moe_compile.quant import a8w4_int, a8w8_int, ggml
from moe_compile.quant.common import QuantRefusal, quantize_per_block_int8
from moe_compile.quant.int8 import sqnr_db


def test_the_default_is_per_channel_and_the_switch_picks_the_grouped_form(monkeypatch):
    w = torch.randn(2, 8, 256)
    monkeypatch.delenv(a8w8_int.GROUP_ENV, raising=False)
    per_channel = quant.pack("a8w8-int", w)
    assert per_channel.scale.dtype == torch.float32 and not per_channel.grouped_activations
    assert quant.formats.default_group("a8w8-int", 256) == 256
    for value, group in (("grouped", a8w8_int.GROUP), ("64", 64)):
        monkeypatch.setenv(a8w8_int.GROUP_ENV, value)
        qw = quant.pack("a8w8-int", w)
        assert qw.grouped_activations and qw.group == group and tuple(qw.scale.shape) == (2, 8, 256 // group)
        assert quant.formats.default_group("a8w8-int", 256) == group
    monkeypatch.setenv(a8w8_int.GROUP_ENV, "many")
    with pytest.raises(ValueError, match="MOE_COMPILE_A8W8_GROUP"):
        quant.pack("a8w8-int", w)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_grouped_pack_holds_w8_int_bytes_and_round_trips_within_half_a_step(group):
    w = torch.randn(3, 16, 512, generator=torch.Generator().manual_seed(group))
    qw = quant.pack("a8w8-int", w, group)
    w8 = quant.pack("w8-int", w, group)  # the same integers and fp16 scales: w8-int's bytes
    assert torch.equal(qw.data, w8.data) and torch.equal(qw.scale, w8.scale)
    err = (quant.dequantize(qw) - w).abs().reshape(3, 16, -1, group)
    assert bool((err <= qw.scale.float()[..., None] / 2 * (1 + 1e-6)).all())


def test_grouped_matmul_is_the_block_sums_scaled_once():
    # y = sum_b (acc_b * s_x_b) * s_w: computed here from the integers in float64 (exact sums), the
    # reference rounds only its fp32 scaling (~1e-7 relative of the terms).
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(2, 24, 1024, generator=g), torch.randn(5, 1024, generator=g) * 3
    qw = quant.pack("a8w8-int", w, 64)
    qx, sx = quantize_per_block_int8(x)
    acc = torch.einsum("tbk,nbk->tnb", qx.double().reshape(5, 32, 32), qw.data[1].double().reshape(24, 32, 32))
    sw = a8w4_int.block_scales(qw, 1).double()  # [N, B]
    want = (acc * sx.double()[:, None, :] * sw[None]).sum(-1)
    got = a8w8_int.matmul(x, qw, 1)
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-6 * want.abs().max().item())


def test_grouped_beats_per_channel_and_matches_q8_0_on_gaussian_weights():
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(1, 256, 2048, generator=g), torch.randn(8, 2048, generator=g)
    ref = x @ w[0].t()
    got = {G: sqnr_db(ref, a8w8_int.matmul(x, a8w8_int.pack(w, G), 0)) for G in (32, 64, 128, None)}
    # llama.cpp's q8_0 weights x q8_0 activations on the same weights (ggml's quantizers)
    qw, dw = ggml.q8_0(w[0])
    qx, dx = ggml.q8_0(x)
    sumi = torch.einsum("tbk,nbk->tnb", qx.float().reshape(8, -1, 32), qw.float().reshape(256, -1, 32))
    q8_0 = sqnr_db(ref, (sumi * (dx[:, None, :] * dw[None])).sum(-1))
    assert got[32] > got[64] > got[128] > got[None] + 2.0, got  # measured 42.7 / 42.2 / 41.7 / 38.6 dB
    assert got[32] >= q8_0 - 0.2, (got[32], q8_0)  # q8_0 x q8_0: 42.7 dB, the same arithmetic


def test_groups_the_kernels_do_not_tile_are_refused():
    w = torch.randn(1, 4, 384)
    with pytest.raises(QuantRefusal, match="32, 64 or a multiple of 128"):
        a8w8_int.pack(w, group_size=96)
    with pytest.raises(QuantRefusal, match="not a multiple of the group 256"):
        a8w8_int.pack(w, group_size=256)
