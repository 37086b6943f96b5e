"""Mixed gRPC traffic for the long-running benchmarks (perf/soak.py, perf/stress.py): prompts
of several lengths, good, cancelled and bad requests on raw decoupled streams, and the
per-minute table of what happened.

Each request is its own ModelStreamInfer call. A "cancel" request is streamed and cancelled
by the client after 1 to 8 responses; a "bad" one must be refused with an error naming the
input that is wrong. Anything else that goes wrong is "unexpected: ...".
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import grpc

from tritonlm.perf.stats import percentile
from tritonlm_bench.rawgrpc import RawTensor, infer_request, is_final, output_int, raw_tensor

REQUEST_TIMEOUT_S = 120.0  # a stream still open after this is a hung request
WORDS = ("the a city river old new small robot wanted to see how far it could go before night fell "
         "and every light in town came on one by one while people walked home 1 2 3 café naïve 你好").split()


# ---- requests ------------------------------------------------------------------------------------


PROMPT_TOKENS = (1, 4, 16, 32, 64, 96)  # + max_tokens (at most 128) stays within tiny-gpt2's 256 positions
PROMPTS: dict[int, list[bytes]] = {}


def make_prompts(tok, per_length: int = 16, seed: int = 0) -> None:
    """A pool of prompts of each length in PROMPT_TOKENS (tokens of the model's own tokenizer)."""
    rng = random.Random(seed)
    for n in PROMPT_TOKENS:
        pool = []
        while len(pool) < per_length:
            ids = tok(" ".join(rng.choice(WORDS) for _ in range(2 * n + 4))).input_ids[:n]
            text = tok.decode(ids, skip_special_tokens=True)
            if text.strip() and len(tok(text).input_ids) <= n + 2:
                pool.append(text.encode())
        PROMPTS[n] = pool


def prompt(rng: random.Random) -> bytes:
    return rng.choice(PROMPTS[rng.choice(PROMPT_TOKENS)])


# (what is wrong, the input its error must name, the tensors)
BAD = [
    ("max_tokens -1", "max_tokens", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("max_tokens", "INT32", [-1])]),
    ("temperature NaN", "temperature", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("temperature", "FP32", [float("nan")])]),
    ("100 stop words", "stop_words", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("stop_words", "BYTES", [b"x"] * 100)]),
    ("invalid UTF-8", "text_input", lambda p: [raw_tensor("text_input", "BYTES", [b"\xff\xfe" + p])]),
    ("empty prompt", "text_input", lambda p: [raw_tensor("text_input", "BYTES", [b""])]),
    ("prompt over the context", "text_input", lambda p: [raw_tensor("text_input", "BYTES", [b"word " * 400])]),
    ("top_p 0", "top_p", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("top_p", "FP32", [0.0])]),
    ("unknown input pad_id", "pad_id", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("pad_id", "INT32", [0])]),
    ("max_tokens as FP32", "max_tokens", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("max_tokens", "FP32", [4.0])]),
    ("max_tokens shape [2]", "max_tokens", lambda p: [raw_tensor("text_input", "BYTES", [p]), raw_tensor("max_tokens", "INT32", [4, 4])]),
    ("no text_input", "text_input", lambda p: [raw_tensor("max_tokens", "INT32", [4])]),
]


@dataclass
class Record:
    kind: str  # "good" | "cancel" | "bad"
    start: float  # seconds since the soak began
    ttft: float | None = None  # streamed requests that got a first token
    end: float = 0.0
    outcome: str = ""  # "completed" | "cancelled" | "refused (expected)" | "unexpected: ..."
    tokens: int = 0


def one_request(stub, model: str, rng: random.Random, rid: str, t_zero: float, cancel_fraction: float,
                bad_fraction: float, stream_fraction: float = 0.7) -> Record:
    u = rng.random()
    p = prompt(rng)
    if u < bad_fraction:
        what, name, build = rng.choice(BAD)
        rec = Record("bad", time.perf_counter() - t_zero)
        tensors, cancel_after = build(p), None
    else:
        cancel = u < bad_fraction + cancel_fraction
        rec = Record("cancel" if cancel else "good", time.perf_counter() - t_zero)
        stream = cancel or rng.random() < stream_fraction
        max_tokens = rng.choice([64, 96, 128]) if cancel else rng.choice([4, 8, 16, 32, 64, 128])
        tensors = [raw_tensor("text_input", "BYTES", [p]), raw_tensor("max_tokens", "INT32", [max_tokens]),
                   raw_tensor("stream", "BOOL", [stream]), raw_tensor("end_id", "INT32", [-1])]
        if rng.random() < 0.3:
            tensors += [raw_tensor("temperature", "FP32", [0.8]), raw_tensor("top_k", "INT32", [40]),
                        raw_tensor("seed", "UINT64", [rng.randrange(2**32)])]
        if rng.random() < 0.1:
            tensors.append(raw_tensor("stop_words", "BYTES", [b"robot", b"night"]))
        cancel_after = rng.randint(1, 8) if cancel else None
        what = name = ""
    t0 = time.perf_counter()
    call = stub.ModelStreamInfer(iter([infer_request(model, rid, tensors)]), timeout=REQUEST_TIMEOUT_S)
    responses = finals = 0
    error = None
    try:
        for response in call:
            now = time.perf_counter()
            responses += 1
            if rec.ttft is None and not response.error_message:
                rec.ttft = now - t0
            if response.error_message:
                error = response.error_message
                finals += 1
                continue
            if is_final(response):
                finals += 1
                rec.tokens = output_int(response, "num_output_tokens") or 0
            elif cancel_after is not None and responses >= cancel_after:
                call.cancel()
    except grpc.RpcError as e:
        if cancel_after is not None and e.code() == grpc.StatusCode.CANCELLED and not finals:
            rec.outcome = "cancelled"
        elif e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            rec.outcome = "unexpected: hung stream (no end within the deadline)"
        else:
            rec.outcome = f"unexpected: gRPC {e.code().name}"
    rec.end = time.perf_counter() - t_zero
    if rec.outcome:
        return rec
    if finals != 1:
        rec.outcome = f"unexpected: {finals} final responses"
    elif rec.kind == "bad":
        rec.outcome = ("refused (expected): " + what) if error and name in error else (
            f"unexpected: bad request ({what}) " + (f"refused without naming {name}" if error else "served"))
    elif error:
        rec.outcome = "unexpected: error " + re.sub(r"\d+", "N", error)[:80]
    else:
        rec.outcome = "completed"
    if rec.kind == "bad" or not stream_of(tensors):
        rec.ttft = None  # time to first token: streamed requests only
    return rec


def stream_of(tensors: list[RawTensor]) -> bool:
    return any(t.name == "stream" and t.data == b"\x01" for t in tensors)


def outcome_counts(records: list[Record]) -> tuple[Counter, Counter, dict[str, int]]:
    """(outcomes, expected refusals by kind, unexpected outcomes by kind)."""
    outcomes = Counter(r.outcome if not r.outcome.startswith("refused (expected)") else "refused (expected)" for r in records)
    bad_kinds = Counter(r.outcome.split(": ", 1)[1] for r in records if r.outcome.startswith("refused (expected)"))
    unexpected = {k: v for k, v in outcomes.items() if k.startswith("unexpected")}
    return outcomes, bad_kinds, unexpected


def minute_rows(records: list[Record]) -> list[dict]:
    """One row per minute of the run (by request start): counts, tokens/s, TTFT p50/p99."""
    minutes: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        minutes[int(r.start // 60)].append(r)
    rows = []
    for m in sorted(minutes):
        rs = minutes[m]
        ttfts = [r.ttft for r in rs if r.ttft is not None and r.outcome == "completed"]
        span = min(60.0, max(1e-9, max(r.end for r in rs) - 60 * m))
        rows.append({
            "minute": m + 1,
            "requests": len(rs),
            "completed": sum(r.outcome == "completed" for r in rs),
            "cancelled": sum(r.outcome == "cancelled" for r in rs),
            "refused_expected": sum(r.outcome.startswith("refused (expected)") for r in rs),
            "unexpected": sum(r.outcome.startswith("unexpected") for r in rs),
            "tokens_per_s": sum(r.tokens for r in rs) / span,
            "ttft_n": len(ttfts),
            "ttft_p50_ms": 1000 * percentile(ttfts, 50),
            "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        })
    return rows


def print_minutes(rows: list[dict], extra: dict[int, str] | None = None, extra_title: str = "") -> None:
    print(f"{'minute':>6} {'requests':>8} {'completed':>9} {'cancelled':>9} {'refused':>7} {'unexpected':>10} "
          f"{'tok/s':>7} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11}" + (f" {extra_title}" if extra_title else ""))
    for row in rows:
        tail = f" {extra.get(row['minute'], '')}" if extra else ""
        print(f"{row['minute']:>6} {row['requests']:>8} {row['completed']:>9} {row['cancelled']:>9} {row['refused_expected']:>7} "
              f"{row['unexpected']:>10} {row['tokens_per_s']:>7.0f} {row['ttft_p50_ms']:>11.1f} {row['ttft_p99_ms']:>11.1f}{tail}")


class ClientPool:
    """n client threads, each sending one request after another (one_request) while the pool
    runs and its index is below `allowed`; every Record is kept in `records`."""

    def __init__(self, stub, model: str, n: int, seed: int, cancel_fraction: float, bad_fraction: float,
                 stream_fraction: float = 0.7):
        self.stub, self.model, self.n, self.seed = stub, model, n, seed
        self.cancel_fraction, self.bad_fraction, self.stream_fraction = cancel_fraction, bad_fraction, stream_fraction
        self.allowed = n
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self._stop = threading.Event()
        self._active = 0
        self._threads: list[threading.Thread] = []
        self.t_zero = 0.0

    def start(self) -> "ClientPool":
        self.t_zero = time.perf_counter()
        self._threads = [threading.Thread(target=self._client, args=(c,), daemon=True) for c in range(self.n)]
        for t in self._threads:
            t.start()
        return self

    def _client(self, c: int) -> None:
        rng = random.Random(self.seed * 1000 + c)
        k = 0
        while not self._stop.is_set():
            if not self._running.is_set():
                self._running.wait(1.0)
                continue
            if c >= self.allowed:
                time.sleep(0.05)
                continue
            with self._lock:
                self._active += 1
            try:
                rec = one_request(self.stub, self.model, rng, f"c{c}-{k}", self.t_zero, self.cancel_fraction,
                                  self.bad_fraction, self.stream_fraction)
            finally:
                with self._lock:
                    self._active -= 1
            with self._lock:
                self.records.append(rec)
            k += 1

    def pause(self, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """No new requests; returns once the ones in flight have ended (or after timeout_s)."""
        self._running.clear()
        deadline = time.monotonic() + timeout_s
        while self._active and time.monotonic() < deadline:
            time.sleep(0.05)

    def resume(self) -> None:
        self._running.set()

    def finish(self) -> None:
        """Stop every client after its request in flight."""
        self._stop.set()
        self._running.set()
        for t in self._threads:
            t.join(timeout=REQUEST_TIMEOUT_S + 10)
