"""perf/tritonlm_bench/streaming.py: a streamed request's TTFT / ITL / latency on a scripted
clock, a run's summary against numpy's percentiles, the closed loop's bookkeeping, and
server-sent events read from a local HTTP server."""

from __future__ import annotations

import json
import math
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tritonlm_bench import streaming
from tritonlm_bench.streaming import (
    GENERATE_ALWAYS,
    StreamClock,
    StreamRecord,
    closed_loop,
    post_sse,
    summarize_streams,
    triton_sse_stream,
)


@pytest.fixture
def clock(monkeypatch):
    """Make streaming's perf_counter return the given times in turn."""

    def script(*times: float) -> None:
        ticks = iter(times)
        monkeypatch.setattr(streaming, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))

    return script


def test_the_clock_times_first_token_inter_token_and_the_whole_request(clock):
    clock(10.0, 10.1, 10.15, 10.3, 10.5)  # sent, three pieces, done
    c = StreamClock()
    for _ in range(3):
        c.piece()
    r = c.done(tokens=4, prompt_tokens=7)
    assert r.ttft_s == pytest.approx(0.1)
    assert r.itl_s == pytest.approx((10.3 - 10.1) / 3)  # first to last piece over tokens - 1
    assert r.latency_s == pytest.approx(0.5)
    assert (r.tokens, r.prompt_tokens) == (4, 7)


def test_one_token_has_no_inter_token_latency_and_no_piece_times_to_the_end(clock):
    clock(0.0, 0.2, 0.3)
    c = StreamClock()
    c.piece()
    r = c.done(tokens=1)
    assert r.ttft_s == pytest.approx(0.2) and math.isnan(r.itl_s)
    clock(0.0, 0.4)
    r = StreamClock().done(tokens=0)
    assert r.ttft_s == r.latency_s == pytest.approx(0.4) and math.isnan(r.itl_s)


def test_the_summary_is_numpys_linear_percentiles_and_tokens_over_wall_time():
    rng = np.random.default_rng(3)
    records = [StreamRecord(float(t), float(i), int(n), float(l), int(p))
               for t, i, n, l, p in zip(rng.uniform(0.01, 2, 37), rng.uniform(0.005, 0.1, 37), rng.integers(1, 129, 37),
                                        rng.uniform(1, 9, 37), rng.integers(3, 60, 37))]
    s = summarize_streams(records, wall_s=12.5)
    ttft, itl, latency = (np.array([getattr(r, f) for r in records]) for f in ("ttft_s", "itl_s", "latency_s"))
    assert s["requests"] == 37 and s["tokens"] == sum(r.tokens for r in records)
    assert s["tokens_per_s"] == pytest.approx(s["tokens"] / 12.5)
    assert s["requests_per_s"] == pytest.approx(37 / 12.5)
    assert s["prompt_tokens_mean"] == pytest.approx(np.mean([r.prompt_tokens for r in records]))
    for q in (50, 99):
        assert s[f"ttft_p{q}_ms"] == pytest.approx(1000 * np.percentile(ttft, q))
        assert s[f"itl_p{q}_ms"] == pytest.approx(1000 * np.percentile(itl, q))
        assert s[f"latency_p{q}_s"] == pytest.approx(np.percentile(latency, q))
    assert math.isnan(summarize_streams(records, wall_s=0.0)["tokens_per_s"])


class Conn:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_the_closed_loop_sends_each_clients_requests_on_its_own_connection():
    conns: list[Conn] = []
    lock = threading.Lock()

    def connect() -> Conn:
        with lock:
            conns.append(Conn())
            return conns[-1]

    run = closed_loop(lambda conn, c, k: (id(conn), c, k), 4, requests_per_client=3, connect=connect)
    assert sorted((c, k) for _, c, k in run.records) == [(c, k) for c in range(4) for k in range(3)]
    by_client = {c: {conn for conn, cc, _ in run.records if cc == c} for c in range(4)}
    assert all(len(ids) == 1 for ids in by_client.values())  # one connection per client
    assert len({next(iter(ids)) for ids in by_client.values()}) == 4
    assert len(conns) == 4 and all(conn.closed for conn in conns)
    assert run.errors == [] and run.wall_s > 0


@pytest.mark.parametrize("stop_on_error, client_1_sent", [(True, [0]), (False, [0, 2])])
def test_a_failed_request_is_counted_and_may_end_its_client(stop_on_error, client_1_sent):
    def send(conn, c, k):
        if c == 1 and k == 1:
            raise ValueError("boom")
        return c, k

    run = closed_loop(send, 2, requests_per_client=3, stop_on_error=stop_on_error)
    assert run.errors == ["client 1: ValueError: boom"]
    assert sorted(k for c, k in run.records if c == 1) == client_1_sent
    assert sorted(k for c, k in run.records if c == 0) == [0, 1, 2]


def test_the_closed_loop_needs_a_count_or_a_duration():
    with pytest.raises(ValueError, match="requests_per_client or seconds"):
        closed_loop(lambda *a: None, 1)
    with pytest.raises(ValueError, match="requests_per_client or seconds"):
        closed_loop(lambda *a: None, 1, requests_per_client=1, seconds=1.0)
    assert closed_loop(lambda *a: 1, 2, seconds=0.0).records == []  # its time is up before the first request


class _Sse(BaseHTTPRequestHandler):
    """Answers a POST with the server's scripted status and body lines; keeps the request."""

    def do_POST(self):
        server = self.server
        server.requests.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
        self.send_response(server.status)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for line in server.lines:
            self.wfile.write(line.encode() + b"\n")
            self.wfile.flush()

    def log_message(self, *args):
        pass


@pytest.fixture
def sse_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sse)
    server.status, server.lines, server.requests = 200, [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, server.server_address[1]
    server.shutdown()
    server.server_close()


def test_post_sse_yields_each_events_json_until_done(sse_server):
    server, port = sse_server
    server.lines = [": a comment", "event: message", 'data: {"a": 1}', "", 'data:{"b": 2}', "data: [DONE]", 'data: {"c": 3}']
    events = list(post_sse("127.0.0.1", port, "/v1/x", {"q": [1, 2]}, server="peer"))
    assert events == [{"a": 1}, {"b": 2}]
    assert server.requests == [("/v1/x", {"q": [1, 2]})]
    server.lines = ['data: {"a": 1}']  # no [DONE]: the end of the stream ends it
    assert list(post_sse("127.0.0.1", port, "/v1/x", {}, server="peer")) == [{"a": 1}]


def test_post_sse_names_the_server_on_an_http_error_or_an_error_event(sse_server):
    server, port = sse_server
    server.lines = ['data: {"a": 1}', 'data: {"error": "model not ready"}']
    events = post_sse("127.0.0.1", port, "/v1/x", {}, server="llama-server")
    assert next(events) == {"a": 1}
    with pytest.raises(RuntimeError, match="llama-server: model not ready"):
        next(events)
    server.status, server.lines = 503, ["busy"]
    with pytest.raises(RuntimeError, match=r"llama-server /v1/x: HTTP 503: b'busy"):
        list(post_sse("127.0.0.1", port, "/v1/x", {}, server="llama-server"))


def test_a_triton_sse_request_counts_the_final_events_tokens(sse_server):
    server, port = sse_server
    server.lines = ['data: {"text_output": " Paris"}', 'data: {"text_output": "."}',
                    'data: {"text_output": "", "num_output_tokens": 3, "num_input_tokens": 5}', 'data: {"late": 1}']
    r = triton_sse_stream(f"127.0.0.1:{port}", "gpt2", "The capital of France is", 3)
    assert (r.tokens, r.prompt_tokens) == (3, 5)
    assert 0 <= r.ttft_s <= r.latency_s and r.itl_s >= 0
    path, body = server.requests[0]
    assert path == "/v2/models/gpt2/generate_stream"
    assert body == {"text_input": "The capital of France is", "max_tokens": 3, **GENERATE_ALWAYS}
