"""The adapters one model serves, by name: a cache of loaded adapters, not a limit.

    LoraRegistry(model, folders, max_rank, max_cpu_loras)
        get(name) -> LoraAdapter     loaded on first use (and again after an eviction)
        add(name, folder)            a new name, or a reload in place (new content, new digest)
        remove(name)

Any number of adapter folders may be named; at most max_cpu_loras stay loaded, the least
recently used dropped first. A dropped adapter that requests still hold stays alive with them
(they keep their LoraAdapter), so eviction never fails a request: the next get() loads it
again. An unknown name is a ValueError naming the known ones.

What it did is kept for the metrics (glue.metrics): requests per adapter, loads, evictions,
and each cold load's seconds (drained by the publisher).
"""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

from tritonlm.engine.lora.adapter import LoraAdapter, load_adapter


class LoraRegistry:
    def __init__(self, model, folders: dict[str, str | Path] | None = None, max_rank: int = 64,
                 max_cpu_loras: int = 8) -> None:
        """model: the runners.model.Transformer the adapters run on (lora.apply.attach_lora'd);
        folders: {name: PEFT adapter folder}, checked only when first loaded."""
        if max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras={max_cpu_loras}: at least 1 adapter must fit in memory")
        if max_rank < 1:
            raise ValueError(f"max_lora_rank={max_rank}: a positive rank is needed")
        self.model = model
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._folders: dict[str, Path] = {}
        self._loaded: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()  # LRU first
        self.loads = 0  # adapters loaded from their folders (first uses, reloads after evictions)
        self.evictions = 0
        self.requests: collections.Counter[str] = collections.Counter()  # get() calls (one per request), by name
        self._lock = threading.Lock()  # guards _load_seconds (request threads vs the metrics publisher)
        self._load_seconds: list[float] = []  # each cold load's seconds, not yet published
        for name, folder in (folders or {}).items():
            self.add(name, folder)

    @property
    def names(self) -> list[str]:
        return sorted(self._folders)

    @property
    def resident(self) -> list[str]:
        """Loaded adapters, least recently used first."""
        return list(self._loaded)

    def add(self, name: str, folder: str | Path) -> None:
        """Serve `folder` as `name`; an existing name is reloaded from it at its next use."""
        if not name or name != name.strip():
            raise ValueError(f"LoRA adapter name {name!r}: a non-empty name without surrounding spaces is needed")
        self._folders[name] = Path(folder)
        self._loaded.pop(name, None)

    def remove(self, name: str) -> None:
        self._folder(name)
        del self._folders[name]
        self._loaded.pop(name, None)

    def get(self, name: str) -> LoraAdapter:
        """The adapter `name`, loading it (and dropping the least recently used past
        max_cpu_loras) if it is not loaded. ValueError for an unknown name or a refused adapter."""
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
            self.requests[name] += 1
            return adapter
        start = time.perf_counter()
        adapter = load_adapter(self._folder(name), self.model, name, self.max_rank)
        with self._lock:
            self._load_seconds.append(time.perf_counter() - start)
        self.loads += 1
        self.requests[name] += 1
        while len(self._loaded) >= self.max_cpu_loras:
            self._loaded.popitem(last=False)
            self.evictions += 1
        self._loaded[name] = adapter
        return adapter

    def drain_load_seconds(self) -> list[float]:
        """The cold loads' seconds since the last call."""
        with self._lock:
            out, self._load_seconds = self._load_seconds, []
        return out

    def _folder(self, name: str) -> Path:
        folder = self._folders.get(name)
        if folder is None:
            known = ", ".join(repr(n) for n in self.names) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r}; this model serves: {known}")
        return folder
