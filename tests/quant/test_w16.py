"""w16 packs a float weight as the 16-bit type that holds it more accurately (quant/w16.py)."""

import torch

from moe_compile.quant import w16


def _sqnr_db(w, data):
    return float(20 * torch.log10(w.norm() / (w - data.float()).norm()))


def test_trained_scale_weights_pack_as_fp16_and_beat_bf16():
    # N(0, 0.02) is the scale of trained LM weights: inside fp16's normal range, where its 10-bit
    # mantissa is 3 bits finer than bf16's (~18 dB)
    w = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    packed = w16.pack(w)
    assert packed.data.dtype == torch.float16
    assert _sqnr_db(w, packed.data) > _sqnr_db(w, w16.pack(w, torch.bfloat16).data) + 15


def test_weights_fp16_cannot_hold_pack_as_bf16():
    big = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(1)) * 1e5  # overflows fp16 (max 65504)
    assert w16.pack(big).data.dtype == torch.bfloat16
    tiny = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2)) * 1e-7  # fp16 subnormals / zeros
    assert w16.pack(tiny).data.dtype == torch.bfloat16
    assert torch.isfinite(w16.dequantize(w16.pack(big))).all()


def test_a_16_bit_weight_keeps_its_own_dtype():
    w = torch.randn(1, 4, 16).bfloat16()
    packed = w16.pack(w)
    assert packed.data.dtype == torch.bfloat16 and torch.equal(packed.data, w)
