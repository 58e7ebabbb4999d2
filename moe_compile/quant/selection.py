"""What ``quant="auto"`` measured and chose, per layer and regime — read by ``explain()`` and the dump.

A ``Selection`` is made by ``kernels/cpu/quant.py`` once per (layer shape, regime, device, budget)
— decode: T <= 16 rows, prefill: more — on the first call of the first layer of that shape, and
shared by every later layer of the shape in any graph of the process (each still checks the
choice's SQNR on its own first call); the report prints it under each layer's rewritten line
(``Rewritten.quant_tag``).  Data only: nothing here runs a kernel.

The rule (``choose``): among the candidates within the accuracy budget, the fastest, unless a more
accurate one is within ``TIE_MARGIN`` (5%) of its time — then the most accurate of those.  Times
are medians of runs interleaved across candidates, so a load spike hits them alike; the margin
keeps a near-tie from flipping between compiles on a noisy machine.
"""

from __future__ import annotations

import dataclasses
import json
import os

TIE_MARGIN = 0.05  # a candidate this much slower than the fastest still wins if it is more accurate


@dataclasses.dataclass(frozen=True)
class Candidate:
    fmt: str  # a format name, or "none" (the unquantized op)
    sqnr_db: float | None  # of the MoE output against the unquantized op; None: not run
    time_ms: float | None  # best of the timing runs on the call's inputs; None: not run
    note: str  # the kernel that ran it, or why it did not run

    def line(self, chosen: str, budget: float) -> str:
        if self.time_ms is None:
            return f"      {self.fmt}: refused, {self.note}"
        verdict = "CHOSEN" if self.fmt == chosen else (
            f"over budget (< {budget:g} dB)" if self.sqnr_db < budget else "slower or less accurate")
        return f"      {self.fmt}: {self.sqnr_text()}, {self.time_ms:.3f} ms on {self.note}: {verdict}"

    def sqnr_text(self) -> str:
        return "exact" if self.sqnr_db == float("inf") else f"{self.sqnr_db:.1f} dB"


@dataclasses.dataclass(frozen=True)
class Selection:
    tag: str  # the layer (module path and graph), as the op call names it
    regime: str  # "decode" or "prefill"
    rows: int  # T of the measured call
    budget_db: float
    chosen: str
    candidates: tuple[Candidate, ...]
    packed_bytes: int = 0
    margin: str = ""  # why the choice won, against the fastest or the runner-up (``choose``)
    shared_from: str = ""  # the layer whose measurement this shape's decision came from, when another
    runs: int = 0  # timed runs per candidate (interleaved)

    def lines(self) -> list[str]:
        packed = f", packed {self.packed_bytes / 2**20:.1f} MiB" if self.packed_bytes else ""
        how = f"median of {self.runs} interleaved runs, " if self.runs else ""
        head = (f"    quant auto, {self.regime} (measured at T={self.rows}, {how}budget {self.budget_db:g} dB): "
                f"chose {self.chosen}{packed}")
        lines = [head]
        if self.margin:
            lines.append(f"      margin: {self.margin}")
        if self.shared_from:
            lines.append(f"      decided once for this shape, regime and device, measured on {self.shared_from}")
        return lines + [c.line(self.chosen, self.budget_db) for c in self.candidates]


def choose(tag: str, regime: str, rows: int, budget: float, candidates, runs: int = 0,
           tie: float = TIE_MARGIN) -> Selection:
    """Among the candidates within budget ("none" always is): the most accurate of those within
    ``tie`` of the fastest's time (the fastest itself when none is more accurate), ties in SQNR to
    the faster.  ``margin`` says by how much it won or what it gave up."""
    ran = [c for c in candidates if c.time_ms is not None and c.sqnr_db >= budget]
    fastest = min(ran, key=lambda c: c.time_ms)
    close = [c for c in ran if c.time_ms <= fastest.time_ms * (1 + tie)]
    best = max(close, key=lambda c: (c.sqnr_db, -c.time_ms))
    return Selection(tag, regime, rows, budget, best.fmt, tuple(candidates), margin=_margin(best, fastest, ran, tie),
                     runs=runs)


def _margin(best: Candidate, fastest: Candidate, ran: list, tie: float) -> str:
    if best is not fastest:
        gap = best.time_ms / fastest.time_ms - 1
        return (f"{fastest.fmt} was {100 * gap:.1f}% faster ({fastest.sqnr_text()}), within {100 * tie:g}%: "
                f"the more accurate {best.fmt} ({best.sqnr_text()}) kept")
    rest = sorted((c for c in ran if c is not best), key=lambda c: c.time_ms)
    if not rest:
        return "the only candidate within budget"
    nxt = rest[0]
    gap = nxt.time_ms / best.time_ms - 1
    within = f", within {100 * tie:g}% but less accurate ({nxt.sqnr_text()})" if gap <= tie else ""
    return f"{100 * gap:.1f}% faster than the next in budget, {nxt.fmt}{within}"


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
