"""config.pbtxt writers for the exported models, each validated against Triton's schema.

Two kinds of entries:
    forward models   NAME_onnx, NAME_onnx_int8, NAME_onnx_fp16, NAME_torchscript: one forward
                     pass (logits + KV cache) per request, batched by Triton's dynamic batcher;
                     `native` runs them on Triton's onnxruntime / pytorch backends (NVIDIA's
                     containers), `python` on the `tritonlm` backend (task=forward).
    generation       NAME: decoupled, task=generate, text in / streamed text out.

Every writer validates its text with `google.protobuf.text_format.Parse` into
`tritonclient.grpc.model_config_pb2.ModelConfig` before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tritonlm.engine.memory import DEFAULT_FULL_SEQUENCES, default_kv_budget
from tritonlm.engine.model_shape import ModelShape
from tritonlm.export.wrapper import input_names, output_names
from tritonlm.protocol import INPUTS, OUTPUTS


class ConfigError(ValueError):
    """A generated config.pbtxt does not parse as Triton's ModelConfig."""


# format -> (model name suffix, artifact file name)
FORMATS: dict[str, tuple[str, str]] = {
    "onnx": ("_onnx", "model.onnx"),
    "onnx-int8": ("_onnx_int8", "model.onnx"),
    "onnx-fp16": ("_onnx_fp16", "model.onnx"),
    "torchscript": ("_torchscript", "model.pt"),
}

# What Triton calls the native backends (platform names per Triton's model configuration docs).
NATIVE = {
    "onnx": ("onnxruntime_onnx", "onnxruntime"),
    "torchscript": ("pytorch_libtorch", "pytorch"),
}


def artifact_kind(fmt: str) -> str:
    return "torchscript" if fmt == "torchscript" else "onnx"


def forward_model_name(name: str, fmt: str) -> str:
    return name + FORMATS[fmt][0]


def parse_config(text: str):
    """ModelConfig from config.pbtxt text; ConfigError with the parser's words otherwise."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ConfigError(f"generated config.pbtxt does not parse as Triton's ModelConfig: {e}") from None


def write_config(model_dir: Path, text: str) -> Path:
    """Validate, then write model_dir/config.pbtxt (the folder name must be the model name)."""
    cfg = parse_config(text)
    if cfg.name and cfg.name != model_dir.name:
        raise ConfigError(f"config name {cfg.name!r} differs from its folder {model_dir.name!r}")
    model_dir.mkdir(parents=True, exist_ok=True)
    path = model_dir / "config.pbtxt"
    path.write_text(text)
    return path


def _q(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _params(params: dict[str, str]) -> str:
    return "".join(
        f"parameters {{ key: {_q(k)} value: {{ string_value: {_q(str(v))} }} }}\n" for k, v in params.items()
    )


def _tensor(name: str, dtype: str, dims: list[int], optional: bool = False, ragged: bool = False) -> str:
    opt = " optional: true" if optional else ""
    opt += " allow_ragged_batch: true" if ragged else ""
    return f"  {{ name: {_q(name)} data_type: {dtype} dims: [ {', '.join(str(d) for d in dims)} ]{opt} }}"


def _instance(device: str, count: int) -> str:
    kind = "KIND_GPU" if device.startswith("cuda") else "KIND_CPU"
    extra = ""
    if kind == "KIND_GPU" and ":" in device:
        extra = f" gpus: [ {int(device.split(':', 1)[1])} ]"
    return f"instance_group [ {{ count: {count} kind: {kind}{extra} }} ]\n"


@dataclass(frozen=True)
class BatchingOptions:
    max_batch_size: int = 16
    max_queue_delay_us: int = 5000
    instances: int = 1
    device: str = "cpu"

    @property
    def preferred(self) -> list[int]:
        sizes = [s for s in (4, 8, 16, 32, 64) if s <= self.max_batch_size]
        return sizes or [self.max_batch_size]


def forward_config(name: str, fmt: str, spec: ModelShape, runtime: str, batching: BatchingOptions,
                   artifact: str | None = None) -> str:
    """config.pbtxt text of a forward-pass model. Dims exclude the batch dimension
    (max_batch_size > 0): the dynamic batcher stacks requests along it."""
    kind = artifact_kind(fmt)
    artifact = artifact or FORMATS[fmt][1]
    n = spec.num_layers
    kv_dims = [spec.num_kv_heads, -1, spec.head_dim]
    ins = input_names(n)
    outs = output_names(n)
    in_dims = {"input_ids": [-1], "attention_mask": [-1], "position_ids": [-1]}
    in_types = {"input_ids": "TYPE_INT64", "attention_mask": "TYPE_INT64", "position_ids": "TYPE_INT64"}
    if runtime == "native" and kind == "torchscript":
        # libtorch has no tensor names: Triton's convention is <name>__<position>
        ins_cfg = [f"{x}__{i}" for i, x in enumerate(ins)]
        outs_cfg = [f"{x}__{i}" for i, x in enumerate(outs)]
    else:
        ins_cfg, outs_cfg = ins, outs
    # python runtime: the handler pads requests of different lengths into one pass itself,
    # so Triton's dynamic batcher may put requests of any shape into one batch.
    ragged = runtime == "python"
    inputs = [_tensor(c, in_types.get(x, "TYPE_FP32"), in_dims.get(x, kv_dims), ragged=ragged)
              for c, x in zip(ins_cfg, ins)]
    outputs = [
        _tensor(c, "TYPE_FP32", [-1, spec.vocab_size] if x == "logits" else kv_dims) for c, x in zip(outs_cfg, outs)
    ]
    head = [f"# Forward pass of {name.removesuffix(FORMATS[fmt][0])} ({fmt}), written by `tritonlm export`.",
            "# One request = one decoder call: logits plus the updated KV cache (see tritonlm/export/wrapper.py)."]
    if runtime == "native":
        platform, backend = NATIVE[kind]
        engine = f'platform: {_q(platform)}\nbackend: {_q(backend)}\ndefault_model_filename: {_q(artifact)}\n'
    else:
        engine = f'backend: "tritonlm"\n'
    text = "\n".join(head) + "\n"
    text += f"name: {_q(name)}\n{engine}"
    text += f"max_batch_size: {batching.max_batch_size}\n"
    text += (
        "dynamic_batching {\n"
        f"  preferred_batch_size: [ {', '.join(str(s) for s in batching.preferred)} ]\n"
        f"  max_queue_delay_microseconds: {batching.max_queue_delay_us}\n"
        "}\n"
    )
    text += "input [\n" + ",\n".join(inputs) + "\n]\n"
    text += "output [\n" + ",\n".join(outputs) + "\n]\n"
    text += _instance(batching.device, batching.instances)
    if runtime == "native" and kind == "torchscript":
        # libtorch's profiling executor re-optimizes for each new shape; a decoder's shapes change every call
        text += _params({"DISABLE_OPTIMIZED_EXECUTION": "true"})
    if runtime == "python":
        text += _params({
            "task": "forward", "format": kind, "artifact": artifact, "device": batching.device,
            "max_positions": str(spec.max_positions),
        })
    return text


# ---- the generation entry ---------------------------------------------------------------


def generate_config_text(
    name: str,
    *,
    max_context: int,
    hf_dir: str = "1/hf",
    runtime: str = "torch",
    onnx_model: str | None = None,
    kv_cache_bytes: int | None = None,
    kv_cache_fraction: float | None = None,
    draft_model: str | None = None,
    device: str = "cpu",
    instances: int = 1,
    extra_parameters: dict[str, str] | None = None,
) -> str:
    """config.pbtxt text of the decoupled generation model (backend tritonlm, task=generate).

    Parameters written (names the engine's EngineSettings reads): task, hf_dir, runtime,
    onnx_model (with runtime onnx or when an ONNX export exists), device, max_context,
    kv_cache_bytes or kv_cache_fraction, draft_model. Paths are relative to the model folder."""
    if runtime not in ("torch", "onnx"):
        raise ValueError(f"runtime {runtime!r}: use 'torch' or 'onnx'")
    if runtime == "onnx" and not onnx_model:
        raise ValueError("runtime 'onnx' needs onnx_model (e.g. '../NAME_onnx/1/model.onnx')")
    if kv_cache_bytes is not None and kv_cache_fraction is not None:
        raise ValueError("give kv_cache_bytes or kv_cache_fraction, not both")
    params: dict[str, str] = {"task": "generate", "hf_dir": hf_dir, "runtime": runtime}
    if onnx_model:
        params["onnx_model"] = onnx_model
    params["device"] = device
    params["max_context"] = str(int(max_context))
    if kv_cache_fraction is not None:
        params["kv_cache_fraction"] = repr(float(kv_cache_fraction))
    elif kv_cache_bytes is not None:
        params["kv_cache_bytes"] = str(int(kv_cache_bytes))
    if draft_model:
        params["draft_model"] = draft_model
    params.update(extra_parameters or {})
    text = (
        f"# Text generation with {name}, written by `tritonlm export`. Streams over gRPC (decoupled).\n"
        f"name: {_q(name)}\n"
        'backend: "tritonlm"\n'
        "max_batch_size: 0\n"
        "model_transaction_policy { decoupled: true }\n"
    )
    # inputs and outputs: the contract in tritonlm/protocol.py (outputs have no `optional`)
    text += "input [\n" + ",\n".join(_tensor(t.name, t.config_type, list(t.dims), t.optional) for t in INPUTS) + "\n]\n"
    text += "output [\n" + ",\n".join(_tensor(t.name, t.config_type, list(t.dims)) for t in OUTPUTS) + "\n]\n"
    text += _instance(device, instances)
    text += _params(params)
    return text


def default_kv_cache_bytes(spec: ModelShape, max_context: int, sequences: int = DEFAULT_FULL_SEQUENCES, block: int = 16) -> int:
    """Room for `sequences` full-context sequences (the engine's default budget, see
    tritonlm/engine/memory.py)."""
    return default_kv_budget(spec.bytes_per_token, max_context, block, sequences)


def write_generate_config(model_dir: Path, name: str | None = None, **kwargs) -> Path:
    """Validate and write MODEL_DIR/config.pbtxt for the generation entry; kwargs as for
    generate_config_text (max_context is required). Returns the path written."""
    model_dir = Path(model_dir)
    return write_config(model_dir, generate_config_text(name or model_dir.name, **kwargs))


def write_generation_model(repo: Path, name: str, model, tokenizer, max_context: int | None = None,
                           **parameters) -> Path:
    """repo/name/{config.pbtxt, 1/hf/} for a loaded model and tokenizer (tests, benchmarks,
    demos); parameters go to config.pbtxt as strings. max_context defaults to the model's."""
    hf = Path(repo) / name / "1" / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    if max_context is None:
        max_context = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    write_generate_config(Path(repo) / name, name, max_context=max_context,
                          extra_parameters={k: str(v) for k, v in parameters.items()})
    return Path(repo) / name
