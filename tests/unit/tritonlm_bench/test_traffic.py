"""perf/tritonlm_bench/traffic.py: what one request's stream of responses is judged to be
(completed, cancelled, refused as expected, or unexpected), against a scripted stub, and the
per-minute table against counts made by hand and numpy's percentiles."""

from __future__ import annotations

import random

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from tritonlm_bench import traffic
from tritonlm_bench.traffic import Record, minute_rows, one_request, outcome_counts, stream_of


class ScriptedRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def piece() -> service_pb2.ModelStreamInferResponse:
    return service_pb2.ModelStreamInferResponse(infer_response=service_pb2.ModelInferResponse(model_name="m"))


def final(tokens: int) -> service_pb2.ModelStreamInferResponse:
    result = service_pb2.ModelInferResponse(model_name="m")
    result.outputs.add(name="num_output_tokens", datatype="INT32", shape=[1])
    result.raw_output_contents.append(np.array([tokens], np.int32).tobytes())
    result.parameters["triton_final_response"].bool_param = True
    return service_pb2.ModelStreamInferResponse(infer_response=result)


def error(message: str) -> service_pb2.ModelStreamInferResponse:
    return service_pb2.ModelStreamInferResponse(error_message=message)


class StreamInferCall:
    """A ModelStreamInfer call that plays its script: responses, and an RpcError (a code) where
    one stands; cancel() makes the next read raise CANCELLED, as grpc does."""

    def __init__(self, script: list) -> None:
        self.script, self.cancelled, self.served = script, False, 0

    def __iter__(self):
        for item in self.script:
            if self.cancelled:
                raise ScriptedRpcError(grpc.StatusCode.CANCELLED)
            if isinstance(item, grpc.StatusCode):
                raise ScriptedRpcError(item)
            self.served += 1
            yield item

    def cancel(self) -> None:
        self.cancelled = True


class StreamInferStub:
    def __init__(self, script: list) -> None:
        self.script, self.requests = script, []

    def ModelStreamInfer(self, requests, timeout):  # noqa: N802 - grpc's name
        self.requests.extend(requests)
        self.call = StreamInferCall(self.script)
        return self.call


@pytest.fixture(autouse=True)
def prompts(monkeypatch):
    monkeypatch.setattr(traffic, "PROMPTS", {n: [b"the old city"] for n in traffic.PROMPT_TOKENS})
    monkeypatch.setattr(traffic, "BAD", [("top_p 0", "top_p", traffic.BAD[6][2])])


def run(script: list, kind: str, seed: int = 0) -> tuple[Record, StreamInferStub]:
    stub = StreamInferStub(script)
    fractions = {"good": (0.0, 0.0), "cancel": (1.0, 0.0), "bad": (0.0, 1.0)}[kind]
    stream = 1.0 if kind == "good" else 0.7  # good requests streamed, so they have a TTFT
    return one_request(stub, "m", random.Random(seed), "r-1", 0.0, *fractions, stream_fraction=stream), stub


def test_a_good_request_that_streams_to_its_final_response_is_completed():
    rec, stub = run([piece(), piece(), final(17)], "good")
    assert (rec.kind, rec.outcome, rec.tokens) == ("good", "completed", 17)
    assert rec.ttft is not None and 0 <= rec.ttft and rec.start <= rec.end
    request = stub.requests[0]
    assert request.model_name == "m" and request.id == "r-1"
    assert {"text_input", "max_tokens", "stream", "end_id"} <= {t.name for t in request.inputs}


@pytest.mark.parametrize("seed", range(4))
def test_a_cancel_request_is_cancelled_after_one_to_eight_responses(seed):
    rec, stub = run([piece()] * 20 + [final(64)], "cancel", seed)
    assert (rec.kind, rec.outcome, rec.tokens) == ("cancel", "cancelled", 0)  # no final response read
    assert stub.call.cancelled and 1 <= stub.call.served <= 8
    assert rec.ttft is not None  # it streamed


@pytest.mark.parametrize("script, outcome", [
    ([error("top_p must be in (0, 1], got 0")], "refused (expected): top_p 0"),
    ([error("unexpected input 'x'")], "unexpected: bad request (top_p 0) refused without naming top_p"),
    ([piece(), final(4)], "unexpected: bad request (top_p 0) served"),
])
def test_a_bad_request_must_be_refused_naming_its_input(script, outcome):
    rec, stub = run(script, "bad")
    assert (rec.kind, rec.outcome, rec.ttft) == ("bad", outcome, None)
    assert "top_p" in {t.name for t in stub.requests[0].inputs}


@pytest.mark.parametrize("script, outcome", [
    ([piece(), grpc.StatusCode.DEADLINE_EXCEEDED], "unexpected: hung stream (no end within the deadline)"),
    ([piece(), grpc.StatusCode.UNAVAILABLE], "unexpected: gRPC UNAVAILABLE"),
    ([piece(), final(3), final(3)], "unexpected: 2 final responses"),
    ([piece()], "unexpected: 0 final responses"),
    ([error("request 12 failed after 345 ms")], "unexpected: error request N failed after N ms"),
])
def test_anything_else_is_unexpected_and_says_what(script, outcome):
    rec, _ = run(script, "good")
    assert rec.outcome == outcome


def test_stream_of_reads_the_stream_flag():
    from tritonlm_bench.rawgrpc import raw_tensor

    assert stream_of([raw_tensor("text_input", "BYTES", [b"x"]), raw_tensor("stream", "BOOL", [True])])
    assert not stream_of([raw_tensor("stream", "BOOL", [False])])
    assert not stream_of([raw_tensor("text_input", "BYTES", [b"\x01"])])


def records() -> list[Record]:
    return [
        Record("good", 1.0, ttft=0.10, end=4.0, outcome="completed", tokens=30),
        Record("good", 20.0, ttft=0.30, end=50.0, outcome="completed", tokens=90),
        Record("good", 30.0, ttft=9.00, end=31.0, outcome="unexpected: error x", tokens=0),
        Record("cancel", 40.0, ttft=None, end=45.0, outcome="cancelled", tokens=0),
        Record("bad", 59.0, end=59.5, outcome="refused (expected): top_p 0"),
        Record("good", 61.0, ttft=0.20, end=70.0, outcome="completed", tokens=10),
        Record("bad", 62.0, end=62.5, outcome="refused (expected): empty prompt"),
        Record("bad", 63.0, end=63.5, outcome="refused (expected): top_p 0"),
    ]


def test_outcomes_are_counted_with_expected_refusals_by_kind():
    outcomes, bad_kinds, unexpected = outcome_counts(records())
    assert outcomes == {"completed": 3, "unexpected: error x": 1, "cancelled": 1, "refused (expected)": 3}
    assert bad_kinds == {"top_p 0": 2, "empty prompt": 1}
    assert unexpected == {"unexpected: error x": 1}


def test_one_row_per_minute_of_request_starts():
    rows = minute_rows(records())
    assert [r["minute"] for r in rows] == [1, 2]
    first, second = rows
    assert (first["requests"], first["completed"], first["cancelled"], first["refused_expected"], first["unexpected"]) == (5, 2, 1, 1, 1)
    assert first["tokens_per_s"] == pytest.approx(120 / 59.5)  # the minute's last end, 59.5 s in
    assert first["ttft_n"] == 2  # completed requests only: the unexpected one's 9 s is not a TTFT
    assert first["ttft_p50_ms"] == pytest.approx(1000 * np.percentile([0.1, 0.3], 50))
    assert first["ttft_p99_ms"] == pytest.approx(1000 * np.percentile([0.1, 0.3], 99))
    assert (second["requests"], second["completed"], second["refused_expected"]) == (3, 1, 2)
    assert second["tokens_per_s"] == pytest.approx(10 / 10.0)  # 60 s to its last end at 70 s
