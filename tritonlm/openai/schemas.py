"""The OpenAI request bodies this server takes, and what each field becomes on the Triton side.

Parsing is strict: an unknown field, a value of the wrong type or out of range, and a known
field this server does not support (images, the deprecated functions, a response_format type
other than text, json_object and json_schema) each get a 400 whose `param` and message name the
field. Tools are checked in tritonlm/openai/tools.py, guides (response_format, vLLM's
structured_outputs) in tritonlm/openai/structured.py.
`sampling()` turns a request into the `sampling_parameters` JSON of tritonlm's generation
model (tritonlm/protocol.py, SAMPLING_KEYS).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tritonlm.engine.request import PRIORITY_RANGE
from tritonlm.openai.errors import OpenAIError, bad_field, unsupported
from tritonlm.openai.tools import Function, check_tool_choice, check_tools
from tritonlm.openai.structured import OLDER_FIELDS, guide_options, guided_decoding

MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # Triton requests one HTTP request may start (prompts x n)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=2**64 - 1 - MAX_N)
    stop: Any = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    user: str | None = None  # accepted, ignored
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id -> bias in [-100, 100] (checked by the model)
    # extensions, with vLLM's names
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100)
    ignore_eos: bool | None = None
    # lower is served earlier; the model's range, so a bad value is a 400 before any generation
    priority: int | None = Field(None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    # structured output (structured.py): vLLM's object, and its older single fields
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # accepted and ignored
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # chat only: tool calls (tritonlm/openai/tools.py); refused on completions
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer
    # known, refused while set (checked in check_supported)
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    _guided: dict | None = None  # sampling_parameters' guided_decoding, set by check_supported

    # --- checks beyond the types ----------------------------------------------------------
    def check_supported(self) -> None:
        for name in ("functions", "function_call", "audio", "prediction", "web_search_options", "reasoning_effort"):
            if getattr(self, name) is not None:
                hint = " (send tools and tool_choice)" if name in ("functions", "function_call") else ""
                raise unsupported(name, f"is not supported by this server{hint}")
        self._guided = guided_decoding(self.response_format, self.structured_outputs,
                                       {name: getattr(self, name) for name in OLDER_FIELDS})
        if self.modalities is not None and self.modalities != ["text"]:
            raise unsupported("modalities", 'only ["text"] is supported')
        if self.stream_options is not None and not self.stream:
            raise bad_field("stream_options", "only allowed when stream is true")
        self.stop_list()  # its errors now, before any generation

    def stop_list(self) -> list[str]:
        stop = self.stop
        if stop is None:
            return []
        words = [stop] if isinstance(stop, str) else stop
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise bad_field("stop", f"expected a string or a list of strings, got {type(stop).__name__}")
        return [w for w in words if w]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def new_tokens(self) -> int | None:
        return self.max_tokens

    def wants_logprobs(self) -> bool:
        return False

    def top_alternatives(self) -> int:
        """How many most likely tokens to list at each position (top_logprobs / logprobs N)."""
        return 0

    def sampling(self, choice: int = 0) -> dict:
        """sampling_parameters for the `choice`-th of n generations (each gets seed + choice,
        so several choices with a seed differ from each other and repeat across requests)."""
        out: dict[str, Any] = {}
        if self.new_tokens() is not None:
            out["max_tokens"] = self.new_tokens()
        for name in ("temperature", "top_p", "top_k", "min_p", "min_tokens", "repetition_penalty", "frequency_penalty",
                     "presence_penalty", "logit_bias", "stop_token_ids", "priority"):
            value = getattr(self, name)
            if value is not None and value != {} and value != []:
                out[name] = value
        if self.seed is not None:
            out["seed"] = self.seed + choice
        stop = self.stop_list()
        if stop:
            out["stop"] = stop
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.wants_logprobs():
            out["logprobs"] = self.top_alternatives()  # the chosen token's, and this many most likely
        if self._guided is not None:
            out["guided_decoding"] = self._guided
        return out


class CompletionRequest(_Request):
    prompt: Any
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                raise unsupported(name, "is a chat field: use /v1/chat/completions")
        if self.suffix:
            raise unsupported("suffix", "is not supported by this server (no insertion)")
        if self.best_of not in (None, 1):
            raise unsupported("best_of", f"only 1 is supported, got {self.best_of}")
        if len(self.prompts()) * (self.n or 1) > MAX_CHOICES:
            raise bad_field("n", f"{len(self.prompts())} prompts x n={self.n} choices; at most {MAX_CHOICES} per request")

    def prompts(self) -> list[str]:
        p = self.prompt
        if isinstance(p, str):
            prompts = [p]
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            prompts = p
        elif isinstance(p, list) and p and all(isinstance(x, int) or isinstance(x, list) for x in p):
            raise unsupported("prompt", "token-id prompts are not supported; send the text (a string or a list of strings)")
        else:
            raise bad_field("prompt", "expected a string or a non-empty list of strings")
        for i, text in enumerate(prompts):
            if not text:
                raise bad_field("prompt" if len(prompts) == 1 else f"prompt[{i}]", "empty prompt; send some text")
        return prompts

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def top_alternatives(self) -> int:
        return self.logprobs or 0

    def sampling(self, choice: int = 0) -> dict:
        out = super().sampling(choice)
        if self.echo and self.logprobs is not None:  # the prompt's tokens get theirs too (vLLM's name)
            out["prompt_logprobs"] = self.logprobs
        return out


class ChatCompletionRequest(_Request):
    messages: list[Any] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    _functions: list = []  # the checked tools (check_supported)
    _choice: Any = "none"  # the checked tool_choice

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise bad_field("top_logprobs", "needs logprobs: true")
        self._functions = check_tools(self.tools) if self.tools is not None else []
        self._choice = check_tool_choice(self.tool_choice, self._functions)
        self.chat_messages()

    @property
    def functions_list(self) -> list[Function]:
        return self._functions

    @property
    def choice(self) -> str | Function:
        """tool_choice, checked: "none", "auto", "required" or the named Function."""
        return self._choice

    @property
    def parallel(self) -> bool:
        return self.parallel_tool_calls is not False

    @property
    def guide_options(self) -> dict:
        """structured_outputs' options (disable_any_whitespace) for a tool call's guide."""
        return guide_options(self.structured_outputs)

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def wants_logprobs(self) -> bool:
        return bool(self.logprobs)

    def top_alternatives(self) -> int:
        return self.top_logprobs or 0 if self.logprobs else 0

    def chat_messages(self) -> list[dict]:
        """The messages as the chat template takes them: role and text content; an assistant's
        tool_calls with their arguments as objects, and tool results with their tool_call_id
        (the form transformers' chat templates take)."""
        out = []
        for i, m in enumerate(self.messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict):
                raise bad_field(where, "expected an object with role and content")
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant", "tool"):
                if role == "function":
                    raise unsupported(f"{where}.role", "'function' messages are deprecated and not supported; send 'tool' messages")
                raise bad_field(f"{where}.role", f"expected system, developer, user, assistant or tool, got {role!r}")
            allowed = {"role", "content", "name", "refusal"} | ({"tool_calls"} if role == "assistant" else set()) \
                | ({"tool_call_id"} if role == "tool" else set())
            for key in m:
                if key in ("function_call", "audio"):
                    raise unsupported(f"{where}.{key}", "is not supported by this server (send tool_calls; no audio)")
                if key not in allowed:
                    raise bad_field(f"{where}.{key}", "unrecognized field" if key not in ("tool_calls", "tool_call_id")
                                    else f"only allowed on {'assistant' if key == 'tool_calls' else 'tool'} messages")
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "text" and isinstance(part.get("text"), str):
                        texts.append(part["text"])
                    elif kind in ("image_url", "input_image", "image"):
                        raise unsupported(f"{where}.content[{j}]", "images are not supported by this server (text only)")
                    elif kind in ("input_audio", "file", "refusal"):
                        raise unsupported(f"{where}.content[{j}]", f"{kind} content is not supported by this server (text only)")
                    else:
                        raise bad_field(f"{where}.content[{j}]", 'expected {"type": "text", "text": "..."}')
                content = "\n".join(texts)
            elif content is None:
                if role != "assistant":
                    raise bad_field(f"{where}.content", "required")
                content = None if m.get("tool_calls") else ""
            elif not isinstance(content, str):
                raise bad_field(f"{where}.content", "expected a string or a list of text parts")
            message = {"role": "system" if role == "developer" else role, "content": content}
            if isinstance(m.get("name"), str):
                message["name"] = m["name"]
            if role == "assistant" and m.get("tool_calls") is not None:
                message["tool_calls"] = _history_calls(m["tool_calls"], f"{where}.tool_calls")
            if role == "tool":
                if not isinstance(m.get("tool_call_id"), str) or not m["tool_call_id"]:
                    raise bad_field(f"{where}.tool_call_id", "required: the id of the call this answers")
                message["tool_call_id"] = m["tool_call_id"]
            out.append(message)
        return out


def _history_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's tool_calls as chat templates take them: arguments as an object."""
    if not isinstance(calls, list):
        raise bad_field(where, "expected a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(call.get("function"), dict):
            raise bad_field(at, 'expected {"id": ..., "type": "function", "function": {"name": ..., "arguments": "..."}}')
        fn = call["function"]
        if not isinstance(fn.get("name"), str):
            raise bad_field(f"{at}.function.name", "required: a string")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as e:
                raise bad_field(f"{at}.function.arguments", f"not valid JSON ({e})") from None
        if not isinstance(arguments, dict):
            raise bad_field(f"{at}.function.arguments", "expected a JSON object")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _loc(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "body"


def parse_body(model: type[_Request], body: Any) -> _Request:
    """The request model from a JSON body; every problem a 400 naming the field."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _loc(err["loc"])
        if err["type"] == "extra_forbidden":
            raise OpenAIError(400, f"{param}: unrecognized request argument", param=param, code="unknown_parameter") from None
        if err["type"] == "missing":
            raise OpenAIError(400, f"{param}: required", param=param, code="missing_required_parameter") from None
        got = repr(err.get("input"))[:60]
        raise OpenAIError(400, f"{param}: {err['msg']} (got {got})", param=param, code="invalid_value") from None
    request.check_supported()
    return request
