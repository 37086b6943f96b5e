"""The documentation cannot drift from the code unnoticed: docs/architecture.md names files,
classes and functions that must exist; docs/configuration.md's tables are generated from the
settings parser's own list of parameters; every relative link in the Markdown pages resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
DOC = (ROOT / "docs" / "architecture.md").read_text()
SOURCES = {p: p.read_text() for d in ("tritonlm", "backends") for p in (ROOT / d).rglob("*.py")}


def _defining_files(cls: str) -> str:
    """The text of every file that defines a class of that name."""
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


# ---- docs/configuration.md: generated from tritonlm/engine/settings.py ---------------------


def _parser_reads(source: str) -> set[str]:
    """The parameter names a parser's source reads: params.get("x"), params["x"], get_int("x", ...)."""
    return set(re.findall(r'(?:params\.get\(|params\[|get_\w+\()"(\w+)"', source))


def test_configuration_tables_are_generated():
    from tritonlm.engine.settings import PARAMETER_TABLES, markdown_table

    page = (ROOT / "docs" / "configuration.md").read_text()
    for kind in PARAMETER_TABLES:
        table = markdown_table(kind)
        assert table in page, (
            f"docs/configuration.md's {kind} table differs from tritonlm.engine.settings.markdown_table({kind!r}); "
            f"paste:\n{table}"
        )


def test_every_generate_parameter_the_parser_reads_is_documented():
    import dataclasses

    from tritonlm.engine.settings import GENERATE_PARAMETERS, EngineSettings

    documented = [p.name for p in GENERATE_PARAMETERS]
    assert len(documented) == len(set(documented)), "a parameter is documented twice"
    # what from_params accepts: the settings fields (model_dir is the folder, not a parameter) and task
    # (cpu_share is the glue's: the model's instance count)
    accepted = {f.name for f in dataclasses.fields(EngineSettings)} - {"model_dir", "cpu_share"} | {"task"}
    read = _parser_reads((ROOT / "tritonlm" / "engine" / "settings.py").read_text())
    assert read, "found no parameter reads in settings.py: the pattern is out of date"
    assert set(documented) == accepted, (
        f"undocumented: {sorted(accepted - set(documented))}; documented but not parsed: {sorted(set(documented) - accepted)}"
    )
    assert read <= set(documented), f"settings.py reads parameters docs/configuration.md lacks: {sorted(read - set(documented))}"


def test_every_forward_parameter_the_glue_reads_is_documented():
    from tritonlm.engine.settings import FORWARD_PARAMETERS

    read = _parser_reads((ROOT / "tritonlm" / "glue" / "forward.py").read_text()) | {"task"}
    assert read == {p.name for p in FORWARD_PARAMETERS}


def test_documented_defaults_are_what_the_parser_gives(tmp_path):
    """Writing a documented default into a config changes nothing: it is the parser's default."""
    from tritonlm.engine.settings import GENERATE_PARAMETERS, EngineSettings

    model_dir = tmp_path / "model"
    (model_dir / "1" / "hf").mkdir(parents=True)
    absent = EngineSettings.from_params({}, model_dir)
    checked = 0
    for p in GENERATE_PARAMETERS:
        if p.default is None:
            continue
        given = EngineSettings.from_params({p.name: p.default}, model_dir)
        assert given == absent, f"{p.name}: documented default {p.default!r} is not the parser's default"
        checked += 1
    assert checked > 20


# ---- relative links ---------------------------------------------------------------------------

PAGES = sorted(
    {ROOT / "README.md"}
    | set((ROOT / "docs").rglob("*.md"))
    | set((ROOT / "deploy").rglob("*.md"))
    | set((ROOT / "export").glob("*.md"))
    | set((ROOT / "tritonlm").rglob("README.md"))
)
_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1", re.M | re.S)


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code spans (links there are not links)."""
    text = _FENCE.sub("", text)
    return re.sub(r"(`+)[^`].*?\1", "", text, flags=re.S)


def github_anchor_slugs(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lowercased, punctuation dropped, spaces as
    hyphens, -1, -2, ... after repeats."""
    slugs: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", _FENCE.sub("", text), re.M):
        heading = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _links(text: str) -> list[str]:
    prose = _prose(text)
    inline = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose)
    reference = re.findall(r"^ {0,3}\[[^\]]+\]:\s*(\S+)", prose, re.M)
    return inline + reference


def test_anchor_slugs_follow_github():
    page = "# A `code` title: yes (really)\n## Same\n## Same\n```\n# not a heading\n```\n### [Linked](x.md) text\n"
    assert github_anchor_slugs(page) == {"a-code-title-yes-really", "same", "same-1", "linked-text"}


def test_every_relative_link_resolves():
    assert ROOT / "README.md" in PAGES and len(PAGES) > 5
    broken = []
    for page in PAGES:
        for link in _links(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", link, re.I):  # https:, mailto:, ...
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: {link}"
            if not target.exists():
                broken.append(f"{where} (no such file)")
            elif not target.resolve().is_relative_to(ROOT):
                broken.append(f"{where} (outside the repository)")
            elif anchor and target.suffix == ".md" and anchor not in github_anchor_slugs(target.read_text()):
                broken.append(f"{where} (no heading with that anchor in {target.relative_to(ROOT)})")
    assert not broken, "broken links:\n" + "\n".join(broken)
