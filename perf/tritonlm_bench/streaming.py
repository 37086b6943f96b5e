"""Timed streaming requests and the closed-loop clients that send them, for benchmark scripts.

Every streamed request is timed the same way, whoever serves it (tritonlm over gRPC or
server-sent events, llama-server, the engine in-process), so their figures compare:

- time to first token (TTFT) = first piece of text received - request sent
- inter-token latency (ITL)  = (last piece - first piece) / (tokens - 1), NaN with fewer than 2
- latency                    = the whole request, the final (possibly empty) response included

as `tritonlm perf llm` defines them for perf_analyzer's timestamps (tritonlm/perf/llm.py).
A closed loop is N client threads, each sending its next request as soon as the last one
ended: the load a fixed number of users puts on a server.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tritonlm.perf.stats import percentile


@dataclass(frozen=True)
class StreamRecord:
    """One streamed request as its client saw it (seconds)."""

    ttft_s: float
    itl_s: float  # NaN with fewer than 2 tokens
    tokens: int
    latency_s: float
    prompt_tokens: int = 0


class StreamClock:
    """Times one streamed request: created as it is sent, piece() as each piece of text
    arrives, done() once it has ended."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def piece(self) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now

    def done(self, tokens: int, prompt_tokens: int = 0) -> StreamRecord:
        end = time.perf_counter()
        first = self.first if self.first is not None else end
        itl = (self.last - self.first) / (tokens - 1) if self.first is not None and tokens > 1 else float("nan")
        return StreamRecord(first - self.t0, itl, tokens, end - self.t0, prompt_tokens)


# ---- one request -----------------------------------------------------------------------------------

# every benchmark request generates exactly max_tokens tokens (the end token is ignored) and
# streams only the new text
GENERATE_ALWAYS = {"stream": True, "end_id": -1, "exclude_input_in_output": True}


def grpc_stream(url: str, model: str, prompt: str, max_tokens: int, *, client=None, timeout_s: float = 300.0) -> StreamRecord:
    """One request over tritonclient's gRPC stream (client: a tritonclient.grpc client to
    reuse; default one of its own); tokens are the server's count."""
    from tritonlm.client.generate import generate_grpc

    clock = StreamClock()
    result = generate_grpc(url, model, prompt, on_piece=lambda _piece: clock.piece(), client=client, timeout_s=timeout_s,
                           max_tokens=max_tokens, **GENERATE_ALWAYS)
    return clock.done(result.num_output_tokens or 0, result.num_input_tokens or 0)


def post_sse(host: str, port: int, path: str, body: dict, *, server: str, timeout_s: float = 600.0) -> Iterator[dict]:
    """POST body as JSON on a connection of its own and yield the JSON of each server-sent
    event (`data: {...}` lines) as it arrives, until `[DONE]` or the end of the stream; the
    connection is closed when the caller stops reading. RuntimeError, naming `server`, for
    an HTTP error or an event carrying "error"."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{server} {path}: HTTP {resp.status}: {resp.read()[:300]!r}")
        while line := resp.readline():
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                return
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"{server}: {event['error']}")
            yield event
    finally:
        conn.close()


def triton_sse_stream(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float = 600.0) -> StreamRecord:
    """One request to Triton's generate_stream (server-sent events) over http.client, on a
    connection of its own: the plainest HTTP client, as llama-server's clients are. Every
    event carries one engine step's new text; the final one the token counts."""
    host, port = url.rsplit(":", 1)
    clock = StreamClock()
    tokens = prompt_tokens = 0
    for event in post_sse(host, int(port), f"/v2/models/{model}/generate_stream",
                          {"text_input": prompt, "max_tokens": max_tokens, **GENERATE_ALWAYS},
                          server="tritonserver", timeout_s=timeout_s):
        clock.piece()
        if "num_output_tokens" in event:  # the final event
            tokens, prompt_tokens = int(event["num_output_tokens"]), int(event["num_input_tokens"])
            break
    return clock.done(tokens, prompt_tokens)


# ---- many clients ----------------------------------------------------------------------------------


@dataclass
class ClosedLoopRun:
    records: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # "client C: Type: message", one per failed request
    wall_s: float = 0.0


def closed_loop(
    send: Callable[[Any, int, int], Any],
    clients: int,
    *,
    requests_per_client: int | None = None,
    seconds: float | None = None,
    connect: Callable[[], Any] = lambda: None,
    stop_on_error: bool = True,
) -> ClosedLoopRun:
    """`clients` threads, each calling send(conn, client, k) for its k-th request one after
    another, until it has sent requests_per_client or `seconds` have passed (give one of
    the two). conn is the client's own connect() (closed at the end when it has close()).
    A request that raises is counted in errors; stop_on_error ends that client there.
    The threads are daemons joined in short waits, so Ctrl-C reaches the caller at once."""
    if (requests_per_client is None) == (seconds is None):
        raise ValueError("closed_loop: give requests_per_client or seconds")
    run = ClosedLoopRun()
    lock = threading.Lock()
    deadline = time.monotonic() + seconds if seconds is not None else None

    def more(k: int) -> bool:
        return k < requests_per_client if deadline is None else time.monotonic() < deadline

    def client(c: int) -> None:
        conn = connect()
        k = 0
        try:
            while more(k):
                try:
                    record = send(conn, c, k)
                except Exception as e:  # noqa: BLE001 - counted; the caller decides what errors mean
                    with lock:
                        run.errors.append(f"client {c}: {type(e).__name__}: {e}")
                    if stop_on_error:
                        return
                else:
                    with lock:
                        run.records.append(record)
                k += 1
        finally:
            close = getattr(conn, "close", None)
            if close:
                close()

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)
    run.wall_s = time.perf_counter() - t0
    return run


def summarize_streams(records: list[StreamRecord], wall_s: float) -> dict[str, float]:
    """Output tokens/s over the wall time of a run, and the requests' TTFT, ITL and latency
    percentiles (tritonlm.perf.stats.percentile)."""
    tokens = sum(r.tokens for r in records)
    ttft = [r.ttft_s for r in records]
    itl = [r.itl_s for r in records]
    latency = [r.latency_s for r in records]
    return {
        "requests": len(records),
        "tokens": tokens,
        "prompt_tokens_mean": statistics.mean(r.prompt_tokens for r in records) if records else 0.0,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else float("nan"),
        "requests_per_s": len(records) / wall_s if wall_s > 0 else float("nan"),
        "ttft_p50_ms": 1000 * percentile(ttft, 50),
        "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(itl, 50),
        "itl_p99_ms": 1000 * percentile(itl, 99),
        "latency_p50_s": percentile(latency, 50),
        "latency_p99_s": percentile(latency, 99),
    }
