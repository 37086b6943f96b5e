"""Benchmark: the engine's own cost per generated token, with a model that costs next to nothing.

The in-process Engine (tritonlm/engine/engine.py) drives the built-in tiny-gpt2 (2 layers,
64 wide, seeded weights, no download) on a TorchRunner, so what a step costs is almost
all the engine: scheduling, building the batch's index tensors, sampling, appending
tokens, stop checks, detokenizing and delivering events. For each row count (concurrent
requests) every request is submitted at once, greedy, with an end id that never fires, so
each one makes exactly --tokens tokens (--tokens-one-row for a single row), and the engine
is stepped on this thread until all are done, the way perf/gpu_check.py's engine_run does.
The KV cache has room for every row and max_num_seqs / max_num_batched_tokens let all
rows run in one batch. torch's thread count is the server's default (one per usable core,
tritonlm/engine/loader.py) unless --threads says otherwise; the server's ThreadGovernor,
observer (metrics) and event-dispatcher thread are not part of this loop: events are
delivered by the engine thread itself, to a callback that only keeps the token ids.

Per row count, after one warm-up round, --repeat times:
  plain    the engine as it is: wall and CPU (time.process_time, every thread of the
           process) per generated token, wall per step, and how many cores' worth of time
           this process's threads spent waiting for a core meanwhile (cpu_cores.CoreWatch):
           a run where that is well above 0 measured the neighbours as much as the engine
  split    the same round again with timing wrappers on the bound methods of the engine's
           component instances (instance attributes shadow the class methods; nothing in
           the engine's code changes) and on runners.torch_runner.plan_step:
             schedule  Scheduler.schedule
             inputs    Scheduler.batch (the cache's slot table for the batch) + plan_step
                       (the runner's index tensors), each its own column too
             forward   runner.forward minus plan_step
             sampling  ModelExecutor.sample
             output    OutputProcessor.process: appending tokens, stop checks, the
                       detokenizer (its own column too), building events and delivering
                       them (its own column too: the callbacks)
             other     the rest of Engine.step and the loop around it
           The wrappers add a little time of their own (two clock reads and a call each),
           so the split's total is a bit above the plain run's.

    .venv/bin/python perf/bench_engine_overhead.py [--rows 1,32,128,256] [--tokens 64]
        [--tokens-one-row 200] [--repeat 2] [--threads N] [--no-stream] [--decode native|python]
        [--out DIR]

Prints the host, then the tables with the goals beside them; writes
bench_engine_overhead.csv and bench_engine_overhead.png (the phase split) under
results/bench_engine_overhead/ (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from tritonlm.engine.cpu_cores import CoreWatch, usable_cores
from tritonlm.engine.engine import Engine
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.request import GenerationEvent, GenerationRequest, SamplingParams
from tritonlm.engine.runners import torch_runner
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.scheduler import SchedulerConfig
from tritonlm.engine.sequence import Sequence
from tritonlm.models.builtin import build_tiny
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, optional_figure, save_figure, table, write_csv

NAME = "bench_engine_overhead"
BLOCK_SIZE = 16
MAX_CONTEXT = 256  # tiny-gpt2's n_positions
PROMPT_LEN = 3
GOAL_US_PER_TOKEN = 15.0  # at GOAL_ROWS rows
GOAL_ROWS = 256
GOAL_MS_PER_STEP = 0.3  # at 1 row
PHASES = ("schedule", "inputs", "forward", "sampling", "output", "other")
OUTPUT_PARTS = ("detok", "events")  # parts of "output", shown apart as well
INPUT_PARTS = ("batch", "plan_step")  # parts of "inputs", shown apart as well
BUSY_CORES = 0.1  # others' cores above this: a run that says more about the neighbours than the engine


# ---- the engine ------------------------------------------------------------------------------


def set_server_threads(threads: int | None) -> tuple[int, str]:
    """torch's intra- and inter-op threads as the loader sets them at defaults (one per
    usable core, one instance, no model parallelism) unless `threads` is given."""
    if threads:
        n, why = threads, "--threads"
    else:
        budget = usable_cores()
        n, why = budget.threads(1), f"server default, auto: {budget.why}"
    torch.set_num_threads(n)
    try:  # only before any inter-op work in this process, as in the loader
        torch.set_num_interop_threads(n)
    except RuntimeError:
        pass
    return n, why


def build_engine(model: Any, tok: Any, rows: int, reserve_tokens: int, native_decode: bool = True) -> Engine:
    """An engine whose cache and scheduler let all `rows` requests run in one batch;
    native_decode False: decode steps take the Python path, not Transformer.decode_step."""
    runner = TorchRunner(model)
    runner.lean_decode = native_decode
    blocks = rows * -(-reserve_tokens // BLOCK_SIZE) + 2  # + the scratch block, + one spare
    cache = KVCacheManager(runner.spec, blocks * BLOCK_SIZE * runner.spec.bytes_per_token, BLOCK_SIZE,
                           allocate_kv=runner.allocate_kv)
    config = SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=max(512, rows * PROMPT_LEN),
                             max_queue_size=max(1024, rows))
    return Engine(runner, tok, cache, config, max_context=MAX_CONTEXT)


def submit_all(engine: Engine, rows: int, tokens: int, stream: bool, counts: list[int]) -> list[Sequence]:
    """rows greedy requests of exactly `tokens` tokens; counts[i] collects request i's
    token count. Returns their Sequences (still in the engine's inbox)."""

    def sink(i: int) -> Callable[[GenerationEvent], None]:
        def on_event(ev: GenerationEvent) -> None:
            counts[i] += len(ev.token_ids)
        return on_event

    params = SamplingParams(max_tokens=tokens, end_id=-1)
    for i in range(rows):
        prompt = [100 + i % 300, 50 + i % 7, 300][:PROMPT_LEN]  # rows differ, so their texts do
        engine.submit(GenerationRequest(prompt, params, sink(i), stream=stream))
    return list(engine._inbox)


# ---- timing wrappers ---------------------------------------------------------------------------


@dataclass
class PhaseTimes:
    seconds: dict[str, float] = field(default_factory=dict)

    def wrap(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        """fn, with the time of each call added to `phase`."""
        clock, seconds = time.perf_counter, self.seconds
        seconds.setdefault(phase, 0.0)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[phase] += clock() - t0
        return timed


class Wrapped:
    """Timing wrappers on one engine's component instances for the length of a `with`."""

    def __init__(self, engine: Engine, seqs: list[Sequence], times: PhaseTimes):
        self.engine, self.seqs, self.times = engine, seqs, times
        self._deliver = engine.output.deliver
        self._plan_step = torch_runner.plan_step

    def __enter__(self) -> "Wrapped":
        e, t = self.engine, self.times
        e.scheduler.schedule = t.wrap(e.scheduler.schedule, "schedule")
        e.scheduler.batch = t.wrap(e.scheduler.batch, "batch")
        e.runner.forward = t.wrap(e.runner.forward, "runner")
        e.executor.sample = t.wrap(e.executor.sample, "sampling")
        e.output.process = t.wrap(e.output.process, "output")
        e.output.deliver = t.wrap(self._deliver, "events")
        torch_runner.plan_step = t.wrap(self._plan_step, "plan_step")
        for seq in self.seqs:
            seq.detok.update = t.wrap(seq.detok.update, "detok")
        return self

    def __exit__(self, *exc: object) -> None:
        e = self.engine
        for obj, name in ((e.scheduler, "schedule"), (e.scheduler, "batch"), (e.runner, "forward"),
                          (e.executor, "sample"), (e.output, "process")):
            del obj.__dict__[name]  # the class's method again
        e.output.deliver = self._deliver
        torch_runner.plan_step = self._plan_step
        for seq in self.seqs:
            del seq.detok.__dict__["update"]


# ---- one round -------------------------------------------------------------------------------


def run_round(engine: Engine, rows: int, tokens: int, stream: bool, split: bool) -> dict[str, Any]:
    """Submit `rows` requests and step the engine until all are done; with split, timed by phase."""
    counts = [0] * rows
    seqs = submit_all(engine, rows, tokens, stream, counts)
    steps0, tokens0 = engine.stats.steps, engine.stats.tokens_generated
    times = PhaseTimes()
    gc.collect()
    # every thread of this process: the engine steps on this thread, not on a named compute thread
    watch = CoreWatch(thread_name=None)  # waiting for a core makes a run slower than the engine is
    with Wrapped(engine, seqs, times) if split else contextlib.nullcontext():
        c0, t0 = time.process_time(), time.perf_counter()
        while engine.has_work() or engine._inbox:
            engine.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        foreign = watch.lost_cores()
    steps, made = engine.stats.steps - steps0, engine.stats.tokens_generated - tokens0
    if made != rows * tokens or any(c != tokens for c in counts):
        raise SystemExit(f"{rows} rows: expected {tokens} tokens each, got {made} in all, per row {sorted(set(counts))}")
    row: dict[str, Any] = {"rows": rows, "tokens_per_row": tokens, "steps": steps, "tokens": made,
                           "wall_us_per_token": 1e6 * wall / made, "cpu_us_per_token": 1e6 * cpu / made,
                           "us_per_step": 1e6 * wall / steps,
                           "others_cores": float("nan") if foreign is None else foreign}
    if split:
        s = times.seconds
        phase = {
            "schedule": s["schedule"],
            "inputs": s["batch"] + s["plan_step"],
            "forward": s["runner"] - s["plan_step"],
            "sampling": s["sampling"],
            "output": s["output"],
        }
        phase["other"] = wall - sum(phase.values())
        for name in PHASES:
            row[f"{name}_us_per_token"] = 1e6 * phase[name] / made
            row[f"{name}_share"] = phase[name] / wall
        for name in INPUT_PARTS + OUTPUT_PARTS:
            row[f"{name}_us_per_token"] = 1e6 * s[name] / made
    return row


# ---- report ----------------------------------------------------------------------------------


def goal_note(rows: int, plain: list[dict]) -> str:
    if rows == GOAL_ROWS:
        best = min(r["wall_us_per_token"] for r in plain)
        return f"goal <= {GOAL_US_PER_TOKEN:g} us/token: {'met' if best <= GOAL_US_PER_TOKEN else 'NOT met'}"
    if rows == 1:
        best = min(r["us_per_step"] for r in plain) / 1000
        return f"goal <= {GOAL_MS_PER_STEP:g} ms/step: {'met' if best <= GOAL_MS_PER_STEP else 'NOT met'}"
    return ""


def draw(path: Path, split_rows: list[dict], title: str) -> None:
    """Stacked bars, one per row count: each phase's share of the step loop's wall time,
    labelled with the split run's wall time per token."""
    drawn = optional_figure(figsize=(7, 4.2))
    if not drawn:
        return
    fig, ax = drawn
    best: dict[int, dict] = {}
    for r in split_rows:  # the faster split run of each row count
        if r["rows"] not in best or r["wall_us_per_token"] < best[r["rows"]]["wall_us_per_token"]:
            best[r["rows"]] = r
    labels = [str(n) for n in best]
    bottom = [0.0] * len(best)
    for i, name in enumerate(PHASES):
        share = [100 * max(0.0, r[f"{name}_share"]) for r in best.values()]
        ax.bar(labels, share, bottom=bottom, color=f"C{i}", label=name)
        bottom = [b + s for b, s in zip(bottom, share)]
    for x, r in enumerate(best.values()):
        ax.text(x, 101, f"{r['wall_us_per_token']:.1f} µs/token", ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 112)
    ax.set_xlabel("rows (concurrent requests)")
    ax.set_ylabel("share of the step loop's wall time, %")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out_arg(ap, NAME)
    ap.add_argument("--rows", default="1,32,128,256", help="concurrent requests, comma-separated")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    ap.add_argument("--tokens-one-row", type=int, default=200, help="tokens when there is a single row")
    ap.add_argument("--repeat", type=int, default=2, help="plain + split runs per row count")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: the server's default)")
    ap.add_argument("--no-stream", action="store_true", help="one final event per request instead of one per token")
    ap.add_argument("--decode", choices=("native", "python"), default="native",
                    help="decode steps in one C++ call (Transformer.decode_step), or the Python path around the stack")
    args = ap.parse_args()
    row_counts = [int(x) for x in args.rows.split(",") if x.strip()]
    stream = not args.no_stream

    cpu = describe_cpu()
    threads, why = set_server_threads(args.threads or None)
    print(f"host: {cpu}")
    print(f"torch threads: {threads} intra-op, {torch.get_num_interop_threads()} inter-op ({why}); torch {torch.__version__}")
    model, tok = build_tiny("tiny-gpt2")
    plain: list[dict] = []
    split: list[dict] = []
    attention = ""
    for rows in row_counts:
        tokens = args.tokens_one_row if rows == 1 else args.tokens
        engine = build_engine(model, tok, rows, PROMPT_LEN + tokens, native_decode=args.decode == "native")
        attention = engine.runner.attention
        run_round(engine, rows, tokens, stream, split=False)  # warm-up: allocator, kernels, caches
        for rep in range(1, args.repeat + 1):
            for is_split, into in ((False, plain), (True, split)):
                row = run_round(engine, rows, tokens, stream, split=is_split)
                row["run"] = rep
                into.append(row)
        got = [r for r in plain if r["rows"] == rows]
        print(f"rows {rows:>4}: {min(r['wall_us_per_token'] for r in got):.1f} us/token, "
              f"{min(r['us_per_step'] for r in got) / 1000:.3f} ms/step  {goal_note(rows, got)}", flush=True)

    print()
    print(f"model: tiny-gpt2 (seeded), attention {attention}, decode steps {args.decode}, prompt {PROMPT_LEN} tokens, greedy, end id never fires, "
          f"{'streaming (an event per token)' if stream else 'one final event per request'}")
    print()
    head = []
    for rows in row_counts:
        got = [r for r in plain if r["rows"] == rows]
        entry: dict[str, Any] = {"rows": rows, "tokens/row": got[0]["tokens_per_row"], "steps": got[0]["steps"]}
        for key, label in (("wall_us_per_token", "wall us/tok"), ("cpu_us_per_token", "CPU us/tok"), ("us_per_step", "us/step"),
                           ("others_cores", "others' cores")):
            entry[label] = " / ".join(f"{r[key]:.{2 if key == 'others_cores' else 1}f}" for r in got)
        entry["goal"] = goal_note(rows, got)
        head.append(entry)
    print(table(head, title=f"plain runs ({args.repeat} each, run 1 / run 2 ...)"))
    busy = [r for r in plain + split if r["others_cores"] > BUSY_CORES]
    if busy:
        print(f"note: other processes took more than {BUSY_CORES:g} cores during {len(busy)} of {len(plain + split)} runs "
              "(others' cores); those runs measured them as much as the engine: run again on a quiet host")
    print()
    cols = ["rows", "run", "wall us/tok", *PHASES, "inputs: batch", "plan_step", "output: detok", "events"]
    body = []
    for r in split:
        entry = {"rows": r["rows"], "run": r["run"], "wall us/tok": r["wall_us_per_token"]}
        for p in PHASES:
            entry[p] = f"{r[f'{p}_us_per_token']:.2f} ({100 * r[f'{p}_share']:.0f}%)"
        entry["inputs: batch"] = r["batch_us_per_token"]
        entry["plan_step"] = r["plan_step_us_per_token"]
        entry["output: detok"] = r["detok_us_per_token"]
        entry["events"] = r["events_us_per_token"]
        body.append(entry)
    print(table(body, cols, title="split runs (timing wrappers on): us per generated token by phase (share of wall)"))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"host": cpu, "torch_threads": threads, "threads_why": why, "attention": attention, "stream": stream,
            "decode": args.decode}
    write_csv(out / f"{NAME}.csv", [{"kind": "plain", **r, **meta} for r in plain] + [{"kind": "split", **r, **meta} for r in split])
    draw(out / f"{NAME}.png", split, f"engine overhead by phase, tiny-gpt2, {threads} threads\n{cpu[:70]}")
    print(f"\nwrote {out / (NAME + '.csv')} and {NAME}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
