"""The adapters one model serves, by name: a cache of loaded adapters, not a limit.

    LoraRegistry(model, folders, max_rank, max_cpu_loras)
        get(name) -> LoraAdapter         loaded now, on the caller's thread, if it is not loaded
        acquire(name) -> LoraAdapter | PendingAdapter
                                         a loaded one at once, else a load on the loader thread
        add(name, folder)                a new name, or a reload in place (new content, new digest)
        remove(name)

Any number of adapter folders may be named; at most max_cpu_loras stay loaded, the least
recently used dropped first. A dropped adapter that requests still hold stays alive with them
(they keep their LoraAdapter), so eviction never fails a request: the next use loads it
again. An unknown name is a ValueError naming the known ones.

acquire() is the served path: a cold adapter is loaded by one background thread (disk and
safetensors never hold up the caller, nor the engine's step loop), and the request waits for
it in the engine (Engine.submit takes a PendingAdapter). Requests for an adapter already
being loaded share that load. Every method may be called from any thread.

What it did is kept for the metrics (glue.metrics): requests per adapter, loads, evictions,
and each cold load's seconds (drained by the publisher).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tritonlm.engine.lora.adapter import LoraAdapter, load_adapter
from tritonlm.engine.request import ServerBusyError
from tritonlm.engine.threads import set_os_thread_name

LOADER_THREAD = "tritonlm-lora"  # the background loader, named for the OS too (threads.py)


@dataclass(eq=False)
class PendingAdapter:
    """An adapter a request names that is being loaded: the engine queues the request once
    `future` holds the LoraAdapter, or fails it with the future's error."""

    name: str
    future: concurrent.futures.Future  # -> LoraAdapter; ValueError naming what is refused


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
        # tests only: called on the loader thread before each background load (a load held back)
        self.before_load: Callable[[str], None] | None = None
        self._folders: dict[str, Path] = {}
        # bumped by every add / remove of a name: a load begun before it is not kept under the name
        self._versions: collections.Counter[str] = collections.Counter()
        self._loaded: collections.OrderedDict[str, LoraAdapter] = collections.OrderedDict()  # LRU first
        self._pending: dict[str, PendingAdapter] = {}  # background loads under way, by name
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False  # close(): no loader thread starts again
        self.loads = 0  # adapters loaded from their folders (first uses, reloads after evictions)
        self.evictions = 0
        self.requests: collections.Counter[str] = collections.Counter()  # get() / acquire() calls, by name
        self._lock = threading.RLock()  # request threads, the loader thread and the metrics publisher
        self._load_seconds: list[float] = []  # each cold load's seconds, not yet published
        for name, folder in (folders or {}).items():
            self.add(name, folder)

    @property
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._folders)

    @property
    def folders(self) -> dict[str, Path]:
        with self._lock:
            return dict(self._folders)

    @property
    def resident(self) -> list[str]:
        """Loaded adapters, least recently used first."""
        with self._lock:
            return list(self._loaded)

    def add(self, name: str, folder: str | Path) -> None:
        """Serve `folder` as `name`; an existing name is reloaded from it at its next use."""
        if not name or name != name.strip():
            raise ValueError(f"LoRA adapter name {name!r}: a non-empty name without surrounding spaces is needed")
        with self._lock:
            self._folders[name] = Path(folder)
            self._forget(name)

    def remove(self, name: str) -> None:
        with self._lock:
            self._folder(name)
            del self._folders[name]
            self._forget(name)

    def _forget(self, name: str) -> None:
        """The name's loaded adapter and any load under way are no longer its content."""
        self._versions[name] += 1
        self._loaded.pop(name, None)
        self._pending.pop(name, None)  # its waiting requests keep their future: they asked before

    def get(self, name: str) -> LoraAdapter:
        """The adapter `name`, loading it on this thread (and dropping the least recently used
        past max_cpu_loras) if it is not loaded. ValueError for an unknown name or a refused
        adapter."""
        with self._lock:
            found = self._lookup(name)
        return found if isinstance(found, LoraAdapter) else self._load(name, *found)

    def acquire(self, name: str) -> LoraAdapter | PendingAdapter:
        """The adapter `name` if it is loaded, else a PendingAdapter whose load runs on the
        loader thread (one load per name at a time, shared by the requests that wait for it).
        ValueError for an unknown name, at once; ServerBusyError after close() (the model is
        shutting down)."""
        with self._lock:
            if self._closed:
                raise ServerBusyError("the model is shutting down; retry on another instance")
            found = self._lookup(name)
            if isinstance(found, LoraAdapter):
                return found
            folder, version = found
            pending = self._pending.get(name)
            if pending is None:
                if self._loader is None:
                    self._loader = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix=LOADER_THREAD, initializer=set_os_thread_name, initargs=(LOADER_THREAD,))
                pending = PendingAdapter(name, self._loader.submit(self._load_in_background, name, folder, version))
                self._pending[name] = pending
            return pending

    def _lookup(self, name: str) -> LoraAdapter | tuple[Path, int]:
        """One request for `name` (lock held): its loaded adapter (now the most recently
        used), else the (folder, version) to load it from. ValueError for an unknown name."""
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
        else:
            folder = self._folder(name)
        self.requests[name] += 1
        return adapter if adapter is not None else (folder, self._versions[name])

    def _load_in_background(self, name: str, folder: Path, version: int) -> LoraAdapter:
        try:
            if self.before_load is not None:
                self.before_load(name)
            return self._load(name, folder, version)
        finally:
            with self._lock:
                if self._versions[name] == version:
                    self._pending.pop(name, None)

    def _load(self, name: str, folder: Path, version: int) -> LoraAdapter:
        """Load from `folder` (no lock held: the slow part) and keep it, unless the name was
        added again or removed meanwhile."""
        start = time.perf_counter()
        adapter = load_adapter(folder, self.model, name, self.max_rank)
        with self._lock:
            self._load_seconds.append(time.perf_counter() - start)
            self.loads += 1
            if self._versions[name] == version:
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

    def close(self) -> None:
        """Stop the loader thread once the load under way (if any) ends; queued loads are
        dropped (their requests end with the engine's shutdown), and acquire() refuses from
        now on rather than start another loader."""
        with self._lock:
            loader, self._loader = self._loader, None
            self._closed = True
        if loader is not None:
            loader.shutdown(wait=False, cancel_futures=True)

    def _folder(self, name: str) -> Path:
        folder = self._folders.get(name)
        if folder is None:
            known = ", ".join(repr(n) for n in sorted(self._folders)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r}; this model serves: {known}")
        return folder
