"""One frozen settings object per generation model, parsed from config.pbtxt
`parameters` (all strings) and validated once at load. A bad value refuses to
load with a message naming the field."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tritonlm.engine.precision import DTYPE_NAMES
from tritonlm.engine.runners.decode_graphs import CUDA_GRAPH_MODES

ATTENTION_BACKENDS = ("auto", "paged", "gather")


class SettingsError(ValueError):
    """A config.pbtxt parameter is wrong; the message names it and says what is allowed."""


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def parse_bytes(field: str, text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?b|b)?\s*", text.lower())
    if not m:
        raise SettingsError(f"{field}: {text!r} is not a size (examples: 67108864, 64MiB, 1.5GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def inside_repository(field: str, raw: str, model_dir: Path) -> Path:
    """A path parameter (hf_dir, onnx_model, draft_model) as the path to open: relative to the
    model folder and, with its '..' applied to the text, inside the model repository (the
    model folder's parent: an export points at sibling models, '../NAME_onnx/1/model.onnx',
    '../NAME_draft/1/hf'). A config, including one sent with a load request, cannot make the
    server read files elsewhere. Symlinks that are in the repository are followed: placing
    them takes write access to it (tritonlm perf's private repositories are made of them)."""
    if "\0" in raw:
        raise SettingsError(f"{field}: {raw!r} holds a NUL character; not a path")
    if Path(raw).is_absolute():
        raise SettingsError(
            f"{field}: {raw!r} is an absolute path; paths are relative to the model folder and stay inside "
            "the model repository (e.g. '1/hf', '../NAME_onnx/1/model.onnx')"
        )
    folder = Path(os.path.abspath(model_dir))
    repository = folder.parent
    path = Path(os.path.normpath(folder / raw))  # '..' applied to the text, not through symlinks
    if path == repository or not path.is_relative_to(repository):
        raise SettingsError(
            f"{field}: {raw!r} leaves the model repository {repository} (resolves to {path}); paths are "
            "relative to the model folder and may name only files inside the repository"
        )
    return path


@dataclass(frozen=True)
class EngineSettings:
    model_dir: Path  # the model's folder in the repository
    hf_dir: Path  # Hugging Face folder: config, weights, tokenizer
    runtime: str = "torch"  # "torch" | "onnx"
    onnx_model: Path | None = None
    device: str = "cpu"
    dtype: str = "float32"  # torch runtime: float32 | bfloat16 | float16 | int8 | int8_weight_only | auto (engine.precision)
    max_context: int | None = None  # None: the model's own maximum
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None  # of free device memory, when kv_cache_bytes is not set
    kv_block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_queue_size: int = 1024
    queue_timeout_s: float = 0.0  # 0: wait as long as it takes
    # latency SLOs (tritonlm/engine/slo/, docs/slo.md); 0: not set. Either one set turns on
    # the SLO controller, which sizes each step under max_num_batched_tokens / max_num_seqs
    slo_ttft_ms: float = 0.0
    slo_tpot_ms: float = 0.0
    # with an SLO set: a short synthetic workload at load fits the step-time model before the
    # first request (engine/slo_warmup.py)
    slo_warmup: bool = True
    # how often every live request is asked whether its client cancelled: each ask is a
    # round trip to tritonserver, and TensorRT-LLM's backend polls every 100 ms too
    cancellation_check_period_ms: int = 100
    # a stream's first token goes out at once, then a response every N tokens (and the last):
    # every response is a round trip to tritonserver and an event it writes (SGLang and vLLM
    # have the same knob); 1 = every token
    stream_interval: int = 1
    default_max_tokens: int = 16
    # request bounds, checked before tokenizing (tritonlm.protocol.RequestLimits)
    max_prompt_bytes: int = 0  # 0: 32 bytes per token of max_context
    max_words: int = 64  # stop_words / bad_words entries, each
    max_word_bytes: int = 256
    max_request_bytes: int = 0  # 0: the limits above added up + 64 KiB
    use_kv_cache: bool = True  # False only for benchmarks: recompute the whole sequence every step
    enable_prefix_caching: bool = True  # share the KV blocks of common prompt prefixes across requests
    # "full": every layer keeps every position's K/V; "window": sliding-window layers keep only a
    # ring of blocks over their window (engine/window_kv.py)
    sliding_window_kv: str = "full"
    num_threads: int = 0  # compute threads; 0 ("auto"): the cores this process gets (cpu_cores.py), adapted while serving
    cpu_share: int = 1  # processes that split the cores (the model's CPU instances); set by the Triton glue
    # torch runtime: how decode steps read the paged KV cache. "paged": tritonlm's C++
    # kernel reads it in place (CPU, float32; compiled for the host at first load);
    # "gather": copy each sequence's K/V, then torch's SDPA; "auto": paged where it can run
    attention_backend: str = "auto"
    # torch runtime on a GPU: decode steps replayed as CUDA graphs ("auto") or launched eagerly ("off")
    cuda_graphs: str = "auto"
    # torch runtime on a GPU: decode steps through torch.compile before capture (a slower load)
    compile_decode: bool = True
    # the next step scheduled and launched before this step's tokens reach the host (engine.py)
    schedule_ahead: bool = False
    # speculative decoding
    draft_model: Path | None = None
    speculative: str = "off"  # "off" | "draft" | "prompt_lookup"
    num_draft_tokens: int = 4  # maximum K
    # speculate only where this host's decode steps are measured faster with it (speculation_governor.py)
    adaptive_speculation: bool = True
    prompt_lookup_ngram: int = 3
    # model parallelism (tritonlm/engine/parallel): one model split over worker processes
    tensor_parallel_size: int = 1  # split heads / MLP columns over N ranks (Megatron style)
    pipeline_parallel_size: int = 1  # consecutive layer ranges on N stages
    pipeline_micro_batches: int = 0  # micro-batches per step with pipeline parallel; 0: one per stage
    parallel_timeout_s: float = 60.0  # a collective op (or a worker start) waiting longer fails
    # multi-LoRA (docs/lora.md): (name, PEFT adapter folder) pairs from `lora_adapters` and a
    # multi_lora.json beside the model; none: the model serves its base only
    lora_adapters: tuple[tuple[str, Path], ...] = ()
    max_lora_rank: int = 64
    max_cpu_loras: int = 8  # adapters loaded at once; more are loaded again at their next use
    max_loras: int = 0  # distinct adapters among the running sequences (one step); 0: no limit
    # the model takes adapters with none named at load (loaded at run time through multi_lora.json)
    enable_lora: bool = False

    @property
    def multi_lora_file(self) -> bool:
        """A multi_lora.json lies beside config.pbtxt, even one naming none ({}: every adapter
        unloaded at run time): the frontend may write adapters into it, so the model takes them."""
        return (self.model_dir / MULTI_LORA_FILE).is_file()

    @property
    def takes_lora(self) -> bool:
        """The model is built to run adapters: some are named, enable_lora, or a multi_lora.json."""
        return bool(self.lora_adapters) or self.enable_lora or self.multi_lora_file

    @property
    def lora_field(self) -> str:
        """The setting that makes the model take adapters, for error messages."""
        return "lora_adapters" if self.lora_adapters else "enable_lora" if self.enable_lora else MULTI_LORA_FILE

    @property
    def is_parallel(self) -> bool:
        """One model split over worker processes (tritonlm/engine/parallel)."""
        return self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1

    @staticmethod
    def from_params(params: dict[str, str], model_dir: Path) -> "EngineSettings":
        model_dir = Path(model_dir)
        known = {f.name for f in dataclasses.fields(EngineSettings)} - {"cpu_share"} | {"task"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise SettingsError(f"unknown parameter(s) {unknown}; known: {sorted(known - {'model_dir'})}")

        def get_int(name: str, default: int, minimum: int) -> int:
            raw = params.get(name, "")
            if raw == "":
                return default
            try:
                value = int(raw)
            except ValueError:
                raise SettingsError(f"{name}: {raw!r} is not an integer") from None
            if value < minimum:
                raise SettingsError(f"{name}: must be >= {minimum}, got {value}")
            return value

        def get_threads() -> int:
            raw = params.get("num_threads", "").strip().lower()
            if raw in ("", "auto"):
                return 0
            if not raw.isdigit():
                raise SettingsError(f"num_threads: {raw!r} is neither 'auto' nor a whole number of threads")
            return int(raw)

        def get_float(name: str, default: float | None) -> float | None:
            raw = params.get(name, "")
            if raw == "":
                return default
            try:
                return float(raw)
            except ValueError:
                raise SettingsError(f"{name}: {raw!r} is not a number") from None

        def get_bool(name: str, default: bool) -> bool:
            raw = params.get(name, "").strip().lower()
            if raw == "":
                return default
            if raw in ("1", "true", "yes", "on"):
                return True
            if raw in ("0", "false", "no", "off"):
                return False
            raise SettingsError(f"{name}: {raw!r} is not a boolean (true/false)")

        def get_path(name: str, default: str | None) -> Path | None:
            raw = params.get(name, "") or default
            if not raw:
                return None
            path = inside_repository(name, raw, model_dir)
            if not path.exists():
                raise SettingsError(f"{name}: {raw!r} does not exist (looked at {path}); re-export the model")
            return path

        runtime = params.get("runtime", "torch") or "torch"
        if runtime not in ("torch", "onnx"):
            raise SettingsError(f"runtime: {runtime!r} is not supported; use 'torch' or 'onnx'")
        device = params.get("device", "cpu") or "cpu"
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise SettingsError(f"device: {device!r}; use 'cpu', 'cuda' or 'cuda:N'")
        dtype = params.get("dtype", "float32") or "float32"
        if dtype not in DTYPE_NAMES:
            raise SettingsError(f"dtype: {dtype!r}; use one of {', '.join(DTYPE_NAMES)}")
        attention_backend = params.get("attention_backend", "auto") or "auto"
        if attention_backend not in ATTENTION_BACKENDS:
            raise SettingsError(f"attention_backend: {attention_backend!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
        cuda_graphs = params.get("cuda_graphs", "auto") or "auto"
        if cuda_graphs not in CUDA_GRAPH_MODES:
            raise SettingsError(f"cuda_graphs: {cuda_graphs!r}; use one of {', '.join(CUDA_GRAPH_MODES)}")
        speculative = params.get("speculative", "") or ("draft" if params.get("draft_model") else "off")
        if speculative not in ("off", "draft", "prompt_lookup"):
            raise SettingsError(f"speculative: {speculative!r}; use 'off', 'draft' or 'prompt_lookup'")
        kv_bytes = parse_bytes("kv_cache_bytes", params["kv_cache_bytes"]) if params.get("kv_cache_bytes") else None
        fraction = get_float("kv_cache_fraction", None)
        if fraction is not None and not 0 < fraction <= 1:
            raise SettingsError(f"kv_cache_fraction: must be in (0, 1], got {fraction}")
        max_context = get_int("max_context", 0, 0) or None
        s = EngineSettings(
            model_dir=model_dir,
            hf_dir=get_path("hf_dir", "1/hf"),
            runtime=runtime,
            onnx_model=get_path("onnx_model", None),
            device=device,
            dtype=dtype,
            max_context=max_context,
            kv_cache_bytes=kv_bytes,
            kv_cache_fraction=fraction,
            kv_block_size=get_int("kv_block_size", 16, 1),
            max_num_seqs=get_int("max_num_seqs", 64, 1),
            max_num_batched_tokens=get_int("max_num_batched_tokens", 512, 1),
            # every request passes through the queue on its way into the batch: 0 would refuse all
            max_queue_size=get_int("max_queue_size", 1024, 1),
            queue_timeout_s=get_float("queue_timeout_s", 0.0) or 0.0,
            slo_ttft_ms=get_float("slo_ttft_ms", 0.0) or 0.0,
            slo_tpot_ms=get_float("slo_tpot_ms", 0.0) or 0.0,
            slo_warmup=get_bool("slo_warmup", True),
            cancellation_check_period_ms=get_int("cancellation_check_period_ms", 100, 1),
            stream_interval=get_int("stream_interval", 1, 1),
            default_max_tokens=get_int("default_max_tokens", 16, 1),
            max_prompt_bytes=get_int("max_prompt_bytes", 0, 0),
            max_words=get_int("max_words", 64, 0),
            max_word_bytes=get_int("max_word_bytes", 256, 1),
            max_request_bytes=get_int("max_request_bytes", 0, 0),
            use_kv_cache=get_bool("use_kv_cache", True),
            enable_prefix_caching=get_bool("enable_prefix_caching", True),
            sliding_window_kv=params.get("sliding_window_kv", "full") or "full",
            num_threads=get_threads(),
            attention_backend=attention_backend,
            cuda_graphs=cuda_graphs,
            compile_decode=get_bool("compile_decode", True),
            schedule_ahead=get_bool("schedule_ahead", False),
            draft_model=get_path("draft_model", None),
            speculative=speculative,
            num_draft_tokens=get_int("num_draft_tokens", 4, 1),
            adaptive_speculation=get_bool("adaptive_speculation", True),
            prompt_lookup_ngram=get_int("prompt_lookup_ngram", 3, 1),
            tensor_parallel_size=get_int("tensor_parallel_size", 1, 1),
            pipeline_parallel_size=get_int("pipeline_parallel_size", 1, 1),
            pipeline_micro_batches=get_int("pipeline_micro_batches", 0, 0),
            parallel_timeout_s=get_float("parallel_timeout_s", 60.0),
            lora_adapters=lora_folders(params.get("lora_adapters", ""), model_dir),
            max_lora_rank=get_int("max_lora_rank", 64, 1),
            max_cpu_loras=get_int("max_cpu_loras", 8, 1),
            max_loras=get_int("max_loras", 0, 0),
            enable_lora=get_bool("enable_lora", False),
        )
        if s.parallel_timeout_s <= 0:
            raise SettingsError(f"parallel_timeout_s: must be > 0, got {s.parallel_timeout_s}")
        if s.tensor_parallel_size > 1 and s.pipeline_parallel_size > 1:
            raise SettingsError(
                "tensor_parallel_size / pipeline_parallel_size: combining both is not supported; set one of them to 1"
            )
        if (s.tensor_parallel_size > 1 or s.pipeline_parallel_size > 1) and s.runtime != "torch":
            field = "tensor_parallel_size" if s.tensor_parallel_size > 1 else "pipeline_parallel_size"
            raise SettingsError(f"{field}: model parallelism needs runtime 'torch', not {s.runtime!r}")
        if s.dtype != "float32" and (s.runtime != "torch" or s.tensor_parallel_size > 1 or s.pipeline_parallel_size > 1):
            raise SettingsError(
                f"dtype: {s.dtype} needs runtime 'torch' without model parallelism "
                "(an ONNX artifact has its own precision: export onnx-fp16 for half precision)"
            )
        if s.attention_backend == "paged" and (s.runtime != "torch" or s.is_parallel):
            raise SettingsError(
                "attention_backend: 'paged' (refuse to load without the kernel) is checked for the torch runtime "
                "without model parallelism; use 'auto' (model-parallel ranks use the kernel where it runs) or 'gather'"
            )
        if s.queue_timeout_s < 0:
            raise SettingsError(f"queue_timeout_s: must be >= 0 seconds (0: wait as long as it takes), got {s.queue_timeout_s}")
        for name in ("slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(s, name)
            if not value >= 0 or value == float("inf"):
                raise SettingsError(f"{name}: must be a finite number of milliseconds >= 0 (0: no SLO), got {value}")
        if s.runtime == "onnx" and s.onnx_model is None:
            raise SettingsError("onnx_model: required with runtime 'onnx' (path to the exported model.onnx)")
        if s.speculative == "draft" and s.draft_model is None:
            raise SettingsError("draft_model: required with speculative 'draft' (a draft model's Hugging Face folder)")
        check_sliding_window_kv(s)
        if s.takes_lora and (s.runtime != "torch" or s.is_parallel):
            raise SettingsError(
                f"{s.lora_field}: LoRA adapters run on the torch runtime without model parallelism; "
                f"this model has runtime {s.runtime!r}, tensor_parallel_size {s.tensor_parallel_size}, "
                f"pipeline_parallel_size {s.pipeline_parallel_size}"
            )
        if s.takes_lora and s.dtype == "int8":
            raise SettingsError(
                f"{s.lora_field}: LoRA adapters do not run on dtype 'int8' "
                "(it rotates and smooths the residual stream, so the adapters' weights are in another basis); "
                "use float32, bfloat16, auto or int8_weight_only"
            )
        return s


SLIDING_WINDOW_KV_MODES = ("full", "window")


def check_sliding_window_kv(s: EngineSettings) -> None:
    """`sliding_window_kv: window` keeps a ring of blocks per sequence in the windowed layers:
    SettingsError for what cannot share or replay a ring, naming both settings."""
    if s.sliding_window_kv not in SLIDING_WINDOW_KV_MODES:
        raise SettingsError(f"sliding_window_kv: {s.sliding_window_kv!r}; use one of {', '.join(SLIDING_WINDOW_KV_MODES)}")
    if s.sliding_window_kv != "window":
        return
    if s.enable_prefix_caching:
        raise SettingsError("sliding_window_kv: 'window' rewrites a sequence's ring of blocks, which prefix caching "
                            "cannot share between requests; set enable_prefix_caching to false, or sliding_window_kv to 'full'")
    if not s.use_kv_cache:
        raise SettingsError("sliding_window_kv: 'window' keeps the K/V of a window only, which use_kv_cache=false "
                            "(the whole history recomputed every step) would read; set sliding_window_kv to 'full'")
    if s.speculative == "draft":
        raise SettingsError("sliding_window_kv: 'window' is not served with a draft_model (speculative 'draft': "
                            "the draft's cache follows the target's full block tables); use speculative "
                            "'prompt_lookup' or 'off', or sliding_window_kv 'full'")
    if s.runtime != "torch" or s.is_parallel:
        raise SettingsError(f"sliding_window_kv: 'window' runs on the torch runtime without model parallelism; "
                            f"this model has runtime {s.runtime!r}, tensor_parallel_size {s.tensor_parallel_size}, "
                            f"pipeline_parallel_size {s.pipeline_parallel_size}")


MULTI_LORA_FILE = "multi_lora.json"  # beside config.pbtxt, as vLLM's Triton backend reads it
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")


def adapter_pairs(text: str, field: str = "lora_adapters") -> list[tuple[str, str]]:
    """`name=folder,name=folder` (vLLM's --lora-modules form) or a JSON object {name: folder}
    -> [(name, folder)], names checked, no paths touched (the OpenAI frontend reads the names
    from the config parameter this way)."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise SettingsError(f"{field}: not valid JSON ({e}); write {{\"name\": \"folder\", ...}}") from None
        if not all(isinstance(v, str) for v in obj.values()):
            raise SettingsError(f"{field}: every adapter's folder must be a string (a path relative to the model folder)")
        pairs = list(obj.items())
    else:
        pairs = []
        for item in text.split(","):
            name, sep, folder = item.partition("=")
            if not sep or not folder.strip():
                raise SettingsError(f"{field}: {item.strip()!r} is not name=folder; write e.g. 'sql=adapters/sql,chat=adapters/chat'")
            pairs.append((name.strip(), folder.strip()))
    seen: set[str] = set()
    for name, _ in pairs:
        if not _ADAPTER_NAME.fullmatch(name):
            raise SettingsError(f"{field}: adapter name {name!r}: use letters, digits and . _ : / - (starting with a letter or digit)")
        if name in seen:
            raise SettingsError(f"{field}: adapter {name!r} is named twice")
        seen.add(name)
    return pairs


def lora_folders(text: str, model_dir: Path) -> tuple[tuple[str, Path], ...]:
    """The model's adapters: `lora_adapters`, then the multi_lora.json beside config.pbtxt (a
    name in both is refused); each folder relative to the model folder, inside the repository."""
    sources = [("lora_adapters", adapter_pairs(text))]
    json_file = Path(model_dir) / MULTI_LORA_FILE
    if json_file.is_file():
        try:
            content = json_file.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise SettingsError(f"{MULTI_LORA_FILE}: cannot be read ({e})") from None
        if not content.strip().startswith("{"):
            raise SettingsError(f"{MULTI_LORA_FILE}: expected a JSON object {{\"name\": \"folder\", ...}}")
        sources.append((MULTI_LORA_FILE, adapter_pairs(content, MULTI_LORA_FILE)))
    out: dict[str, Path] = {}
    for field, pairs in sources:
        for name, raw in pairs:
            if name in out:
                raise SettingsError(f"{field}: adapter {name!r} is also named in lora_adapters; name it once")
            out[name] = adapter_folder(field, name, raw, model_dir)
    return tuple(out.items())


def adapter_folder(field: str, name: str, raw: str, model_dir: Path) -> Path:
    """One adapter's folder, `raw` relative to the model folder: inside the repository and
    holding an adapter_config.json, else a SettingsError naming `field` and the adapter."""
    path = inside_repository(f"{field}: adapter {name!r}", raw, model_dir)
    if not (path / "adapter_config.json").is_file():
        raise SettingsError(
            f"{field}: adapter {name!r}: {raw!r} holds no adapter_config.json (looked at {path}); "
            "give a folder as PEFT's save_pretrained writes it"
        )
    return path


# ---- the parameters' documentation ---------------------------------------------------------
# One row per config.pbtxt parameter, next to the parser above: docs/configuration.md holds
# markdown_table()'s output, and tests/unit/test_docs.py fails when the page differs from it,
# when the parser reads a parameter that has no row here, or when a documented default is not
# what the parser gives a config without that parameter.


@dataclass(frozen=True)
class ParameterDoc:
    """One config.pbtxt parameter.

    name     the key in `parameters { key: ... }`
    default  the value a config without it gets, written as config.pbtxt would write it;
             None: no value (`absent` says what happens then)
    meaning  one line for the table
    absent   with default None: what a config without it gets
    """

    name: str
    default: str | None
    meaning: str
    absent: str = "-"


_P = ParameterDoc

# the generation model (task "generate"): EngineSettings.from_params
GENERATE_PARAMETERS: tuple[ParameterDoc, ...] = (
    _P("task", None, "`generate`: the tritonlm backend runs this model as a generation model (required)", "required"),
    _P("runtime", "torch",
       "`torch`: tritonlm's own PyTorch forward pass over the paged KV cache; `onnx`: the exported decoder "
       "(`onnx_model`) through ONNX Runtime"),
    _P("hf_dir", "1/hf",
       "the Hugging Face folder (config, weights, tokenizer), relative to the model folder; must stay inside"
       " the model repository"),
    _P("onnx_model", None,
       "the exported `model.onnx`, relative to the model folder (exports write `../NAME_onnx/1/model.onnx`);"
       " required with `runtime: onnx`"),
    _P("device", "cpu",
       "`cpu`, `cuda` or `cuda:N`; with `cuda` and an instance group of kind GPU, each instance runs on its "
       "own GPU"),
    _P("dtype", "float32",
       "torch runtime precision, resolved at load and logged. `bfloat16` / `float16`: compute and KV in half"
       " precision (half the KV bytes per token); `int8`: CPU only, weights int8 per output channel "
       "(SmoothQuant-smoothed), activations quantized per token, compute and KV float32; `int8_weight_only`:"
       " CPU only, weights (LM head included) int8 with a scale and an offset per 32 inputs, activations and KV"
       " float32 (rounded to 16-bit codes inside tritonlm's C++ kernel, 2^-16 of a block's "
       "largest value); closer to float32 than `int8`, prefill at "
       "float32's speed ([configuration.md](configuration.md#precision)); `auto`: bfloat16 "
       "where the device multiplies it natively (a GPU of compute capability 8.0+, a CPU with AVX512-BF16 or"
       " AMX), else float32. Anything but float32 needs `runtime: torch` without model parallelism and may "
       "change greedy text at near ties"),
    _P("max_context", None,
       "longest prompt + output in tokens; at most the model's positions", "the model's positions"),
    _P("kv_cache_bytes", None,
       "KV cache budget in bytes (`64MiB`, `1.5GiB` work); must hold one full-context sequence; wins over "
       "`kv_cache_fraction`", "8 full-context sequences"),
    _P("kv_cache_fraction", None, "KV cache budget as a fraction of the device's free memory at load, in (0, 1]"),
    _P("kv_block_size", "16", "tokens per KV cache page"),
    _P("max_num_seqs", "64", "most sequences in one forward pass"),
    _P("max_num_batched_tokens", "512", "most new tokens in one forward pass (prefill is chunked to fit)"),
    _P("max_queue_size", "1024", "requests that may wait; one more is refused as \"server busy\""),
    _P("queue_timeout_s", "0", "seconds a request may wait in the queue (or for its LoRA adapter to load) before it fails; 0: no limit"),
    _P("slo_ttft_ms", "0",
       "time-to-first-token SLO in ms; set, a request predicted to miss it is refused at arrival (503 with "
       "Retry-After at the OpenAI API: [slo.md](slo.md)); 0: none"),
    _P("slo_tpot_ms", "0",
       "time-per-output-token SLO in ms; set, each step's token budget and the running sequences are sized "
       "to keep it, under `max_num_batched_tokens` / `max_num_seqs` ([slo.md](slo.md)); 0: none"),
    _P("slo_warmup", "true",
       "with an SLO set, a short synthetic workload (a few dozen steps) runs at load, before the model is ready, so "
       "that the SLO controller judges the first requests by a fitted step-time model "
       "([slo.md](slo.md#warm-up-at-load)); `false`: it learns from the first requests"),
    _P("cancellation_check_period_ms", "100",
       "how often each live request is asked whether its client cancelled or left; each ask is a round trip "
       "to tritonserver"),
    _P("stream_interval", "1",
       "a stream's first token goes out at once, then one response every N tokens (and the final one); N > 1"
       " trades smoothness for throughput at many streams"),
    _P("default_max_tokens", "16", "new tokens for a request without `max_tokens`"),
    _P("max_prompt_bytes", "0", "most UTF-8 bytes in `text_input`; 0: 32 x `max_context`"),
    _P("max_words", "64", "most entries in `stop_words`, and in `bad_words`"),
    _P("max_word_bytes", "256", "most bytes in one stop or bad word"),
    _P("max_request_bytes", "0", "most bytes of all inputs together; 0: the limits above added up + 64 KiB"),
    _P("use_kv_cache", "true", "`false` recomputes the whole sequence every step (a benchmark baseline only)"),
    _P("enable_prefix_caching", "true",
       "share the KV blocks of common prompt prefixes (a system prompt, earlier turns of a chat) across "
       "requests; off with a `draft_model`"),
    _P("sliding_window_kv", "full",
       "`window`: a sliding-window layer keeps only a ring of blocks over its window (plus one step's tokens) "
       "per sequence instead of every position's K/V, so a Gemma-3-shaped model holds a long sequence in a "
       "fraction of the bytes ([models.md](models.md#sliding-window-kv-memory)); needs `enable_prefix_caching` "
       "false, the torch runtime without model parallelism and no `draft_model`; a model without a "
       "sliding-window layer ignores it (logged). `full`: every layer keeps every position"),
    _P("num_threads", "auto",
       "compute threads (torch intra-op, the C++ kernels, ONNX Runtime). `auto` (or 0): one per core this "
       "process may use (the affinity mask and the cgroup CPU quota, split over the model's CPU instances and "
       "model-parallel ranks), lowered while other processes take our cores and raised when they leave "
       "([serving.md](serving.md#cpu-threads)); a number: exactly that many, never changed"),
    _P("attention_backend", "auto",
       "torch runtime, how decode steps read the KV cache. `paged`: tritonlm's C++ kernels read K/V in place"
       " (CPU with float32 compute: `dtype` float32, int8 or int8_weight_only; prebuilt per x86-64 ISA level by "
       "`make setup`, the best the CPU runs loaded); `gather`: copy each sequence's K/V, then torch's SDPA; `auto`: `paged` where it runs, "
       "else `gather` (logged)"),
    _P("cuda_graphs", "auto",
       "torch runtime on a GPU: `auto` replays each decode step as a CUDA graph (one per batch-size bucket "
       "1, 2, 4, ... up to `max_num_seqs`, captured at first use) where the Triton paged decode kernel runs; "
       "`off` launches the same padded step eagerly. No effect on the CPU"),
    _P("compile_decode", "true",
       "torch runtime on a GPU, with the Triton decode kernel: each decode step goes through "
       "`torch.compile` (inductor fuses the norms, RoPE, residual adds and SwiGLU) before it is captured. "
       "Compiling and capturing every bucket happens at load (it can take minutes); where "
       "compiling fails the model loads uncompiled (logged). `false`: no compilation. No effect on the CPU"),
    _P("schedule_ahead", "false",
       "`true`: while a step's forward pass runs on a GPU, its tokens are chosen there and the next step is "
       "scheduled and launched before the host reads them; the host appends them, ends the requests an end token "
       "or `max_tokens` ends and makes their text while that step runs. Each request's outputs are the plain "
       "loop's. Stays off with speculative decoding, without a KV cache, with a length-dependent RoPE, and on a "
       "runtime that cannot take tokens on its device (ONNX); on the CPU it only delays each token by a step "
       "([architecture.md](architecture.md#the-kv-cache-and-the-copy-arithmetic))"),
    _P("draft_model", None,
       "speculative decoding: the draft model's Hugging Face folder, relative to the model folder (exports "
       "write `../NAME_draft/1/hf`); must share the tokenizer"),
    _P("speculative", None,
       "`off`, `draft` (a draft model guesses) or `prompt_lookup` (guesses copied from the prompt and "
       "output)", "`draft` with a `draft_model`, else `off`"),
    _P("num_draft_tokens", "4",
       "speculative decoding: most tokens guessed per step (a request's `num_draft_tokens` may ask fewer)"),
    _P("adaptive_speculation", "true",
       "speculative decoding: decode steps are timed with and without it (seconds per token made, per batch "
       "size) and greedy and unseeded sampled rows speculate only while that is faster on this host; seeded "
       "sampled rows always speculate (their tokens depend on it). `false`: every row speculates as configured "
       "([architecture.md](architecture.md#the-kv-cache-and-the-copy-arithmetic))"),
    _P("prompt_lookup_ngram", "3", "prompt lookup: the longest n-gram matched against earlier text"),
    _P("tensor_parallel_size", "1",
       "N > 1: split every layer's heads and MLP columns over N processes; must divide the attention and "
       "key/value heads"),
    _P("pipeline_parallel_size", "1",
       "N > 1: consecutive layer ranges on N processes; at most the number of layers; not together with "
       "`tensor_parallel_size`"),
    _P("pipeline_micro_batches", "0", "pipeline parallel: micro-batches per step; 0: one per stage"),
    _P("parallel_timeout_s", "60",
       "model parallelism: seconds one collective op (or a worker's start) may take before the model goes "
       "out of service"),
    _P("lora_adapters", None,
       "LoRA adapters served on this model ([lora.md](lora.md)): `name=folder,name=folder` or a JSON object "
       "`{\"name\": \"folder\"}`, each a PEFT adapter folder relative to the model folder, inside the model "
       "repository; a `multi_lora.json` (`{\"name\": \"folder\"}`) beside `config.pbtxt` adds more. A request "
       "picks one by `lora_name` (Triton) or `model` (OpenAI). Torch runtime without model parallelism",
       "none: the base model only"),
    _P("max_lora_rank", "64", "the highest LoRA rank an adapter may have; a higher one is refused at its first use"),
    _P("max_cpu_loras", "8",
       "LoRA adapters kept loaded; past it, the least recently used is dropped and loaded again at its next use"),
    _P("max_loras", "0",
       "distinct LoRA adapters among the running sequences, so in one step (vLLM's `--max-loras`); a request "
       "under another adapter waits in the queue until one leaves, never refused; 0: no limit"),
    _P("enable_lora", "false",
       "the model takes LoRA adapters even with none named at load, so that adapters loaded at run time "
       "(the OpenAI frontend's `/v1/load_lora_adapter`, a rewritten `multi_lora.json`) can run on it; "
       "naming any adapter turns it on. Torch runtime without model parallelism"),
)

# the forward-pass models run inside the tritonlm backend (task "forward", `tritonlm export
# --runtime python`): read by tritonlm/glue/forward.py, documented here where tests can import it
FORWARD_PARAMETERS: tuple[ParameterDoc, ...] = (
    _P("task", None,
       "`forward`: one forward pass per request, batched by Triton's dynamic batcher (required)", "required"),
    _P("format", "onnx", "`onnx` (ONNX Runtime) or `torchscript`"),
    _P("artifact", None, "the file in the version folder", "`model.onnx` / `model.pt`"),
    _P("device", "cpu", "`cpu`, `cuda` or `cuda:N`"),
    _P("threads", "0", "intra-op threads; 0: one per core this process may use (affinity mask, cgroup CPU quota), "
       "split over the model's instances"),
    _P("spin", None, "`true`: ONNX Runtime's idle threads busy-wait (lower latency, burns CPU)", "off"),
    _P("max_positions", None,
       "the model's context length: requests with positions beyond it are refused (exports write it)", "no "
       "check"),
)

PARAMETER_TABLES = {"generate": GENERATE_PARAMETERS, "forward": FORWARD_PARAMETERS}


def markdown_table(kind: str = "generate") -> str:
    """The docs/configuration.md table of one model kind's config.pbtxt parameters."""
    if kind not in PARAMETER_TABLES:
        raise ValueError(f"kind {kind!r}: use one of {sorted(PARAMETER_TABLES)}")
    lines = ["| parameter | default | meaning |", "|---|---|---|"]
    for p in PARAMETER_TABLES[kind]:
        default = p.absent if p.default is None else f"`{p.default}`"
        lines.append(f"| `{p.name}` | {default} | {p.meaning} |")
    return "\n".join(lines) + "\n"
