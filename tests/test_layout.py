"""The package's shape: no import circle among its modules, no source file too long to read, and
docs/architecture.md's folder tree naming exactly the files the package has."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moe_compile"
SOURCES = (".py", ".c", ".h", ".cpp")
MAX_LINES = 800  # a file a reader takes in at one sitting; ggml-cpu's per-family files are this size


def _package_files() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and not p.name.endswith((".pyc", ".so")))


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports, at its top or inside a function (a lazy import still
    ties the two modules together).  ``from pkg import sub`` is an edge to ``pkg.sub`` alone; a
    module's own parent packages are not edges (Python imports them first in any case)."""
    name = _module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{a.name}" for a in node.names} & modules
            found |= subs or ({target} & modules)
    return found - {name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    files = [p for p in _package_files() if p.suffix == ".py"]
    modules = {_module_name(p) for p in files}
    graph = {_module_name(p): _imports(p, modules) for p in files}
    assert _circles(graph) == [], "modules that import each other (cut one edge: move what both need lower)"


def test_the_circle_finder_finds_a_circle():
    # The check above must be able to fail: a -> b -> a is a circle, c -> a is not part of one.
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_source_file_too_long():
    long = {str(p.relative_to(ROOT)): n for p in _package_files() if p.suffix in SOURCES
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concern (at most {MAX_LINES} lines a file)"


def _tree_paths(text: str) -> list[str]:
    """The file paths of docs/architecture.md's folder tree: the fenced block after the
    "## Folder tree" heading, one entry a line, two spaces of indent a level, folders ending in /."""
    block = re.search(r"^## Folder tree\n.*?^```text\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/architecture.md needs a '## Folder tree' section with a ```text block"
    paths, folders = [], []
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        entry = line.split()[0]
        folders[depth:] = []
        if entry.endswith("/"):
            folders.append(entry.rstrip("/"))
        else:
            paths.append("/".join([*folders, entry]))
    return paths


def test_architecture_tree_lists_every_package_file():
    listed = _tree_paths((ROOT / "docs" / "architecture.md").read_text())
    present = {str(p.relative_to(ROOT)) for p in _package_files()}
    assert sorted(set(listed) - present) == [], "listed in docs/architecture.md but not in the package"
    assert sorted(present - set(listed)) == [], "in the package but not in docs/architecture.md's folder tree"
    assert len(listed) == len(set(listed))


def test_no_file_names_a_work_session_or_an_issue():
    # The repo speaks of the project: its history is in git, not in its files' words or names.
    pattern = re.compile(r"session [0-9]|issue [0-9]|\bs[0-9]{2}_", re.IGNORECASE)
    roots = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / d for d in ("docs", "benchmarks", "moe_compile", "tests"))]
    files = [p for r in roots for p in ([r] if r.is_file() else r.rglob("*"))
             if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".png", ".so", ".pyc", ".gguf")]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)!r}" for p in files
             for m in [pattern.search(p.read_text(errors="replace")) or pattern.search(str(p.relative_to(ROOT)))] if m]
    assert found == []


def test_moved_modules_keep_their_old_names_with_a_warning():
    import importlib
    import warnings

    import moe_compile
    from moe_compile.models import zoo

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from moe_compile import zoo as old  # noqa: F401  the name examples and user code imported
    assert old is zoo
    assert any(issubclass(w.category, DeprecationWarning) and "moe_compile.models.zoo" in str(w.message) for w in caught)
    for target in moe_compile._MOVED.values():  # every old name leads to a module that exists
        importlib.import_module(f"moe_compile.{target}")
