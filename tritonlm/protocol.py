"""The generation model's tensor contract, as plain NumPy in and out.

Names follow what Triton LLM users and tools already send (TensorRT-LLM's
ensemble, vLLM's backend, genai-perf): see CONVENTIONS.md. The Triton glue only
moves tensors between Triton and these functions, so every rule here is tested
without a server.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tritonlm.engine.request import GenerationEvent, InvalidRequestError, SamplingParams

INT_INPUTS = ("max_tokens", "min_tokens", "min_length", "end_id", "pad_id", "top_k", "num_draft_tokens")
FLOAT_INPUTS = ("temperature", "top_p", "repetition_penalty")
BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_log_probs")
LIST_INPUTS = ("stop_words", "bad_words")
KNOWN_INPUTS = ("text_input", "seed", *INT_INPUTS, *FLOAT_INPUTS, *BOOL_INPUTS, *LIST_INPUTS)


@dataclass(frozen=True)
class ParsedRequest:
    text: str
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    num_draft_tokens: int | None
    bad_words_text: tuple[str, ...]  # turned into token ids by the caller (needs the tokenizer)


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


def _word_list(inputs: dict[str, np.ndarray], name: str) -> tuple[str, ...]:
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
    return tuple(words)


def parse_request(inputs: dict[str, np.ndarray], default_max_tokens: int, vocab_size: int | None = None) -> ParsedRequest:
    """Triton input tensors (name -> array) -> plain, validated request fields.
    vocab_size, when known, bounds end_id."""
    unknown = sorted(set(inputs) - set(KNOWN_INPUTS))
    if unknown:
        raise InvalidRequestError(f"unknown input(s) {unknown}; known inputs: {sorted(KNOWN_INPUTS)}")
    if "text_input" not in inputs:
        raise InvalidRequestError("text_input: missing; send the prompt as a BYTES tensor of shape [1]")
    text = _text(_scalar(inputs, "text_input"), "text_input")
    if not text:
        raise InvalidRequestError("text_input: empty prompt; send some text")

    def get_int(name: str, default):
        v = _scalar(inputs, name)
        if v is None:
            return default
        if isinstance(v, (bytes, str, bool, np.bool_)) or not np.issubdtype(np.asarray(v).dtype, np.integer):
            raise InvalidRequestError(f"{name}: expected an integer (INT32), got {np.asarray(v).dtype}")
        return int(v)

    def get_float(name: str, default):
        v = _scalar(inputs, name)
        if v is None:
            return default
        if isinstance(v, (bytes, str, bool, np.bool_)) or not np.issubdtype(np.asarray(v).dtype, np.number):
            raise InvalidRequestError(f"{name}: expected a number (FP32), got {np.asarray(v).dtype}")
        value = float(v)
        if not np.isfinite(value):
            raise InvalidRequestError(f"{name}: must be a finite number, got {value}")
        return value

    def get_bool(name: str, default: bool) -> bool:
        v = _scalar(inputs, name)
        if v is None:
            return default
        if not isinstance(v, (bool, np.bool_)):
            raise InvalidRequestError(f"{name}: expected a boolean (BOOL), got {np.asarray(v).dtype}")
        return bool(v)

    min_tokens = get_int("min_tokens", None)
    if min_tokens is None:
        min_tokens = get_int("min_length", 0)  # genai-perf's name for it
    seed = _scalar(inputs, "seed")
    if seed is not None:
        if isinstance(seed, (bytes, str, bool, np.bool_)) or not np.issubdtype(np.asarray(seed).dtype, np.integer):
            raise InvalidRequestError(f"seed: expected an integer (UINT64), got {np.asarray(seed).dtype}")
        seed = int(seed)
        if seed < 0:
            raise InvalidRequestError(f"seed: must be >= 0, got {seed}")
    end_id = get_int("end_id", None)
    if end_id is not None and (end_id < -1 or (vocab_size is not None and end_id >= vocab_size)):
        allowed = f"a token id in [0, {vocab_size})" if vocab_size is not None else "a token id >= 0"
        raise InvalidRequestError(f"end_id: must be -1 (never stop on a token) or {allowed}, got {end_id}")
    num_draft = get_int("num_draft_tokens", None)
    if num_draft is not None and num_draft < 0:
        raise InvalidRequestError(f"num_draft_tokens: must be >= 0 (0 turns speculation off), got {num_draft}")
    params = SamplingParams(
        max_tokens=get_int("max_tokens", default_max_tokens),
        min_tokens=min_tokens,
        temperature=get_float("temperature", None),
        top_k=get_int("top_k", 0),
        top_p=get_float("top_p", 1.0),
        seed=seed,
        repetition_penalty=get_float("repetition_penalty", 1.0),
        end_id=end_id,
        stop_words=_word_list(inputs, "stop_words"),
        return_log_probs=get_bool("return_log_probs", False),
    )
    params.validate()
    return ParsedRequest(
        text=text,
        params=params,
        stream=get_bool("stream", False),
        exclude_input_in_output=get_bool("exclude_input_in_output", False),
        num_draft_tokens=num_draft,
        bad_words_text=_word_list(inputs, "bad_words"),
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


def event_outputs(event: GenerationEvent, prefix: str = "", with_log_probs: bool = False) -> dict[str, np.ndarray]:
    """Output tensors for one response. Intermediate stream responses carry text only;
    the final one also says why it finished and the token counts."""
    out: dict[str, np.ndarray] = {"text_output": np.array([(prefix + event.text).encode("utf-8")], dtype=object)}
    if with_log_probs:
        out["output_log_probs"] = np.asarray(event.log_probs, dtype=np.float32)
    if event.finished:
        out["finish_reason"] = np.array([(event.finish_reason or "").encode()], dtype=object)
        out["num_input_tokens"] = np.array([event.num_input_tokens], dtype=np.int32)
        out["num_output_tokens"] = np.array([event.num_output_tokens], dtype=np.int32)
        out["total_draft_tokens"] = np.array([event.draft_tokens], dtype=np.int32)
        out["total_accepted_draft_tokens"] = np.array([event.accepted_draft_tokens], dtype=np.int32)
        rate = event.accepted_draft_tokens / event.draft_tokens if event.draft_tokens else 0.0
        out["acceptance_rate"] = np.array([rate], dtype=np.float32)
    return out
