"""Huge-page advice on the CPU op's large buffers (moe_compile/kernels/cpu/memory.py)."""

import pytest
import torch

from moe_compile.kernels.cpu import memory as cpu_memory


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


def test_small_and_fake_buffers_are_plain():
    small = cpu_memory.empty((4, 4), torch.float32, "cpu")
    assert small.shape == (4, 4) and small.dtype == torch.float32
    assert not cpu_memory.advise_huge_pages(small)  # below MIN_BYTES: left to glibc's heap
    assert not cpu_memory.advise_huge_pages(torch.empty(1 << 22, device="meta"))


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
def test_large_buffer_is_advised_and_holds_data():
    n = (cpu_memory.MIN_BYTES // 4) * 2  # 2x MIN_BYTES of fp32
    t = cpu_memory.empty((n,), torch.float32, "cpu")
    assert cpu_memory.advise_huge_pages(t)  # madvise accepted the aligned inside of the buffer
    t.copy_(torch.arange(n, dtype=torch.float32))
    assert torch.equal(t[:: n // 7], torch.arange(0, n, n // 7, dtype=torch.float32))


def test_workspace_reuses_one_buffer_per_name_and_width():
    # Every chunk of a call takes its temporaries from the same storage (no new heap blocks per
    # chunk); names and widths get separate buffers, and a chunk larger than planned is an error.
    ws = cpu_memory.Workspace(8, torch.float32, "cpu")
    first, again = ws.take("h", 8, 6), ws.take("h", 3, 6)
    assert first.shape == (8, 6) and again.shape == (3, 6)
    assert again.data_ptr() == first.data_ptr()
    assert ws.take("a", 3, 6).data_ptr() != first.data_ptr()
    assert ws.take("h", 3, 4).data_ptr() != first.data_ptr()
    first.fill_(1.0)
    assert torch.equal(again, torch.ones(3, 6))  # a view of the same rows
    with pytest.raises(ValueError, match="9 rows asked, built for 8"):
        ws.take("h", 9, 6)
