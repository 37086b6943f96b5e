"""A served model's adapters kept in step with the multi_lora.json beside its config.pbtxt,
which the OpenAI frontend rewrites (whole, by rename) to load and unload adapters at run time.

    MultiLoraFile(registry, model_dir, fixed).check() -> bool   re-read if the file changed

Every instance of the model (each its own process) watches the file itself: no call has to
reach each instance, and an instance that starts later reads the same file. check() costs one
stat() while nothing changed; the generation model calls it for every request that names an
adapter, so an unload is in force for the next request. A change re-reads the file and brings
the registry in step: names gone are removed (requests running under them keep their
LoraAdapter), new names added, and a name whose folder or whose files changed (a new
adapter_model.safetensors written in place, or the name unloaded and loaded again) is added
again, so it reloads with a new digest and the prefix cache's blocks of the old content are
never reused. The `lora_adapters` parameter's names (`fixed`) are the config's: the file
cannot drop or replace them. A file that cannot be read keeps the adapters as they were, logged;
an entry whose folder is gone or wrong is left out, logged, and the others apply.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from tritonlm.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from tritonlm.engine.lora.registry import LoraRegistry
from tritonlm.engine.settings import MULTI_LORA_FILE, SettingsError, adapter_folder, adapter_pairs

log = logging.getLogger(__name__)

FileStamp = tuple[int, int, int]  # (inode, mtime ns, size): a rewrite by rename changes the inode


def _stamp(path: Path) -> FileStamp | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def folder_stamp(folder: Path) -> tuple[FileStamp | None, FileStamp | None]:
    """An adapter folder's two files as they are on disk now."""
    return _stamp(folder / CONFIG_FILE), _stamp(folder / WEIGHTS_FILE)


class MultiLoraFile:
    def __init__(self, registry: LoraRegistry, model_dir: Path, fixed: set[str] | frozenset[str] = frozenset()):
        """registry: the model's adapters as it loaded them (settings.lora_folders); fixed: the
        names its `lora_adapters` parameter gives."""
        self.registry = registry
        self.model_dir = Path(model_dir)
        self.path = self.model_dir / MULTI_LORA_FILE
        self.fixed = frozenset(fixed)
        self._seen: FileStamp | None | bool = False  # False: not read here yet (the first check reads it)
        self._stamps = {name: folder_stamp(folder) for name, folder in registry.folders.items()}
        self._lock = threading.Lock()  # one re-read at a time (requests come on several threads)

    def check(self) -> bool:
        """Bring the registry in step with the file if it changed since the last check;
        whether any adapter was added, removed or is to be reloaded."""
        if _stamp(self.path) == self._seen:
            return False
        with self._lock:
            stamp = _stamp(self.path)
            if stamp == self._seen:
                return False
            self._seen = stamp
            try:
                wanted = self._read() if stamp is not None else {}
            except SettingsError as e:
                log.error("%s changed but cannot be used (%s); the LoRA adapters stay as they were: %s",
                          MULTI_LORA_FILE, e, ", ".join(self.registry.names) or "none")
                return False
            return self._apply(wanted)

    def _read(self) -> dict[str, Path]:
        """The file's adapters, entry by entry: one whose folder is gone or wrong is left out,
        logged, and the others still apply (a whole file that cannot be parsed raises)."""
        try:
            content = self.path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SettingsError(f"{MULTI_LORA_FILE}: cannot be read ({e})") from None
        if not content.strip().startswith("{"):
            raise SettingsError(f"{MULTI_LORA_FILE}: expected a JSON object {{\"name\": \"folder\", ...}}")
        wanted: dict[str, Path] = {}
        for name, raw in adapter_pairs(content, MULTI_LORA_FILE):
            try:
                wanted[name] = adapter_folder(MULTI_LORA_FILE, name, raw, self.model_dir)
            except SettingsError as e:
                log.error("%s; adapter %r is not served until its entry is mended", e, name)
        return wanted

    def _apply(self, wanted: dict[str, Path]) -> bool:
        for name in sorted(self.fixed & set(wanted)):
            log.error("%s: adapter %r is also named in lora_adapters; the config's folder stays", MULTI_LORA_FILE, name)
            del wanted[name]
        current = self.registry.folders
        changed = False
        for name in sorted(set(current) - set(wanted) - self.fixed):
            self.registry.remove(name)
            self._stamps.pop(name, None)
            log.info("LoRA adapter %r: unloaded (%s)", name, MULTI_LORA_FILE)
            changed = True
        for name, folder in sorted(wanted.items()):
            stamp = folder_stamp(folder)
            if current.get(name) == folder and self._stamps.get(name) == stamp:
                continue
            self.registry.add(name, folder)  # a new name, or new content: loaded (again) at its next use
            self._stamps[name] = stamp
            log.info("LoRA adapter %r: %s %s (%s)", name, "reloaded from" if name in current else "added,", folder,
                     MULTI_LORA_FILE)
            changed = True
        return changed
