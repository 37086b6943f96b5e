"""Structured output in the OpenAI API: `response_format` (OpenAI's json_object and
json_schema) and vLLM's extra fields (`structured_outputs`, and the older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`) -> the `guided_decoding` object of
tritonlm's sampling_parameters (vLLM's names, tritonlm/guide_fields.py).

A structured_outputs object that sets no guide but options (`disable_any_whitespace`) goes
with the guide of response_format or an older field, as in vLLM, or with a tool call's
(guide_options).

Each guide is compiled here once without a tokenizer (llguidance's own check), so a bad
schema, regex or grammar is a 400 naming the field that carried it, before any Triton
request starts.
"""

from __future__ import annotations

from typing import Any

from tritonlm.engine.guided import check_guide
from tritonlm.engine.request import InvalidRequestError
from tritonlm.openai.errors import bad_field, unsupported
from tritonlm.guide_fields import GUIDE_FIELDS, guide_from_fields

GUIDE_OPTIONS = ("disable_any_whitespace",)  # structured_outputs' options that may go with another field's guide

# vLLM's older extra fields (before structured_outputs) -> the structured_outputs key each sets
OLDER_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def guided_decoding(response_format: Any, structured_outputs: Any, older: dict[str, Any]) -> dict | None:
    """The sampling_parameters `guided_decoding` object of a request, or None without a guide.

    response_format: OpenAI's field; structured_outputs: vLLM's object; older: vLLM's
    guided_* fields as sent (None where absent). At most one of the three may set a guide;
    errors are 400s naming the field."""
    sources: list[tuple[str, dict]] = []  # (field that set it, guided_decoding object)
    options: dict = {}  # structured_outputs' options for the guide another field sets
    if response_format is not None:
        guide = _from_response_format(response_format)
        if guide is not None:
            sources.append(("response_format", guide))
    given = {name: v for name, v in older.items() if v is not None}
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise bad_field("structured_outputs", 'expected an object such as {"regex": "[0-9]+"}')
        # vLLM's way: options alone (disable_any_whitespace) apply to another field's guide, or
        # to a tool call's (guide_options)
        options = guide_options(structured_outputs)
        if _sets_guide(structured_outputs) or not (options or sources or given):
            sources.append(("structured_outputs", structured_outputs))
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
    guide = {**guide, **options}
    try:
        check_guide(guide_from_fields(guide, where))
    except InvalidRequestError as e:
        raise bad_field(_param(where, guide), _without_prefix(str(e), where)) from None
    return guide


def _sets_guide(structured_outputs: dict) -> bool:
    return any(structured_outputs.get(k) not in (None, False) for k in GUIDE_FIELDS)


def guide_options(structured_outputs: Any) -> dict:
    """The options of a structured_outputs object that sets no guide of its own, for the guide
    another field sets ({} where it sets one, or is absent); any other key set is a 400."""
    if not isinstance(structured_outputs, dict) or _sets_guide(structured_outputs):
        return {}
    for key, value in structured_outputs.items():
        if key not in GUIDE_OPTIONS and not key.startswith("_") and value not in (None, False):
            raise bad_field(f"structured_outputs.{key}", f"not supported by this server (without a guide of its own, "
                                                         f"structured_outputs takes {', '.join(GUIDE_OPTIONS)})")
    if structured_outputs.get("disable_any_whitespace") not in (None, True, False):
        raise bad_field("structured_outputs.disable_any_whitespace", "expected true or false")
    return {k: structured_outputs[k] for k in GUIDE_OPTIONS if structured_outputs.get(k) is not None}


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
