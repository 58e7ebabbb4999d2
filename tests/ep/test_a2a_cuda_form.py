"""The CUDA form of ep_dispatch / ep_combine without a GPU: its device-side block table
(``a2a_cuda.pull_table``) and Triton copy kernel (``a2a_triton.pull_blocks``, under
TRITON_INTERPRET=1 on CPU tensors whose addresses stand for the peers' symmetric buffers) move
every rank's rows exactly as the pure-torch model does; the op's fakes trace on Meta tensors.

Skipped where CUDA is present unless TRITON_INTERPRET=1 is already set (the flag is read when a
kernel is defined; the GPU lane runs the real transport, benchmarks/ep_gpu_check.py).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CUDA present: the GPU lane tests the CUDA transport", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from moe_compile.ep.a2a_cuda import pull_table  # noqa: E402
from moe_compile.ep.a2a_reference import combine_reference, dispatch_reference  # noqa: E402
from moe_compile.ep.a2a_triton import pull_blocks  # noqa: E402
from tests.ep.a2a_workers import _rows_needed, random_dispatch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _pull(kind, bufs, pays, me, R, ne, out_rows, align=None):
    """What rank ``me`` gets: the table from every rank's payload, the kernel over the 'peers'."""
    pay = torch.stack([p.reshape(-1) for p in pays])  # [R, P]: the payload buffer after the barrier
    (n, src_rank, src_row, dst_row), oso = pull_table(kind, pay, me, R, ne, align)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    out = torch.zeros(out_rows, bufs[0].shape[1])
    pull_blocks(ptrs, n.contiguous(), src_rank.contiguous(), src_row.contiguous(), dst_row.contiguous(), out)
    return out, oso


@pytest.mark.parametrize("world,seed", [(2, 0), (2, 1), (4, 2), (4, 3)])
def test_dispatch_combine_and_transpose_match_the_model(world, seed):
    ne, H = 3, 40  # H not a multiple of the kernel's column tile
    gen = torch.Generator().manual_seed(seed)
    inputs, splits, align = random_dispatch(gen, world, ne, H)
    out_rows = _rows_needed(splits, world, ne, align) + 2
    ref = dispatch_reference(inputs, splits, ne, out_rows, align)
    rows_in = [t.shape[0] for t in inputs]
    cref = combine_reference([r[0] for r in ref], [r[1] for r in ref], ne, rows_in)
    for me in range(world):
        out, oso = _pull("dispatch", inputs, splits, me, world, ne, out_rows, align)
        assert torch.equal(out, ref[me][0]) and torch.equal(oso, ref[me][1])
        back, boso = _pull("combine", [r[0] for r in ref], [r[1] for r in ref], me, world, ne, rows_in[me])
        assert torch.equal(back, cref[me][0]) and torch.equal(boso, cref[me][1])
        # combine_t of the combine's outputs puts them back at the combine's input rows
        t, _ = _pull("combine_t", [c[0] for c in cref], [r[1] for r in ref], me, world, ne, out_rows)
        assert torch.equal(t, ref[me][0])


def test_rows_past_out_are_dropped_not_written():
    bufs = [torch.arange(12.0).reshape(6, 2)]
    out = torch.full((3, 2), -1.0)
    t = torch.tensor
    pull_blocks(torch.tensor([bufs[0].data_ptr()]), t([5]), t([0]), t([0]), t([1]), out)
    assert out.tolist() == [[-1.0, -1.0], [0.0, 1.0], [2.0, 3.0]]


def test_ops_trace_on_meta_tensors():
    import moe_compile.ep.a2a  # noqa: F401

    x, s = torch.empty(12, 16, device="meta"), torch.empty(8, dtype=torch.long, device="meta")
    out, oso = torch.ops.moe_compile.ep_dispatch(x, s, "g", 40, 8)
    back, _ = torch.ops.moe_compile.ep_combine(out, oso, "g", 12)
    assert out.shape == (40, 16) and oso.shape == (2, 8) and back.shape == (12, 16) and back.device.type == "meta"
