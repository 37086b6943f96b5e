"""A guide (guided decoding, structured output) as requests carry it -> GuidedDecoding:
vLLM's structured-output object (`sampling_parameters.guided_decoding`, the OpenAI
frontend's `structured_outputs`) and TensorRT-LLM's `guided_decoding_guide_type` /
`guided_decoding_guide` inputs. Errors name the field; the guide itself is checked when it
is compiled (tritonlm/engine/guided.py)."""

from __future__ import annotations

import json

from tritonlm.engine.request import GuidedDecoding, InvalidRequestError

# vLLM's structured-output fields -> GuidedDecoding kinds
GUIDE_FIELDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "grammar": "grammar", "choice": "choice"}
# vLLM's options this server does not implement: refused by name when set
GUIDE_OPTIONS_REFUSED = ("structural_tag", "whitespace_pattern", "disable_additional_properties", "disable_fallback")


def guide_from_fields(obj, where: str) -> GuidedDecoding:
    """vLLM's structured-output object ({"json": schema} | {"json_object": true} | {"regex": ..} |
    {"grammar": ..} | {"choice": [..]}) -> GuidedDecoding. Exactly one guide; errors name
    `where` and the field. The guide itself is checked when it is compiled."""
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"{where}: expected an object such as {{\"regex\": \"[0-9]+\"}}, got {json.dumps(obj)[:40]}")
    # vLLM's own state (`_backend`, `_backend_was_auto`: what asdict() of its dataclass holds) says
    # nothing about the guide
    obj = {k: v for k, v in obj.items() if not k.startswith("_")}
    unknown = sorted(k for k in obj if k not in GUIDE_FIELDS and k not in GUIDE_OPTIONS_REFUSED and k != "disable_any_whitespace")
    if unknown:
        raise InvalidRequestError(f"{where}: unknown key(s) {unknown}; known keys: {sorted(GUIDE_FIELDS)}")
    for key in GUIDE_OPTIONS_REFUSED:
        if obj.get(key) not in (None, False):
            raise InvalidRequestError(f"{where}.{key}: not supported by this server")
    if obj.get("disable_any_whitespace") not in (None, True, False):
        raise InvalidRequestError(f"{where}.disable_any_whitespace: expected true or false, "
                                  f"got {json.dumps(obj['disable_any_whitespace'])[:40]}")
    # vLLM's disable_any_whitespace: JSON without whitespace between tokens; otherwise bounded whitespace
    compact = obj.get("disable_any_whitespace") is True
    given = [k for k in GUIDE_FIELDS if obj.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequestError(f"{where}: exactly one of {', '.join(GUIDE_FIELDS)} is needed, got "
                                  f"{', '.join(given) if given else 'none'}")
    key = given[0]
    v = obj[key]
    if key == "json":
        if isinstance(v, (dict, bool)):
            v = json.dumps(v)
        if not isinstance(v, str):
            raise InvalidRequestError(f"{where}.json: expected a JSON Schema (an object or its JSON text), got {json.dumps(v)[:40]}")
        return GuidedDecoding("json_schema", v, compact=compact)
    if key == "json_object":
        if v is not True:
            raise InvalidRequestError(f"{where}.json_object: expected true, got {json.dumps(v)[:40]}")
        return GuidedDecoding("json_object", compact=compact)
    if key == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise InvalidRequestError(f"{where}.choice: expected a non-empty list of non-empty strings, got {json.dumps(v)[:40]}")
        return GuidedDecoding("choice", json.dumps(v, ensure_ascii=False))
    if not isinstance(v, str) or not v:
        raise InvalidRequestError(f"{where}.{key}: expected a non-empty string, got {json.dumps(v)[:40]}")
    return GuidedDecoding(GUIDE_FIELDS[key], v)


# TensorRT-LLM backend's guided_decoding_guide_type values -> GuidedDecoding kinds
TRTLLM_GUIDE_TYPES = {"json": "json_schema", "json_schema": "json_schema", "regex": "regex", "ebnf_grammar": "grammar"}
ANY_JSON_SCHEMA = '{"type": ["object", "array"]}'  # TensorRT-LLM's `json` guide: any JSON object or array


def guide_from_trtllm(guide_type: str | None, guide: str | None) -> GuidedDecoding | None:
    """guided_decoding_guide_type / guided_decoding_guide -> GuidedDecoding (None: neither sent)."""
    if guide_type is None:
        if guide is not None:
            raise InvalidRequestError("guided_decoding_guide: sent without guided_decoding_guide_type; add the type "
                                      f"({', '.join(TRTLLM_GUIDE_TYPES)})")
        return None
    if guide_type not in TRTLLM_GUIDE_TYPES:
        raise InvalidRequestError(f"guided_decoding_guide_type: must be one of {', '.join(TRTLLM_GUIDE_TYPES)}, got {guide_type[:40]!r}")
    if guide_type == "json":
        if guide:
            raise InvalidRequestError("guided_decoding_guide: the `json` guide type takes no guide; use `json_schema` for a schema")
        return GuidedDecoding("json_schema", ANY_JSON_SCHEMA)
    if not guide:
        raise InvalidRequestError(f"guided_decoding_guide: missing or empty; the `{guide_type}` guide type needs one")
    return GuidedDecoding(TRTLLM_GUIDE_TYPES[guide_type], guide)
