"""OpenAI tool calls: the request's tools and tool_choice, the guide that makes named and
required calls valid, and the readers that turn an answer's text into `tool_calls`.

tool_choice decides how the answer becomes calls:
- "none": plain text (the tools are still rendered into the prompt when the template can);
- "auto": the chat template renders the tools (its own format) and the answer is read for
  Hermes-style `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (HermesReader);
- "required": guided decoding keeps the answer a JSON array of calls
  `[{"name": <one of the tools>, "arguments": <its parameters>}, ...]` (one call when
  parallel_tool_calls is false), read by CallListReader;
- a named function: guided decoding keeps the answer a JSON object valid for its parameters;
  the answer is that call's arguments (NamedReader).

Every reader takes the answer's text piece by piece and gives back what is final so far:
content text and whole or partial calls (ToolDelta), so streamed deltas and the
non-streamed message come from the same reading.

An answer cut short (max_tokens) ends the same streamed or not: a named call keeps the
arguments made so far; a required call cut inside an array element whose name is written
becomes a call with the arguments' text so far (nothing if the name is not complete); an
auto block that does not parse stays content. The answer's finish_reason is `tool_calls`
only when it ended on its own and every call's arguments parse (`Reader.complete`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tritonlm.engine.guided import check_guide
from tritonlm.engine.request import GuidedDecoding, InvalidRequestError
from tritonlm.openai.errors import bad_field

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
# the start of a required call's element, cut short: its complete name, then maybe the arguments' key
# (the guide writes "name" first: required_schema lists it first)
CUT_ELEMENT = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*(,\s*"arguments"\s*:\s*)?')


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --- the request's tools ------------------------------------------------------------------------
@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict  # a JSON Schema (EMPTY_PARAMETERS when the request gives none)
    given: dict  # the tool as the request sent it: what the chat template renders


def check_tools(tools: Any) -> list[Function]:
    """The `tools` field, checked: function tools with unique names and JSON Schema parameters."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(tools, list) or not tools:
        raise bad_field("tools", "expected a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    if len(tools) > MAX_TOOLS:
        raise bad_field("tools", f"{len(tools)} tools; at most {MAX_TOOLS}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_field(f"{where}.type", 'only "function" tools are supported')
        unknown = sorted(set(tool) - {"type", "function"})
        if unknown:
            raise bad_field(f"{where}.{unknown[0]}", "unrecognized field")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_field(f"{where}.function", "expected an object with name, description and parameters")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise bad_field(f"{where}.function.{unknown[0]}", "unrecognized field")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise bad_field(f"{where}.function.name", f"expected 1-64 letters, digits, _ or -, got {json.dumps(name)[:70]}")
        if name in seen:
            raise bad_field(f"{where}.function.name", f"{name!r} is defined twice")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise bad_field(f"{where}.function.description", "expected a string")
        if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
            raise bad_field(f"{where}.function.strict", "expected true or false")
        parameters = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise bad_field(f"{where}.function.parameters", "expected a JSON Schema object")
        try:
            Draft202012Validator.check_schema(parameters)
        except SchemaError as e:
            raise bad_field(f"{where}.function.parameters", f"not a valid JSON Schema: {e.message}") from None
        if parameters.get("type", "object") != "object":
            raise bad_field(f"{where}.function.parameters", f'the arguments must be an object ("type": "object"), got {parameters.get("type")!r}')
        try:  # named and required calls are guided by it: the grammar library must take it too
            check_guide(GuidedDecoding("json_schema", json.dumps(parameters)))
        except InvalidRequestError as e:
            raise bad_field(f"{where}.function.parameters", str(e).removeprefix("guided_decoding: ")) from None
        out.append(Function(name, description, parameters, tool))
    return out


def check_tool_choice(choice: Any, functions: list[Function]) -> str | Function:
    """"none" | "auto" | "required", or the named Function."""
    if choice is None:
        return "auto" if functions else "none"
    if choice in ("none", "auto", "required"):
        if choice != "none" and not functions:
            raise bad_field("tool_choice", f"{choice!r} needs tools; send tools or leave tool_choice out")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and set(choice) == {"type", "function"} and set(choice["function"]) == {"name"}:
        name = choice["function"]["name"]
        for fn in functions:
            if fn.name == name:
                return fn
        raise bad_field("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(f.name for f in functions) or 'none sent'})")
    raise bad_field("tool_choice", 'expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def required_schema(functions: list[Function], parallel: bool) -> dict:
    """tool_choice "required": a JSON array of calls, each of one of the tools with valid arguments."""
    calls = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema: dict = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def guide(choice: str | Function, functions: list[Function], parallel: bool) -> dict | None:
    """The sampling_parameters `guided_decoding` object that keeps the answer a valid call, or None."""
    if isinstance(choice, Function):
        return {"json": choice.parameters}
    if choice == "required":
        return {"json": required_schema(functions, parallel)}
    return None


# --- reading the answer -------------------------------------------------------------------------
@dataclass
class ToolDelta:
    """One piece of a call: `index` among the answer's calls; id, name on its first piece;
    arguments: more of its arguments' text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def chunk(self) -> dict:
        """OpenAI's streamed form (choices[].delta.tool_calls[])."""
        out: dict = {"index": self.index}
        fn: dict = {"arguments": self.arguments}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
            fn = {"name": self.name, "arguments": self.arguments}
        out["function"] = fn
        return out


@dataclass
class Reading:
    """What a reader has made final so far, for one piece of text."""

    content: str = ""
    calls: list[ToolDelta] = field(default_factory=list)


class Reader:
    """Reads an answer piece by piece; `calls` accumulates the whole calls."""

    def __init__(self):
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}
        self.content: list[str] = []

    def _call(self, name: str, arguments: str) -> ToolDelta:
        delta = ToolDelta(len(self.calls), call_id(), name, arguments)
        self.calls.append({"id": delta.id, "type": "function", "function": {"name": name, "arguments": arguments}})
        return delta

    def _more(self, arguments: str) -> ToolDelta:
        self.calls[-1]["function"]["arguments"] += arguments
        return ToolDelta(len(self.calls) - 1, arguments=arguments)

    def feed(self, text: str) -> Reading:
        raise NotImplementedError

    def finish(self) -> Reading:
        return Reading()

    def message(self) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of the whole answer: content None when there are calls and the
        text around them is only whitespace."""
        content = "".join(self.content)
        return (None if self.calls and not content.strip() else content), self.calls

    def complete(self) -> bool:
        """Every call's arguments are a whole JSON object (a cut call's are not)."""
        for call in self.calls:
            try:
                if not isinstance(json.loads(call["function"]["arguments"]), dict):
                    return False
            except ValueError:
                return False
        return True


class ForcedReader(Reader):
    """A reader of a guided answer (named or required): all of it is calls, never content."""

    def message(self) -> tuple[str | None, list[dict]]:
        return None, self.calls


class NamedReader(ForcedReader):
    """A named function: the whole answer is its arguments, streamed as they come (cut short,
    the arguments so far)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Reading:
        if not self.calls:
            return Reading(calls=[self._call(self.name, text)])
        return Reading(calls=[self._more(text)] if text else [])


class CallListReader(ForcedReader):
    """tool_choice "required": the answer is a JSON array of {"name", "arguments"}; each call is
    given once its object closes (a scan of the brackets outside strings). An element left
    open at the end (max_tokens) becomes a call when its name is complete, its arguments the
    text written so far."""

    def __init__(self):
        super().__init__()
        self.depth = 0
        self.in_string = self.escaped = False
        self.current: list[str] = []  # the text of the array element being read

    def feed(self, text: str) -> Reading:
        out = Reading()
        for ch in text:
            if self.depth >= 2 or (self.depth == 1 and ch == "{"):
                self.current.append(ch)
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}":
                    out.calls += self._element("".join(self.current))
                    self.current = []
        return out

    def finish(self) -> Reading:
        text, self.current = "".join(self.current), []
        found = CUT_ELEMENT.match(text)
        if found is None:  # nothing open, or cut before its name was complete
            return Reading()
        arguments = text[found.end():] if found.group(2) else ""
        return Reading(calls=[self._call(json.loads(found.group(1)), arguments)])

    def _element(self, text: str) -> list[ToolDelta]:
        try:
            obj = json.loads(text)
        except ValueError:
            return []  # the guide forbids this
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        return [self._call(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False))]


class HermesReader(Reader):
    """tool_choice "auto": `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks are
    calls, the text outside them content. Text that may be the start of a block is held back
    until it is known; a block is read when it closes (or, unclosed, at the end). A block that
    is not a JSON object naming one of the tools with object arguments stays content, as written.
    parallel: false keeps only the first call (later blocks stay content)."""

    def __init__(self, names: set[str], parallel: bool = True):
        super().__init__()
        self.names = names
        self.parallel = parallel
        self.held = ""  # text not yet known to be content or a block

    def feed(self, text: str) -> Reading:
        self.held += text
        out = Reading()
        while True:
            start = self.held.find(CALL_START)
            if start < 0:
                keep = _partial_suffix(self.held, CALL_START)
                self._content(out, self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                return out
            end = self.held.find(CALL_END, start)
            if end < 0:
                self._content(out, self.held[:start])
                self.held = self.held[start:]
                return out
            self._content(out, self.held[:start])
            self._block(out, self.held[start: end + len(CALL_END)], self.held[start + len(CALL_START): end])
            self.held = self.held[end + len(CALL_END):]

    def finish(self) -> Reading:
        out = Reading()
        if self.held.startswith(CALL_START):  # a block the answer never closed: read it as it is
            self._block(out, self.held, self.held[len(CALL_START):])
        else:
            self._content(out, self.held)
        self.held = ""
        return out

    def _content(self, out: Reading, text: str) -> None:
        if text:
            out.content += text
            self.content.append(text)

    def _block(self, out: Reading, written: str, inner: str) -> None:
        call = self._parse(inner)
        if call is None or (self.calls and not self.parallel):
            self._content(out, written)
        else:
            out.calls.append(self._call(*call))

    def _parse(self, inner: str) -> tuple[str, str] | None:
        try:
            obj = json.loads(inner)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """How many trailing characters of text could begin marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def reader(choice: str | Function, functions: list[Function], parallel: bool) -> Reader | None:
    """The reader of answers for this tool_choice; None: plain text ("none")."""
    if isinstance(choice, Function):
        return NamedReader(choice.name)
    if choice == "required":
        return CallListReader()
    if choice == "auto":
        return HermesReader({f.name for f in functions}, parallel)
    return None
