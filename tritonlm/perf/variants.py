"""Config variants of a model folder: the one place that edits a config.pbtxt for perf runs.

A variant is a new model folder beside the original whose config.pbtxt is the
original's ModelConfig (parsed with Triton's own protobuf schema) with a few
fields changed, and whose version folders hold symlinks to the original
artifacts, so no weights are copied. `perf batching` loads two variants side by
side (dynamic batching on / off); `perf tune` makes one variant folder and
reloads it with config overrides through Triton's model-control API.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

ModelConfig = model_config_pb2.ModelConfig

# Written into every variant folder, so cleanup never deletes a folder it did not make.
MARKER = ".tritonlm-variant"


class VariantError(ValueError):
    """The requested change does not fit the model (e.g. batching a model without a batch dimension)."""


@dataclass(frozen=True)
class VariantSpec:
    """Fields to change; None leaves the original's value.

    dynamic_batching: True adds (or keeps) a dynamic_batching block, False removes it.
    max_queue_delay_us: implies dynamic_batching=True.
    instance_count: applied to every instance_group (one group of that count if none).
    """

    dynamic_batching: bool | None = None
    max_batch_size: int | None = None
    max_queue_delay_us: int | None = None
    instance_count: int | None = None

    def label(self) -> str:
        parts = []
        if self.dynamic_batching is False:
            parts.append("nobatch")
        elif self.dynamic_batching or self.max_queue_delay_us is not None:
            parts.append("dyn")
        if self.max_batch_size is not None:
            parts.append(f"mbs{self.max_batch_size}")
        if self.max_queue_delay_us is not None:
            parts.append(f"q{self.max_queue_delay_us}")
        if self.instance_count is not None:
            parts.append(f"i{self.instance_count}")
        return "_".join(parts) or "same"


def read_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.pbtxt"
    if not path.is_file():
        raise VariantError(f"{path} does not exist: --repo must be the model repository the server serves")
    try:
        return text_format.Parse(path.read_text(), ModelConfig())
    except text_format.ParseError as e:
        raise VariantError(f"{path}: not a valid Triton model config ({e})") from None


def config_to_text(config: ModelConfig) -> str:
    return text_format.MessageToString(config)


def config_to_json(config: ModelConfig) -> str:
    """The JSON form Triton's load API takes as a `config` override."""
    return json_format.MessageToJson(config, preserving_proto_field_name=True)


def apply_variant(config: ModelConfig, spec: VariantSpec, name: str | None = None) -> ModelConfig:
    """A changed copy of config (the argument is left as it was)."""
    out = ModelConfig()
    out.CopyFrom(config)
    if name is not None:
        out.name = name
    if spec.max_batch_size is not None:
        if spec.max_batch_size < 0:
            raise VariantError(f"max_batch_size must be >= 0, not {spec.max_batch_size}")
        if (config.max_batch_size == 0) != (spec.max_batch_size == 0):
            # 0 means "no batch dimension": switching changes every tensor's shape.
            raise VariantError(
                f"model '{config.name}' has max_batch_size {config.max_batch_size}; a variant can change its size "
                "but cannot add or remove the batch dimension"
            )
        out.max_batch_size = spec.max_batch_size
    batching = spec.dynamic_batching
    if spec.max_queue_delay_us is not None:
        if batching is False:
            raise VariantError("max_queue_delay_us needs dynamic batching on")
        batching = True
    if batching is False:
        out.ClearField("dynamic_batching")
    elif batching:
        if out.max_batch_size == 0:
            raise VariantError(
                f"model '{config.name}' has max_batch_size 0 (no batch dimension): dynamic batching cannot be turned on"
            )
        out.dynamic_batching.SetInParent()
        if spec.max_queue_delay_us is not None:
            if spec.max_queue_delay_us < 0:
                raise VariantError(f"max_queue_delay_us must be >= 0, not {spec.max_queue_delay_us}")
            out.dynamic_batching.max_queue_delay_microseconds = spec.max_queue_delay_us
    if out.HasField("dynamic_batching"):
        # preferred sizes above the new max would make the config invalid
        kept = [s for s in out.dynamic_batching.preferred_batch_size if s <= out.max_batch_size]
        del out.dynamic_batching.preferred_batch_size[:]
        out.dynamic_batching.preferred_batch_size.extend(kept)
    if spec.instance_count is not None:
        if spec.instance_count < 1:
            raise VariantError(f"instance count must be >= 1, not {spec.instance_count}")
        if not out.instance_group:
            group = out.instance_group.add()
            group.kind = model_config_pb2.ModelInstanceGroup.KIND_CPU
        for group in out.instance_group:
            group.count = spec.instance_count
    return out


def _link(target: Path, link: Path) -> None:
    """A relative symlink where possible, so a copied repository keeps working."""
    try:
        rel = os.path.relpath(target.resolve(), link.parent.resolve())
    except ValueError:  # other drive (Windows)
        rel = str(target.resolve())
    link.symlink_to(rel, target_is_directory=target.is_dir())


def make_variant(model_dir: Path, repo: Path, name: str, spec: VariantSpec) -> Path:
    """Write repo/name: the changed config.pbtxt, version folders of symlinks to the original
    artifacts, and symlinks to any other file of the original folder (side files, tokenizers).
    Replaces an earlier variant of the same name; refuses to overwrite a real model."""
    model_dir = Path(model_dir)
    config = read_config(model_dir)
    changed = apply_variant(config, spec, name=name)
    dst = Path(repo) / name
    if dst.resolve() == model_dir.resolve():
        raise VariantError(f"variant name '{name}' is the original model's name")
    remove_variant(dst)
    if dst.exists():
        raise VariantError(f"{dst} exists and is not a variant made by tritonlm perf; choose another name")
    dst.mkdir(parents=True)
    (dst / MARKER).write_text(f"variant of {config.name}: {spec.label()}\n")
    header = f"# Variant of '{config.name}' made by `tritonlm perf` ({spec.label()}); artifacts are symlinks.\n"
    (dst / "config.pbtxt").write_text(header + config_to_text(changed))
    for entry in sorted(model_dir.iterdir()):
        if entry.name in ("config.pbtxt", MARKER):
            continue
        if entry.is_dir() and entry.name.isdigit():
            version = dst / entry.name
            version.mkdir()
            for item in sorted(entry.iterdir()):
                _link(item, version / item.name)
        else:
            _link(entry, dst / entry.name)
    return dst


def remove_variant(path: Path) -> bool:
    """Delete a folder only if make_variant made it (it holds the marker file)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink() and (path / MARKER).is_file():
        shutil.rmtree(path)
        return True
    return False
