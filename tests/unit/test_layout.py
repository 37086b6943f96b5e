"""The repository's layout rules, so they hold after the next change too (docs/architecture.md
and README's "Where things live" describe the layout these keep):

- README.md is a front page; the rest is in docs/;
- no module of the package grows past 700 lines (one job per module);
- one definition of `percentile`, and no class name defined twice;
- scripts import the installed package: nothing edits sys.path;
- tritonlm/perf holds only what its subcommands reach; what only the benchmark scripts use is
  perf/tritonlm_bench (the package tritonlm_bench), which nothing in tritonlm imports;
- code comments carry no measured figures or history (they go stale; docs/ holds them);
- tests/unit mirrors the package: each test file is named after the module it tests
  (tests/unit/tritonlm_bench/ mirrors perf/tritonlm_bench, what the benchmark scripts share).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

import tritonlm
import tritonlm_bench

PACKAGE = Path(tritonlm.__file__).resolve().parent
BENCH = Path(tritonlm_bench.__file__).resolve().parent
ROOT = PACKAGE.parent
CODE_DIRS = ("tritonlm", "backends", "export", "perf", "scripts", "tests")
MAX_MODULE_LINES = 700
MAX_README_LINES = 300

# Repo-wide checks in tests/unit that test no single module.
REPO_CHECKS = {"test_docs.py", "test_imports.py", "test_layout.py", "test_deploy.py"}


def python_files() -> list[Path]:
    return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; details belong in docs/"
    assert (ROOT / "docs" / "benchmarks.md").is_file()


def test_no_module_is_too_long():
    long = {
        str(p.relative_to(ROOT)): n
        for p in (*PACKAGE.rglob("*.py"), *BENCH.rglob("*.py"))
        if (n := p.read_text().count("\n")) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by job): {long}"


def test_one_percentile_and_no_class_defined_twice():
    classes: dict[str, list[str]] = defaultdict(list)
    percentiles = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ClassDef):
                classes[node.name].append(where)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "percentile":
                percentiles.append(where)
    assert len(percentiles) == 1, f"percentile is defined {len(percentiles)} times: {percentiles}"
    twice = {name: places for name, places in classes.items() if len(places) > 1}
    assert not twice, f"class names defined more than once: {twice}"


def test_nothing_edits_sys_path():
    edits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in python_files()
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"sys\.path\.(insert|append|extend)|sys\.path\s*=", line) and p.name != "test_layout.py"
    ]
    assert not edits, f"sys.path edits (import the installed package instead): {edits}"


# A measured figure or its history: "2.3x slower", "0.77 -> 0.87", "~2.8 ms of a step", "was 40".
FIGURE = re.compile(
    r"\d(?:\.\d+)?x (?:faster|slower)"
    r"|\b\d+\.\d+ ?-> ?\d+\.\d+\b"
    r"|~\d[\d.,]* ?(?:ms|µs|us|%|MB|GB|tok/s)\b"
    r"|\b(?:was|were) \d"
    r"|\b[Mm]easured (?:at|on|here)\b"
)


def figures_in_comments(text: str) -> list[tuple[int, str]]:
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and FIGURE.search(tok.string):
            found.append((tok.start[0], tok.string.strip()))
    return found


def test_figure_pattern_catches_figures():
    assert figures_in_comments("x = 1  # 2.3x slower on one CPU\n")
    assert figures_in_comments("# served / in-process 0.77 -> 0.87\n")
    assert figures_in_comments("# took ~2.8 ms of a 44 ms step\n")
    assert not figures_in_comments("# [B, T] -> [B, T, C]\nd = {}  # seq id -> its blocks\n")
    assert not figures_in_comments("# 0: the sum of the limits above + 64 KiB\n")


def test_code_comments_carry_no_figures():
    found = [
        f"{p.relative_to(ROOT)}:{n}: {c}"
        for p in python_files()
        if p.name != "test_layout.py"
        for n, c in figures_in_comments(p.read_text())
    ]
    assert not found, "comments with measured figures or history (move them to docs/):\n" + "\n".join(found)


def test_unit_tests_mirror_the_package():
    """tests/unit/a/b/test_c.py tests tritonlm/a/b/c.py, a native source tritonlm/a/b/c.cpp, or
    the package tritonlm/a/b/c/ (whose __init__ may also be tested by tests/unit/a/b/c/test_c.py)."""
    unit = ROOT / "tests" / "unit"
    orphans = []
    for test in sorted(unit.rglob("test_*.py")):
        rel = test.relative_to(unit)
        if rel.parent == Path(".") and rel.name in REPO_CHECKS:
            continue
        package = PACKAGE
        if rel.parts[0] == BENCH.name:
            package, rel = BENCH, rel.relative_to(BENCH.name)
        target = package / rel.parent / rel.name.removeprefix("test_")
        own_package = rel.parent.name == target.with_suffix("").name and (package / rel.parent).is_dir()
        native = target.with_suffix(".cpp").is_file()
        if not (target.is_file() or native or target.with_suffix("").is_dir() or own_package):
            orphans.append(str(test.relative_to(ROOT)))
    assert not orphans, f"unit test files named after no module of the package: {orphans}"
    for module in ("engine/detok.py", "engine/output.py", "engine/sequence.py", "engine/tokenizer.py",
                   "engine/scheduler.py", "engine/runners/model.py", "engine/runners/layers.py"):
        path = Path(module)
        test = unit / path.parent / f"test_{path.name}"
        assert test.is_file(), f"tritonlm/{module} has no unit test at {test.relative_to(ROOT)}"


def _named_modules(path: Path) -> set[str]:
    """Dotted names a module imports or names in a string (the CLI imports its subcommands'
    modules by name), with each name's parents: `from a.b import c` gives a.b.c, a.b and a."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"tritonlm(\.\w+)+", node.value):
            names.add(node.value)
    return {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}


def test_perf_holds_only_what_the_cli_uses():
    """tritonlm/perf keeps what `tritonlm perf` and `tritonlm plan` use; benchmark-only code lives
    in perf/tritonlm_bench, which tritonlm never imports."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["tritonlm", *path.relative_to(PACKAGE).with_suffix("").parts]
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    importers = sorted(
        f"{p.relative_to(ROOT)}" for p in modules.values() if any(n.split(".")[0] == BENCH.name for n in _named_modules(p))
    )
    assert not importers, f"tritonlm modules importing {BENCH.name} (benchmark code; tritonlm must not need it): {importers}"
    reached, todo = set(), ["tritonlm.cli"]
    while todo:
        module = todo.pop()
        if module in reached:
            continue
        reached.add(module)
        todo.extend(n for n in _named_modules(modules[module]) if n in modules)
    unused = sorted(m for m in modules if m.startswith("tritonlm.perf.") and m not in reached)
    assert not unused, (
        f"tritonlm/perf modules no subcommand reaches from tritonlm.cli (move what only perf/*.py "
        f"uses to perf/tritonlm_bench): {unused}"
    )
