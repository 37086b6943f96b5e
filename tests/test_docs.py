"""docs/architecture.md names files, classes and functions a newcomer will look for:
every one of them must exist, so the page cannot drift from the code unnoticed."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text()
SOURCES = {p: p.read_text() for d in ("tritonlm", "backends") for p in (ROOT / d).rglob("*.py")}


def _defining_files(cls: str) -> str:
    """The text of every file that defines a class of that name (several Handler classes exist)."""
    return "\n".join(text for text in SOURCES.values() if re.search(rf"^class {cls}\b", text, re.M))


def test_every_path_named_exists():
    paths = set(re.findall(r"\b((?:tritonlm|backends|perf|docs|tests)/[\w/.]*\w)", DOC))
    assert paths, "the page names no files?"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_every_class_member_named_exists():
    pairs = set(re.findall(r"\b([A-Z][A-Za-z]+)\.([a-z_][a-z_0-9]*)\b", DOC))
    pairs = {(c, m) for c, m in pairs if not m.endswith(("md", "py"))}
    assert len(pairs) > 20
    missing = []
    for cls, member in sorted(pairs):
        text = _defining_files(cls)
        defined = re.search(
            rf"(def {member}\b|^\s+{member}: |self\.{member} = )", text, re.M
        )
        if not defined:
            missing.append(f"{cls}.{member}")
    assert not missing, f"docs/architecture.md names members that do not exist: {missing}"


def test_every_function_named_exists():
    names = set(re.findall(r"`([a-z_][a-z_0-9]*)(?:\(\))?`", DOC)) | set(re.findall(r"\b([a-z_][a-z_0-9]+)\(\)", DOC))
    code = "\n".join(SOURCES.values())
    missing = sorted(
        n for n in names
        if not re.search(rf"(def {n}\b|^{n} = |^\s+{n}: |self\.{n} = |^{n}: )", code, re.M)
        and n not in {"kv_block_size", "tensor_parallel_size", "pipeline_parallel_size", "text_input", "text_output",
                      "finish_reason", "execute", "finalize",
                      "tritonlm", "present"}  # the backend's name, the ONNX graph's output
    )
    assert not missing, f"docs/architecture.md names functions or fields that do not exist: {missing}"
