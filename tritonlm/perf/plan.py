"""`tritonlm plan`: KV cache capacity planning, as pure arithmetic.

- bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
  (tritonlm.engine.model_shape.ModelShape.bytes_per_token, from a Hugging Face config.json
  or a built-in table of shapes)
- free memory     = device memory - weights (parameters x bytes) - an optional reserve
- concurrent sequences at a context length = floor(free / (bytes per token x length))
- max_sequence_length recommended from a traffic log: the P99 (nearest rank) of
  prompt + output tokens, rounded up, capped at the model's context.

Sizes: "GB" is 10^9 bytes, "GiB" 2^30. Device presets use the marketed decimal
size (an "80 GB" A100 counts as 80e9 bytes), about 7% under the physical 80 GiB,
which leaves room for the CUDA context and activations a real server also needs.
Worked example (LLaMA-7B, fp16, A100 80 GB): 512 KiB per token; a 512-token chat
holds 256 MiB; 80 GB - 13.5 GB of weights leaves 66.5 GB, room for 247 such
chats; a 16K-token context holds 8 GiB, so 7 fit at once.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from tritonlm.perf.jsonl import read_jsonl

KiB, MiB, GiB = 1024, 1024**2, 1024**3
KB, MB, GB = 1000, 1000**2, 1000**3


def _gpt2(layers: int, heads: int, width: int) -> dict:
    return {"model_type": "gpt2", "n_layer": layers, "n_head": heads, "n_embd": width, "n_positions": 1024, "vocab_size": 50257}


def _llama(layers: int, heads: int, kv_heads: int, hidden: int, intermediate: int, positions: int,
           vocab: int = 32000, tied: bool = False) -> dict:
    return {
        "model_type": "llama", "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "hidden_size": hidden, "intermediate_size": intermediate, "max_position_embeddings": positions,
        "vocab_size": vocab, "tie_word_embeddings": tied,
    }


# Hugging Face style configs of well-known shapes (enough for the arithmetic; no weights).
BUILTIN: dict[str, dict] = {
    "distilgpt2": _gpt2(6, 12, 768),
    "gpt2": _gpt2(12, 12, 768),
    "gpt2-medium": _gpt2(24, 16, 1024),
    "gpt2-large": _gpt2(36, 20, 1280),
    "gpt2-xl": _gpt2(48, 25, 1600),
    "smollm2-135m": _llama(30, 9, 3, 576, 1536, 8192, vocab=49152, tied=True),
    "llama-7b": _llama(32, 32, 32, 4096, 11008, 4096),
    "llama-13b": _llama(40, 40, 40, 5120, 13824, 4096),
    "llama-70b": _llama(80, 64, 8, 8192, 28672, 4096),
    "mistral-7b": _llama(32, 32, 8, 4096, 14336, 32768),
}

# Memory as marketed (decimal GB); see the module docstring.
DEVICES: dict[str, int] = {
    "a100-80gb": 80 * GB,
    "a100-40gb": 40 * GB,
    "h100-80gb": 80 * GB,
    "h200-141gb": 141 * GB,
    "l40s-48gb": 48 * GB,
    "a10g-24gb": 24 * GB,
    "l4-24gb": 24 * GB,
    "t4-16gb": 16 * GB,
}

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn", "int8": "int8"}


class PlanError(ValueError):
    pass


# --- model shapes --------------------------------------------------------------------------------
def load_model_config(name_or_path: str) -> tuple[str, dict]:
    """(display name, HF-style config dict) from a built-in name, a config.json, or a folder holding one."""
    key = name_or_path.lower()
    if key in BUILTIN:
        return key, dict(BUILTIN[key])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            return path.parent.name or path.name, json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"{path}: not JSON ({e})") from None
    raise PlanError(f"unknown model {name_or_path!r}: give a Hugging Face config.json path or one of {', '.join(BUILTIN)}")


def _llama_like(config: dict) -> bool:
    return all(k in config for k in ("num_hidden_layers", "num_attention_heads", "hidden_size"))


def model_shape(config: dict, kv_dtype: str = "fp16"):
    """tritonlm.engine.model_shape.ModelShape for the config, with the KV cache element type."""
    import torch

    from tritonlm.engine.model_shape import ModelShape

    if kv_dtype not in _TORCH_DTYPES:
        raise PlanError(f"KV cache dtype {kv_dtype!r}: use one of {', '.join(_TORCH_DTYPES)}")
    cfg = dict(config)
    if cfg.get("model_type") not in ("gpt2", "llama") and _llama_like(cfg):
        cfg["model_type"] = "llama"  # mistral, qwen2, ...: the same K/V layout for this arithmetic
    try:
        return ModelShape.from_hf_config(SimpleNamespace(**cfg), dtype=getattr(torch, _TORCH_DTYPES[kv_dtype]))
    except (ValueError, AttributeError) as e:
        raise PlanError(f"cannot read the model shape: {e}") from None


def bytes_per_token(config: dict, kv_dtype: str = "fp16") -> int:
    return model_shape(config, kv_dtype).bytes_per_token


def param_count(config: dict) -> int:
    """Parameters of a GPT-2 or LLaMA-shaped decoder, from its config (exact for these architectures)."""
    if config.get("model_type") == "gpt2":
        d, v, p, n = config["n_embd"], config["vocab_size"], config["n_positions"], config["n_layer"]
        inner = config.get("n_inner") or 4 * d
        per_layer = 4 * d * d + 4 * d + 2 * d * inner + inner + d + 4 * d  # attn, mlp, two layer norms
        lm_head = 0 if config.get("tie_word_embeddings", True) else v * d
        return v * d + p * d + n * per_layer + 2 * d + lm_head
    if _llama_like(config):
        d, v, n = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
        heads = config["num_attention_heads"]
        kv = config.get("num_key_value_heads") or heads
        hd = config.get("head_dim") or d // heads
        ffn = config["intermediate_size"]
        bias = hd * (heads + 2 * kv) if config.get("attention_bias") else 0
        per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + bias + 3 * d * ffn + 2 * d
        lm_head = 0 if config.get("tie_word_embeddings", False) else v * d
        return v * d + n * per_layer + d + lm_head
    raise PlanError(f"cannot count parameters of model_type {config.get('model_type')!r}: pass --weights-bytes")


def weight_bytes(config: dict, dtype: str = "fp16") -> int:
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"weights dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    return int(param_count(config) * DTYPE_BYTES[dtype])


# --- capacity ----------------------------------------------------------------------------------
def bytes_per_sequence(per_token: int, tokens: int) -> int:
    return per_token * tokens


def max_concurrent(free_bytes: int, per_token: int, tokens: int) -> int:
    """Sequences of `tokens` tokens whose KV cache fits in free_bytes at once."""
    if tokens <= 0 or per_token <= 0:
        raise PlanError("tokens and bytes per token must be positive")
    return max(0, int(free_bytes // (per_token * tokens)))


def free_memory(device_bytes: int, weights: int, reserve: int = 0) -> int:
    return device_bytes - weights - reserve


def parse_size(text: str) -> int:
    """'80GB' -> 80e9, '66GiB' -> 66 x 2^30, '512MiB', '1.5TB', or plain bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", str(text), re.I)
    if not m:
        raise PlanError(f"size {text!r}: use e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes)")
    value, unit = float(m.group(1)), (m.group(2) or "B")
    u = unit[0].upper()
    if u == "B":
        return int(value)
    power = "KMGT".index(u) + 1
    base = 1024 if "i" in unit.lower() else 1000
    return int(value * base**power)


def human(n: float) -> str:
    """Binary units with up to two decimals, trailing zeros dropped: 524288 -> '512 KiB'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{int(n)} B"


def human_decimal(n: float) -> str:
    for unit, size in (("GB", GB), ("MB", MB), ("KB", KB)):
        if abs(n) >= size:
            return f"{n / size:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{int(n)} B"


# --- traffic logs --------------------------------------------------------------------------------
_PROMPT_KEYS = ("prompt_tokens", "input_tokens", "prompt_len", "input_len")
_OUTPUT_KEYS = ("output_tokens", "completion_tokens", "generated_tokens", "output_len")


def sequence_lengths(path: Path, count_tokens=None) -> list[int]:
    """prompt + output tokens per request of a JSONL traffic log. Token counts are read from
    prompt_tokens/input_tokens and output_tokens/completion_tokens; lacking those, `prompt` and
    `output` text is counted with count_tokens (or ~4 characters per token)."""
    count = count_tokens or (lambda s: math.ceil(len(s) / 4))
    lengths = []
    for n, obj in read_jsonl(path, PlanError):
        p = next((obj[k] for k in _PROMPT_KEYS if k in obj), None)
        o = next((obj[k] for k in _OUTPUT_KEYS if k in obj), None)
        if p is None and isinstance(obj.get("prompt"), str):
            p = count(obj["prompt"])
        if o is None and isinstance(obj.get("output"), str):
            o = count(obj["output"])
        if p is None or o is None:
            raise PlanError(f"{path}:{n}: needs prompt_tokens and output_tokens (or prompt and output text)")
        lengths.append(int(p) + int(o))
    if not lengths:
        raise PlanError(f"{path}: no requests")
    return lengths


def nearest_rank(values: list[int], pct: float) -> int:
    """The smallest value with at least pct% of the values at or below it."""
    s = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(s)))
    return s[rank - 1]


def recommend_max_sequence_length(lengths: list[int], *, pct: float = 99, round_to: int = 64, cap: int | None = None) -> int:
    p = nearest_rank(lengths, pct)
    rec = math.ceil(p / round_to) * round_to if round_to > 1 else p
    return min(rec, cap) if cap else rec


# --- the report ----------------------------------------------------------------------------------
@dataclass
class CapacityPlan:
    model: str
    kv_dtype: str
    weights_dtype: str
    per_token: int
    params: int
    weights: int
    device_bytes: int
    free: int
    rows: list[dict]
    max_positions: int


def make_plan(
    model: str,
    *,
    kv_dtype: str = "fp16",
    weights_dtype: str | None = None,
    device_bytes: int | None = None,
    free_bytes: int | None = None,
    reserve: int = 0,
    contexts: list[int] = (512, 2048, 16384),
    weights_override: int | None = None,
) -> CapacityPlan:
    name, config = load_model_config(model)
    spec = model_shape(config, kv_dtype)
    weights_dtype = weights_dtype or ("fp16" if kv_dtype in ("fp8", "int8") else kv_dtype)
    params = param_count(config) if weights_override is None else 0
    weights = weights_override if weights_override is not None else weight_bytes(config, weights_dtype)
    if free_bytes is None:
        free_bytes = free_memory(device_bytes if device_bytes is not None else DEVICES["a100-80gb"], weights, reserve)
        dev = device_bytes if device_bytes is not None else DEVICES["a100-80gb"]
    else:
        dev = free_bytes + weights + reserve
    rows = []
    for ctx in contexts:
        rows.append(
            {
                "context_tokens": ctx,
                "kv_bytes_per_sequence": bytes_per_sequence(spec.bytes_per_token, ctx),
                "per_sequence": human(bytes_per_sequence(spec.bytes_per_token, ctx)),
                "concurrent_sequences": max_concurrent(free_bytes, spec.bytes_per_token, ctx) if free_bytes > 0 else 0,
                "beyond_model_context": ctx > spec.max_positions,
            }
        )
    return CapacityPlan(name, kv_dtype, weights_dtype, spec.bytes_per_token, params, weights, dev, free_bytes, rows, spec.max_positions)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="KV cache capacity planner: bytes per token, sequences that fit, max_sequence_length from traffic",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("model", nargs="?", default=None,
                   help=f"a Hugging Face config.json (or its folder), or one of: {', '.join(BUILTIN)} "
                   "(optional with --rate: replicas only)")
    p.add_argument("--kv-dtype", default="fp16", choices=sorted(_TORCH_DTYPES), help="KV cache element type (default fp16)")
    p.add_argument("--weights-dtype", default=None, choices=sorted(DTYPE_BYTES), help="weights element type (default: the KV dtype, fp16 for 8-bit caches)")
    p.add_argument("--weights-bytes", default=None, help="weights size instead of parameters x dtype (e.g. 3.9GB)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--device", default="a100-80gb", help=f"device preset: {', '.join(DEVICES)} (default a100-80gb)")
    mem.add_argument("--device-memory", default=None, help="device memory, e.g. 24GB or 24GiB")
    mem.add_argument("--free-memory", default=None, help="memory left for the KV cache after weights, e.g. 66GB")
    p.add_argument("--reserve", default="0", help="memory kept back for activations/runtime (default 0)")
    p.add_argument("--context", default="512,2048,16384", help="context lengths in tokens (default 512,2048,16384)")
    p.add_argument("--traffic-log", type=Path, default=None, help="JSONL of requests (prompt_tokens, output_tokens) for max_sequence_length")
    p.add_argument("--percentile", type=float, default=99.0, help="percentile of prompt+output lengths to cover (default 99)")
    p.add_argument("--round-to", type=int, default=64, help="round max_sequence_length up to a multiple of this (default 64)")
    p.add_argument("--results", default=None, help="results folder (default results/plan)")
    r = p.add_argument_group("replicas (tritonlm/perf/replicas.py)")
    r.add_argument("--rate", type=float, default=None, help="target request rate, req/s: print the replicas needed")
    r.add_argument("--p99-ms", type=float, default=None, help="p99 latency budget in milliseconds (with --rate)")
    r.add_argument("--capacity", default=None,
                   help="one replica's req/s within the budget: a number, or the sla.csv `tritonlm perf sla` wrote")
    r.add_argument("--utilization", type=float, default=None,
                   help="share of the measured capacity to plan each replica at (default 0.8: headroom for bursts)")
    p.set_defaults(func=main)


def main_replicas(args: argparse.Namespace) -> None:
    """--rate ...: replicas and the HPA target (raises CliError naming a bad flag)."""
    from tritonlm.errors import CliError
    from tritonlm.perf.replicas import DEFAULT_UTILIZATION, ReplicaPlanError, capacity_from, describe, plan_replicas

    missing = [flag for flag, v in (("--p99-ms", args.p99_ms), ("--capacity", args.capacity)) if v is None]
    if missing:
        raise CliError(f"--rate needs {' and '.join(missing)} (one replica's capacity as `tritonlm perf sla` measures it)")
    try:
        if args.p99_ms <= 0:
            raise ReplicaPlanError(f"--p99-ms must be a positive latency budget in milliseconds, not {args.p99_ms:g}")
        capacity = capacity_from(args.capacity, args.p99_ms)
        utilization = DEFAULT_UTILIZATION if args.utilization is None else args.utilization
        print(describe(plan_replicas(args.rate, args.p99_ms, capacity, utilization)))
    except ReplicaPlanError as e:
        raise CliError(str(e)) from None


def main(args: argparse.Namespace) -> int:
    from tritonlm.errors import CliError
    from tritonlm.perf import report

    rate_only = [flag for flag, v in (("--p99-ms", args.p99_ms), ("--capacity", args.capacity),
                                      ("--utilization", args.utilization)) if v is not None]
    if args.rate is not None:
        main_replicas(args)
        if args.model is None:
            return 0
        print()
    elif rate_only:
        raise CliError(f"{', '.join(rate_only)} only count with --rate (the replica plan)")
    elif args.model is None:
        raise CliError("give a model (the KV cache plan) or --rate (the replica plan)")
    try:
        contexts = [int(c) for c in args.context.split(",") if c.strip()]
        device = None
        if args.device_memory:
            device = parse_size(args.device_memory)
        elif not args.free_memory:
            if args.device.lower() not in DEVICES:
                raise PlanError(f"unknown device {args.device!r}: one of {', '.join(DEVICES)}, or --device-memory SIZE")
            device = DEVICES[args.device.lower()]
        plan = make_plan(
            args.model,
            kv_dtype=args.kv_dtype,
            weights_dtype=args.weights_dtype,
            device_bytes=device,
            free_bytes=parse_size(args.free_memory) if args.free_memory else None,
            reserve=parse_size(args.reserve),
            contexts=contexts,
            weights_override=parse_size(args.weights_bytes) if args.weights_bytes else None,
        )
        recommended = None
        if args.traffic_log:
            lengths = sequence_lengths(args.traffic_log)
            p_len = nearest_rank(lengths, args.percentile)
            recommended = recommend_max_sequence_length(lengths, pct=args.percentile, round_to=args.round_to, cap=plan.max_positions)
    except (PlanError, ValueError, OSError) as e:
        raise CliError(str(e)) from None
    print(f"model {plan.model}: KV cache {human(plan.per_token)} per token ({plan.kv_dtype})")
    if plan.params:
        print(f"weights: {plan.params / 1e9:.2f}B parameters x {plan.weights_dtype} = {human_decimal(plan.weights)}")
    else:
        print(f"weights: {human_decimal(plan.weights)}")
    print(f"device {human_decimal(plan.device_bytes)} - weights = {human_decimal(plan.free)} ({human(plan.free)}) for the KV cache")
    if plan.free <= 0:
        print("the weights alone do not fit: use a larger device, fewer bytes per weight, or tensor parallelism")
    if recommended is not None:
        extra = {
            "context_tokens": recommended,
            "kv_bytes_per_sequence": plan.per_token * recommended,
            "per_sequence": human(plan.per_token * recommended),
            "concurrent_sequences": max_concurrent(plan.free, plan.per_token, recommended) if plan.free > 0 else 0,
            "beyond_model_context": False,
        }
        plan.rows.append(extra)
    print()
    print(report.table(plan.rows, ["context_tokens", "per_sequence", "concurrent_sequences", "beyond_model_context"]))
    if recommended is not None:
        print(
            f"\ntraffic log {args.traffic_log}: {len(lengths)} requests, P{args.percentile:g} of prompt+output = {p_len} tokens"
            f" -> max_sequence_length {recommended}"
            + (f" (capped at the model's {plan.max_positions})" if recommended < p_len else "")
            + f"; {extra['concurrent_sequences']} sequences of that length fit"
        )
    out = report.results_dir(args.results, "plan")
    report.write_csv(out / "plan.csv", plan.rows)
    rows = sorted(plan.rows, key=lambda r: r["context_tokens"])
    report.plot_xy(
        out / "plan.png",
        "context length (tokens)",
        "concurrent sequences",
        {f"{plan.model} ({plan.kv_dtype}, {human_decimal(plan.free)} free)": ([r["context_tokens"] for r in rows], [r["concurrent_sequences"] for r in rows])},
        title="KV cache capacity",
    )
    print(f"wrote {out / 'plan.csv'}\nwrote {out / 'plan.png'}")
    return 0
