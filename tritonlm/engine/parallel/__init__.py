"""Model parallelism: one model split over processes (tensor or pipeline parallel).

Settings (config.pbtxt parameters, read by EngineSettings):
    tensor_parallel_size    N > 1: every layer's heads and MLP columns split over N ranks
                            (Megatron style, one all-reduce per sublayer); each rank holds
                            ~1/N of the weights and 1/N of the KV cache (its kv heads).
                            N must divide the attention heads and the key/value heads.
    pipeline_parallel_size  N > 1: consecutive layer ranges on N stages; each step's rows
                            are cut into micro-batches that flow stage to stage, so the
                            stages work at the same time. N <= number of layers.
    pipeline_micro_batches  micro-batches per step (default 0: one per stage)
    parallel_timeout_s      deadline of one collective op (default 60): a hung rank fails
                            the step instead of hanging it
Only runtime "torch"; one of the two sizes at a time. Rank 0 is the engine process
itself; ranks 1..N-1 are worker processes (`python -m tritonlm.engine.parallel.worker`),
children of the engine process that die with it. On GPUs (device cuda[:K]) rank r uses
cuda:K+r over NCCL; on the CPU all ranks use gloo over loopback.

KV budget: kv_cache_bytes is the whole model's budget; rank r holds its share
(with TP total / N per rank: bytes per token per rank = spec.bytes_per_token / N; with PP
each stage its layers' share). See README.md in this folder for instances and budgets.

    runner = load_parallel_runner(settings)        # or ParallelRunner(ParallelConfig(...))
    cache = KVCacheManager(runner.spec, budget, block, allocate_kv=runner.allocate_kv)  # pool: None
    logits = runner.forward(batch, None)
    runner.close()
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tritonlm.engine.parallel.runner import (
        ParallelConfig,
        ParallelError,
        ParallelRunner,
        WorkerFailure,
        kv_bytes_per_token_per_rank,
        rank_devices,
        validate_parallel,
    )

log = logging.getLogger(__name__)

__all__ = [
    "ParallelConfig",
    "ParallelError",
    "ParallelRunner",
    "WorkerFailure",
    "kv_bytes_per_token_per_rank",
    "load_parallel_runner",
    "rank_devices",
    "validate_parallel",
]

# Resolved on first use (PEP 562), not at import: the model's forward pass imports
# parallel.comm (Comm, ONE_RANK) and parallel.runner imports the model, so importing this
# package must not import parallel.runner, or loading the model would import itself.
_FROM_RUNNER = {name for name in __all__ if name != "load_parallel_runner"}


def __getattr__(name: str):
    if name in _FROM_RUNNER:
        from tritonlm.engine.parallel import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_parallel_runner(settings) -> ParallelRunner:
    """The runner for a model's settings; in Triton, a lost worker also unloads the model."""
    from tritonlm.engine.parallel.runner import ParallelConfig, ParallelError, ParallelRunner
    from tritonlm.engine.settings import SettingsError

    try:
        runner = ParallelRunner(ParallelConfig.from_settings(settings))
    except ParallelError as e:
        raise SettingsError(str(e)) from None
    runner.on_failure(unload_from_triton(runner.config.name))
    return runner


def unload_from_triton(model_name: str):
    """on_failure callback: ask Triton to unload the model, so it reports not ready and new
    requests get Triton's 'model unavailable' error. Needs --model-control-mode=explicit;
    otherwise the model stays loaded and every request gets the runner's error."""

    def hook(reason: str) -> None:
        try:
            import triton_python_backend_utils as pb_utils
        except ImportError:  # not inside Triton's Python backend
            return

        def unload() -> None:
            try:
                pb_utils.unload_model(model_name)
                log.error("model %s: asked Triton to unload it after: %s", model_name, reason)
                print(f"tritonlm-parallel model={model_name}: unloading it (reload it to serve again)", flush=True)
            except Exception as e:  # e.g. model control mode none/poll
                log.error(
                    "model %s: could not unload it (%s); it stays loaded and fails every request until "
                    "it is reloaded (needs --model-control-mode=explicit to unload itself)", model_name, e,
                )

        threading.Thread(target=unload, name=f"tritonlm-unload-{model_name}", daemon=True).start()

    return hook
