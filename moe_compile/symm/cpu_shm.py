"""CPU symmetric heap: POSIX shared memory among the ranks of one host.

Each rank creates one ``/dev/shm`` file of ``nbytes`` data + ``nflags`` int64 flags, publishes its
path through the process group's store, maps every peer's file (``mmap``, MAP_SHARED), waits until
every rank has mapped everything, and unlinks its own file — so nothing is left in ``/dev/shm``
even if a process dies later (the mappings keep the memory alive while anyone holds them).

Flags: the waiting rank polls its own flag words; a writer stores data first, then the flag.  On
x86 (TSO) stores become visible in program order; a torch copy that ran on several threads has
joined (a full barrier) before the flag store.  Values only grow (epochs), so flags never need a
reset and a late reader cannot confuse two rounds.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid

import numpy as np
import torch

from moe_compile.symm.heap import SymmetricHeap

SHM_DIR = "/dev/shm"
_ALIGN = 4096


def _round(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


class CpuShmHeap(SymmetricHeap):
    def __init__(self, store, rank: int, world: int, nbytes: int, nflags: int, tag: str, timeout_s: float):
        self.rank, self.world, self.nbytes, self.nflags = rank, world, _round(max(nbytes, 1)), nflags
        self.store, self.tag = store, tag
        total = self.nbytes + _round(max(nflags, 1) * 8)
        path = os.path.join(SHM_DIR, f"moec_{tag.replace('/', '_')}_{uuid.uuid4().hex[:10]}_r{rank}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, total)
            mine = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        np.frombuffer(mine, dtype=np.int64, count=max(nflags, 1), offset=self.nbytes)[:] = 0
        try:
            store.set(self._key("path", rank), f"{path}|{total}")
            self._wait_store("path", timeout_s, "heap rendezvous")
            self._maps = []
            for r in range(world):
                if r == rank:
                    self._maps.append(mine)
                    continue
                peer_path, size = store.get(self._key("path", r)).decode().rsplit("|", 1)
                pfd = os.open(peer_path, os.O_RDWR)
                try:
                    self._maps.append(mmap.mmap(pfd, int(size)))
                finally:
                    os.close(pfd)
            store.set(self._key("mapped", rank), "1")
            self._wait_store("mapped", timeout_s, "heap rendezvous (mapping)")
        finally:
            os.unlink(path)
        self._bytes = [torch.frombuffer(m, dtype=torch.uint8, count=self.nbytes) for m in self._maps]
        self._flags = [np.frombuffer(m, dtype=np.int64, count=max(nflags, 1), offset=self.nbytes) for m in self._maps]
        self._barrier_epoch = 0

    def _key(self, what: str, r: int) -> str:
        return f"moec_symm/{self.tag}/{what}/{r}"

    def _wait_store(self, what: str, timeout_s: float, desc: str) -> None:
        deadline, delay = time.monotonic() + timeout_s, 1e-4
        while True:
            missing = [r for r in range(self.world) if not self.store.check([self._key(what, r)])]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"symmetric heap {self.tag!r}: rank(s) {missing} did not arrive within "
                    f"timeout_s={timeout_s:g}s ({desc}; this is rank {self.rank})"
                )
            time.sleep(delay)
            delay = min(2 * delay, 0.01)

    # -- the interface ------------------------------------------------------------------------
    def tensor(self, rank: int, offset: int, shape, dtype):
        """A typed view of ``rank``'s bytes [offset, offset + numel * itemsize)."""
        n = 1
        for s in shape:
            n *= s
        item = dtype.itemsize
        size = n * item
        if offset % item or offset + size > self.nbytes:
            raise ValueError(f"heap view [{offset}, {offset + size}) of {dtype} outside/unaligned in {self.nbytes} bytes")
        return self._bytes[rank][offset : offset + size].view(dtype).view(*shape)

    def flags(self, rank: int) -> np.ndarray:
        return self._flags[rank]

    def signal(self, rank: int, slot: int, value: int) -> None:
        self._flags[rank][slot] = value

    def ready(self, slots, value: int) -> np.ndarray:
        return self._flags[self.rank][slots] >= value

    def wait(self, slots, value: int, timeout_s: float, who=None, what: str = "") -> None:
        slots = np.asarray(slots, dtype=np.int64)
        if slots.size == 0:
            return
        own = self._flags[self.rank]
        deadline = time.monotonic() + timeout_s
        spins = 0
        while True:
            pending = slots[own[slots] < value]
            if pending.size == 0:
                return
            if time.monotonic() > deadline:
                ranks = sorted({int(who(int(s))) for s in pending}) if who else [int(s) for s in pending]
                raise TimeoutError(
                    f"symmetric heap {self.tag!r}: rank(s) {ranks} did not signal within timeout_s={timeout_s:g}s"
                    f" ({what or 'waiting for flags'}; this is rank {self.rank})"
                )
            spins += 1
            backoff(spins)

    def barrier(self, timeout_s: float) -> None:
        """Every rank sets slot ``nflags - world + me`` in every pad; waits for its own pad's slots."""
        self._barrier_epoch += 1
        base = self.nflags - self.world
        for r in range(self.world):
            self.signal(r, base + self.rank, self._barrier_epoch)
        self.wait(list(range(base, base + self.world)), self._barrier_epoch, timeout_s,
                  who=lambda s: s - base, what="barrier")

    def close(self) -> None:
        self._bytes, self._flags = [], []
        for m in getattr(self, "_maps", []):
            try:
                m.close()
            except BufferError:  # a tensor view still exports the buffer; the mapping dies with it
                pass
        self._maps = []


def backoff(spins: int) -> None:
    """Poll cheaply first, then yield the core (ranks can outnumber cores), then sleep briefly."""
    if spins < 50:
        return
    if spins < 2000:
        os.sched_yield()
        return
    time.sleep(min(1e-3, 1e-5 * (spins - 1999)))
