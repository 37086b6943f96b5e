"""Structured output in the OpenAI API: `response_format` (OpenAI's json_object and
json_schema) and vLLM's extra fields (`structured_outputs`, and the older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`) -> the `guided_decoding` object of
tritonlm's sampling_parameters (vLLM's names, tritonlm/guide_fields.py).

Each guide is compiled here once without a tokenizer (llguidance's own check), so a bad
schema, regex or grammar is a 400 naming the field that carried it, before any Triton
request starts.
"""

from __future__ import annotations

from typing import Any

from tritonlm.engine.guided import check_guide
from tritonlm.engine.request import InvalidRequestError
from tritonlm.openai.errors import bad_field, unsupported
from tritonlm.guide_fields import guide_from_fields

# vLLM's older extra fields (before structured_outputs) -> the structured_outputs key each sets
OLDER_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def guided_decoding(response_format: Any, structured_outputs: Any, older: dict[str, Any]) -> dict | None:
    """The sampling_parameters `guided_decoding` object of a request, or None without a guide.

    response_format: OpenAI's field; structured_outputs: vLLM's object; older: vLLM's
    guided_* fields as sent (None where absent). At most one of the three may set a guide;
    errors are 400s naming the field."""
    sources: list[tuple[str, dict]] = []  # (field that set it, guided_decoding object)
    if response_format is not None:
        guide = _from_response_format(response_format)
        if guide is not None:
            sources.append(("response_format", guide))
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise bad_field("structured_outputs", 'expected an object such as {"regex": "[0-9]+"}')
        sources.append(("structured_outputs", structured_outputs))
    given = {name: v for name, v in older.items() if v is not None}
    if len(given) > 1:
        first, second = sorted(given)[:2]
        raise bad_field(second, f"sent with {first}; send one guide")
    for name, v in given.items():
        sources.append((name, {OLDER_FIELDS[name]: v}))
    if not sources:
        return None
    if len(sources) > 1:
        raise bad_field(sources[1][0], f"sent with {sources[0][0]}; send one guide")
    where, guide = sources[0]
    try:
        check_guide(guide_from_fields(guide, where))
    except InvalidRequestError as e:
        raise bad_field(_param(where, guide), _without_prefix(str(e), where)) from None
    return guide


def _from_response_format(rf: Any) -> dict | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_field("response_format", 'expected an object with a type: "text", "json_object" or "json_schema"')
    kind = rf["type"]
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra:
        raise bad_field(f"response_format.{extra[0]}", "unrecognized field")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise unsupported("response_format.type", f'{kind!r} is not supported: use "text", "json_object" or "json_schema"')
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_field("response_format.json_schema", "required with type json_schema: an object with name and schema")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise bad_field(f"response_format.json_schema.{unknown[0]}", "unrecognized field")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_field("response_format.json_schema.name", "required: a non-empty string")
    if spec.get("strict") not in (None, True, False):
        raise bad_field("response_format.json_schema.strict", "expected true or false")
    schema = spec.get("schema")
    if schema is None:  # OpenAI: no schema, any JSON object
        return {"json_object": True}
    if not isinstance(schema, dict):
        raise bad_field("response_format.json_schema.schema", "expected a JSON Schema object")
    return {"json": schema}


def _param(where: str, guide: dict) -> str:
    """The field a guide's own error is about."""
    if where == "response_format":
        return "response_format.json_schema.schema" if "json" in guide else "response_format"
    if where == "structured_outputs":
        keys = [k for k in guide if k in ("json", "json_object", "regex", "grammar", "choice")]
        return f"structured_outputs.{keys[0]}" if len(keys) == 1 else where
    return where


def _without_prefix(message: str, where: str) -> str:
    for prefix in (f"{where}: ", "guided_decoding: "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message
