"""A process's exit status in words, for every place that reports a child's death: the
parallel runner's workers (engine) and tritonserver under `tritonlm serve` (supervise).
It lives low so that neither side imports the other."""

from __future__ import annotations

import signal


def describe_exit(code: int) -> str:
    """A Popen returncode in words: "signal SIGKILL" (negative: killed by that signal),
    "exit code 1"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
