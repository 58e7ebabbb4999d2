"""What ``quant="auto"`` measured and chose, per layer and regime — read by ``explain()`` and the dump.

A ``Selection`` is recorded by ``kernels/cpu/quant.py`` on the first call of each regime (decode:
T <= 16 rows, prefill: more) of a layer compiled with quant="auto"; the report prints it under
the layer's rewritten line (``Rewritten.quant_tag``).  Data only: nothing here runs a kernel.
"""

from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass(frozen=True)
class Candidate:
    fmt: str  # a format name, or "none" (the unquantized op)
    sqnr_db: float | None  # of the MoE output against the unquantized op; None: not run
    time_ms: float | None  # best of the timing runs on the call's inputs; None: not run
    note: str  # the kernel that ran it, or why it did not run

    def line(self, chosen: str, budget: float) -> str:
        if self.time_ms is None:
            return f"      {self.fmt}: refused, {self.note}"
        sq = "exact" if self.sqnr_db == float("inf") else f"{self.sqnr_db:.1f} dB"
        verdict = "CHOSEN" if self.fmt == chosen else (
            f"over budget (< {budget:g} dB)" if self.sqnr_db < budget else "slower")
        return f"      {self.fmt}: {sq}, {self.time_ms:.2f} ms on {self.note}: {verdict}"


@dataclasses.dataclass(frozen=True)
class Selection:
    tag: str  # the layer (module path and graph), as the op call names it
    regime: str  # "decode" or "prefill"
    rows: int  # T of the measured call
    budget_db: float
    chosen: str
    candidates: tuple[Candidate, ...]
    packed_bytes: int = 0

    def lines(self) -> list[str]:
        packed = f", packed {self.packed_bytes / 2**20:.1f} MiB" if self.packed_bytes else ""
        head = (f"    quant auto, {self.regime} (measured at T={self.rows}, budget {self.budget_db:g} dB): "
                f"chose {self.chosen}{packed}")
        return [head] + [c.line(self.chosen, self.budget_db) for c in self.candidates]


def choose(tag: str, regime: str, rows: int, budget: float, candidates) -> Selection:
    """The fastest candidate whose SQNR is within budget ("none" always is)."""
    ran = [c for c in candidates if c.time_ms is not None and c.sqnr_db >= budget]
    best = min(ran, key=lambda c: c.time_ms)
    return Selection(tag, regime, rows, budget, best.fmt, tuple(candidates))


_RECORDED: dict = {}  # tag -> {regime: Selection}
_DUMP_DIRS: dict = {}  # tag -> dump directory of the graph that holds the layer


def record(sel: Selection) -> None:
    _RECORDED.setdefault(sel.tag, {})[sel.regime] = sel
    folder = _DUMP_DIRS.get(sel.tag)
    if folder:
        _write_dump(folder, sel)


def watch_dump(tag: str, folder: str) -> None:
    """Write this layer's selections into ``folder`` (the graph's dump) when they are made."""
    _DUMP_DIRS[tag] = folder


def _write_dump(folder: str, sel: Selection) -> None:
    os.makedirs(folder, exist_ok=True)
    name = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in sel.tag)
    with open(os.path.join(folder, f"quant_{name}_{sel.regime}.txt"), "w") as fh:
        fh.write("\n".join(sel.lines()) + "\n")
    with open(os.path.join(folder, f"quant_{name}_{sel.regime}.json"), "w") as fh:
        json.dump(dataclasses.asdict(sel), fh, indent=2, default=str)


_PACKED: dict = {}  # tag -> bytes of an explicit variant's packs (auto's are in its Selection)


def note_packed(tag: str, nbytes: int) -> None:
    _PACKED[tag] = nbytes


def packed_bytes(tag: str) -> int:
    return _PACKED.get(tag, 0)


def recorded(tag: str) -> dict:
    """{regime: Selection} made so far for a layer."""
    return dict(_RECORDED.get(tag, {}))


def clear() -> None:
    _RECORDED.clear()
    _PACKED.clear()
