"""The one-stream decode limit: the host's memory read bandwidth over the weight bytes a step reads.

A decode step at one row reads every weight once and does little arithmetic with each, so
tokens/s x weight bytes per token cannot exceed what the memory system reads per second
(a batch reuses each weight for all its rows, which is why only one stream is bounded so).

    read_bandwidth(threads, mib=None, repeats=5) -> float
        bytes/s of a STREAM-like read: the best of `repeats` sums over a float32 buffer
        several times the last-level cache, on `threads` intra-op threads
    WEIGHT_FORMATS                      bytes per weight and per output channel of each format:
                                        tritonlm's dtypes and llama.cpp's GGUF types
    decode_weight_bytes(config, fmt) -> int
        the weight bytes one decode step reads for a Hugging Face config: every projection
        and the LM head in the format, norms and biases in float32 (embedding lookups read a
        row per token and are left out; a tied LM head reads the whole table)
    one_stream_limit(bandwidth, weight_bytes) -> float   tokens/s

Figures from this module are measured ones: docs/benchmarks.md, "The one-stream limit".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class WeightFormat:
    per_weight: float  # bytes per weight of a projection matrix (the codes and any per-block scales)
    per_output: float  # bytes per output channel on top (a per-channel scale)
    what: str


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "float32": WeightFormat(4.0, 0.0, "tritonlm float32"),
    "bfloat16": WeightFormat(2.0, 0.0, "tritonlm bfloat16"),
    "int8": WeightFormat(1.0, 4.0, "tritonlm int8: int8 codes, a float32 scale per output channel"),
    # GROUP (32) inputs share a float16 scale and a float16 offset
    "int8_weight_only": WeightFormat(1.0 + 4.0 / 32, 0.0,
                                     "tritonlm int8_weight_only: int8 codes, float16 scale and offset per 32"),
    "F32": WeightFormat(4.0, 0.0, "GGUF F32"),
    "F16": WeightFormat(2.0, 0.0, "GGUF F16"),
    # a block of 32 weights: a float16 scale and 32 int8 codes
    "Q8_0": WeightFormat(34.0 / 32, 0.0, "GGUF Q8_0: 32 int8 codes and a float16 scale per block of 32"),
}

_FLOAT_BYTES = 4  # norms and biases: float32 in every format here


def weight_format(name: str) -> WeightFormat:
    try:
        return WEIGHT_FORMATS[name]
    except KeyError:
        raise ValueError(f"weight format {name!r} is not one of {', '.join(WEIGHT_FORMATS)}") from None


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 (sysfs), 0 where it cannot be read."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best


def read_bandwidth(threads: int, mib: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of the best of `repeats` full reads (a vectorized sum) of a float32 buffer of
    `mib` MiB (default: 8 x the last-level cache, at least 256 MiB, so the caches hold a
    small part of it), on `threads` torch intra-op threads (the process's setting is put
    back). The best, not the mean: the limit is what the memory system can do, and a shared
    host only ever takes from it."""
    if threads < 1:
        raise ValueError(f"threads must be at least 1, not {threads}")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, not {repeats}")
    size = (mib << 20) if mib is not None else max(256 << 20, 8 * last_level_cache_bytes())
    buf = torch.ones(size // 4, dtype=torch.float32)  # [size / 4]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf.sum()  # pages touched, threads started
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return buf.numel() * 4 / best


def decode_weight_bytes(config, fmt: str) -> int:
    """Weight bytes one decode step of a Hugging Face config's model reads in format `fmt`
    (WEIGHT_FORMATS): each projection matrix and the LM head at the format's bytes per weight
    (plus its bytes per output channel), every other parameter (norms, biases) in float32.
    Embedding tables are gathered a row per token and not counted, except one the LM head
    shares (tied), which the head reads whole. The model is built on the meta device:
    shapes only, no memory, no download."""
    from transformers import AutoModelForCausalLM

    form = weight_format(fmt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    head_weight = head.weight if head is not None else None
    gathered = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    total = 0.0
    for name, p in model.named_parameters():  # a tied table once
        if id(p) in gathered and p is not head_weight:
            continue
        if p.dim() == 2:  # a projection (nn.Linear [out, in], GPT-2's Conv1D [in, out]) or the head
            out_channels = p.shape[1] if type(_owner(model, name)).__name__ == "Conv1D" else p.shape[0]
            total += p.numel() * form.per_weight + out_channels * form.per_output
        else:
            total += p.numel() * _FLOAT_BYTES
    return int(round(total))


def _owner(model: torch.nn.Module, param_name: str) -> torch.nn.Module:
    return model.get_submodule(param_name.rpartition(".")[0])


def one_stream_limit(bandwidth: float, weight_bytes: int) -> float:
    """Tokens/s one stream's decode cannot exceed: bytes/s over bytes per token."""
    if weight_bytes <= 0:
        raise ValueError(f"weight_bytes must be positive, not {weight_bytes}")
    return bandwidth / weight_bytes
