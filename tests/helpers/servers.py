"""What the tests that run servers share: small generation-model repositories (seeded tiny
weights, no downloads), waits for a process or server to change state, and reads of a
server's metrics.

A test waits for the thing itself (a log line, a metric, a process exit), never for a fixed
time: the host may be slow or busy. The timeouts here are hang guards only, long enough that
no working run reaches them."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from tests.helpers.models import tiny
from tritonlm.export.repository import write_generation_model
from tritonlm_bench.serve_process import ServeProcess, http_status  # noqa: F401 - the tests import them from here

HANG_GUARD_S = 600.0  # what a wait for something that does happen gives it: reached only by a hang


# ---- model repositories ----------------------------------------------------------------------

def add_generation_model(repo: Path, name: str, builtin: str = "tiny-gpt2", **parameters) -> Path:
    """repo/name/{config.pbtxt, 1/hf/} for a built-in tiny model; parameters go to config.pbtxt."""
    model, tok = tiny(builtin)
    return write_generation_model(repo, name, model, tok, **parameters)


def add_long_llama(repo: Path, name: str, context: int, seed: int, **parameters) -> Path:
    """A tiny Llama (seeded weights, the tiny tokenizer; RoPE: no position table) with room for
    `context` tokens: generations that last, so a test can act mid-stream however fast the host."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tritonlm.models.builtin import tiny_tokenizer

    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=context,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    return write_generation_model(repo, name, LlamaForCausalLM(config).eval(), tok, max_context=context, **parameters)


def add_slow_model(repo: Path, name: str = "slow", max_num_seqs: int = 2) -> None:
    """A seeded GPT-2 (4 layers x 256, 1024 positions, the tiny tokenizer) at most two
    sequences at a time: 8 streams of 300 tokens last seconds on a CPU."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from tritonlm.export.repository import write_generate_config
    from tritonlm.models.builtin import tiny_tokenizer

    tok = tiny_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_positions=1024, n_embd=256, n_layer=4, n_head=4,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(7)
    hf = repo / name / "1" / "hf"
    GPT2LMHeadModel(config).eval().save_pretrained(hf)
    tok.save_pretrained(hf)
    write_generate_config(repo / name, name, max_context=1024, extra_parameters={"max_num_seqs": str(max_num_seqs)})


# ---- holding an engine in its step ------------------------------------------------------------

@contextmanager
def stall_env(path: Path) -> Iterator[Path]:
    """Servers started inside see the test-only stall (engine.STALL_FILE_ENV): while `path`
    exists their engines hold in their step, the GIL free. The file is gone afterwards."""
    from tritonlm.engine.engine import STALL_FILE_ENV

    old = os.environ.get(STALL_FILE_ENV)
    os.environ[STALL_FILE_ENV] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop(STALL_FILE_ENV, None)
        else:
            os.environ[STALL_FILE_ENV] = old
        path.unlink(missing_ok=True)


def release_when(cond: Callable[[], bool], stall: Path, timeout_s: float = HANG_GUARD_S) -> threading.Thread:
    """A started thread that removes the stall file once cond() holds (or after timeout_s, so a
    failing test still ends): the held step goes on."""
    def run() -> None:
        wait_until(cond, timeout_s)
        stall.unlink(missing_ok=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# ---- waiting -----------------------------------------------------------------------------------

def wait_until(cond, timeout_s: float, step: float = 0.1) -> bool:
    """Poll cond() until it is true or timeout_s passes; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def requests_arrived(metrics_port: int, model: str) -> float:
    """Requests that have reached the model's engine so far (waiting + running + finished,
    from the server's metrics; -1 while the metrics endpoint does not answer)."""
    from tritonlm.perf.serverstats import metric_sum, read_metrics

    try:
        samples = read_metrics(f"http://127.0.0.1:{metrics_port}/metrics")
    except OSError:
        return -1
    names = ("tritonlm_requests_waiting", "tritonlm_requests_running", "tritonlm_requests_finished_total")
    return sum(metric_sum(samples, n, model) or 0 for n in names)


def wait_for_requests(metrics_port: int, model: str, count: int, since: float = 0.0,
                      timeout_s: float = HANG_GUARD_S) -> bool:
    """Wait until `count` requests more than `since` (requests_arrived before they were sent)
    have reached the model's engine: a test that signals the server must know its requests
    are in. Finished ones count too, so a fast host that completes the first requests before
    the last arrive still gets there; the finished counter is cumulative, hence `since` for a
    server that served earlier requests."""
    return wait_until(lambda: requests_arrived(metrics_port, model) >= since + count, timeout_s)


def stream_responses(grpc_url: str, model: str, inputs: list) -> list[dict]:
    """Every response's outputs (name -> numpy array) of one request over a gRPC stream, up to
    the final one; GenerateError with the server's message for a refused request."""
    import queue

    import tritonclient.grpc as grpcclient

    from tritonlm.client.generate import GenerateError

    client = grpcclient.InferenceServerClient(grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        out = []
        while True:
            result, error = q.get(timeout=HANG_GUARD_S)
            if error is not None:
                raise GenerateError(str(error))
            out.append({o.name: result.as_numpy(o.name) for o in result.get_response().outputs})
            final = result.get_response().parameters.get("triton_final_response")
            if final and final.bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


class Output:
    """A process's text output, read on a thread as it comes: a test waits for a line in it
    (not for the first line: a library may print a warning before it) and shows all of it
    when an assertion fails. The process's stdout belongs to this reader: wait on the
    process itself (proc.wait), then read .text."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self._thread.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    @property
    def closed(self) -> bool:
        """The process closed its output (it exited): nothing more will come."""
        return not self._thread.is_alive()

    def wait_for(self, text: str, timeout_s: float = HANG_GUARD_S) -> bool:
        """Until text appears in the output, or the output ends without it."""
        wait_until(lambda: text in self.text or self.closed, timeout_s)
        return text in self.text

    def finish(self, timeout_s: float = 30) -> str:
        """All of it, once the process has exited (the reader reaches the end)."""
        self._thread.join(timeout_s)
        return self.text


# ---- a server's metrics ------------------------------------------------------------------------

def histogram_peak(server, name: str, model: str) -> float:
    """For a histogram: the largest bucket bound that some observation exceeded (0 when none did)."""
    rows = re.findall(rf'{name}{{instance="[^"]+",model="{model}",version="1",le="([^"]+)"}} (\S+)', metrics_text(server))
    total = float(rows[-1][1])
    below = [float(le) for le, count in rows if le != "+Inf" and float(count) < total]
    return max(below) if below else 0.0


def metrics_text(server) -> str:
    """The server's Prometheus metrics page."""
    return urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()


def metric(server, name: str, model: str, default: float | None = None, **labels) -> float:
    """The value of metric `name` for `model` (and these labels). A labelled counter appears
    only with its first sample: `default` is the value a caller takes for one not there yet;
    without it a missing metric fails the test."""
    for line in metrics_text(server).splitlines():
        if line.startswith(name + "{") and f'model="{model}"' in line and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise AssertionError(f"metric {name}{labels} of {model} not found")


# ---- `tritonlm serve` as a process -------------------------------------------------------------

Serve = ServeProcess  # the tests' name for it
