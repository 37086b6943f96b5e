"""What tritonserver says it serves, over its HTTP API: each model's state from the
repository index (POST /v2/repository/index: READY, LOADING, UNLOADING, UNAVAILABLE), and
how many Python backend stubs a loaded model's configuration asks for (its instance_group).

The index belongs to the model-repository API: with --restrict-model-control it wants the
restriction's header, which this client sends. Reads that fail (the server restarting or
too busy to answer in time) return None: the caller decides what not knowing means.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

READY, LOADING, UNLOADING, UNAVAILABLE = "READY", "LOADING", "UNLOADING", "UNAVAILABLE"
# backends that run each model instance in a Python backend stub process (tritonlm is one)
STUB_BACKENDS = ("python", "tritonlm")
# a model listed with several versions: the state that says most about whether it serves
_STATE_ORDER = (READY, UNLOADING, LOADING, UNAVAILABLE)
TIMEOUT_S = 2.0


def index_states(entries: list[dict]) -> dict[str, str]:
    """The repository index (a list of {"name", "version", "state", "reason"}) as model ->
    state: READY when any version is, else the first of UNLOADING, LOADING, UNAVAILABLE."""
    states: dict[str, str] = {}
    for entry in entries:
        name, state = entry.get("name"), str(entry.get("state", UNAVAILABLE)).upper()
        if not isinstance(name, str):
            raise ValueError(f"a repository index entry without a model name: {entry!r}")
        old = states.get(name)
        rank = _STATE_ORDER.index(state) if state in _STATE_ORDER else len(_STATE_ORDER)
        if old is None or rank < (_STATE_ORDER.index(old) if old in _STATE_ORDER else len(_STATE_ORDER)):
            states[name] = state
    return states


def stubs_asked(config: dict) -> int:
    """How many stub processes a loaded model's configuration (Triton's JSON, instance
    groups filled in) makes: one per instance for a stub-running backend, none otherwise."""
    if config.get("backend") not in STUB_BACKENDS:
        return 0
    total = 0
    for group in config.get("instance_group") or [{}]:
        count = int(group.get("count", 1))
        if group.get("kind") == "KIND_GPU":
            count *= max(1, len(group.get("gpus") or []))  # `count` instances on each listed GPU
        total += count
    return total


class TritonModels:
    """Reads the model states and configurations of the tritonserver at http_url (host:port)."""

    def __init__(self, http_url: str, headers: dict[str, str] | None = None, timeout_s: float = TIMEOUT_S):
        self.base = f"http://{http_url}"
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s

    def _json(self, path: str, body: bytes | None = None) -> object | None:
        request = urllib.request.Request(self.base + path, data=body, headers=self.headers,
                                         method="POST" if body is not None else "GET")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):  # HTTPError is a URLError
            return None

    def index(self) -> dict[str, str] | None:
        """model -> state (READY, LOADING, UNLOADING, UNAVAILABLE); None when unreadable."""
        entries = self._json("/v2/repository/index", b"{}")
        if not isinstance(entries, list):
            return None
        try:
            return index_states(entries)
        except ValueError:
            return None

    def stubs_asked(self, model: str) -> int | None:
        """The stubs `model`'s loaded configuration asks for; None when unreadable."""
        config = self._json(f"/v2/models/{urllib.parse.quote(model, safe='')}/config")
        return stubs_asked(config) if isinstance(config, dict) else None
