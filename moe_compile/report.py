"""What the backend did: one entry per rewritten region, one per refused candidate, and notes
(the inner compiler set aside, how Dynamo's capture would go under a plain ``torch.compile``).

Printed, identical skips (same family and reason, e.g. the layers of one model) are one line
with a count and the graphs they came from.

``FORMAT`` numbers the layout of ``Report.to_dict()`` (the dump's ``report.json``) and of
``summary()``; it goes up whenever a field is added, removed or changes meaning, so that scripts
reading reports can tell.  Format 2 (format 1 had no number): ``Rewritten.quant_sqnr_db``,
``Report.no_topk``, ``graph=None`` for entries that belong to no compiled graph (Dynamo could not
trace the function at all), and the summary's ``[report v2]``."""

from __future__ import annotations

import dataclasses

from moe_compile.ir import FFNAttrs

FORMAT = 2


@dataclasses.dataclass(frozen=True)
class Rewritten:
    family: str
    num_experts: int
    top_k: int
    hidden: int
    ffn: int
    variant: str
    source: str
    gate_up: str
    activation: str
    weight_on: str
    proof_error: float
    graph: int = 0
    world_size: int = 1  # expert parallel: ranks of the process group
    local_experts: int = 0  # expert parallel: experts held by this rank (0: not expert parallel)
    ep_style: str = ""  # expert parallel: all_to_all (the EP op), all_gather / all_reduce / reduce_scatter (kept)
    transposed: bool = False  # weights stored [E, in, out] (x @ W)
    limit: float = 0.0  # clamp of gate/up (0: none)
    alpha: float = FFNAttrs.alpha  # sigmoid slope of activation "gptoss"
    biases: tuple[str, ...] = ()  # the roles with a bias: "fc1", "fc1_up", "fc2"
    flipped: tuple[str, ...] = ()  # weight roles read as transpose views (held in the other orientation)
    unflattened: tuple[str, ...] = ()  # roles read as [E, out, in] views of one [E*out, in] weight
    quant_tag: str = ""  # the layer's name in quant.selection (quantized layers)
    quant_note: str = ""  # why a quant= setting left this layer unquantized
    quant_sqnr_db: float | None = None  # explicit quant variant: SQNR of this layer's output against the
    # unquantized op, measured by explain() on its inputs (None: not measured; compiling does not measure)

    def line(self) -> str:
        where = self.source or "<unknown module>"
        ep = f" world_size={self.world_size} local_experts={self.local_experts}" if self.local_experts else ""
        ep += f" ep_style={self.ep_style}" if self.local_experts and self.ep_style else ""
        act = self.activation
        if self.limit > 0:
            act += f"(limit={self.limit:g}" + (f", alpha={self.alpha:g}" if self.activation == "gptoss" else "") + ")"
        extra = (" transposed" if self.transposed else "") + (f" biases={'+'.join(self.biases)}" if self.biases else "")
        extra += (f" flipped={'+'.join(self.flipped)}" if self.flipped else "") + (
            f" unflattened={'+'.join(self.unflattened)}" if self.unflattened else "")
        return (
            f"  [graph {self.graph}] {where}: family={self.family}{ep} E={self.num_experts} K={self.top_k} "
            f"H={self.hidden} F={self.ffn} {self.gate_up}/{act}{extra} weight_on={self.weight_on} "
            f"variant={self.variant} ({self._proof()})"
        ) + self._quant_lines()

    def _proof(self) -> str:
        """The proof checks the matched pattern against the unquantized op; a quantized variant's own
        error is its SQNR, on the line below."""
        if not self.quant_tag:  # the model's own numerics: the proof is the whole story
            return f"proved, rel. err {self.proof_error:.1e}"
        return f"pattern proved on the unquantized op, rel. err {self.proof_error:.1e}"

    def _quant_lines(self) -> str:
        """Under the line: why quant= left the layer unquantized, or what the variant runs on."""
        if self.quant_note:
            return f"\n    {self.quant_note}"
        if not self.quant_tag:
            return ""
        from moe_compile.quant import selection

        made = selection.recorded(self.quant_tag)
        if self.variant != "auto":
            held = selection.packed_bytes(self.quant_tag)
            packed = f", packed {held / 2**20:.2f} MiB" if held else ", packed on the first call"
            return f"\n    quant {self.variant}: fixed by the option (layer {self.quant_tag}{packed}); {self._sqnr()}"
        if not made:
            return (f"\n    quant auto (layer {self.quant_tag}): chosen per regime (decode T <= 16, prefill) on the "
                    f"first real call; run the model once and print the report again to see the choice")
        return "".join("\n" + "\n".join(made[r].lines()) for r in ("decode", "prefill") if r in made)

    def _sqnr(self) -> str:
        if self.quant_sqnr_db is None:
            return (f"quantization error not measured by compiling: moe_compile.explain(model, x, "
                    f"quant={self.variant!r}) measures its SQNR")
        sq = "exact" if self.quant_sqnr_db == float("inf") else f"{self.quant_sqnr_db:.1f} dB"
        return f"SQNR {sq} (this layer's output against the unquantized op, on explain()'s inputs)"


@dataclasses.dataclass(frozen=True)
class Skipped:
    reason: str
    family: str = ""
    graph: int | None = 0  # None: no compiled graph holds it (Dynamo traced nothing, or the whole function)

    def line(self) -> str:
        fam = f" ({self.family})" if self.family else ""
        return f"  {_where(self.graph)}{fam} {self.reason}"


@dataclasses.dataclass(frozen=True)
class Note:
    """Something the user should know that is not a region: e.g. the inner compiler failed on this
    graph and it runs without it."""

    text: str
    graph: int | None = 0  # None: about no one compiled graph

    def line(self) -> str:
        return f"  {_where(self.graph)} {self.text}"


def _where(graph: int | None) -> str:
    return "[no graph]" if graph is None else f"[graph {graph}]"


def _shift(graph: int | None, offset: int) -> int | None:
    return None if graph is None else graph + offset


@dataclasses.dataclass
class Report:
    rewritten: list[Rewritten] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    graphs: int = 0
    notes: list[Note] = dataclasses.field(default_factory=list)
    no_topk: list[int] = dataclasses.field(default_factory=list)  # graphs with no top-k: no MoE routing at all

    def extend(self, other: Report) -> None:
        offset = self.graphs
        self.rewritten += [dataclasses.replace(r, graph=r.graph + offset) for r in other.rewritten]
        self.skipped += [dataclasses.replace(s, graph=_shift(s.graph, offset)) for s in other.skipped]
        self.notes += [dataclasses.replace(n, graph=_shift(n.graph, offset)) for n in other.notes]
        self.no_topk += [g + offset for g in other.no_topk]
        self.graphs += other.graphs

    def summary(self) -> str:
        """``N graph(s), N MoE region(s) rewritten, N skipped`` (scripts may split on these words);
        then, when there is nothing else to say, that no graph had a top-k (no MoE routing to rewrite:
        an MoE that went unrecognised is a skip instead); then the format, ``[report v2]``."""
        text = f"{self.graphs} graph(s), {len(self.rewritten)} MoE region(s) rewritten, {len(self.skipped)} skipped"
        if self.graphs and not self.rewritten and not self.skipped and len(self.no_topk) == self.graphs:
            text += ": no top-k found, so no MoE routing to rewrite"
        return f"{text} [report v{FORMAT}]"

    def __str__(self) -> str:
        lines = [f"moe_compile report: {self.summary()}"]
        if self.rewritten:
            lines.append("rewritten:")
            lines += [r.line() for r in self.rewritten]
        if self.skipped:
            lines.append("skipped:")
            lines += merged_skip_lines(self.skipped)
        if self.notes:
            lines.append("notes:")
            lines += list(dict.fromkeys(n.line() for n in self.notes))
        if self.no_topk and len(self.no_topk) < self.graphs:
            lines.append(f"no top-k (no MoE routing) in graph(s) {', '.join(map(str, self.no_topk))}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"version": FORMAT, "graphs": self.graphs, "rewritten": [dataclasses.asdict(r) for r in self.rewritten],
                "skipped": [dataclasses.asdict(s) for s in self.skipped],
                "notes": [dataclasses.asdict(n) for n in self.notes], "no_topk": list(self.no_topk)}


def merged_skip_lines(skipped: list[Skipped]) -> list[str]:
    """One line per distinct (family, reason), in first-seen order: ``[graphs 0, 2] (loop) reason (x3)``."""
    groups: dict[tuple[str, str], list[int | None]] = {}
    for s in skipped:
        groups.setdefault((s.family, s.reason), []).append(s.graph)
    lines = []
    for (family, reason), graphs in groups.items():
        if len(graphs) == 1:
            lines.append(Skipped(reason, family, graphs[0]).line())
            continue
        distinct = list(dict.fromkeys(graphs))
        if len(distinct) == 1:
            where = _where(distinct[0])[1:-1]
        else:
            where = f"graphs {', '.join('none' if g is None else str(g) for g in distinct)}"
        fam = f" ({family})" if family else ""
        lines.append(f"  [{where}]{fam} {reason} (x{len(graphs)})")
    return lines
