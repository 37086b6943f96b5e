"""One export of tiny-gpt2 in every format (and its draft) for the whole session: the export
tests of several modules read it, and making it is the slow part."""

from __future__ import annotations

import pytest

from tests.helpers.exports import NAME
from tritonlm.export.pipeline import ExportOptions, export
from tritonlm.models.builtin import build_tiny


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    repo = tmp_path_factory.mktemp("export") / "repo"
    lines: list[str] = []
    result = export(
        ExportOptions(model="tiny-gpt2", name=NAME, repo=repo, runtime="python", draft="tiny-gpt2-draft",
                      max_context=128),
        out=lines.append,
    )
    return repo, result, lines


@pytest.fixture(scope="session")
def model():
    m, _ = build_tiny("tiny-gpt2")
    return m
