"""What the export tests share: the names of the tiny-gpt2 export they check (tests/unit/export/
conftest.py makes it once per session) and where its artifacts lie."""

from __future__ import annotations

from pathlib import Path

NAME = "tg"
FORWARD = {"onnx": "tg_onnx", "onnx-int8": "tg_onnx_int8", "onnx-fp16": "tg_onnx_fp16", "torchscript": "tg_torchscript"}


def artifact(repo: Path, fmt: str) -> Path:
    return repo / FORWARD[fmt] / "1" / ("model.pt" if fmt == "torchscript" else "model.onnx")


def assert_untouched(parent: Path):
    assert not [p for p in parent.iterdir() if ".export-" in p.name], "staging left behind"
