"""The model repository and the first measurements the goodput benchmarks share
(perf/bench_goodput.py, perf/bench_slo_step.py): one set of weights served under several
names (a configuration each, all with the same KV room and prefix caching off), and a lone
request's TTFT and TPOT, from which the SLO targets are set; the server that serves it."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

from tritonlm.engine.model_shape import ModelShape
from tritonlm.export.repository import default_kv_cache_bytes
from tritonlm.perf.goodput import request_metrics
from tritonlm.perf.openloop import GrpcTarget, PromptMaker, warm_up
from tritonlm.perf.target import PerfError, Target
from tritonlm.perf.trace import ScheduledRequest
from tritonlm.server import ServerStartError, TritonServer, free_ports
from tritonlm_bench.benchrepo import link_generation_model, save_weights_once

# max_context: the workload's longest request and this margin (a text prompt's token count
# is near, not exactly, the one asked), or the model's positions when fewer. Sized to the
# workload, the KV room stays small and a configuration loads quickly.
CONTEXT_MARGIN = 64
MAX_SEQS = 64  # the engine's default max_num_seqs: the KV room is sized for that many
# an unload still going after this long is stuck, and the next configuration would be
# measured beside its process (docs/serving.md#unloading-a-model)
UNLOAD_WAIT_S = 300.0


class GoodputRepo:
    """OUT/repo: one entry per configuration, all linked to the weights saved
    once, all with the same KV room and prefix caching off."""

    def __init__(self, out: Path, model_name: str, longest_request: int):
        from tritonlm.models.loading import load_model

        model, tok, _ = load_model(model_name, progress=lambda *a, **k: None)
        self.weights = save_weights_once(model, tok, out / "weights" / model_name)
        positions = getattr(model.config, "max_position_embeddings", None) or model.config.n_positions
        self.context = min(longest_request + CONTEXT_MARGIN, positions)
        self.kv_cache_bytes = default_kv_cache_bytes(ModelShape.from_hf_config(model.config), self.context, sequences=MAX_SEQS)
        self.path = out / "repo"

    def add(self, name: str, params: dict[str, str]) -> None:
        link_generation_model(self.path, name, self.weights, self.context, kv_cache_bytes=self.kv_cache_bytes,
                              enable_prefix_caching="false", **params)


async def lone_request(target: GrpcTarget, schedule: list[ScheduledRequest], prompts: PromptMaker) -> tuple[float, float]:
    """Median TTFT and TPOT (ms) of the workload's first requests sent one at a time."""
    records = await warm_up(target, schedule[:5], prompts)
    failed = [r.error for r in records if r.status != "ok"]
    if failed:
        raise PerfError(f"a lone request failed: {failed[0]}")
    metrics = [request_metrics(r) for r in records]
    # the first one after load runs cold: shown, not counted
    print(f"the first request after load: TTFT {metrics[0].ttft_ms:.1f} ms ({records[0].prompt_tokens} prompt tokens)", flush=True)
    rest = metrics[1:]
    return statistics.median(m.ttft_ms for m in rest), statistics.median(m.tpot_ms for m in rest if m.tpot_ms)


def serve(repo: GoodputRepo, out: Path) -> tuple[TritonServer, Target] | None:
    """tritonserver on the repository (explicit model control, `default` loaded; its log in
    `out`) and a client that loads and unloads the configurations; None, the reason
    printed, where it did not start."""
    http, grpc, metrics = free_ports(3)
    server = TritonServer(repo.path, http, grpc, metrics, model_control="explicit", load_models=["default"],
                          log_path=out / "tritonserver.log")
    try:
        server.start(timeout_s=600)
    except ServerStartError as e:
        print(f"tritonserver did not start: {e}", file=sys.stderr)
        return None
    return server, Target("127.0.0.1", http, grpc, metrics, repo=repo.path)


async def switch(control: Target, server: TritonServer, target, loaded: str, name: str) -> GrpcTarget:
    """Configuration `name` served in place of `loaded` (unloaded first, its process gone: one
    at a time), and a gRPC target for it; `target`, the previous one, is closed."""
    if name != loaded:
        if loaded:
            await unload(control, loaded)
        control.load(name)
    await target.close()
    return GrpcTarget(server.grpc_url, name, timeout_s=600)


async def unload(control: Target, name: str) -> None:
    """Unload `name` and wait until Triton reports it unloaded; PerfError where it is still
    loaded or unloading (or its state cannot be read) after UNLOAD_WAIT_S."""
    control.unload(name)
    deadline = time.monotonic() + UNLOAD_WAIT_S
    while (state := control.model_state(name)) in ("READY", "UNLOADING", None):
        if time.monotonic() > deadline:
            raise PerfError(f"model '{name}' is still {state or 'of unknown state'} {UNLOAD_WAIT_S:.0f} s after its "
                            "unload: the next configuration would run beside its process "
                            "(docs/serving.md#unloading-a-model)")
        await asyncio.sleep(0.1)
