"""ParallelRunner: the engine-side face of a model split over processes.

The engine process is rank 0: it holds share 0 (1/N of the weights and of the KV cache,
a runners.model.Transformer slice) and computes like any other rank; ranks 1..N-1
are worker processes it starts (children of the engine process, see worker.py). It
implements the Runner protocol so the Engine is unchanged: `allocate_kv(num_slots)` has
every rank allocate its share and returns None (the KVCacheManager keeps doing block
accounting for the whole model, with no pool of its own), and `forward` ignores `pool`.

Per step (forward): rank 0 validates the batch (plan_step), sends its index tensors to
every worker over the control socket, and all ranks run their shard:
    tensor    embedding all-reduce, per layer 2 all-reduces, logits gathered to rank 0
    pipeline  the batch's rows cut into micro-batches that flow stage to stage
              (send/recv), the last stage sending logits back to rank 0

Failure: a worker that exits (any reason) or a collective that fails or times out
(parallel_timeout_s) puts the runner out of service: one ERROR log line says which rank
died and how, the other workers are stopped, every later forward raises WorkerFailure
(so the engine fails those requests at once instead of letting them hang), and the
`on_failure` callbacks run (in Triton: unload the model, so it reports not ready).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.cpu_cores import usable_cores
from tritonlm.engine.parallel.comm import ProcessComm, batch_fields, make_store, pack, unpack
from tritonlm.engine.kv_cache import KVPool
from tritonlm.engine.parallel.shard import split_range
from tritonlm.engine.parallel.steps import load_shard, memory_line, micro_batch_bounds, run_pp_step, run_tp_step
from tritonlm.engine.runners.base import plan_step
from tritonlm.engine.runners.rope import LengthRope, recompute_at, rope_key
from tritonlm.engine.settings import SettingsError
from tritonlm.engine.model_shape import ModelShape
from tritonlm.engine.threads import named_thread
from tritonlm.proc_exit import describe_exit

log = logging.getLogger(__name__)

MODES = {"tensor": "tensor_parallel_size", "pipeline": "pipeline_parallel_size"}


class ParallelError(RuntimeError):
    """Starting the workers failed (the message carries the worker's own words)."""


class WorkerFailure(RuntimeError):
    """The model lost a worker (or a collective failed): it cannot serve until reloaded."""


@dataclass(frozen=True)
class ParallelConfig:
    hf_dir: str
    mode: str  # "tensor" | "pipeline"
    size: int  # ranks, the engine process included
    device: str = "cpu"  # rank r runs on rank_devices(device, size)[r]
    dtype: torch.dtype | None = None  # None: the checkpoint's
    timeout_s: float = 60.0  # per collective op, and to join the process group
    start_timeout_s: float = 600.0  # for every worker to load its shard
    num_threads: int = 0  # torch threads per rank; 0: the usable cores // (size x cpu_share), at least 1
    cpu_share: int = 1  # model instances on this host, each with `size` ranks
    micro_batches: int = 0  # pipeline: micro-batches per step; 0: one per stage
    name: str = "model"  # the Triton model name (logs, worker command lines)
    attention: str = "auto"  # attention_backend: every rank's decode steps ("gather": never the kernel)

    @property
    def field(self) -> str:
        return MODES[self.mode]

    @staticmethod
    def from_settings(settings) -> "ParallelConfig":
        """EngineSettings.from_params already refused setting both sizes."""
        tp, pp = settings.tensor_parallel_size, settings.pipeline_parallel_size
        mode, size = ("tensor", tp) if tp > 1 else ("pipeline", pp)
        return ParallelConfig(
            hf_dir=str(settings.hf_dir),
            mode=mode,
            size=size,
            device=settings.device,
            timeout_s=settings.parallel_timeout_s,
            num_threads=settings.num_threads,
            cpu_share=settings.cpu_share,
            micro_batches=settings.pipeline_micro_batches,
            name=Path(settings.model_dir).name,
            attention=settings.attention_backend,
        )


def rank_devices(device: str, size: int, field: str = "tensor_parallel_size") -> list[str]:
    """cpu: every rank on the CPU; cuda / cuda:K: rank r on cuda:K+r (one GPU per rank)."""
    if not device.startswith("cuda"):
        return ["cpu"] * size
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if base + size > have:
        raise SettingsError(
            f"{field}: {size} ranks from {device} need GPUs {base}..{base + size - 1}, this machine has {have}"
        )
    return [f"cuda:{base + r}" for r in range(size)]


def validate_parallel(spec: ModelShape, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> None:
    """SettingsError naming the field when the model cannot be split that way."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    if tp > 1:
        divisors = [d for d in range(1, spec.num_kv_heads + 1) if spec.num_heads % d == 0 and spec.num_kv_heads % d == 0]
        if spec.num_heads % tp:
            raise SettingsError(
                f"tensor_parallel_size: {tp} does not divide the model's {spec.num_heads} attention heads "
                f"(use one of {divisors})"
            )
        if spec.num_kv_heads % tp:
            raise SettingsError(
                f"tensor_parallel_size: {tp} does not divide the model's {spec.num_kv_heads} key/value heads "
                f"(use one of {divisors})"
            )
    if pp > 1 and pp > spec.num_layers:
        raise SettingsError(
            f"pipeline_parallel_size: {pp} stages for a model of {spec.num_layers} layers; use at most {spec.num_layers}"
        )


def kv_bytes_per_token_per_rank(spec: ModelShape, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> list[int]:
    """KV bytes one token costs on each rank (for a capacity planner): TP splits the kv
    heads, PP the layers (each rank the share its Transformer slice holds)."""
    if tensor_parallel_size > 1:
        heads = [split_range(spec.num_kv_heads, tensor_parallel_size, r) for r in range(tensor_parallel_size)]
        return [spec.kv_bytes_per_token(num_kv_heads=hi - lo) for lo, hi in heads]
    layers = [split_range(spec.num_layers, pipeline_parallel_size, r) for r in range(pipeline_parallel_size)]
    return [spec.kv_bytes_per_token(num_layers=hi - lo) for lo, hi in layers]


def python_executable() -> str:
    """The interpreter for workers: sys.executable, unless an embedding host (Triton's
    stub) set it to something that is not a Python."""
    exe = sys.executable or ""
    if exe and "python" in Path(exe).name:
        return exe
    for cand in (Path(sys.prefix) / "bin" / "python3", Path(sys.prefix) / "bin" / "python"):
        if cand.exists():
            return str(cand)
    found = shutil.which("python3")
    if not found:
        raise ParallelError("no Python interpreter found to start parallel workers")
    return found


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen, conn: Connection):
        self.rank, self.proc, self.conn = rank, proc, conn
        self.info: dict = {}


def _kill_all(workers: list[_Worker]) -> None:
    """Finalizer (also used by close): no worker outlives its runner."""
    for w in workers:
        if w.proc.poll() is None:
            try:
                w.proc.kill()
            except OSError:
                pass
    for w in workers:
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            w.conn.close()
        except OSError:
            pass


class ParallelRunner:
    """Runner protocol over N ranks; see the module docstring."""

    def __init__(self, config: ParallelConfig):
        from transformers import AutoConfig

        if config.mode not in MODES:
            raise ValueError(f"mode {config.mode!r}: use one of {list(MODES)}")
        self.config = config
        self.mode = config.mode
        self.world = config.size
        hf_config = AutoConfig.from_pretrained(config.hf_dir)
        spec = ModelShape.from_hf_config(hf_config)
        # a length-dependent RoPE keys the prefix cache by its tables, as TorchRunner's does
        self.length_rope = LengthRope.from_config(hf_config, spec.head_dim)
        validate_parallel(
            spec,
            config.size if config.mode == "tensor" else 1,
            config.size if config.mode == "pipeline" else 1,
        )
        self.devices = rank_devices(config.device, config.size, config.field)
        self.device = torch.device(self.devices[0])
        self._lock = threading.Lock()  # one step / control exchange at a time
        self._state = threading.Lock()
        self._dead: str | None = None
        self._closed = False
        self._on_failure: list = []
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _kill_all, self._workers)
        self.comm: ProcessComm | None = None
        self._monitor: threading.Thread | None = None
        self._stop_monitor = threading.Event()
        try:
            self._start()
        except BaseException:
            self._finalizer()
            if self.comm is not None:
                self.comm.shutdown()
            raise

    def rank_threads(self) -> int:
        """Each rank's compute threads: num_threads, or the cores this process may use split
        over every rank of every instance."""
        return self.config.num_threads or usable_cores().threads(self.world * self.config.cpu_share)

    # ---- start ------------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.config
        t0 = time.monotonic()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL binds rank 0 to the current device
        store = make_store(0, self.world, 0, cfg.timeout_s)
        threads = self.rank_threads()  # the workers'; the loader gave rank 0 the same on the thread that steps
        dtype = str(cfg.dtype).removeprefix("torch.") if cfg.dtype is not None else None
        for rank in range(1, self.world):
            self._spawn(rank)
            self._workers[-1].conn.send_bytes(pack(
                "init", mode=self.mode, hf_dir=cfg.hf_dir, device=self.devices[rank], dtype=dtype,
                threads=threads, timeout_s=cfg.timeout_s, attention=cfg.attention,
            ))
        # rank 0's own share loads while the workers load theirs
        self.model, self.logits_width = load_shard(self.mode, cfg.hf_dir, 0, self.world, self.devices[0], cfg.dtype,
                                                       cfg.attention)
        self.pool: KVPool | None = None  # rank 0's share of the KV cache (allocate_kv)
        self.spec: ModelShape = self.model.spec
        self.max_positions = self.model.max_positions
        deadline = time.monotonic() + cfg.start_timeout_s
        for w in self._workers:
            w.info = self._expect(w, "loaded", deadline)
            if self.mode == "pipeline" and w.rank == self.world - 1:
                self.logits_width = w.info["logits_width"]
        for w in self._workers:
            w.conn.send_bytes(pack("connect", port=store.port))
        self.comm = ProcessComm(store, 0, self.world, self.devices[0], cfg.timeout_s)  # waits for every rank
        self._store = store
        for w in self._workers:
            self._expect(w, "ready", time.monotonic() + cfg.timeout_s)
        self._monitor = named_thread(self._watch, f"tritonlm-parallel-monitor-{cfg.name}")  # not "tritonlm-engine"
        self._monitor.start()
        log.info(
            "model %s: %s parallel over %d ranks (pids %s) ready in %.1f s",
            cfg.name, self.mode, self.world, [os.getpid()] + [w.proc.pid for w in self._workers], time.monotonic() - t0,
        )

    def _spawn(self, rank: int) -> None:
        parent_sock, child_sock = socket.socketpair()
        child_fd = child_sock.fileno()
        cmd = [
            python_executable(), "-m", "tritonlm.engine.parallel.worker",
            "--fd", str(child_fd), "--parent", str(os.getpid()),
            "--rank", str(rank), "--world", str(self.world), "--name", self.config.name,
        ]
        if threading.current_thread() is threading.main_thread():
            cmd.append("--pdeathsig")  # PR_SET_PDEATHSIG follows the creating thread: only from the main one
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[3])  # the folder holding the tritonlm package
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("OMP_NUM_THREADS", str(self.rank_threads()))
        try:
            proc = subprocess.Popen(cmd, pass_fds=(child_fd,), stdin=subprocess.DEVNULL, env=env, close_fds=True)
        finally:
            child_sock.close()
        self._workers.append(_Worker(rank, proc, Connection(parent_sock.detach())))

    def _expect(self, w: _Worker, kind: str, deadline: float) -> dict:
        """The next control message of worker w, which must be `kind`."""
        while True:
            try:
                ready = w.conn.poll(0.2)
            except (OSError, EOFError):
                ready = False
            if ready:
                try:
                    got, fields = unpack(w.conn.recv_bytes())
                except (EOFError, OSError):
                    got, fields = None, {}
                if got == "error":
                    raise ParallelError(
                        f"{self.config.field}: worker rank {w.rank} failed to load {self.config.hf_dir}:\n{fields.get('message', '')}"
                    )
                if got == kind:
                    return fields
                if got is not None:
                    raise ParallelError(f"worker rank {w.rank} sent {got!r}, expected {kind!r}")
            code = w.proc.poll()
            if code is not None:
                raise ParallelError(
                    f"{self.config.field}: worker rank {w.rank} (pid {w.proc.pid}) exited with {describe_exit(code)} "
                    f"while starting; see its output in the log above"
                )
            if time.monotonic() > deadline:
                raise ParallelError(f"worker rank {w.rank} did not answer {kind!r} in time")

    # ---- health -------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self._dead is None and not self._closed

    @property
    def failure(self) -> str | None:
        return self._dead

    def on_failure(self, callback) -> None:
        """callback(reason: str), run once, on the thread that saw the failure."""
        self._on_failure.append(callback)

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def _watch(self) -> None:
        while not self._stop_monitor.wait(0.2):
            for w in self._workers:
                code = w.proc.poll()
                if code is not None:
                    self._fail(f"{self.mode}-parallel worker rank {w.rank} (pid {w.proc.pid}) died with {describe_exit(code)}")
                    return

    def _fail(self, reason: str) -> None:
        with self._state:
            if self._dead is not None or self._closed:
                return
            self._dead = reason
        log.error(
            "model %s is out of service: %s; every request fails until the model is reloaded", self.config.name, reason
        )
        print(f"tritonlm-parallel model={self.config.name} FAILED: {reason}", file=sys.stderr, flush=True)
        self._stop_monitor.set()
        for w in self._workers:  # the process group is broken: stop the survivors
            if w.proc.poll() is None:
                try:
                    w.proc.kill()
                except OSError:
                    pass
        for cb in list(self._on_failure):
            try:
                cb(reason)
            except Exception:
                log.exception("on_failure callback failed")

    def _check(self) -> None:
        if self._closed:
            raise WorkerFailure(f"model {self.config.name}: the parallel runner is closed")
        if self._dead is not None:
            raise WorkerFailure(f"model {self.config.name} is out of service ({self._dead}); reload the model")

    # ---- Runner protocol ------------------------------------------------------------------
    def forward(self, batch: StepBatch, pool=None) -> torch.Tensor:
        """`pool` is ignored: the KV pool lives sharded in the ranks (allocate_kv)."""
        self._check()
        if self.pool is None:
            raise RuntimeError("ParallelRunner.allocate_kv(num_slots) must run before forward")
        plan_step(batch, torch.device("cpu"), self.max_positions)  # a bad batch fails here, before any rank moves
        bounds = None
        if self.mode == "pipeline":
            bounds = micro_batch_bounds(batch.batch_size, self.config.micro_batches or self.world)
        msg = pack("step", bounds=bounds, **batch_fields(batch))
        with self._lock:
            self._check()
            try:
                for w in self._workers:
                    w.conn.send_bytes(msg)
                if self.mode == "tensor":
                    return run_tp_step(self.model, self.pool, self.comm, batch)
                return run_pp_step(self.model, self.pool, self.comm, batch, bounds, self.logits_width)
            except Exception as e:
                time.sleep(0.3)  # let the monitor name a dead worker first: a clearer reason than a socket error
                self._fail(f"a {self.mode}-parallel step failed: {type(e).__name__}: {e}")
                raise WorkerFailure(f"model {self.config.name} is out of service ({self._dead}); reload the model") from e

    __call__ = forward

    # ---- KV cache -------------------------------------------------------------------------
    @property
    def rope_recompute_at(self) -> int | None:
        """TorchRunner.rope_recompute_at."""
        return recompute_at(self.length_rope)

    def rope_key(self, prompt_tokens: int) -> bytes | None:
        """TorchRunner.rope_key: which RoPE tables a sequence of that prompt's length is rotated by."""
        return rope_key(self.length_rope, prompt_tokens)

    def allocate_kv(self, num_slots: int) -> None:
        """Every rank allocates its share of num_slots slots. None: the ranks hold the
        tensors (memory_report() has each rank's bytes)."""
        self._check()
        with self._lock:
            self.pool = None  # the old pool goes first: never two at once
            self.pool = self.model.allocate_kv(num_slots)
            total = self.pool.nbytes
            print(f"tritonlm-parallel {memory_line(self.config.name, self.mode, 0, self.world, self.model, self.pool)}",
                  file=sys.stderr, flush=True)
            for w in self._workers:
                w.conn.send_bytes(pack("alloc_kv", num_slots=num_slots))
            for w in self._workers:
                total += self._expect(w, "kv", time.monotonic() + self.config.timeout_s)["kv_bytes"]
        log.info(
            "model %s: KV cache of %d slots split over %d ranks: %s bytes/token per rank, %d bytes in all",
            self.config.name, num_slots, self.world, self.kv_bytes_per_token_per_rank, total,
        )

    @property
    def kv_bytes_per_token_per_rank(self) -> list[int]:
        tp = self.world if self.mode == "tensor" else 1
        pp = self.world if self.mode == "pipeline" else 1
        return kv_bytes_per_token_per_rank(self.spec, tp, pp)

    def resolve_kv_budget(self, settings, default_budget: int) -> int:
        """The model's whole KV budget (all ranks together; each rank holds its share).

        kv_cache_bytes: as given (total; rank r holds its share, total / N with TP).
        kv_cache_fraction on GPUs: every rank has its own device, so the total is what
        the fraction leaves on the tightest rank, times N; on the CPU all ranks share one
        memory and `default_budget` (fraction x free host memory) already is the total."""
        if settings.kv_cache_bytes is None and settings.kv_cache_fraction is not None and self.device.type == "cuda":
            free = [torch.cuda.mem_get_info(self.device)[0]] + [w.info.get("free_memory", 0) for w in self._workers]
            shares = self.kv_bytes_per_token_per_rank
            # tokens the tightest rank can hold, times the whole model's bytes per token
            tokens = min(int(f * settings.kv_cache_fraction) // s for f, s in zip(free, shares) if s)
            return tokens * self.spec.bytes_per_token
        return default_budget

    def memory_report(self) -> list[dict]:
        """Per rank: pid, device, weight_bytes and kv_bytes of the tensors it holds."""
        self._check()
        rows = [{"rank": 0, "pid": os.getpid(), "device": str(self.model.device),
                 "weight_bytes": self.model.weight_bytes(), "kv_bytes": 0 if self.pool is None else self.pool.nbytes}]
        with self._lock:
            for w in self._workers:
                w.conn.send_bytes(pack("report"))
                rows.append(self._expect(w, "report", time.monotonic() + self.config.timeout_s))
        return rows

    # ---- stop -----------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """Stop and join every worker (idempotent). Called when the model unloads."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        self._stop_monitor.set()
        got = self._lock.acquire(timeout=timeout_s)  # a step in flight finishes (or times out) first
        try:
            for w in self._workers:
                if w.proc.poll() is None:
                    try:
                        w.conn.send_bytes(pack("stop"))
                    except OSError:
                        pass
            deadline = time.monotonic() + timeout_s
            for w in self._workers:
                try:
                    w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("model %s: worker rank %d (pid %d) did not stop; killing it", self.config.name, w.rank, w.proc.pid)
            self._finalizer()  # kills what is left, reaps every worker, closes the sockets
            if self.comm is not None:
                self.comm.shutdown()
            self._store = None
        finally:
            if got:
                self._lock.release()
        log.info("model %s: %d parallel worker(s) stopped", self.config.name, len(self._workers))
