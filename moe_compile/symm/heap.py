"""The symmetric heap's interface (``moe_compile.symm`` describes it); each backend implements it."""

from __future__ import annotations

import abc


class SymmetricHeap(abc.ABC):
    rank: int
    world: int
    nbytes: int

    @abc.abstractmethod
    def tensor(self, rank: int, offset: int, shape, dtype):
        """A typed view of ``rank``'s buffer at byte ``offset``."""

    @abc.abstractmethod
    def signal(self, rank: int, slot: int, value: int) -> None:
        """Publish: set flag ``slot`` of ``rank`` to ``value`` (after the data it guards is written)."""

    @abc.abstractmethod
    def wait(self, slots, value: int, timeout_s: float, who=None, what: str = "") -> None:
        """Block until every own flag in ``slots`` reaches ``value``; TimeoutError names the missing."""

    @abc.abstractmethod
    def barrier(self, timeout_s: float) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...
