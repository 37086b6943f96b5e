"""tritonlm's Python log records into Triton's own log.

The engine logs with the standard `logging` module (what it resolved at load: precision,
attention path, KV budget; and what went wrong). A stub process has no handler for
those, so INFO records went nowhere; Triton's Python backend offers `pb_utils.Logger`,
which writes into the server's log with its level and source (what `--log-info`,
`--log-verbose` and `--log-file` control).
"""

from __future__ import annotations

import logging

import triton_python_backend_utils as pb_utils


class TritonLogHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{record.name}: {self.format(record)}"
            if record.levelno >= logging.ERROR:
                pb_utils.Logger.log_error(text)
            elif record.levelno >= logging.WARNING:
                pb_utils.Logger.log_warn(text)
            elif record.levelno >= logging.INFO:
                pb_utils.Logger.log_info(text)
            else:
                pb_utils.Logger.log_verbose(text)
        except Exception:  # noqa: BLE001 - logging must never take a request down
            self.handleError(record)


def route_logging_to_triton(level: int = logging.INFO) -> None:
    """Send the `tritonlm` loggers' records to Triton's log (once per process)."""
    root = logging.getLogger("tritonlm")
    if any(isinstance(h, TritonLogHandler) for h in root.handlers):
        return
    root.addHandler(TritonLogHandler())
    root.setLevel(level)
    root.propagate = False  # not also to Python's last-resort stderr handler
