"""tritonlm/openai/errors.py: OpenAI's error body, and which status, param and code each kind
of Triton or model error becomes (the model's own words kept, Triton's request id dropped)."""

from __future__ import annotations

import pytest

from tritonlm.openai.errors import OpenAIError, bad_field, from_triton, model_not_found, unsupported


def test_the_body_is_openais_shape_with_a_type_per_status():
    assert OpenAIError(400, "x: bad", param="x", code="invalid_value").body() == {
        "error": {"message": "x: bad", "type": "invalid_request_error", "param": "x", "code": "invalid_value"}}
    assert [OpenAIError(s, "m").type for s in (404, 429, 500, 503)] == [
        "invalid_request_error", "rate_limit_error", "server_error", "service_unavailable_error"]
    assert OpenAIError(401, "m", type="invalid_request_error").type == "invalid_request_error"
    assert bad_field("n", "too many").body()["error"] == {"message": "n: too many", "type": "invalid_request_error",
                                                          "param": "n", "code": "invalid_value"}
    assert unsupported("suffix").code == "unsupported_parameter" and unsupported("suffix").message.startswith("suffix: ")
    missing = model_not_found("nope", ["a", "b"])
    assert (missing.status, missing.param, missing.code) == (404, "model", "model_not_found")
    assert "'nope'" in missing.message and "a, b" in missing.message
    assert "served: none" in model_not_found("nope", []).message


@pytest.mark.parametrize("message, chat, status, param, code", [
    ("[request id: 12] server busy: 4 requests wait", False, 429, None, "server_busy"),
    ("request timed out after waiting 5 s in the queue", False, 503, None, "unavailable"),
    ("the model is shutting down", False, 503, None, "unavailable"),
    ("overloaded: predicted time to first token 2400 ms is past slo_ttft_ms=500 with 9 requests queued and 4 running; "
     "retry later", False, 503, None, "slo_overloaded"),
    ("Request for unknown model: 'x' is not found", False, 404, "model", "model_not_found"),
    ("guided_decoding: the answer violates the json_schema: $.a: not an integer", False, 500, None, "schema_violation"),
    ("internal error: boom", False, 500, None, "internal_error"),
    ("text_input: the prompt has 900 tokens; at most 256", False, 400, "prompt", "invalid_value"),
    ("text_input: the prompt has 900 tokens; at most 256", True, 400, "messages", "invalid_value"),
    ("sampling_parameters.top_k: must be >= -1", False, 400, "top_k", "invalid_value"),
    ("stop_words: too many", False, 400, "stop", "invalid_value"),
    ("guided_decoding: the grammar does not compile for this tokenizer", False, 400, "response_format", "invalid_value"),
    ("sampling_parameters: not a JSON object", False, 400, "sampling_parameters", "invalid_value"),
    ("request: exclude_input_in_output must be true with stream", False, 400, None, "invalid_value"),
    ("something nobody expected", False, 500, None, "internal_error"),
])
def test_a_triton_error_becomes_its_status_and_names_the_openai_field(message, chat, status, param, code):
    error = from_triton(message, chat=chat)
    assert (error.status, error.param, error.code) == (status, param, code), error.body()
    assert error.message == message.removeprefix("[request id: 12] ")
