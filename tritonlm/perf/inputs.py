"""perf_analyzer input data derived from a model's own config, so a harness works on any model.

BYTES inputs get readable strings, integer inputs get token ids inside the
model's vocabulary (masks get ones, positions get 0..n-1, length-like scalars a
small count), floats get uniform noise; dynamic dims get `--seq-len` and a
matching `--shape`. A decoder forward pass with a KV cache (inputs named
past_key_values.*) gets a cache of `--past-len` positions (default 0, a
prefill) and a mask and positions that agree with it. Optional inputs are left
out. `--input-data FILE` bypasses all of this.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_VOCAB = 256  # safe for any tokenizer when nothing says otherwise
_INT_TYPES = {"TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64", "TYPE_UINT8", "TYPE_UINT16", "TYPE_UINT32", "TYPE_UINT64"}
_FLOAT_TYPES = {"TYPE_FP16", "TYPE_FP32", "TYPE_FP64"}
_WORDS = (
    "the model serves text quickly while batching many requests on one device and every token "
    "costs memory in the cache so latency grows with load until the queue is full"
).split()


def vocab_size_of(config: dict, explicit: int | None = None) -> int:
    """Explicit > config parameter `vocab_size` > fixed last dim of a `*logits*` output > 256."""
    if explicit:
        return int(explicit)
    param = config.get("parameters", {}).get("vocab_size", {}).get("string_value")
    if param and str(param).isdigit():
        return int(param)
    for out in config.get("output", []):
        dims = [int(d) for d in out.get("dims", [])]
        if "logit" in out.get("name", "").lower() and dims and dims[-1] > 0:
            return dims[-1]
    return DEFAULT_VOCAB


def _text(rng: random.Random, length: int) -> str:
    words = []
    while sum(len(w) + 1 for w in words) < length:
        words.append(rng.choice(_WORDS))
    return " ".join(words)[:length]


def _is_past(inp: dict) -> bool:
    """A KV cache input (past_key_values.N.key ...): its dynamic dim is the past length."""
    return "past" in inp["name"].lower() and inp.get("data_type", "") in _FLOAT_TYPES


def _values(name: str, dtype: str, n: int, rng: random.Random, vocab: int, string_length: int, offset: int = 0) -> list:
    lname = name.lower()
    if dtype == "TYPE_STRING":
        return [_text(rng, string_length) for _ in range(n)]
    if dtype == "TYPE_BOOL":
        return [False] * n
    if dtype in _INT_TYPES:
        if "mask" in lname:
            return [1] * n
        if "position" in lname:
            return list(range(offset, offset + n))
        if any(k in lname for k in ("max_tokens", "length", "count", "num_")):
            return [16] * n
        high = vocab
        if dtype in ("TYPE_INT8", "TYPE_UINT8"):
            high = min(high, 127)
        return [rng.randrange(0, high) for _ in range(n)]
    if dtype in _FLOAT_TYPES:
        return [round(rng.random(), 4) for _ in range(n)]
    raise ValueError(f"input '{name}' has type {dtype}, which the harness cannot synthesize: pass --input-data FILE")


def synth_input_data(
    config: dict,
    *,
    seq_len: int = 16,
    vocab_size: int | None = None,
    string_length: int = 32,
    entries: int = 8,
    seed: int = 0,
    shape_overrides: dict[str, list[int]] | None = None,
    past_len: int = 0,
) -> tuple[dict, list[str]]:
    """(perf_analyzer --input-data JSON, extra perf_analyzer args such as --shape) from a model config dict
    (the server's get_model_config answer). Shapes exclude the batch dimension, as perf_analyzer expects.

    Decoder forward passes with a KV cache (inputs named *past*) get a cache of `past_len`
    positions (0: a prefill), an attention_mask covering past + new tokens and position ids
    continuing after the past."""
    rng = random.Random(seed)
    vocab = vocab_size_of(config, vocab_size)
    inputs = [i for i in config.get("input", []) if not i.get("optional", False)]
    if not inputs:
        raise ValueError(f"model '{config.get('name')}' declares no required input: pass --input-data FILE")
    has_past = any(_is_past(i) for i in inputs)
    shapes: dict[str, list[int]] = {}
    dynamic: set[str] = set()
    for inp in inputs:
        dims = [int(d) for d in inp.get("dims", [])]
        if any(d < 0 for d in dims):
            dynamic.add(inp["name"])
        length = seq_len
        if _is_past(inp):
            length = past_len
        elif has_past and "mask" in inp["name"].lower():
            length = past_len + seq_len
        shapes[inp["name"]] = [length if d < 0 else d for d in dims] or [1]
        if shape_overrides and inp["name"] in shape_overrides:
            shapes[inp["name"]] = list(shape_overrides[inp["name"]])
    data = []
    for _ in range(entries):
        entry = {}
        for inp in inputs:
            name, shape = inp["name"], shapes[inp["name"]]
            n = 1
            for d in shape:
                n *= d
            values = _values(name, inp.get("data_type", ""), n, rng, vocab, string_length, offset=past_len if has_past else 0)
            entry[name] = {"content": values, "shape": shape} if name in dynamic else values
        data.append(entry)
    args = []
    for name in sorted(dynamic):
        if all(d > 0 for d in shapes[name]):  # perf_analyzer's --shape refuses 0; the JSON shape still says it
            args += ["--shape", f"{name}:{','.join(str(d) for d in shapes[name])}"]
    return {"data": data}, args


def input_args(
    config: dict,
    workdir: Path,
    *,
    input_data: Path | None = None,
    shapes: list[str] | None = None,
    seq_len: int = 16,
    vocab_size: int | None = None,
    string_length: int = 32,
    past_len: int = 0,
) -> list[str]:
    """perf_analyzer arguments that feed the model: the user's file, or one synthesized here."""
    overrides = dict(parse_shape(s) for s in shapes or [])
    if input_data is not None:
        extra = []
        for name, dims in overrides.items():
            extra += ["--shape", f"{name}:{','.join(map(str, dims))}"]
        return ["--input-data", str(input_data), *extra]
    data, shape_args = synth_input_data(
        config, seq_len=seq_len, vocab_size=vocab_size, string_length=string_length, shape_overrides=overrides,
        past_len=past_len,
    )
    path = Path(workdir) / "input_data.json"
    path.write_text(json.dumps(data))
    return ["--input-data", str(path), *shape_args]


def parse_shape(text: str) -> tuple[str, list[int]]:
    """'input_ids:1,16' -> ('input_ids', [1, 16])"""
    name, sep, dims = text.rpartition(":")
    try:
        if not sep or not name:
            raise ValueError
        return name, [int(d) for d in dims.split(",")]
    except ValueError:
        raise ValueError(f"--shape {text!r}: expected NAME:D1,D2,... (e.g. input_ids:16)") from None
