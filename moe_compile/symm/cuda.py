"""CUDA symmetric heap over ``torch.distributed._symmetric_memory`` (untested on the CPU machine).

``empty`` allocates the same bytes on every rank, ``rendezvous(tensor, group_name)`` exchanges the
handles (a collective), ``get_buffer(rank, shape, dtype, storage_offset)`` addresses a peer's
bytes, and the signal pad gives per-(peer, channel) flags: ``put_signal(dst, channel)`` /
``wait_signal(src, channel)`` are ordered on the current stream after the copies that precede
them, so "copy rows into the peer's buffer, then put_signal" publishes the rows on the device
without a host sync.  Channels play the role of the CPU heap's flag slots; a wait names its peer
through ``who`` and turns the backend's timeout into a ``TimeoutError``.
"""

from __future__ import annotations

import torch

from moe_compile.symm.heap import SymmetricHeap


class CudaSymmHeap(SymmetricHeap):
    def __init__(self, group_name: str, nbytes: int, nflags: int, device):
        import torch.distributed._symmetric_memory as symm_mem

        self.nbytes, self.nflags = nbytes, nflags
        self._buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        self._handle = symm_mem.rendezvous(self._buf, group_name)
        self.rank, self.world = self._handle.rank, self._handle.world_size

    def tensor(self, rank: int, offset: int, shape, dtype):
        item = torch.empty((), dtype=dtype).element_size()
        if offset % item:
            raise ValueError(f"heap view at byte {offset} is not aligned to {dtype}")
        if rank == self.rank:
            n = 1
            for s in shape:
                n *= s
            return self._buf[offset : offset + n * item].view(dtype).view(*shape)
        return self._handle.get_buffer(rank, tuple(shape), dtype, offset // item)

    def signal(self, rank: int, slot: int, value: int = 1) -> None:
        # Channel ``slot``; the pad word is set on ``rank`` in stream order (value is implicit: 1).
        self._handle.put_signal(rank, slot)

    def wait(self, slots, value: int = 1, timeout_s: float = 60.0, who=None, what: str = "") -> None:
        for slot in slots:
            src = who(slot) if who else slot
            try:
                self._handle.wait_signal(src, slot, int(timeout_s * 1000))
            except RuntimeError as exc:  # the backend's timeout
                raise TimeoutError(
                    f"CUDA symmetric heap: rank {src} did not signal channel {slot} within {timeout_s:g}s "
                    f"({what}; this is rank {self.rank})"
                ) from exc

    def barrier(self, timeout_s: float) -> None:
        self._handle.barrier(0, int(timeout_s * 1000))

    def close(self) -> None:
        self._handle = None
        self._buf = None
