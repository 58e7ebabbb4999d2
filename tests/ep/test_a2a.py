"""ep_dispatch / ep_combine: torch's all_to_all_vdev_2d contract — layout, fake kernels, and the CPU
heap transport bit-identical to the pure-torch model (dispatch, combine, their gradients)."""

from __future__ import annotations

import pytest
import torch

from moe_compile.ep.a2a_layout import combine_layout, dispatch_layout
from tests.ep.harness import run_world


def test_dispatch_layout_is_torchs_docstring_example():
    # torch's all_to_all_vdev_2d docstring: world 2, ne 2; c0 has 5 rows, d0 has 7, major_align 16
    # -> c1's offset is 16.  An empty expert still takes major_align rows (cutlass has no empty groups).
    splits = torch.tensor([[5, 2, 0, 3], [7, 1, 0, 4]])  # [R_src, R*ne]: c0 c1 c2 c3 / d0 d1 d2 d3
    o_splits, o_offs = dispatch_layout(splits, 2, 16)
    assert o_splits[0].tolist() == [5, 7, 2, 1] and o_offs[0].tolist() == [0, 5, 16, 18]
    assert o_splits[1].tolist() == [0, 0, 3, 4] and o_offs[1].tolist() == [0, 0, 16, 19]
    _, o_offs = dispatch_layout(splits, 2, None)  # default 1: the empty tile of rank 1's expert 0 keeps 1 row
    assert o_offs[1].tolist() == [0, 0, 1, 4]


def test_combine_layout_is_rank_major_and_packed():
    iso = torch.tensor([[[2, 1, 0, 3], [0, 4, 9, 9]], [[1, 1, 2, 0], [0, 1, 2, 7]]])  # [R_p, 2, ne*R]
    sp, offs, src = combine_layout(iso, 2)
    assert sp[0].tolist() == [2, 0, 1, 2] and offs[0].tolist() == [0, 2, 2, 3]  # rank 0 gets (p, e) blocks
    assert src[0].tolist() == [0, 9, 0, 2]


def test_register_registers_the_a2a_ops():
    from moe_compile import ep

    ep.register()
    assert hasattr(torch.ops.moe_compile, "ep_dispatch") and hasattr(torch.ops.moe_compile, "ep_combine")


def test_fake_kernels_give_static_shapes():
    import moe_compile.ep.a2a  # noqa: F401

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, s = torch.empty(10, 4, 8), torch.empty(6, dtype=torch.long)
        out, oso = torch.ops.moe_compile.ep_dispatch(x, s, "g", 33, 4)
        back, boso = torch.ops.moe_compile.ep_combine(out, oso, "g", 10)
        t = torch.ops.moe_compile.ep_combine_t(back, oso, "g", 33)
    assert out.shape == (33, 4, 8) and oso.shape == (2, 6) and oso.dtype == torch.long
    assert back.shape == (10, 4, 8) and boso.shape == (2, 6) and t.shape == (33, 4, 8)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_bit_identical_to_the_model_gradients_and_errors(world):
    res = run_world(world, "tests.ep.a2a_workers.all_checks", list(range(25)), 2, 8, timeout=180)
    for rank, (status, out) in res.items():
        assert status == "ok", out
        assert out["rounds"] == [], f"rank {rank}: not bit-identical to the model on {out['rounds']}"
        assert out["grads"] == (True, True), f"rank {rank}: dispatch / combine gradient differs from the model's"
        msgs = out["errors"]  # sizes that do not fit raise the same ValueError on every rank
        assert f"rank 0 receives {6 * world} rows, its out has 2" in msgs[0]
        assert "rank 0's splits span" in msgs[1] and "which has 1" in msgs[1]
        assert msgs[2] == 24.0 * world  # the ranks are still in step: the next call moves every row
        assert out["torch_signatures"], f"rank {rank}: all_to_all_vdev_2d(_offset) wrappers differ from the ops"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_200_random_routings_bit_identical(world):
    res = run_world(world, "tests.ep.a2a_workers.random_rounds", list(range(1000, 1200)), 3, 16, timeout=600)
    for rank, (status, out) in res.items():
        assert status == "ok", out
        assert out == [], f"rank {rank}: not bit-identical to the model on {out}"


@pytest.mark.dist
@pytest.mark.parametrize("env", [{}, {"MOE_COMPILE_EP_COPY": "0", "MOE_COMPILE_EP_WAIT": "futex"}])
def test_window_path_and_slab_growth(env, monkeypatch):
    """The fused op's path (C, or numpy's with the C kernel off; the futex wait) equal to the model,
    and a dispatch larger than the slabs (grown on every rank, sent again) still exact."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # big: 300 rows of 1024 fp32 (4 KiB) per (source, dest) = 1.2 MiB > the 1 MiB first slab
    res = run_world(2, "tests.ep.a2a_workers.window_paths", list(range(10)), 2, 1024, 300, timeout=180)
    for rank, (status, out) in res.items():
        assert status == "ok", out
        assert out == [], f"rank {rank}: window path differs from the model on {out}"


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dispatch_by_token_index_and_combine_sum(world):
    """The fused op's pair: rows sent by token index, read in place (``idx``) equal to the model's
    dispatch of x[tokens], a per-slot field with them; the weighted sum back exact; slab growth."""
    # big: 300 rows of 1024 fp32 (4 KiB) per (source, dest) = 1.2 MiB > the 1 MiB first slab
    res = run_world(world, "tests.ep.a2a_workers.index_paths", list(range(12)), 2, 1024 if world == 2 else 64,
                    300 if world == 2 else 5000, timeout=180)
    for rank, (status, out) in res.items():
        assert status == "ok", out
        assert out == [], f"rank {rank}: the by-index exchange differs from the model on {out}"
