"""The generation model's tensor contract, as plain NumPy in and out.

INPUTS and OUTPUTS below are the one description of the generation model's tensors:
the exported config.pbtxt (tritonlm/export/repository.py), the request parser here,
the client (tritonlm/client/generate.py) and the tables in docs/protocol.md are
all derived from them, and tests/unit/test_protocol.py fails when they drift.
Names follow what Triton LLM users and tools already send (TensorRT-LLM's ensemble,
vLLM's backend, genai-perf). The Triton glue only moves tensors between Triton and
these functions, so every rule here is tested without a server.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np

from tritonlm.engine.request import (MAX_TOP_LOG_PROBS, PRIORITY_RANGE, GenerationEvent, InvalidRequestError, SamplingParams,
                                     check_priority)
from tritonlm.guide_fields import guide_from_fields, guide_from_trtllm

Default = Union[bool, int, float, None]


@dataclass(frozen=True)
class Tensor:
    """One row of the contract.

    dtype     Triton's datatype name, as clients send it (INT32, UINT64, FP32, BOOL, BYTES)
    dims      shape without a batch dimension (the model has max_batch_size 0); -1: any length
    optional  inputs: a request may leave it out (config.pbtxt `optional: true`);
              outputs: some responses leave it out (not written to config.pbtxt: Triton
              outputs have no such flag)
    default   inputs: the value a request without it gets; None: no value (see meaning)
    meaning   one line for the docs/protocol.md table
    """

    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool
    default: Default
    meaning: str

    @property
    def config_type(self) -> str:
        """The data_type config.pbtxt writes (Triton calls BYTES TYPE_STRING there)."""
        return "TYPE_STRING" if self.dtype == "BYTES" else "TYPE_" + self.dtype

    @property
    def numpy_type(self):
        return NUMPY_TYPES[self.dtype]


NUMPY_TYPES = {"INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_, "BYTES": np.object_}


def _in(name: str, dtype: str, meaning: str, default: Default = None, dims: tuple[int, ...] = (1,), optional: bool = True) -> Tensor:
    return Tensor(name, dtype, dims, optional, default, meaning)


def _out(name: str, dtype: str, meaning: str, dims: tuple[int, ...] = (1,), optional: bool = True) -> Tensor:
    return Tensor(name, dtype, dims, optional, None, meaning)


INPUTS: tuple[Tensor, ...] = (
    _in("text_input", "BYTES", "the prompt", optional=False),
    _in("max_tokens", "INT32", "most new tokens to generate; absent: the model's `default_max_tokens` parameter (16)"),
    _in("stream", "BOOL", "true: a response as tokens are made: one per generated token (its text; empty for a special token; a split character waits for its last token); several tokens in one with speculative decoding, when responses fall behind the steps, or every `stream_interval` tokens after the first when the model sets it", False),
    _in("exclude_input_in_output", "BOOL", "true: a non-streamed answer leaves the prompt out (streamed pieces never repeat it)", False),
    _in("min_tokens", "INT32", "the end token (EOS or `end_id`) is not generated before this many tokens", 0),
    _in("min_length", "INT32", "genai-perf's name for `min_tokens` (read when `min_tokens` is absent)", 0),
    _in("end_id", "INT32", "token id that ends generation; absent: the tokenizer's EOS; -1: none"),
    _in("top_k", "INT32", "sample among the k most likely tokens; 0: off, 1: greedy", 0),
    _in("num_draft_tokens", "INT32", "speculative decoding: most draft tokens per step; absent: the model's setting; 0: off"),
    _in("lora_name", "BYTES",
        "the LoRA adapter this request runs under, by the name the model serves it (`lora_adapters`, `multi_lora.json`: "
        "[lora.md](lora.md)); absent or empty: the base model"),
    _in("priority", "INT32",
        "vLLM's `priority`: waiting requests are admitted lowest value first, in arrival order among equals; in "
        f"[{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}]", 0),
    _in("temperature", "FP32", "sampling temperature; absent or 0: greedy"),
    _in("top_p", "FP32", "sample among the most likely tokens whose probabilities add up to top_p; 1: off", 1.0),
    _in("repetition_penalty", "FP32", "penalty on tokens already in the prompt or the answer; 1: off", 1.0),
    _in("frequency_penalty", "FP32", "OpenAI's: a token's logit loses this times its count in the answer so far; in [-2, 2], 0: off", 0.0),
    _in("presence_penalty", "FP32", "OpenAI's: a token's logit loses this once it is in the answer; in [-2, 2], 0: off", 0.0),
    _in("min_p", "FP32", "sample only among tokens at least min_p times as likely as the most likely one; in [0, 1], 0: off", 0.0),
    _in("seed", "UINT64", "seed of this request's sampling (same seed, same text); absent: random"),
    _in("stop_words", "BYTES", "strings that end the answer (TensorRT-LLM's comma-separated form works too)", dims=(-1,)),
    _in("bad_words", "BYTES", "words never generated (as written and after a space)", dims=(-1,)),
    _in("return_log_probs", "BOOL", "true: responses also carry `output_log_probs`", False),
    _in("top_log_probs", "INT32",
        "with `return_log_probs`: also the N most likely tokens at each position (`output_top_token_ids`, "
        "`output_top_log_probs`: log_softmax of the model's raw logits); in [0, 20], 0: off", 0),
    _in("prompt_log_probs", "INT32",
        "the prompt's log-probabilities (vLLM's `prompt_logprobs`): 0 each prompt token's own (`prompt_log_probs` output), "
        "N in [1, 20] also the N most likely tokens there; absent: off. Such a prompt is not served from the prefix cache"),
    # what Triton's OpenAI frontend sends to a vLLM-backend model (`--backend vllm`)
    _in("sampling_parameters", "BYTES",
        "vLLM backend's JSON object of settings (NVIDIA's OpenAI frontend sends it): `max_tokens`, `min_tokens`, "
        "`temperature`, `top_p`, `top_k`, `min_p`, `seed`, `repetition_penalty`, `frequency_penalty`, `presence_penalty`, "
        "`logit_bias` (token id -> bias in [-100, 100]), `stop`, `stop_token_ids`, `bad_words`, `ignore_eos`, "
        "`logprobs` (true or 0: the chosen token's; N up to 20: and the N most likely), `prompt_logprobs` (as the "
        "`prompt_log_probs` input), `guided_decoding` (structured output, vLLM's names: one of `json` (a JSON Schema, "
        "object or string), `json_object` true, `regex`, `grammar`, `choice` (a list of strings); also as "
        "`structured_outputs`, an object or its JSON text), `lora_name` and `priority` (as those inputs); `n`, "
        "`best_of` 1; other keys are refused by name"),
    _in("return_logprobs", "BOOL",
        "vLLM backend's flag (NVIDIA's OpenAI frontend sends it with every request): true asks for the chosen "
        "tokens' log-probabilities, as `return_log_probs`, and for them in the vLLM backend's form too (the `logprobs` "
        "output)", False),
    # TensorRT-LLM backend's guided decoding inputs (its tensorrt_llm model's config.pbtxt)
    _in("guided_decoding_guide_type", "BYTES",
        "guided decoding (structured output), TensorRT-LLM backend's names: `json` (any JSON object or array), "
        "`json_schema`, `regex`, `ebnf_grammar` (GBNF / EBNF, or Lark); the answer stays inside `guided_decoding_guide`"),
    _in("guided_decoding_guide", "BYTES",
        "the guide of `guided_decoding_guide_type`: a JSON Schema, a regular expression the whole answer matches, or a "
        "grammar (none for `json`)"),
    _in("return_num_input_tokens", "BOOL",
        "vLLM backend's flag (NVIDIA's OpenAI frontend sends true): accepted; the final response carries `num_input_tokens` either way",
        False),
    _in("return_num_output_tokens", "BOOL",
        "vLLM backend's flag (NVIDIA's OpenAI frontend sends true): accepted; the final response carries `num_output_tokens` either way",
        False),
)

OUTPUTS: tuple[Tensor, ...] = (
    _out("text_output", "BYTES", "new text: streamed, this piece; otherwise the whole answer (prompt first unless `exclude_input_in_output`)",
         dims=(-1,), optional=False),
    _out("finish_reason", "BYTES", "final response: `stop` / `length` / `cancelled` / `error`"),
    _out("num_input_tokens", "INT32", "final response: tokens in the prompt"),
    _out("num_output_tokens", "INT32", "final response: tokens generated"),
    _out("num_cached_tokens", "INT32", "final response: prompt tokens served from the prefix cache (`enable_prefix_caching`)"),
    _out("output_log_probs", "FP32",
         "with `return_log_probs`: log-probability of each token of this response (log_softmax of the model's raw "
         "logits, before penalties, guide and temperature: the source of the alternatives too)", dims=(-1,)),
    _out("output_top_token_ids", "INT32",
         "with `top_log_probs` N: for each token of this response, the N most likely token ids, most likely first",
         dims=(-1, -1)),
    _out("output_top_log_probs", "FP32",
         "with `top_log_probs` N: their log-probabilities (log_softmax of the model's raw logits)", dims=(-1, -1)),
    _out("logprobs", "BYTES",
         "with `return_logprobs`: the vLLM backend's form, one JSON string: for each token of this response an object "
         "token id -> {`logprob`, `rank`, `decoded_token`} holding the chosen token (its `output_log_probs` value; `rank` "
         "left out where a speculative verify made it) and the `logprobs` N most likely (raw log_softmax)"),
    _out("prompt_token_ids", "INT32", "with `prompt_log_probs`, first response: the prompt's token ids", dims=(-1,)),
    _out("prompt_log_probs", "FP32",
         "with `prompt_log_probs`, first response: each prompt token's log-probability given the tokens before it "
         "(log_softmax of the raw logits); the first is NaN (nothing predicts it)", dims=(-1,)),
    _out("prompt_top_token_ids", "INT32",
         "with `prompt_log_probs` N, first response: at each prompt position the N most likely token ids (the "
         "first row -1)", dims=(-1, -1)),
    _out("prompt_top_log_probs", "FP32",
         "with `prompt_log_probs` N, first response: their log-probabilities (the first row NaN)", dims=(-1, -1)),
    _out("acceptance_rate", "FP32", "final response: accepted / proposed draft tokens (0 without speculation)"),
    _out("total_accepted_draft_tokens", "INT32", "final response: draft tokens the target accepted"),
    _out("total_draft_tokens", "INT32", "final response: draft tokens proposed"),
)

INPUT = {t.name: t for t in INPUTS}
OUTPUT = {t.name: t for t in OUTPUTS}
KNOWN_INPUTS = tuple(INPUT)


def _cell(value: Default) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def markdown_table(direction: str = "inputs") -> str:
    """The docs/protocol.md table of the generation model's inputs (or outputs), from the contract."""
    if direction == "inputs":
        lines = ["| input | type | shape | required | default | meaning |", "|---|---|---|---|---|---|"]
        lines += [
            f"| `{t.name}` | {t.dtype} | {list(t.dims)} | {'no' if t.optional else 'yes'} | {_cell(t.default)} | {t.meaning} |"
            for t in INPUTS
        ]
    elif direction == "outputs":
        lines = ["| output | type | shape | meaning |", "|---|---|---|---|"]
        lines += [f"| `{t.name}` | {t.dtype} | {list(t.dims)} | {t.meaning} |" for t in OUTPUTS]
    else:
        raise ValueError(f"direction {direction!r}: use 'inputs' or 'outputs'")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RequestLimits:
    """Bounds checked before any expensive work (decoding, tokenizing); each breach is an
    error naming the input and the limit. From the model's settings (docs/configuration.md)."""

    max_prompt_bytes: int = 262_144  # text_input, UTF-8 bytes
    max_words: int = 64  # entries in stop_words, and in bad_words
    max_word_bytes: int = 256  # one stop or bad word
    max_request_bytes: int = 0  # all inputs together; 0: the sum of the limits above + 64 KiB

    @staticmethod
    def for_model(settings, max_context: int) -> "RequestLimits":
        """From a model's EngineSettings and the context it serves."""
        return RequestLimits(
            max_prompt_bytes=settings.max_prompt_bytes or 32 * max_context,  # a token is rarely 32 bytes of text
            max_words=settings.max_words,
            max_word_bytes=settings.max_word_bytes,
            max_request_bytes=settings.max_request_bytes,
        )

    @property
    def request_bytes(self) -> int:
        return self.max_request_bytes or self.max_prompt_bytes + 2 * self.max_words * self.max_word_bytes + 65_536


def _input_bytes(arr: np.ndarray) -> int:
    if arr.dtype == object:
        return sum(len(v) if isinstance(v, (bytes, bytearray, str)) else 8 for v in arr.reshape(-1))
    return int(arr.nbytes)


def check_sizes(inputs: dict[str, np.ndarray], limits: RequestLimits) -> None:
    """The size bounds of RequestLimits, on the raw tensors (nothing decoded yet)."""
    elements = sum(np.asarray(a).size for a in inputs.values())
    if elements > 2 * limits.max_words + len(INPUTS):
        raise InvalidRequestError(
            f"request: {elements} values in its inputs; at most {limits.max_words} stop_words and "
            f"{limits.max_words} bad_words and one value for every other input"
        )
    total = sum(_input_bytes(np.asarray(a)) for a in inputs.values())
    if total > limits.request_bytes:
        raise InvalidRequestError(f"request: {total} bytes of inputs; the limit is {limits.request_bytes} (max_request_bytes)")
    prompt = inputs.get("text_input")
    if prompt is not None:
        size = _input_bytes(np.asarray(prompt))
        if size > limits.max_prompt_bytes:
            raise InvalidRequestError(f"text_input: {size} bytes; the limit is {limits.max_prompt_bytes} (max_prompt_bytes)")
    for name in ("stop_words", "bad_words"):
        arr = inputs.get(name)
        if arr is None:
            continue
        arr = np.asarray(arr).reshape(-1)
        if arr.size > limits.max_words:
            raise InvalidRequestError(f"{name}: {arr.size} entries; the limit is {limits.max_words} (max_words)")
        longest = max((_input_bytes(np.asarray([v], dtype=object)) for v in arr), default=0)
        if longest > limits.max_word_bytes:
            raise InvalidRequestError(f"{name}: an entry of {longest} bytes; the limit is {limits.max_word_bytes} (max_word_bytes)")


@dataclass(frozen=True)
class ParsedRequest:
    text: str
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    num_draft_tokens: int | None
    bad_words_text: tuple[str, ...]  # turned into token ids by the caller (needs the tokenizer)
    vllm_logprobs: bool = False  # return_logprobs: also the vLLM backend's `logprobs` output
    lora_name: str | None = None  # the LoRA adapter asked for, by name (resolved by the caller); None: the base
    priority: int = 0  # lower is admitted earlier (GenerationRequest.priority)
    # field -> what the request called it, where that differs ("sampling_parameters.max_tokens",
    # "min_length"): later errors about the field name what was sent (rename_error)
    renames: dict[str, str] = field(default_factory=dict)


def rename_error(message: str, renames: dict[str, str]) -> str:
    """An error message `FIELD: ...` with FIELD as the request named it."""
    head, sep, rest = message.partition(": ")
    return f"{renames[head]}: {rest}" if sep and head in renames else message


def _scalar(inputs: dict[str, np.ndarray], name: str):
    arr = inputs.get(name)
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise InvalidRequestError(f"{name}: expected one value (shape [1]), got {flat.size} values with shape {list(np.shape(arr))}")
    return flat[0]


def _text(value, name: str) -> str:
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequestError(f"{name}: not valid UTF-8 ({e.reason} at byte {e.start}); send UTF-8 text") from None
    if isinstance(value, str):
        return value
    raise InvalidRequestError(f"{name}: expected text (BYTES), got {type(value).__name__}")


def _word_list(inputs: dict[str, np.ndarray], name: str, max_words: int | None = None) -> tuple[str, ...]:
    arr = inputs.get(name)
    if arr is None:
        return ()
    arr = np.asarray(arr)
    if arr.dtype != object and arr.dtype.kind not in ("S", "U"):
        raise InvalidRequestError(f"{name}: expected a list of strings (BYTES), got {arr.dtype}")
    words = []
    for v in arr.reshape(-1):
        word = _text(v, name)
        # also accept TensorRT-LLM's comma-separated form ["foo,bar"]; a word whose split
        # leaves an empty piece (",", ", ", "a,,b") is one literal word that holds a comma
        pieces = word.split(",")
        words.extend(pieces if len(pieces) > 1 and all(pieces) else [word] if word else [])
    if max_words is not None and len(words) > max_words:  # "a,b,c,..." packs many words in one entry
        raise InvalidRequestError(f"{name}: {len(words)} words; the limit is {max_words} (max_words)")
    return tuple(words)


# Triton datatype -> (what the message calls it, numpy kind the value must have)
_NUMERIC = {"INT32": ("an integer", np.integer), "UINT64": ("an integer", np.integer), "FP32": ("a number", np.number)}


def _value(inputs: dict[str, np.ndarray], name: str):
    """The value of one scalar input, checked against the contract's datatype for it;
    None when the request leaves it out. BYTES lists go through _word_list."""
    row = INPUT[name]
    v = _scalar(inputs, name)
    if v is None:
        return None
    if row.dtype == "BYTES":
        return _text(v, name)
    if row.dtype == "BOOL":
        if not isinstance(v, (bool, np.bool_)):
            raise InvalidRequestError(f"{name}: expected a boolean (BOOL), got {np.asarray(v).dtype}")
        return bool(v)
    what, kind = _NUMERIC[row.dtype]
    if isinstance(v, (bytes, str, bool, np.bool_)) or not np.issubdtype(np.asarray(v).dtype, kind):
        raise InvalidRequestError(f"{name}: expected {what} ({row.dtype}), got {np.asarray(v).dtype}")
    if kind is np.integer:
        return int(v)
    value = float(v)
    if not np.isfinite(value):
        raise InvalidRequestError(f"{name}: must be a finite number, got {value}")
    return value


# --- sampling_parameters: the vLLM backend's JSON settings ---------------------------------------
# key -> (the contract input it sets, what it must be). Keys are vLLM's SamplingParams names,
# as Triton's OpenAI frontend (python/openai/openai_frontend/engine/utils/triton.py in
# triton-inference-server/server, r25.08) writes them from an OpenAI request.
SAMPLING_KEYS: dict[str, tuple[str | None, str]] = {
    "max_tokens": ("max_tokens", "int"),
    "min_tokens": ("min_tokens", "int"),
    "temperature": ("temperature", "number"),
    "top_p": ("top_p", "number"),
    "top_k": ("top_k", "int"),  # vLLM's -1 (off) is 0 here
    "seed": ("seed", "int"),
    "repetition_penalty": ("repetition_penalty", "number"),
    "frequency_penalty": ("frequency_penalty", "number"),
    "presence_penalty": ("presence_penalty", "number"),
    "min_p": ("min_p", "number"),
    "logit_bias": ("logit_bias", "bias"),
    "stop_token_ids": ("stop_token_ids", "ids"),
    "stop": ("stop_words", "words"),
    "bad_words": ("bad_words", "words"),
    "ignore_eos": ("end_id", "bool"),  # true: end_id -1
    "logprobs": ("return_log_probs", "logprobs"),  # int (completions) or bool (chat)
    "prompt_logprobs": ("prompt_log_probs", "int"),
    "guided_decoding": ("guided", "guide"),  # vLLM's StructuredOutputsParams fields
    # the same object under vLLM's current SamplingParams name; NVIDIA's OpenAI frontend sends
    # it (as JSON text) for a named or required tool_choice
    "structured_outputs": ("guided", "guide"),
    "lora_name": ("lora_name", "text"),  # vLLM's Triton backend reads it here too
    "priority": ("priority", "int"),
    "top_logprobs": (None, "no_alternatives"),
    "n": (None, "one"),
    "best_of": (None, "one"),
}
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows


def _sp_error(key: str, text: str) -> InvalidRequestError:
    return InvalidRequestError(f"sampling_parameters.{key}: {text}")


def _sp_number(key: str, v, integer: bool):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise _sp_error(key, f"expected {'an integer' if integer else 'a number'}, got {json.dumps(v)[:40]}")
    if not integer:
        try:
            value = float(v)  # an int past float's range overflows
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise _sp_error(key, f"must be a finite number, got {v}")
        return value
    lo, hi = (0, 2**64 - 1) if key == "seed" else (-(2**31), 2**31 - 1)  # the inputs' UINT64 / INT32 ranges
    if not lo <= v <= hi:
        raise _sp_error(key, f"must be in [{lo}, {hi}], got {v}")
    return v


def _sp_words(key: str, v, limits: RequestLimits) -> tuple[str, ...]:
    words = [v] if isinstance(v, str) else v
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise _sp_error(key, f"expected a string or a list of strings, got {json.dumps(v)[:40]}")
    if len(words) > limits.max_words:
        raise _sp_error(key, f"{len(words)} entries; the limit is {limits.max_words} (max_words)")
    for w in words:
        if len(w.encode("utf-8")) > limits.max_word_bytes:
            raise _sp_error(key, f"an entry of {len(w.encode('utf-8'))} bytes; the limit is {limits.max_word_bytes} (max_word_bytes)")
    return tuple(w for w in words if w)  # literal strings: no comma splitting here


def parse_sampling_parameters(text: str, limits: RequestLimits) -> dict:
    """The JSON object of `sampling_parameters` -> values of contract inputs (by input name).
    Nulls count as absent; unknown keys and unsupported values are refused by name."""
    try:
        obj = json.loads(text)
    except RecursionError:
        raise InvalidRequestError("sampling_parameters: nested too deeply; send a flat JSON object of settings") from None
    except ValueError as e:
        raise InvalidRequestError(f"sampling_parameters: not valid JSON ({e}); send a JSON object such as "
                                  '{"max_tokens": 16, "temperature": 0}') from None
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"sampling_parameters: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(k for k in obj if k not in SAMPLING_KEYS)
    if unknown:
        raise InvalidRequestError(f"sampling_parameters: unknown key(s) {unknown}; known keys: {sorted(SAMPLING_KEYS)}")
    out: dict = {}
    for key, v in obj.items():
        if v is None:
            continue
        name, kind = SAMPLING_KEYS[key]
        if kind in ("int", "number"):
            v = _sp_number(key, v, kind == "int")
            if key == "top_k" and v == -1:
                v = 0
            out[name] = v
        elif kind == "words":
            out[name] = _sp_words(key, v, limits)
        elif kind == "bool":
            if not isinstance(v, bool):
                raise _sp_error(key, f"expected true or false, got {json.dumps(v)[:40]}")
            if v:
                out[name] = -1
        elif kind == "logprobs":  # vLLM: the chosen token's plus this many alternatives; true/false from chat requests
            if not isinstance(v, bool):
                n = _sp_number(key, v, True)
                if not 0 <= n <= MAX_TOP_LOG_PROBS:
                    raise _sp_error(key, f"must be in [0, {MAX_TOP_LOG_PROBS}] (alternatives per token), got {v}")
                if n:
                    out["top_log_probs"] = n
            out[name] = v is not False
        elif kind == "no_alternatives":
            if _sp_number(key, v, True) != 0:
                raise _sp_error(key, f"only 0: alternatives' log-probabilities are not computed, got {v}")
        elif kind == "one":
            if _sp_number(key, v, True) != 1:
                raise _sp_error(key, f"only 1 is supported (one sequence per request: send several requests), got {v}")
        elif kind == "bias":
            out[name] = _sp_bias(key, v)
        elif kind == "text":
            if not isinstance(v, str):
                raise _sp_error(key, f"expected a string, got {json.dumps(v)[:40]}")
            out[name] = v
        elif kind == "guide":
            if name in out:
                raise _sp_error(key, "sent with another guide (guided_decoding / structured_outputs); send one")
            if isinstance(v, str):  # NVIDIA's frontend sends json.dumps(asdict(StructuredOutputsParams(...)))
                try:
                    v = json.loads(v)
                except ValueError:
                    raise _sp_error(key, f"expected an object (or its JSON text), got {v[:40]!r}") from None
            out[name] = guide_from_fields(v, f"sampling_parameters.{key}")
        elif kind == "ids":
            if not isinstance(v, list) or len(v) > limits.max_words:
                raise _sp_error(key, f"expected a list of at most {limits.max_words} token ids, got {json.dumps(v)[:40]}")
            out[name] = tuple(_sp_number(key, t, True) for t in v)
    return out


def _sp_bias(key: str, v) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias} (ids as JSON strings or numbers)."""
    if not isinstance(v, dict):
        raise _sp_error(key, f'expected an object mapping token ids to biases, such as {{"50256": -100}}, got {json.dumps(v)[:40]}')
    if len(v) > MAX_LOGIT_BIAS:
        raise _sp_error(key, f"{len(v)} entries; the limit is {MAX_LOGIT_BIAS}")
    out = []
    for token, bias in v.items():
        text = str(token)
        if not text.isdigit():
            raise _sp_error(key, f"keys must be token ids (digits), got {text[:20]!r}")
        out.append((int(text), _sp_number(key, bias, False)))
    return tuple(sorted(out))


def parse_request(
    inputs: dict[str, np.ndarray], default_max_tokens: int, vocab_size: int | None = None, limits: RequestLimits | None = None
) -> ParsedRequest:
    """Triton input tensors (name -> array) -> plain, validated request fields, checked
    against INPUTS and, first of all, the size limits. vocab_size, when known, bounds end_id."""
    limits = limits or RequestLimits()
    unknown = sorted(set(inputs) - set(KNOWN_INPUTS))
    if unknown:
        raise InvalidRequestError(f"unknown input(s) {unknown}; known inputs: {sorted(KNOWN_INPUTS)}")
    check_sizes(inputs, limits)
    for row in INPUTS:
        if not row.optional and row.name not in inputs:
            raise InvalidRequestError(f"{row.name}: missing; send {row.meaning} as a {row.dtype} tensor of shape {list(row.dims)}")
    text = _value(inputs, "text_input")
    if not text:
        raise InvalidRequestError("text_input: empty prompt; send some text")
    sampling = _value(inputs, "sampling_parameters")
    overrides = parse_sampling_parameters(sampling, limits) if sampling is not None else {}
    both = sorted(name for name in overrides if name in inputs)
    if both:
        raise InvalidRequestError(f"{both[0]}: sent both as an input and in sampling_parameters; send it once")
    _value(inputs, "return_num_input_tokens")  # vLLM's flags: checked, the final response carries the counts anyway
    _value(inputs, "return_num_output_tokens")

    def get(name: str, default=None):
        """The input's value (or sampling_parameters'); absent: `default` when given, else the contract's default."""
        v = _value(inputs, name)
        if v is None:
            v = overrides.get(name)
        if v is not None:
            return v
        return INPUT[name].default if default is None else default

    def words(name: str) -> tuple[str, ...]:
        return overrides[name] if name in overrides else _word_list(inputs, name, limits.max_words)

    # errors about a field name it as the request did: a sampling_parameters key, or min_length
    keys = {name: key for key, (name, _) in SAMPLING_KEYS.items() if name}
    keys["top_log_probs"] = "logprobs"  # vLLM's logprobs=N sets both
    renames = {name: f"sampling_parameters.{keys[name]}" for name in overrides}
    min_tokens = _value(inputs, "min_tokens")
    if min_tokens is None:
        min_tokens = overrides.get("min_tokens")
    if min_tokens is None:
        min_tokens = get("min_length")  # genai-perf's name for it
        if "min_length" in inputs:
            renames["min_tokens"] = "min_length"
    seed = get("seed")
    if seed is not None and seed < 0:
        raise InvalidRequestError(f"seed: must be >= 0, got {seed}")
    end_id = get("end_id")
    if end_id is not None and (end_id < -1 or (vocab_size is not None and end_id >= vocab_size)):
        allowed = f"a token id in [0, {vocab_size})" if vocab_size is not None else "a token id >= 0"
        raise InvalidRequestError(f"end_id: must be -1 (never stop on a token) or {allowed}, got {end_id}")
    prompt_log_probs = get("prompt_log_probs")
    if prompt_log_probs is not None and not 0 <= prompt_log_probs <= MAX_TOP_LOG_PROBS:
        raise InvalidRequestError(rename_error(
            f"prompt_log_probs: must be in [0, {MAX_TOP_LOG_PROBS}] (alternatives per prompt token), got {prompt_log_probs}",
            renames))
    guided = guide_from_trtllm(get("guided_decoding_guide_type"), get("guided_decoding_guide"))
    if guided is not None and "guided" in overrides:
        raise InvalidRequestError("guided_decoding_guide_type: sent with sampling_parameters.guided_decoding; send one guide")
    guided = guided or overrides.get("guided")
    num_draft = get("num_draft_tokens")
    if num_draft is not None and num_draft < 0:
        raise InvalidRequestError(f"num_draft_tokens: must be >= 0 (0 turns speculation off), got {num_draft}")
    priority = check_priority(get("priority"), renames.get("priority", "priority"))
    params = SamplingParams(
        max_tokens=get("max_tokens", default_max_tokens),
        min_tokens=min_tokens,
        temperature=get("temperature"),
        top_k=get("top_k"),
        top_p=get("top_p"),
        seed=seed,
        repetition_penalty=get("repetition_penalty"),
        frequency_penalty=get("frequency_penalty"),
        presence_penalty=get("presence_penalty"),
        min_p=get("min_p"),
        logit_bias=overrides.get("logit_bias", ()),
        stop_token_ids=overrides.get("stop_token_ids", ()),
        end_id=end_id,
        stop_words=words("stop_words"),
        return_log_probs=bool(get("return_log_probs") or _value(inputs, "return_logprobs") or get("top_log_probs")),
        top_log_probs=get("top_log_probs"),
        prompt_log_probs=prompt_log_probs,
        guided=guided,
    )
    try:
        params.validate()
    except InvalidRequestError as e:
        raise InvalidRequestError(rename_error(str(e), renames)) from None
    return ParsedRequest(
        text=text,
        params=params,
        stream=get("stream"),
        exclude_input_in_output=get("exclude_input_in_output"),
        num_draft_tokens=num_draft,
        bad_words_text=words("bad_words"),
        renames=renames,
        vllm_logprobs=bool(_value(inputs, "return_logprobs")),
        lora_name=get("lora_name") or None,
        priority=priority,
    )


def bad_word_token_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token sequences: as written and with a leading space (how words
    usually appear mid-sentence in byte-level BPE)."""
    out: set[tuple[int, ...]] = set()
    for w in words:
        for variant in (w, " " + w):
            ids = tuple(tokenizer(variant, add_special_tokens=False).input_ids)
            if ids:
                out.add(ids)
    return tuple(sorted(out))


def _tensor(name: str, values) -> np.ndarray:
    """An output array with the contract's datatype for `name`."""
    return np.array(values, dtype=OUTPUT[name].numpy_type)


def vllm_logprobs(event: GenerationEvent, token_text: Callable[[int], str]) -> str:
    """The vLLM backend's `logprobs` output for one response (its src/model.py): a JSON list,
    per token, of {token id: {"logprob", "rank", "decoded_token"}} holding the chosen token and
    the most likely ones (ranks 1..N). NVIDIA's OpenAI frontend reads it
    (_get_logprobs_from_response in its engine/utils/triton.py)."""
    out = []
    ranks = event.ranks or [None] * len(event.token_ids)
    tops = event.top_log_probs or [[] for _ in event.token_ids]
    for token, logprob, rank, top in zip(event.token_ids, event.log_probs, ranks, tops):
        entries = {str(t): {"logprob": lp, "rank": r, "decoded_token": token_text(t)} for r, (t, lp) in enumerate(top, 1)}
        if str(token) not in entries:
            chosen = {"logprob": logprob, "decoded_token": token_text(token)}
            if rank is not None:
                chosen["rank"] = rank
            entries = {str(token): chosen, **entries}
        out.append(entries)
    return json.dumps(out, ensure_ascii=False)


def event_outputs(
    event: GenerationEvent, prefix: str = "", with_log_probs: bool = False, top_log_probs: int = 0,
    token_text: Callable[[int], str] | None = None, prompt_ids: list[int] | None = None,
) -> dict[str, np.ndarray]:
    """Output tensors for one response. Intermediate stream responses carry text only;
    the final one also says why it finished and the token counts. token_text (a token id's
    text): also the vLLM backend's `logprobs` output. prompt_ids: the prompt's tokens, for the
    response that carries their log-probabilities."""
    out: dict[str, np.ndarray] = {"text_output": _tensor("text_output", [(prefix + event.text).encode("utf-8")])}
    if with_log_probs:
        out["output_log_probs"] = _tensor("output_log_probs", event.log_probs)
        if token_text is not None:
            out["logprobs"] = _tensor("logprobs", [vllm_logprobs(event, token_text).encode("utf-8")])
    if event.prompt_log_probs is not None:
        values = [math.nan if v is None else v for v in event.prompt_log_probs]
        out["prompt_token_ids"] = _tensor("prompt_token_ids", (prompt_ids or [])[: len(values)])
        out["prompt_log_probs"] = _tensor("prompt_log_probs", values)
        n = max((len(top) for top in event.prompt_top_log_probs or []), default=0)
        if n:  # [prompt tokens, N]; the first position has none
            rows = [top if top else [(-1, math.nan)] * n for top in event.prompt_top_log_probs]
            out["prompt_top_token_ids"] = _tensor("prompt_top_token_ids", [[t for t, _ in r] for r in rows]).reshape(len(rows), n)
            out["prompt_top_log_probs"] = _tensor("prompt_top_log_probs", [[v for _, v in r] for r in rows]).reshape(len(rows), n)
    if top_log_probs:  # [tokens, N]
        tops = event.top_log_probs
        out["output_top_token_ids"] = _tensor("output_top_token_ids", [[t for t, _ in top] for top in tops]).reshape(
            len(tops), top_log_probs)
        out["output_top_log_probs"] = _tensor("output_top_log_probs", [[lp for _, lp in top] for top in tops]).reshape(
            len(tops), top_log_probs)
    if event.finished:
        rate = event.accepted_draft_tokens / event.draft_tokens if event.draft_tokens else 0.0
        out["finish_reason"] = _tensor("finish_reason", [(event.finish_reason or "").encode()])
        out["num_input_tokens"] = _tensor("num_input_tokens", [event.num_input_tokens])
        out["num_output_tokens"] = _tensor("num_output_tokens", [event.num_output_tokens])
        out["num_cached_tokens"] = _tensor("num_cached_tokens", [event.num_cached_tokens])
        out["total_draft_tokens"] = _tensor("total_draft_tokens", [event.draft_tokens])
        out["total_accepted_draft_tokens"] = _tensor("total_accepted_draft_tokens", [event.accepted_draft_tokens])
        out["acceptance_rate"] = _tensor("acceptance_rate", [rate])
    return out
