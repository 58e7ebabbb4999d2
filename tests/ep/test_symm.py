"""The CPU symmetric heap (shared memory among spawned ranks) and the int8 per-token format."""

from __future__ import annotations

import pytest
import torch

from moe_compile.quant.int8 import dequantize, quantize, sqnr_db
from tests.ep.harness import run_world


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_peer_write_signal_wait_barrier(world):
    res = run_world(world, "tests.ep.workers.heap_roundtrip", 10.0, timeout=60)
    for rank, (status, out) in res.items():
        assert status == "ok", out
        assert out["got"] == out["expect"]
        assert f"rank(s) [{(rank - 1) % world}]" in out["timeout"], out["timeout"]
        assert out["elapsed"] < 2.0


@pytest.mark.dist
def test_rendezvous_names_the_missing_rank():
    res = run_world(2, "tests.ep.workers.heap_missing_rank", 1.0, timeout=60)
    elapsed, msg = res[0][1]
    assert "rank(s) [1]" in msg, msg
    assert elapsed < 3.0


@pytest.mark.parametrize("shape", [(1, 7), (5, 64), (123, 256)])
def test_int8_roundtrip_error_bound(shape):
    x = torch.randn(shape) * 3
    q, s = quantize(x)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    back = dequantize(q, s)
    assert ((back - x).abs() <= s[:, None] / 2 + 1e-6).all()  # half a step per element
    if shape[1] >= 64:
        assert sqnr_db(x, back) > 35.0  # Gaussian rows: ~38-40 dB


def test_int8_zero_row_and_out_buffers():
    x = torch.zeros(3, 8)
    x[1] = torch.arange(8.0)
    q_out, s_out = torch.empty(3, 8, dtype=torch.int8), torch.empty(3)
    quantize(x, q_out, s_out)
    assert s_out[0] == 1.0 and (q_out[0] == 0).all()
    assert torch.allclose(dequantize(q_out, s_out), x, atol=7 / 254)
