"""What the backend did: one entry per rewritten region, one per refused candidate, and notes
(the inner compiler set aside, how Dynamo's capture would go under a plain ``torch.compile``).

Printed, identical skips (same family and reason, e.g. the layers of one model) are one line
with a count and the graphs they came from."""

from __future__ import annotations

import dataclasses

from moe_compile.ir import FFNAttrs


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
    transposed: bool = False  # weights stored [E, in, out] (x @ W)
    limit: float = 0.0  # clamp of gate/up (0: none)
    alpha: float = FFNAttrs.alpha  # sigmoid slope of activation "gptoss"
    biases: tuple[str, ...] = ()  # the roles with a bias: "fc1", "fc1_up", "fc2"
    quant_tag: str = ""  # the layer's name in quant.selection (quantized layers)
    quant_note: str = ""  # why a quant= setting left this layer unquantized

    def line(self) -> str:
        where = self.source or "<unknown module>"
        ep = f" world_size={self.world_size} local_experts={self.local_experts}" if self.local_experts else ""
        act = self.activation
        if self.limit > 0:
            act += f"(limit={self.limit:g}" + (f", alpha={self.alpha:g}" if self.activation == "gptoss" else "") + ")"
        extra = (" transposed" if self.transposed else "") + (f" biases={'+'.join(self.biases)}" if self.biases else "")
        return (
            f"  [graph {self.graph}] {where}: family={self.family}{ep} E={self.num_experts} K={self.top_k} "
            f"H={self.hidden} F={self.ffn} {self.gate_up}/{act}{extra} weight_on={self.weight_on} "
            f"variant={self.variant} (proved, rel. err {self.proof_error:.1e})"
        ) + self._quant_lines()

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
            return f"\n    quant {self.variant}: fixed by the option (layer {self.quant_tag}{packed})"
        if not made:
            return (f"\n    quant auto (layer {self.quant_tag}): chosen per regime (decode T <= 16, prefill) on the "
                    f"first real call; run the model once and print the report again to see the choice")
        return "".join("\n" + "\n".join(made[r].lines()) for r in ("decode", "prefill") if r in made)


@dataclasses.dataclass(frozen=True)
class Skipped:
    reason: str
    family: str = ""
    graph: int = 0

    def line(self) -> str:
        fam = f" ({self.family})" if self.family else ""
        return f"  [graph {self.graph}]{fam} {self.reason}"


@dataclasses.dataclass(frozen=True)
class Note:
    """Something the user should know that is not a region: e.g. the inner compiler failed on this
    graph and it runs without it."""

    text: str
    graph: int = 0

    def line(self) -> str:
        return f"  [graph {self.graph}] {self.text}"


@dataclasses.dataclass
class Report:
    rewritten: list[Rewritten] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)
    graphs: int = 0
    notes: list[Note] = dataclasses.field(default_factory=list)

    def extend(self, other: Report) -> None:
        offset = self.graphs
        self.rewritten += [dataclasses.replace(r, graph=r.graph + offset) for r in other.rewritten]
        self.skipped += [dataclasses.replace(s, graph=s.graph + offset) for s in other.skipped]
        self.notes += [dataclasses.replace(n, graph=n.graph + offset) for n in other.notes]
        self.graphs += other.graphs

    def summary(self) -> str:
        return (f"{self.graphs} graph(s), {len(self.rewritten)} MoE region(s) rewritten, {len(self.skipped)} "
                f"skipped")

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
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"graphs": self.graphs, "rewritten": [dataclasses.asdict(r) for r in self.rewritten],
                "skipped": [dataclasses.asdict(s) for s in self.skipped],
                "notes": [dataclasses.asdict(n) for n in self.notes]}


def merged_skip_lines(skipped: list[Skipped]) -> list[str]:
    """One line per distinct (family, reason), in first-seen order: ``[graphs 0, 2] (loop) reason (x3)``."""
    groups: dict[tuple[str, str], list[int]] = {}
    for s in skipped:
        groups.setdefault((s.family, s.reason), []).append(s.graph)
    lines = []
    for (family, reason), graphs in groups.items():
        if len(graphs) == 1:
            lines.append(Skipped(reason, family, graphs[0]).line())
            continue
        distinct = list(dict.fromkeys(graphs))
        where = f"graph {distinct[0]}" if len(distinct) == 1 else f"graphs {', '.join(map(str, distinct))}"
        fam = f" ({family})" if family else ""
        lines.append(f"  [{where}]{fam} {reason} (x{len(graphs)})")
    return lines
