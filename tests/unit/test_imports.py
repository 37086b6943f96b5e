"""Every import of the tritonlm package points down its layers, and no modules import each other.

The layers are the numbered list under "## Layers" in docs/architecture.md, read from there
(the one place the order is written): a module may import its own layer and the layers
listed before it. Every `import` / `from ... import` statement counts: function-level ones
(a lazy import hides a cycle, it does not remove it) and those under `if TYPE_CHECKING:` (a
type-only import is still a dependency; a circle through one is still a circle). An edge
goes to the module named: `import tritonlm.a.b` and `from tritonlm.a import b` (b a module)
-> tritonlm.a.b; `from tritonlm.a import name` (name not a module) -> tritonlm.a, a
package's __init__ being the module tritonlm.a.
"""

from __future__ import annotations

import ast
import re
from collections import deque
from pathlib import Path

import tritonlm

PACKAGE = "tritonlm"
ROOT = Path(tritonlm.__file__).resolve().parent
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"
LAYERS_HEADING = "## Layers"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root (a package's __init__.py
    is the package's module)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


class _ImportCollector(ast.NodeVisitor):
    """Every import statement of a module, wherever it stands (top level, in a function, under
    `if TYPE_CHECKING:`)."""

    def __init__(self) -> None:
        self.found: list[ast.Import | ast.ImportFrom] = []

    def visit_Import(self, node: ast.Import) -> None:
        self.found.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.found.append(node)


def import_graph(modules: dict[str, Path] | None = None, package: str = PACKAGE,
                 missing: list[tuple[str, int, str]] | None = None) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}. An
    import of a package module that does not exist makes no edge; it is appended to
    `missing` as (importing module, line, name) when given."""
    modules = module_files() if modules is None else modules
    missing = [] if missing is None else missing
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        collector = _ImportCollector()
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        is_package = path.name == "__init__.py"
        edges: dict[str, int] = {}

        def add(target: str, line: int) -> None:
            if target not in modules:
                missing.append((module, line, target))
            elif target != module:
                edges.setdefault(target, line)

        for node in collector.found:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        add(alias.name, node.lineno)
                continue
            if node.level:  # relative: from the module's package, one level up per extra dot
                base_parts = module.split(".") if is_package else module.split(".")[:-1]
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not (base == package or base.startswith(package + ".")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else base, node.lineno)
        graph[module] = edges
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, {})))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _shortest_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside it."""
    inside = set(component)
    start = component[0]
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in sorted(graph[node]):
            if succ not in inside:
                continue
            if succ == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if succ not in parent:
                parent[succ] = node
                queue.append(succ)
    raise AssertionError(f"no cycle through {start} in {component}")  # pragma: no cover


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle per group of modules that import each other (a strongly connected component)."""
    return [_shortest_cycle(graph, c) for c in _strongly_connected(graph) if len(c) > 1]


def describe(graph: dict[str, dict[str, int]], modules: dict[str, Path], cycle: list[str], root: Path = ROOT) -> str:
    steps = []
    for a, b in zip(cycle, cycle[1:]):
        where = modules[a].relative_to(root.parent)
        steps.append(f"  {a} -> {b}  ({where}:{graph[a][b]})")
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


# ---- layers ----------------------------------------------------------------------------------


def read_layers(text: str, heading: str = LAYERS_HEADING, package: str = PACKAGE) -> list[list[str]]:
    """The numbered list under the heading: one layer per item, lowest first, each the names
    of what it lists before the item's first ': ' (so its description may name other paths):
    `pkg/a/b.py` -> "pkg.a.b", that module alone; `pkg/a/` -> "pkg.a.*", the folder, every
    module in it."""
    section = text.split(f"\n{heading}", 1)[1].split("\n#", 1)[0]
    layers = []
    for item in re.findall(r"^\d+\. (.*)$", section, re.M):
        paths = re.findall(rf"`({package}/[\w/.]*)`", item.split(": ", 1)[0])
        assert paths, f"{heading}: the item {item!r} names no module or folder"
        layers.append([layer_name(p) for p in paths])
    return layers


def layer_name(path: str) -> str:
    """`pkg/a/b.py` -> pkg.a.b, `pkg/__init__.py` -> pkg (modules); `pkg/a/` -> pkg.a.* (a folder)."""
    if path.endswith("/"):
        return path.removesuffix("/").replace("/", ".") + ".*"
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str, layers: list[list[str]]) -> int | None:
    """The index of the layer that names the module itself, else of the one naming the
    innermost folder that holds it (None: no layer does)."""
    best: tuple[int, int] | None = None  # (how specific the name is, layer)
    for index, names in enumerate(layers):
        for name in names:
            folder = name.removesuffix(".*")
            if name.endswith(".*") and (module == folder or module.startswith(folder + ".")):
                rank = 2 * len(folder)
            elif module == name:
                rank = 2 * len(name) + 1
            else:
                continue
            if best is None or rank > best[0]:
                best = (rank, index)
    return None if best is None else best[1]


def upward_imports(graph: dict[str, dict[str, int]], layers: list[list[str]]) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for every import of a module in a later layer than the importer's."""
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            if layer_of(target, layers) > layer_of(module, layers):
                found.append((module, target, line))
    return found


def test_the_layers_name_every_module_once_and_nothing_else():
    layers = read_layers(ARCHITECTURE.read_text())
    modules = module_files()
    assert len(layers) > 3
    names = [n for layer in layers for n in layer]
    assert len(names) == len(set(names)), f"docs/architecture.md names a module in two layers: {names}"
    unknown = [n for n in names if n.removesuffix(".*") not in modules]
    assert not unknown, f"docs/architecture.md's layers name modules or folders that do not exist: {unknown}"
    homeless = [m for m in modules if layer_of(m, layers) is None]
    assert not homeless, f"modules in no layer (add them to {LAYERS_HEADING!r} in docs/architecture.md): {homeless}"


def test_every_import_points_down_the_layers():
    layers = read_layers(ARCHITECTURE.read_text())
    modules = module_files()
    graph = import_graph(modules)
    report = [
        f"  {modules[m].relative_to(ROOT.parent)}:{line}: {m} (layer {layer_of(m, layers) + 1}) imports "
        f"{t} (layer {layer_of(t, layers) + 1})"
        for m, t, line in upward_imports(graph, layers)
    ]
    assert not report, ("imports that point up the layers of docs/architecture.md (move the shared part down, "
                        "or the importer up):\n" + "\n".join(report))


def test_no_import_cycles():
    modules = module_files()
    graph = import_graph(modules)
    report = []
    for component in _strongly_connected(graph):
        if len(component) > 1:
            cycle = _shortest_cycle(graph, component)
            report.append(describe(graph, modules, cycle))
            if len(component) > len(cycle) - 1:  # more cycles among these modules
                report.append(f"  (all of these import each other: {', '.join(component)})")
    assert not report, "import cycle(s) among tritonlm modules:\n" + "\n".join(report)


def test_every_import_names_an_existing_module():
    modules = module_files()
    missing: list[tuple[str, int, str]] = []
    import_graph(modules, missing=missing)
    assert not missing, "imports of tritonlm modules that do not exist:\n" + "\n".join(
        f"  {modules[m].relative_to(ROOT.parent)}:{line}: {name}" for m, line, name in missing
    )


# ---- the walker itself, on a small made-up package -------------------------------------------


def test_walker_finds_edges_and_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "import os\nfrom pkg.b import thing\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.c import X\nelse:\n    pass\n"
                "def f():\n    from .sub import mod\n",
        "c.py": "import pkg.a\nimport pkg.gone\nfrom pkg.sub.gone import x\n",
        "sub/__init__.py": "from . import mod\nfrom .mod import name\n",
        "sub/mod.py": "from .. import c\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    modules = module_files(pkg, "pkg")
    missing: list[tuple[str, int, str]] = []
    graph = import_graph(modules, "pkg", missing)
    assert missing == [("pkg.c", 2, "pkg.gone"), ("pkg.c", 3, "pkg.sub.gone")]
    assert {m: sorted(e) for m, e in graph.items()} == {
        "pkg": [],
        "pkg.a": ["pkg.b"],  # `from pkg.b import thing`: thing is no module
        "pkg.b": ["pkg.c", "pkg.sub.mod"],  # the TYPE_CHECKING import counts; function-level, relative
        "pkg.c": ["pkg.a"],
        "pkg.sub": ["pkg.sub.mod"],
        "pkg.sub.mod": ["pkg.c"],  # `from .. import c`: c is a module
    }
    cycles = find_cycles(graph)
    assert cycles == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]  # the shortest, through the type-only import
    assert "pkg/b.py:3" in describe(graph, modules, cycles[0], pkg)


def test_layers_read_from_the_doc_and_an_upward_import_found():
    doc = (
        "# Title\n\n## Layers: down\n\nSome words naming `pkg/c.py`.\n\n"
        "1. `pkg/__init__.py`, `pkg/sub/mod.py`: low, see `pkg/a.py`\n"
        "2. `pkg/sub/`: the rest of sub\n"
        "3. `pkg/a.py`, `pkg/b.py`\n\n## Next\n4. `pkg/c.py`\n"
    )
    layers = read_layers(doc, package="pkg")
    assert layers == [["pkg", "pkg.sub.mod"], ["pkg.sub.*"], ["pkg.a", "pkg.b"]]
    # a module named alone goes by its own name, the others by their innermost folder named;
    # pkg/__init__.py names that module alone, so pkg.c is in no layer
    assert [layer_of(m, layers) for m in ("pkg", "pkg.sub.mod", "pkg.sub", "pkg.sub.other", "pkg.a", "pkg.c")] == [
        0, 0, 1, 1, 2, None]
    graph = {"pkg.a": {"pkg.b": 1, "pkg.sub": 2}, "pkg.sub": {"pkg.sub.mod": 1, "pkg.a": 5}, "pkg.sub.mod": {"pkg": 3}}
    assert upward_imports(graph, layers) == [("pkg.sub", "pkg.a", 5)]
