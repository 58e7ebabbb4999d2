"""Graph dumps: per compiled graph, code before/after, the report, and the MoE region as DOT/SVG.

    MOE_COMPILE_DUMP=dir python train.py        or   torch.compile(..., options={"dump": "dir"})
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess

import torch.fx as fx

_counter = itertools.count()


def write_graph_dump(root: str, before_code: str, gm: fx.GraphModule, report) -> str:
    index = next(_counter)
    folder = os.path.join(root, f"graph_{os.getpid()}_{index:03d}")
    os.makedirs(folder, exist_ok=True)
    _write(folder, "before.py", before_code)
    _write(folder, "after.py", gm.code)
    _write(folder, "report.txt", str(report) + "\n")
    _write(folder, "report.json", json.dumps(report.to_dict(), indent=2))
    dot = region_dot(gm)
    _write(folder, "moe_region.dot", dot)
    if shutil.which("dot"):
        subprocess.run(["dot", "-Tsvg", "-o", os.path.join(folder, "moe_region.svg")], input=dot.encode(),
                       check=False, timeout=60)
    return folder


def _write(folder: str, name: str, text: str) -> None:
    with open(os.path.join(folder, name), "w") as fh:
        fh.write(text)


def region_dot(gm: fx.GraphModule) -> str:
    """The fused op calls with their inputs and users, as a Graphviz digraph."""
    lines = ["digraph moe {", "  rankdir=TB; node [shape=box, fontname=monospace];"]
    for node in gm.graph.nodes:
        if "fused_moe" not in str(node.target):
            continue
        lines.append(f'  "{node.name}" [style=filled, fillcolor=lightblue, label="{node.name}\\nfused_moe"];')
        for arg in node.all_input_nodes:
            lines.append(f'  "{arg.name}" -> "{node.name}";')
        for user in node.users:
            lines.append(f'  "{node.name}" -> "{user.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"
