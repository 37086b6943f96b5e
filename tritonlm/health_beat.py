"""The beat file a model process writes for `tritonlm serve`'s supervisor: its format, read
and written here, so that the writer (tritonlm/glue/heartbeat.py, in the model's process)
and the reader (tritonlm/supervise/watch.py, in serve's process) share one definition and
neither imports the other.

One file per model process: <dir>/<pid>.json, rewritten whole at every beat (written
beside, then renamed: a reader never sees half a beat):

  pid       the model process
  model     the model's name; instance: its instance's name
  time      when the beat was written (wall clock, seconds)
  fault     why the model can no longer serve (None while it can)
  step_at   when its engine last made progress: a step finished, or the engine woke with
            new work (wall clock; absent for a model without an engine loop)
  waiting   requests the engine owes a step (queued or running; absent as step_at)
  step_tokens    the tokens the current step runs (0 until it is scheduled)
  sec_per_token  the slowest pace, seconds per token, of any step the engine has finished
  longest_step   the longest step the engine has finished, seconds
  steps_done     how many steps that ran tokens the engine has finished
                 (these four are absent as step_at)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

HEALTH_DIR_ENV = "TRITONLM_HEALTH_DIR"  # `tritonlm serve` sets it for tritonserver; the stubs inherit it


def beat_path(directory: str | os.PathLike, pid: int) -> Path:
    return Path(directory) / f"{pid}.json"


def read_beat(path: str | os.PathLike) -> dict | None:
    """A beat, or None when there is none (or it cannot be read)."""
    try:
        beat = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return beat if isinstance(beat, dict) else None


def write_beat(path: str | os.PathLike, beat: dict) -> None:
    """Replace the beat at path in one rename. Raises OSError (e.g. the folder is gone)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(beat))
    os.replace(tmp, path)
