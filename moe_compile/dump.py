"""Graph dumps: per compiled graph, code before/after, the report, and a picture of each MoE region.

    MOE_COMPILE_DUMP=dir python train.py        or   torch.compile(..., options={"dump": "dir"})

Shapes:  T tokens, H hidden, F expert FFN width, E experts, K top-k.

One folder per compiled graph (``graph_<pid>_<n>``) holds ``before.py`` / ``after.py`` (the
graph's code around the rewrite), ``report.txt`` / ``report.json`` and, per rewritten region i,
``moe_region_<i>.dot``: the region as the graph held it *before* the rewrite — x, router, top-k,
dispatch, experts, combine, each stage one box listing its ops and source lines, the E per-expert
weights of a role collapsed into one node (``experts[0..7].gate_proj.weight``) — beside the
fused op that replaced it, labelled with family, E, K, H, F, layout, variant and proof error.
Where Graphviz's ``dot`` is installed, ``.svg`` and ``.png`` are rendered beside it; where it is
not, the first dump of the process says so once (``GRAPHVIZ_HINT``).  ``after.py``'s long lines
(the fused call lists every expert's weights) are wrapped at their commas.

How a region is found again: the rewrite erased the region's nodes and kept everything else, so
the before-graph's nodes missing from the after-graph, flood-filled from the fused op's inputs,
are that op's region; the router is what lies between x and the top-k outside it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import traceback
import warnings

import torch
import torch.fx as fx

from moe_compile.ir import ROLES
from moe_compile.passes.graph import module_path

_counter = itertools.count()
RENDER_FORMATS = ("svg", "png")
# Ops that only look at a weight (slicing an expert, transposing, casting): still "the weight".
_WEIGHT_VIEWS = {"getitem", "transpose", "t", "permute", "view", "reshape", "to", "contiguous", "expand",
                 "unsqueeze", "squeeze", "float", "type_as", "index_select", "select", "__getitem__"}
_MAX_LINE = 72  # characters of a source line shown in a box (keeps the picture under ~1000 px)


def write_graph_dump(root: str, before: fx.GraphModule | str, gm: fx.GraphModule, report,
                     moe_only: fx.GraphModule | None = None) -> str:
    """Write one graph's dump under ``root``; ``before`` is a copy of the graph before the rewrite
    (or only its code, when no picture is wanted), ``moe_only`` the graph right after the MoE pass
    when a later pass (the dense linears) changed ``gm`` again: regions are found against it, since
    a node the later pass replaced is not part of any MoE region.  Returns the folder."""
    index = next(_counter)
    folder = os.path.join(root, f"graph_{os.getpid()}_{index:03d}")
    os.makedirs(folder, exist_ok=True)
    _write(folder, "before.py", before if isinstance(before, str) else before.code)
    _write(folder, "after.py", wrap_code(gm.code))
    _write(folder, "report.txt", str(report) + "\n")
    _write(folder, "report.json", json.dumps(report.to_dict(), indent=2))
    if not isinstance(before, str):
        after = moe_only if moe_only is not None else gm
        for i, fused in enumerate(fused_nodes(after)):
            try:
                dot = region_dot(region_stages(before, after, fused), fused, _entry_for(fused, report.rewritten, i))
            except Exception:  # a debugging aid must not fail the user's compile: say so in the folder
                _write(folder, f"moe_region_{i}.error.txt", traceback.format_exc())
                warnings.warn(f"moe_compile dump: no picture of MoE region {i}; see {folder}", RuntimeWarning)
                continue
            _write(folder, f"moe_region_{i}.dot", dot)
            if not render(dot, os.path.join(folder, f"moe_region_{i}")):
                GRAPHVIZ_HINT.warn_once()
    return folder


class _GraphvizHint:
    """Says once per process that the pictures are ``.dot`` only because Graphviz is missing
    (``moe-compile dump`` sets ``said`` and prints it under its listing instead)."""

    said = False

    def text(self) -> str:
        if shutil.which("dot"):
            return ""
        return ("moe_compile dump: Graphviz's `dot` is not installed, so the region pictures are .dot files only; "
                "install Graphviz (apt install graphviz, brew install graphviz or conda install graphviz) for "
                ".png/.svg beside them")

    def warn_once(self) -> None:
        if not self.said and (text := self.text()):
            self.said = True
            warnings.warn(text, UserWarning, stacklevel=3)


GRAPHVIZ_HINT = _GraphvizHint()


def _write(folder: str, name: str, text: str) -> None:
    with open(os.path.join(folder, name), "w") as fh:
        fh.write(text)


def wrap_code(code: str, width: int = 110) -> str:
    """Generated code with each line longer than ``width`` broken after its commas inside brackets
    (Python continues such lines implicitly), continuation lines indented under the call; FX's
    ``;  a = b = ... = None`` (freeing the call's inputs) goes on its own lines."""
    out = []
    for line in code.split("\n"):
        if len(line) <= width:
            out.append(line)
            continue
        indent = line[:len(line) - len(line.lstrip())]
        head, sep, frees = line.partition(";  ")
        out.append(_wrap_line(head, width))
        if sep:
            out.append(_wrap_chain(indent + frees, width))
    return "\n".join(out)


def _wrap_chain(line: str, width: int) -> str:
    """``a = b = c = None`` longer than width: continued with backslashes at its ``=`` signs."""
    if len(line) <= width or not re.fullmatch(r"\s*\w+( = \w+)+", line):
        return line
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    out, current = [], ""
    for name in line.split(" = "):
        piece = name if not current else f" = {name}" if not current.isspace() else name
        if current and len(current) + len(piece) + 2 > width:
            out.append(current + " \\")
            current = indent + "= " + name
        else:
            current += piece
    return "\n".join(out + [current])


def _wrap_line(line: str, width: int) -> str:
    indent = " " * (len(line) - len(line.lstrip()) + 4)
    pieces, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote and line[i - 1] != "\\" else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth > 0 and line[i + 1:i + 2] == " ":
            pieces.append(line[start:i + 1])
            start = i + 2
    pieces.append(line[start:])
    out, current = [], pieces[0]
    for piece in pieces[1:]:
        if len(current) + 1 + len(piece) > width:
            out.append(current)
            current = indent + piece
        else:
            current += " " + piece
    return "\n".join(out + [current])


def render(dot: str, stem: str) -> list[str]:
    """``stem.svg`` and ``stem.png`` from DOT source when Graphviz is installed; the paths written."""
    if not shutil.which("dot"):
        return []
    written = []
    for fmt in RENDER_FORMATS:
        path = f"{stem}.{fmt}"
        done = subprocess.run(["dot", f"-T{fmt}", "-o", path], input=dot.encode(), capture_output=True,
                              check=False, timeout=60)
        if done.returncode == 0:
            written.append(path)
    return written


# ----------------------------------------------------------------------------- the region, found again


@dataclasses.dataclass(frozen=True)
class Stage:
    """One box of the before-picture: a stage's nodes in graph order."""

    name: str
    nodes: tuple[fx.Node, ...]


@dataclasses.dataclass(frozen=True)
class RegionStages:
    """A rewritten region as the before-graph held it, cut into the stages a reader expects."""

    x: fx.Node
    ids: fx.Node
    weights: fx.Node
    roles: dict[str, tuple[fx.Node, ...]]  # op argument name -> the before-graph's weight nodes
    router_inputs: tuple[fx.Node, ...]  # router weights, biases, token ids of a hash table
    stages: tuple[Stage, ...]  # router, top-k, dispatch, experts, combine (empty ones left out)


def fused_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and "fused_moe" in str(n.target)]


def region_stages(before: fx.GraphModule, after: fx.GraphModule, fused: fx.Node) -> RegionStages:
    by_name = {n.name: n for n in before.graph.nodes}
    kept = {n.name for n in after.graph.nodes}
    x, ids, weights = (_in_before(a, by_name) for a in fused.args[:3])
    roles = {role: tuple(by_name[n.name] for n in nodes if n.name in by_name)
             for role, nodes in zip(ROLES, fused.args[3:9]) if nodes}
    params = {n for nodes in roles.values() for n in nodes}
    region = _erased_component({x, ids, weights, *params}, lambda n: n.name not in kept)
    router = _between(x, (ids, weights), lambda n: n.name in kept)
    router_inputs = tuple(n for n in router if n.op == "placeholder" or n.op == "get_attr")
    router_ops = [n for n in router if n not in router_inputs and _shown(n)]
    topk = next((n for n in router_ops if _op_name(n) == "topk"), None)
    # No top-k (a hash table, sparsemixer's maxima): the whole router is one stage.
    before_topk = _ancestors([topk]) if topk is not None else set(router_ops)
    order = {n: i for i, n in enumerate(before.graph.nodes)}
    stages = [Stage("router", tuple(n for n in router_ops if n in before_topk)),
              Stage("top-k", tuple(n for n in router_ops if n not in before_topk)),
              *_split_region(sorted(region, key=order.get), params, {ids, weights})]
    return RegionStages(x, ids, weights, roles, router_inputs, tuple(s for s in stages if s.nodes))


def _in_before(node, by_name: dict[str, fx.Node]) -> fx.Node:
    """The before-graph node of an op argument; a node the rewrite made (the dense family's gather
    of [T, K] weights from the score matrix) stands for its first input."""
    while node.name not in by_name:
        node = node.all_input_nodes[0]
    return by_name[node.name]


def _erased_component(seeds: set[fx.Node], erased) -> set[fx.Node]:
    """The erased nodes connected to ``seeds`` through erased nodes (one region; other regions
    connect to this one only through nodes the rewrites kept)."""
    found, stack = set(), [m for s in seeds for m in (*s.users, *s.all_input_nodes) if erased(m)]
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack += [m for m in (*node.users, *node.all_input_nodes) if erased(m) and m not in found]
    return found


def _ancestors(nodes, stop=lambda n: False) -> set[fx.Node]:
    found, stack = set(), list(nodes)
    while stack:
        node = stack.pop()
        for src in node.all_input_nodes:
            if src not in found and not stop(src):
                found.add(src)
                stack.append(src)
    return found


def _between(x: fx.Node, ends, kept) -> list[fx.Node]:
    """The kept nodes that produce ``ends`` from x (and from the router's own weights), in graph order."""
    found = _ancestors(ends, stop=lambda n: n is x or not kept(n)) | {e for e in ends if kept(e)}
    return [n for n in x.graph.nodes if n in found]


def _split_region(region: list[fx.Node], params: set[fx.Node], routing: set[fx.Node]) -> list[Stage]:
    """dispatch (what selects rows and routing weights), experts (weight views, GEMMs, the
    activation between them), combine (after the last GEMM, and buffers that only collect results)."""
    views = set(params)
    for node in region:
        if node.all_input_nodes and node.all_input_nodes[0] in views and _op_name(node) in _WEIGHT_VIEWS:
            views.add(node)
    gemms = {n for n in region if n not in views and any(a in views for a in n.all_input_nodes)}
    last = [g for g in gemms if not _descendants([g], region) & gemms]  # FC2: no GEMM after it
    between = _descendants(gemms, region) & _ancestors(last)  # the activation, gate * up
    after_last, feeds_gemm = _descendants(last, region), _ancestors(gemms)
    experts = views | gemms | between
    from_routing = _descendants(routing, region)
    combine = {n for n in region if n not in experts
               and (n in after_last or (n not in feeds_gemm and n not in from_routing))}
    dispatch = [n for n in region if n not in experts and n not in combine]
    pick = lambda keep: tuple(n for n in region if n in keep and n not in params and _shown(n))  # noqa: E731
    return [Stage("dispatch", pick(set(dispatch))), Stage("experts", pick(experts)), Stage("combine", pick(combine))]


def _descendants(nodes, region: list[fx.Node]) -> set[fx.Node]:
    inside, found, stack = set(region), set(), list(nodes)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in inside and user not in found:
                found.add(user)
                stack.append(user)
    return found


def _op_name(node: fx.Node) -> str:
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return name.split(".")[0] if name.endswith((".default", ".int", ".Tensor")) else name


def _shown(node: fx.Node) -> bool:
    """Tensor-valued ops (and tuple-valued ones such as topk / where); not the SymInt bookkeeping
    Dynamo adds around data-dependent sizes (sym_size, _assert_scalar, ge/le on sizes)."""
    value = node.meta.get("example_value")
    return node.op in ("call_function", "call_method", "call_module") and (
        isinstance(value, torch.Tensor) or (isinstance(value, (tuple, list)) and value != ()))


# ----------------------------------------------------------------------------- labels and DOT


def _entry_for(fused: fx.Node, rewritten, index: int):
    """The report entry of a fused op: the one whose module path prefixes its FC2 weight's path."""
    fc2 = fused.args[5][0] if fused.args[5] else None
    path = module_path(fc2) if fc2 is not None else ""
    matching = [r for r in rewritten if r.source and path.startswith(r.source)]
    if len(matching) == 1:
        return matching[0]
    return rewritten[index] if index < len(rewritten) else None


def region_dot(region: RegionStages, fused: fx.Node, entry) -> str:
    title = f"MoE region {entry.source or '?'} ({entry.family}, E={entry.num_experts}, K={entry.top_k})" \
        if entry is not None else "MoE region"
    title += ": before and after the rewrite"
    y = _value_label("y", region.x).split("\n")[0]  # the op's result has x's shape and dtype
    lines = ["digraph moe {",
             f'  graph [label="{_esc(title)}", labelloc=t, fontsize=18, fontname="Helvetica", nodesep=0.3, '
             'ranksep=0.35, newrank=true];',
             '  node [shape=box, fontname="Courier", fontsize=11, style="rounded,filled", fillcolor=white];',
             '  edge [color="#555555"];',
             f'  x [label="{_esc(_value_label("x", region.x))}", fillcolor="#eeeeee"];',
             f'  weights [label="{_esc(_weights_label(region.roles, entry))}", fillcolor="#fff3cd"];']
    lines += ['  subgraph cluster_before {', '    label="before: the matched region"; style=dashed; color="#888888";']
    previous = "x"
    for stage in region.stages:
        name = stage.name.replace("-", "")
        lines.append(f'    {name} [label="{_esc(_stage_label(stage, region))}", fillcolor="{_COLORS[stage.name]}"];')
        lines.append(f"    {previous} -> {name};")
        previous = name
    lines.append(f'    y_before [label="{_esc(y)}", fillcolor="#eeeeee"];')
    lines += [f"    {previous} -> y_before;", "  }"]
    if any(s.name == "experts" for s in region.stages):
        lines.append('  weights -> experts [style=dashed];')
    lines += ['  subgraph cluster_after {', '    label="after: one fused op"; style=dashed; color="#888888";',
              f'    fused [label="{_esc(_fused_label(fused, entry))}", fillcolor="#cfe2ff"];',
              f'    y_after [label="{_esc(y)}", fillcolor="#eeeeee"];',
              "    fused -> y_after;", "  }",
              '  x -> fused; weights -> fused [style=dashed];']
    routing = [s.name.replace("-", "") for s in region.stages if s.name in ("router", "top-k")][-1:] or ["x"]
    lines.append(f'  {routing[0]} -> fused [label="ids, weights", fontname="Helvetica", fontsize=10];')
    lines.append("}")
    return "\n".join(lines) + "\n"


_COLORS = {"router": "#e2f0d9", "top-k": "#e2f0d9", "dispatch": "#fde2cf", "experts": "#fff3cd",
           "combine": "#fde2cf"}


def _esc(label: str) -> str:
    """DOT quoted-string label: left-justified lines."""
    text = label.replace("\\", "\\\\").replace('"', '\\"')
    return "\\l".join(text.split("\n")) + "\\l"


def _shape(node: fx.Node) -> str:
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        return f"[{', '.join(str(s) for s in value.shape)}] {str(value.dtype).replace('torch.', '')}"
    return ""


def _value_label(name: str, node: fx.Node) -> str:
    code = _code_line(node)
    origin = module_path(node) if node.op == "placeholder" else ""  # the argument's name in the user's code
    text = f"{name} {_shape(node)}"
    if origin:
        return text if origin == name else f"{text}\ninput {origin}"  # "x [4, 64]" once, not "x" twice
    return text + (f"\n{code}" if code else "")


def _stage_label(stage: Stage, region: RegionStages) -> str:
    counts: dict[str, int] = {}
    for node in stage.nodes:
        counts[_op_name(node)] = counts.get(_op_name(node), 0) + 1
    ops = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in counts.items())
    lines = [stage.name.upper(), *_wrap(ops)]
    if stage.name == "router" and region.router_inputs:
        lines.append("reads " + ", ".join(module_path(n) or n.name for n in region.router_inputs))
    if stage.name == "top-k" or (stage.name == "router" and not any(s.name == "top-k" for s in region.stages)):
        lines.append(f"ids {_shape(region.ids)}, weights {_shape(region.weights)}")
    codes = list(dict.fromkeys(c for c in (_code_line(n) for n in stage.nodes) if c))
    lines += codes[:3] + ([f"... {len(codes) - 3} more source lines"] if len(codes) > 3 else [])
    return "\n".join(lines)


def _wrap(text: str, width: int = _MAX_LINE) -> list[str]:
    lines, current = [], ""
    for word in text.split(" "):
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    return lines + ([current] if current else [])


def _code_line(node: fx.Node) -> str:
    """``file.py:LINE  code`` of the user's source line that produced a node, shortened."""
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.+)', trace)
    if not found:
        return ""
    path, line, code = found[-1]
    text = f"{os.path.basename(path)}:{line}  {code.strip()}"
    return text if len(text) <= _MAX_LINE else text[: _MAX_LINE - 3] + "..."


def _weights_label(roles: dict[str, tuple[fx.Node, ...]], entry) -> str:
    lines = ["EXPERT WEIGHTS"]
    for role, nodes in roles.items():
        name = f"{role} ({_role_meaning(role, entry.gate_up if entry is not None else '')})"
        lines.append(f"{name:16s} {collapse_paths([module_path(n) or n.name for n in nodes])}  {_role_shape(nodes)}")
    return "\n".join(lines)


def _role_meaning(role: str, gate_up: str) -> str:
    """What an op argument holds, in the model's words (ir.FFNAttrs.gate_up)."""
    first = {"separate": "gate", "concat": "gate|up", "interleaved": "gate,up", "none": "up"}.get(gate_up, "FC1")
    meaning = {"fc1": first, "fc1_up": "up", "fc2": "down"}[role.removesuffix("_bias")]
    return meaning + (" bias" if role.endswith("_bias") else "")


def _role_shape(nodes: tuple[fx.Node, ...]) -> str:
    value = nodes[0].meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return ""
    dims = ", ".join(str(s) for s in value.shape)
    return f"[{dims}]" if len(nodes) == 1 else f"{len(nodes)} x [{dims}]"


def collapse_paths(paths: list[str]) -> str:
    """``experts.0.w1.weight`` ... ``experts.7.w1.weight`` -> ``experts[0..7].w1.weight``: the one
    dotted component in which the paths differ, when it is an integer in all of them."""
    if len(paths) == 1:
        return paths[0]
    split = [p.split(".") for p in paths]
    if len({len(s) for s in split}) != 1:
        return f"{paths[0]} (+{len(paths) - 1} more)"
    differ = [i for i in range(len(split[0])) if len({s[i] for s in split}) > 1]
    if len(differ) != 1 or not all(s[differ[0]].isdigit() for s in split):
        return f"{paths[0]} (+{len(paths) - 1} more)"
    i = differ[0]
    numbers = sorted(int(s[i]) for s in split)
    span = f"{numbers[0]}..{numbers[-1]}" if numbers == list(range(numbers[0], numbers[-1] + 1)) else \
        ",".join(map(str, numbers))
    head, tail = ".".join(split[0][:i]), ".".join(split[0][i + 1:])
    return f"{head}[{span}]" + (f".{tail}" if tail else "")


def _fused_label(fused: fx.Node, entry) -> str:
    lines = [f"torch.ops.{str(fused.target).split('.default')[0]}"]
    if entry is None:
        return "\n".join(lines)
    layout = entry.gate_up + (" transposed [E, in, out]" if entry.transposed else " [out, in]")
    act = entry.activation + (f" limit={entry.limit:g}" if entry.limit > 0 else "")
    lines += [f"family   {entry.family}", f"E={entry.num_experts}  K={entry.top_k}  H={entry.hidden}  F={entry.ffn}",
              f"layout   gate_up={layout}", f"act      {act}", f"weight   on {entry.weight_on}",
              f"variant  {entry.variant}", f"proof    rel. error {entry.proof_error:.1e}"]
    if entry.biases:
        lines.append(f"biases   {'+'.join(entry.biases)}")
    if entry.local_experts:
        lines.append(f"EP       {entry.world_size} ranks, {entry.local_experts} local experts")
    return "\n".join(lines)
