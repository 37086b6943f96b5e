"""tritonlm/glue/logs.py: the `tritonlm` loggers' records reach Triton's log at their own
level, once however often routing is asked for, and a failing Triton logger never raises
into the code that logged. Triton's pb_utils is a recording stand-in here (the real one
exists only inside a Python backend stub)."""

from __future__ import annotations

import importlib
import logging
import sys
import types

import pytest


class RecordingLogger:
    lines: list[tuple[str, str]] = []
    fail = False

    @classmethod
    def _log(cls, level: str, text: str) -> None:
        if cls.fail:
            raise RuntimeError("stub gone")
        cls.lines.append((level, text))

    log_error = classmethod(lambda cls, t: cls._log("error", t))
    log_warn = classmethod(lambda cls, t: cls._log("warn", t))
    log_info = classmethod(lambda cls, t: cls._log("info", t))
    log_verbose = classmethod(lambda cls, t: cls._log("verbose", t))


@pytest.fixture
def logs(monkeypatch):
    RecordingLogger.lines, RecordingLogger.fail = [], False
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", types.SimpleNamespace(Logger=RecordingLogger))
    monkeypatch.delitem(sys.modules, "tritonlm.glue.logs", raising=False)
    module = importlib.import_module("tritonlm.glue.logs")
    root = logging.getLogger("tritonlm")
    # routing changes the tritonlm logger for the whole process: put it back after
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "propagate", root.propagate)
    monkeypatch.setattr(root, "level", root.level)
    yield module
    # the module imported over the stand-in goes, so a later import gets the real pb_utils
    sys.modules.pop("tritonlm.glue.logs", None)
    vars(sys.modules["tritonlm.glue"]).pop("logs", None)


def test_each_record_reaches_triton_at_its_level(logs):
    logs.route_logging_to_triton(logging.DEBUG)
    log = logging.getLogger("tritonlm.engine.loader")
    log.debug("kernel path %s", "paged")
    log.info("dtype float32")
    log.warning("no AVX512")
    log.error("load failed")
    log.critical("gone")
    assert RecordingLogger.lines == [
        ("verbose", "tritonlm.engine.loader: kernel path paged"),
        ("info", "tritonlm.engine.loader: dtype float32"),
        ("warn", "tritonlm.engine.loader: no AVX512"),
        ("error", "tritonlm.engine.loader: load failed"),
        ("error", "tritonlm.engine.loader: gone"),
    ]
    assert logging.getLogger("tritonlm").propagate is False  # not printed twice


def test_routing_twice_adds_one_handler_and_the_level_filters(logs):
    logs.route_logging_to_triton()
    logs.route_logging_to_triton()
    root = logging.getLogger("tritonlm")
    assert sum(isinstance(h, logs.TritonLogHandler) for h in root.handlers) == 1
    logging.getLogger("tritonlm.x").debug("below INFO")
    logging.getLogger("tritonlm.x").info("once")
    logging.getLogger("other").info("not tritonlm's")
    assert RecordingLogger.lines == [("info", "tritonlm.x: once")]


def test_a_failing_triton_logger_does_not_raise(logs, monkeypatch):
    logs.route_logging_to_triton()
    RecordingLogger.fail = True
    handled = []
    monkeypatch.setattr(logs.TritonLogHandler, "handleError", lambda self, record: handled.append(record.getMessage()))
    logging.getLogger("tritonlm.x").error("request failed")  # must not raise
    assert handled == ["request failed"]
