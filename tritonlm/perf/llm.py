"""`tritonlm perf llm`: streaming LLM metrics from perf_analyzer's per-response timestamps.

perf_analyzer runs with `-i grpc --streaming` against the decoupled generation
model and writes `--profile-export-file`: every request's send time and the
arrival time of each of its responses. From those (parse_profile_export, a pure
function):

- time to first token (TTFT) = first response carrying text - request sent
- request latency           = last response (the final, empty one included) - request sent
- inter-token latency (ITL) = (last text response - first text response) / (output tokens - 1),
                              i.e. (latency - TTFT) / (tokens - 1) measured to the last token
- output tokens/s           = all output tokens / (last response - first request) of the run

Output tokens are the server's own count (the final response's num_output_tokens, or
the OpenAI usage chunk), else streamed pieces, or re-tokenized text with a tokenizer.

`--openai [URL]` measures the same through the OpenAI-compatible API (tritonlm/openai/):
perf_analyzer's OpenAI client posts streaming /v1/completions (or chat) requests with
`stream_options.include_usage`, and each server-sent event is one response.
`--compare-grpc` also measures gRPC direct at the same loads and prints the frontend's
overhead (output tok/s through it / direct) with the CPU it ran on.
Prompts and output lengths come from a JSONL dataset (`prompt`, `max_tokens`)
or are generated with set length distributions.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tritonlm.perf import harness, report
from tritonlm.perf.analyzer import Measure, measure_point, warm_up
from tritonlm.perf.jsonl import read_jsonl
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.stats import summarize
from tritonlm.perf.target import PerfError

TEXT_OUTPUT = "text_output"
PROMPT_WORDS = (  # common English words: about one token each in large vocabularies
    "serving language models means keeping many streams busy at once while every new token "
    "reads the weights and the cache so the scheduler decides who runs each step and how much "
    "memory each sequence may hold before the queue grows and latency follows"
).split()


# --- the profile export parser -------------------------------------------------------------------
@dataclass
class RequestTiming:
    ttft_ms: float
    latency_ms: float
    itl_ms: float | None  # None with fewer than 2 output tokens
    output_tokens: int
    text: str


@dataclass
class LlmMetrics:
    mode: str  # "concurrency" | "request_rate"
    load: float
    requests: int
    empty_requests: int  # requests that got no text at all
    duration_s: float
    output_tokens: int
    ttft_ms: dict[str, float]
    itl_ms: dict[str, float]
    latency_ms: dict[str, float]
    tokens_per_request: dict[str, float]
    timings: list[RequestTiming] = field(default_factory=list, repr=False)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    def row(self) -> dict:
        return {
            self.mode: int(self.load) if float(self.load).is_integer() else self.load,
            "requests": self.requests,
            "ttft_p50_ms": round(self.ttft_ms["p50"], 2),
            "ttft_p99_ms": round(self.ttft_ms["p99"], 2),
            "itl_avg_ms": round(self.itl_ms["avg"], 2),
            "itl_p99_ms": round(self.itl_ms["p99"], 2),
            "latency_p50_ms": round(self.latency_ms["p50"], 2),
            "latency_p99_ms": round(self.latency_ms["p99"], 2),
            "tokens_per_request": round(self.tokens_per_request["avg"], 1),
            "output_tokens_per_s": round(self.output_tokens_per_s, 1),
            "requests_per_s": round(self.requests_per_s, 2),
        }


def _piece(output: dict, name: str) -> str:
    value = output.get(name, "")
    if isinstance(value, list):  # a BYTES tensor with several elements
        return "".join(str(v) for v in value)
    return "" if value is None else str(value)


def sse_events(output: dict) -> list[dict]:
    """The JSON events of one OpenAI streaming response as perf_analyzer records it
    ({"response": "data: {...}\\n\\n"}, sometimes several events at once); [DONE] left out."""
    events = []
    for block in str((output or {}).get("response", "")).split("\n\n"):
        line = block.strip()
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            try:
                events.append(json.loads(line[5:]))
            except ValueError:
                pass
    return events


def openai_output(output: dict) -> dict:
    """One recorded OpenAI response as tritonlm's outputs: text_output, and num_output_tokens
    from a usage event."""
    text, out = [], {}
    for event in sse_events(output):
        for choice in event.get("choices") or []:
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content")
            text.append(piece or "")
        if event.get("usage"):
            out["num_output_tokens"] = event["usage"].get("completion_tokens")
    out[TEXT_OUTPUT] = "".join(text)
    return out


def _server_token_count(outputs: list) -> int | None:
    for o in reversed(outputs):
        value = (o or {}).get("num_output_tokens")
        if isinstance(value, list):
            value = value[0] if value else None
        if value not in (None, ""):
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


def request_timing(request: dict, count_tokens: Callable[[str], int] | None = None, output_name: str = TEXT_OUTPUT) -> RequestTiming | None:
    """Timing of one profile-export request; None when no response carried text."""
    sent = request["timestamp"]
    stamps = request.get("response_timestamps", [])
    outputs = request.get("response_outputs", [{}] * len(stamps))
    texts = [(t, _piece(o or {}, output_name)) for t, o in zip(stamps, outputs)]
    with_text = [(t, s) for t, s in texts if s]
    if not with_text:
        return None
    text = "".join(s for _, s in with_text)
    served = _server_token_count(outputs)
    # the server's own count (tritonlm's final response carries num_output_tokens) beats
    # re-tokenizing text, which need not round-trip to the same tokens
    tokens = served if served is not None else (count_tokens(text) if count_tokens else len(with_text))
    first, last = with_text[0][0], with_text[-1][0]
    itl = (last - first) / 1e6 / (tokens - 1) if tokens > 1 else None
    return RequestTiming(
        ttft_ms=(first - sent) / 1e6,
        latency_ms=(max(stamps) - sent) / 1e6,
        itl_ms=itl,
        output_tokens=tokens,
        text=text,
    )


def parse_profile_export(
    export: dict, count_tokens: Callable[[str], int] | None = None, output_name: str = TEXT_OUTPUT
) -> list[LlmMetrics]:
    """LLM metrics per experiment (one per concurrency or request rate) of a perf_analyzer profile export."""
    results = []
    openai = export.get("service_kind") == "openai"
    for exp in export.get("experiments", []):
        info = exp.get("experiment", {})
        requests = exp.get("requests", [])
        if openai:
            requests = [{**r, "response_outputs": [openai_output(o) for o in r.get("response_outputs", [])]} for r in requests]
        timings, empty = [], 0
        for r in requests:
            t = request_timing(r, count_tokens, output_name)
            if t is None:
                empty += 1
            else:
                timings.append(t)
        starts = [r["timestamp"] for r in requests]
        ends = [max(r.get("response_timestamps") or [r["timestamp"]]) for r in requests]
        duration = (max(ends) - min(starts)) / 1e9 if requests else 0.0
        results.append(
            LlmMetrics(
                mode="request_rate" if info.get("mode") == "request_rate" else "concurrency",
                load=float(info.get("value", 0)),
                requests=len(requests),
                empty_requests=empty,
                duration_s=duration,
                output_tokens=sum(t.output_tokens for t in timings),
                ttft_ms=summarize([t.ttft_ms for t in timings]),
                itl_ms=summarize([t.itl_ms for t in timings if t.itl_ms is not None]),
                latency_ms=summarize([t.latency_ms for t in timings]),
                tokens_per_request=summarize([float(t.output_tokens) for t in timings]),
                timings=timings,
            )
        )
    return results


# --- datasets ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int


def load_dataset(path: Path) -> list[Prompt]:
    """JSONL, one object a line: `prompt` (or `text_input`) and `max_tokens` (or `output_tokens`)."""
    prompts = []
    for n, obj in read_jsonl(path, PerfError):
        text = obj.get("prompt", obj.get("text_input"))
        try:
            max_tokens = int(obj.get("max_tokens", obj.get("output_tokens", 0)))
        except (ValueError, TypeError):
            max_tokens = 0
        if not isinstance(text, str) or max_tokens < 1:
            raise PerfError(f"{path}:{n}: needs a string `prompt` and a positive `max_tokens`")
        prompts.append(Prompt(text, max_tokens))
    if not prompts:
        raise PerfError(f"{path}: no prompts")
    return prompts


def _length(rng: random.Random, mean: float, stddev: float) -> int:
    return max(1, int(round(rng.gauss(mean, stddev) if stddev > 0 else mean)))


def synthetic_dataset(
    n: int, *, prompt_mean: float = 64, prompt_stddev: float = 0, output_mean: float = 32, output_stddev: float = 0, seed: int = 0
) -> list[Prompt]:
    """n prompts of about `prompt` words (≈ tokens for common English words) asking for `output` tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(PROMPT_WORDS) for _ in range(_length(rng, prompt_mean, prompt_stddev))]
        out.append(Prompt(" ".join(words), _length(rng, output_mean, output_stddev)))
    return out


def input_data(prompts: Sequence[Prompt], model_inputs: set[str], *, fixed_length: bool = False) -> dict:
    """perf_analyzer --input-data JSON: one entry per prompt, only inputs the model declares."""
    missing = {"text_input", "max_tokens"} - model_inputs
    if missing:
        raise PerfError(
            f"the model has no input {', '.join(sorted(missing))}: perf llm drives the LLM tensor names "
            "(text_input BYTES, max_tokens INT32, stream BOOL); pass --input-data FILE for other models"
        )
    data = []
    for p in prompts:
        entry = {"text_input": [p.text], "max_tokens": [p.max_tokens]}
        if "stream" in model_inputs:
            entry["stream"] = [True]
        if "exclude_input_in_output" in model_inputs:
            entry["exclude_input_in_output"] = [True]
        if fixed_length:
            for name in ("min_tokens", "min_length"):
                if name in model_inputs:
                    entry[name] = [p.max_tokens]
        data.append(entry)
    return {"data": data}


OPENAI_ENDPOINTS = {"completions": "v1/completions", "chat": "v1/chat/completions"}


def openai_input_data(prompts: Sequence[Prompt], model: str, endpoint: str = "completions", *, fixed_length: bool = False) -> dict:
    """perf_analyzer --input-data for its OpenAI client: one streaming request body per prompt."""
    data = []
    for p in prompts:
        body: dict = {"model": model, "max_tokens": p.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": p.text}]
        else:
            body["prompt"] = p.text
        if fixed_length:
            body["min_tokens"] = p.max_tokens
        data.append({"payload": [body]})
    return {"data": data}


def token_counter(tokenizer: str | None) -> Callable[[str], int] | None:
    """Count tokens by re-tokenizing with a tokenizer.json file or a Hugging Face tokenizer folder."""
    if not tokenizer:
        return None
    path = Path(tokenizer)
    try:
        if path.is_file():
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path))
            return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        return lambda text: len(tok.encode(text, add_special_tokens=False))
    except Exception as e:
        raise PerfError(f"cannot load tokenizer {tokenizer}: {e}") from None


# --- the harness -------------------------------------------------------------------------------
def run_llm(
    target,
    model: str,
    concurrencies: list[float],
    measure: Measure,
    data_file: Path,
    workdir: Path,
    *,
    requests_per_point: Callable[[int], int] | None = None,
    count_tokens: Callable[[str], int] | None = None,
    extra_args: Sequence[str] = (),
    label: str = "",
) -> list[LlmMetrics]:
    results = []
    for i, c in enumerate(concurrencies, 1):
        m = measure
        if requests_per_point is not None:
            m = replace(measure, requests=requests_per_point(int(c)))
        print(f"[llm {model}{label}] concurrency {int(c)} ({i}/{len(concurrencies)}) ...", end="", flush=True)
        point = measure_point(target, model, c, m, ["--input-data", str(data_file), *extra_args], workdir=workdir)
        metrics = parse_profile_export(point.export, count_tokens)
        if not metrics or metrics[-1].requests == 0:
            print(" no requests", flush=True)
            raise PerfError(f"perf_analyzer recorded no requests at concurrency {int(c)}: lengthen --measurement-interval")
        r = metrics[-1]
        results.append(r)
        print(
            f" TTFT p50 {r.ttft_ms['p50']:.1f} ms  ITL {r.itl_ms['avg']:.1f} ms  {r.output_tokens_per_s:.1f} tok/s"
            f"  ({r.requests} requests)",
            flush=True,
        )
        if r.empty_requests:
            print(f"  warning: {r.empty_requests} request(s) returned no text", flush=True)
    return results


def write_outputs(results: list[LlmMetrics], out: Path, model: str) -> list[Path]:
    rows = [r.row() for r in results]
    files = [report.write_csv(out / "llm.csv", rows)]
    fig, (ax1, ax2) = report.pyplot().subplots(1, 2, figsize=(11, 4.2))
    conc = [r.load for r in results]
    ax1.plot(conc, [r.ttft_ms["p50"] for r in results], "o-", label="TTFT p50")
    ax1.plot(conc, [r.ttft_ms["p99"] for r in results], "o--", label="TTFT p99")
    ax1.plot(conc, [r.itl_ms["avg"] for r in results], "s-", label="ITL avg")
    ax1.plot(conc, [r.latency_ms["p99"] for r in results], "^:", label="request latency p99")
    report.style_axes(ax1, "concurrency", "ms", f"{model}: latency")
    ax2.plot(conc, [r.output_tokens_per_s for r in results], "o-")
    report.style_axes(ax2, "concurrency", "output tokens/s", "throughput", legend_size=None)
    files.append(report.save_figure(fig, out / "llm.png"))
    return files


def add_parser(sub) -> None:
    p = harness.harness_parser(sub, "llm", "streaming LLM metrics: TTFT, inter-token latency, tokens/s (decoupled model, gRPC)")
    p.add_argument("--concurrency", default="1,2,4,8", help="concurrencies (default 1,2,4,8)")
    src = p.add_argument_group("prompts (default: generated)")
    src.add_argument("--dataset", type=Path, default=None, help="JSONL with prompt and max_tokens per line")
    src.add_argument("--num-prompts", type=int, default=100)
    src.add_argument("--prompt-tokens", type=float, default=64, help="mean prompt length in tokens (default 64)")
    src.add_argument("--prompt-tokens-stddev", type=float, default=0)
    src.add_argument("--output-tokens", type=float, default=32, help="mean max_tokens (default 32)")
    src.add_argument("--output-tokens-stddev", type=float, default=0)
    src.add_argument("--fixed-output-length", action="store_true", help="also send min_tokens = max_tokens where the model takes it")
    src.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-data", type=Path, default=None, help="a ready perf_analyzer --input-data JSON instead")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json or HF folder: count output tokens by re-tokenizing")
    p.add_argument("--requests-per-concurrency", type=int, default=4, help="with request counting: requests = this x concurrency (min 10)")
    p.add_argument("--time-windows", action="store_true", help="use perf_analyzer's stabilized time windows instead of request counts")
    oa = p.add_argument_group("through the OpenAI-compatible API")
    oa.add_argument("--openai", nargs="?", const="start", default=None, metavar="URL",
                    help="measure through the OpenAI API at URL (e.g. http://127.0.0.1:9000, as `tritonlm serve` runs it); "
                         "without URL: start one in this process in front of the measured server")
    oa.add_argument("--openai-endpoint", choices=sorted(OPENAI_ENDPOINTS), default="completions",
                    help="completions (default) or chat (needs the model's chat template)")
    oa.add_argument("--compare-grpc", action="store_true",
                    help="with --openai: also measure gRPC direct at the same loads and print the frontend's overhead")
    harness.add_harness_args(p, "llm", main, interval_ms=5000, inputs=False)


class _ViaOpenAI:
    """The measured server, reached through the OpenAI API: perf_analyzer talks to the frontend
    (http_url), the statistics still come from Triton."""

    def __init__(self, target, host_port: str):
        self._target = target
        self.http_url = host_port

    def __getattr__(self, name):
        return getattr(self._target, name)


def _host_port(url: str) -> str:
    url = url.strip().rstrip("/")
    for prefix in ("http://", "https://"):
        url = url.removeprefix(prefix)
    return url.removesuffix("/v1")


def _synthetic_or_dataset(args: argparse.Namespace) -> list[Prompt]:
    if args.dataset:
        return load_dataset(args.dataset)
    return synthetic_dataset(
        args.num_prompts,
        prompt_mean=args.prompt_tokens,
        prompt_stddev=args.prompt_tokens_stddev,
        output_mean=args.output_tokens,
        output_stddev=args.output_tokens_stddev,
        seed=args.seed,
    )


def overhead_rows(direct: list[LlmMetrics], via: list[LlmMetrics]) -> list[dict]:
    rows = []
    for d, o in zip(direct, via):
        rows.append({
            "concurrency": int(d.load),
            "grpc_tokens_per_s": round(d.output_tokens_per_s, 1),
            "openai_tokens_per_s": round(o.output_tokens_per_s, 1),
            "ratio": round(o.output_tokens_per_s / d.output_tokens_per_s, 3) if d.output_tokens_per_s else float("nan"),
            "grpc_ttft_p50_ms": round(d.ttft_ms["p50"], 2),
            "openai_ttft_p50_ms": round(o.ttft_ms["p50"], 2),
            "grpc_itl_avg_ms": round(d.itl_ms["avg"], 2),
            "openai_itl_avg_ms": round(o.itl_ms["avg"], 2),
        })
    return rows


def main(args: argparse.Namespace) -> int:
    concurrencies = harness.loads_from(args.concurrency)
    out = report.results_dir(args.results, "llm")
    count_tokens = token_counter(args.tokenizer)
    if args.openai is not None and args.input_data:
        raise PerfError("--input-data is perf_analyzer's gRPC input; with --openai give prompts with --dataset or the generated ones")
    if args.openai is not None and args.time_windows:
        raise PerfError("--openai measures request counts (perf_analyzer's OpenAI client records each request); drop --time-windows")
    if args.compare_grpc and args.openai is None:
        raise PerfError("--compare-grpc compares gRPC with the OpenAI API: add --openai [URL]")
    direct: list[LlmMetrics] = []
    via: list[LlmMetrics] = []
    with harness.open_target(args, [args.model], log_path=out / "tritonserver.log") as target:
        if not target.is_decoupled(args.model):
            raise PerfError(f"model '{args.model}' is not decoupled: perf llm measures streaming models; use `tritonlm perf sla`")
        measure = harness.measure_from_args(args, decoupled=True)
        work = harness.raw_dir(out)
        prompts = None if args.input_data else _synthetic_or_dataset(args)
        per_point = None
        if not args.time_windows and not args.requests:
            per_point = lambda c: max(10, args.requests_per_concurrency * c)  # noqa: E731
        if args.openai is None or args.compare_grpc:
            if args.input_data:
                data_file = args.input_data
            else:
                names = {i["name"] for i in target.config(args.model).get("input", [])}
                data_file = work / "llm_input_data.json"
                data_file.write_text(json.dumps(input_data(prompts, names, fixed_length=args.fixed_output_length)))
            warm_up(target, args.model, measure, ["--input-data", str(data_file)], work, requests=2)
            direct = run_llm(target, args.model, concurrencies, measure, data_file, work, requests_per_point=per_point,
                             count_tokens=count_tokens, label=" gRPC" if args.openai else "")
        if args.openai is not None:
            via = _measure_openai(args, target, prompts, concurrencies, measure, work, per_point, count_tokens)
    print()
    if direct:
        print(report.table([r.row() for r in direct], title=f"{args.model}: streaming LLM metrics (gRPC)"))
        for f in write_outputs(direct, out, args.model):
            print(f"wrote {f}")
    if via:
        oa_out = out / "openai"
        oa_out.mkdir(exist_ok=True)
        print(report.table([r.row() for r in via], title=f"{args.model}: streaming LLM metrics (OpenAI API, {args.openai_endpoint})"))
        for f in write_outputs(via, oa_out, args.model):
            print(f"wrote {f}")
    if direct and via:
        rows = overhead_rows(direct, via)
        cpu = describe_cpu()
        print()
        print(report.table(rows, title=f"OpenAI frontend overhead: output tok/s through it / gRPC direct (CPU: {cpu})"))
        print(f"wrote {report.write_csv(out / 'overhead.csv', [{**r, 'cpu': cpu} for r in rows])}")
    return 0


def _measure_openai(args, target, prompts, concurrencies, measure, work, per_point, count_tokens) -> list[LlmMetrics]:
    import contextlib

    from tritonlm.server import free_ports

    frontend = contextlib.nullcontext()
    url = args.openai
    if args.openai == "start":
        from tritonlm.openai.server import OpenAIServer

        (port,) = free_ports(1)
        frontend = OpenAIServer(target.grpc_url, port=port, repo=target.repo)
        url = f"127.0.0.1:{port}"
    with frontend:
        via = _ViaOpenAI(target, _host_port(url))
        oa_work = work / "openai"
        oa_work.mkdir(exist_ok=True)
        data_file = oa_work / "openai_input_data.json"
        data_file.write_text(json.dumps(openai_input_data(prompts, args.model, args.openai_endpoint,
                                                          fixed_length=args.fixed_output_length)))
        extra = ["--service-kind", "openai", "--endpoint", OPENAI_ENDPOINTS[args.openai_endpoint], "--async"]
        m = replace(measure, protocol="http", streaming=False)
        warm_up(via, args.model, m, ["--input-data", str(data_file), *extra], oa_work, requests=2)
        return run_llm(via, args.model, concurrencies, m, data_file, oa_work, requests_per_point=per_point,
                       count_tokens=count_tokens, extra_args=extra, label=" OpenAI")
