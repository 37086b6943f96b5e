"""tritonlm/engine/parallel/runner.py: tensor and pipeline parallel runners alone (no
server), on the CPU with gloo; the plain helpers of parallel/ (shard, steps) with them.

Every rank is a real process: rank 0 is this test process, rank 1 a worker started by
the runner. Logits are checked step by step against TorchRunner (same batches, unsplit)
and against Hugging Face's own forward pass; memory is measured from the tensors each
rank holds; a killed, a hung and an orphaned worker (worker.py's watch on its parent)
are each checked to fail fast or go away.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.models import LLAMA_VOCAB, assert_close, hf_greedy_text, hf_logits, random_tokens, tiny, tiny_llama
from tests.helpers.servers import HANG_GUARD_S, add_generation_model, wait_until
from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.model_shape import ModelShape
from tritonlm.engine.parallel import (
    ParallelConfig,
    ParallelRunner,
    WorkerFailure,
    kv_bytes_per_token_per_rank,
    validate_parallel,
)
from tritonlm.engine.parallel.shard import split_range
from tritonlm.engine.parallel.steps import micro_batch_bounds
from tritonlm.engine.runners import Runner
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.settings import EngineSettings, SettingsError


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    models = {"gpt2": tiny()[0], "llama": tiny_llama()}
    for name, model in models.items():
        model.save_pretrained(root / name)
    return {name: (root / name, model) for name, model in models.items()}


def start(hf_dir, mode: str, size: int = 2, **kw) -> ParallelRunner:
    return ParallelRunner(ParallelConfig(hf_dir=str(hf_dir), mode=mode, size=size, num_threads=1, name=f"test-{mode}", **kw))


RUNNERS = [("gpt2", "tensor"), ("gpt2", "pipeline"), ("llama", "tensor"), ("llama", "pipeline")]


@pytest.fixture(scope="module", params=RUNNERS, ids=[f"{a}-{m}" for a, m in RUNNERS])
def split(request, hf_dirs):
    arch, mode = request.param
    hf_dir, model = hf_dirs[arch]
    runner = start(hf_dir, mode)
    yield model, runner
    runner.close()


# ---------------------------------------------------------------------------- helpers


def worker_children(pid: int | None = None) -> list[int]:
    """Live (non-zombie) processes whose parent is pid and that run a parallel worker."""
    pid = os.getpid() if pid is None else pid
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z" and "tritonlm.engine.parallel.worker" in cmd:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Twin:
    """The same steps on an unsplit TorchRunner (with a pool) and on a split runner
    (accounting only, pool in the ranks); both managers hand out the same slots."""

    def __init__(self, model, runner: ParallelRunner, blocks: int = 64, block_size: int = 4):
        self.model = model
        self.ref = TorchRunner(model)
        self.runner = runner
        budget = self.ref.spec.bytes_per_token * block_size * blocks
        self.ref_cache = KVCacheManager(self.ref.spec, budget, block_size=block_size, allocate_kv=self.ref.allocate_kv)
        self.cache = KVCacheManager(runner.spec, budget, block_size=block_size, allocate_kv=runner.allocate_kv)
        assert self.cache.pool is None
        self.seqs: dict[int, list[int]] = {}

    def add(self, sid: int, capacity: int = 40) -> None:
        self.ref_cache.allocate(sid, capacity)
        self.cache.allocate(sid, capacity)
        self.seqs[sid] = []

    def step(self, rows: list[tuple[int, list[int]]], all_logits: bool = False) -> None:
        past = [len(self.seqs[sid]) for sid, _ in rows]
        new = [toks for _, toks in rows]
        slots = [self.cache.slots(sid, p + len(t)) for (sid, t), p in zip(rows, past)]
        assert slots == [self.ref_cache.slots(sid, p + len(t)) for (sid, t), p in zip(rows, past)]
        batch = StepBatch.build(new, past, slots, all_logits=all_logits)
        want = self.ref.forward(batch, self.ref_cache.pool)
        got = self.runner.forward(batch, self.cache.pool)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert_close(got, want)
        for b, (sid, toks) in enumerate(rows):
            self.seqs[sid].extend(toks)
            full = hf_logits(self.model, self.seqs[sid])
            if all_logits:
                assert_close(got[b, : len(toks)], full[-len(toks):])
            else:
                assert_close(got[b], full[-1])


# ---------------------------------------------------------------------------- logits


def test_runner_protocol_and_spec(split):
    model, runner = split
    assert isinstance(runner, Runner)
    assert runner.spec == TorchRunner(model).spec  # the whole model's shape: the engine's accounting is unchanged
    assert runner.healthy and len(runner.worker_pids) == 1
    assert runner.model.cpp_ops  # decode steps on the paged-attention kernel, as TorchRunner's (CPU, float32)


def test_chunked_prefill_verify_and_decode_match_torch_runner_and_hf(split):
    model, runner = split
    twin = Twin(model, runner)
    for sid in (1, 2, 3, 4, 5):
        twin.add(sid)
    twin.step([(1, random_tokens(7, 1)), (2, random_tokens(3, 2)), (3, random_tokens(1, 3))])  # prefill of mixed widths
    twin.step([(1, random_tokens(5, 4)), (2, random_tokens(1, 5)), (3, random_tokens(1, 6)), (4, random_tokens(9, 7)), (5, random_tokens(2, 8))])
    twin.step([(1, random_tokens(4, 9)), (2, random_tokens(1, 10)), (4, random_tokens(2, 11))], all_logits=True)  # speculative verify
    for i in range(4):  # decode, everyone, then a batch of one
        twin.step([(sid, random_tokens(1, 100 + 10 * i + sid)) for sid in (1, 2, 3, 4, 5)])
    twin.step([(3, random_tokens(1, 999))])
    for sid in twin.seqs:  # finished sequences give their cache back; the next ones reuse it
        twin.cache.free(sid)
        twin.ref_cache.free(sid)
    twin.seqs.clear()
    twin.add(6)
    twin.step([(6, random_tokens(11, 12))])
    twin.step([(6, random_tokens(1, 13))])


def test_greedy_generation_matches_hf_generate(split):
    """Token by token through the split runner: the same greedy continuation as HF."""
    model, runner = split
    twin = Twin(model, runner)
    prompts = [random_tokens(6, 21), random_tokens(2, 22), random_tokens(9, 23)]
    for sid in range(len(prompts)):
        twin.add(sid, 40)
    seqs = [list(p) for p in prompts]
    feed = [list(p) for p in prompts]
    for _ in range(12):
        past = [len(s) - len(f) for s, f in zip(seqs, feed)]
        batch = StepBatch.build(feed, past, [twin.cache.slots(i, len(s)) for i, s in enumerate(seqs)])
        nxt = runner.forward(batch, None).argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        feed = [[t] for t in nxt]
    for p, s in zip(prompts, seqs):
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0].tolist()
        assert len(ref) > len(p) and s[: len(ref)] == ref  # HF stops at EOS, the loop above does not


# ---------------------------------------------------------------------------- memory


def test_each_tensor_parallel_rank_holds_half_the_weights_and_half_the_kv(hf_dirs):
    hf_dir, model = hf_dirs["gpt2"]
    runner = start(hf_dir, "tensor")
    try:
        ref = TorchRunner(model)
        full_weights = ref.transformer.weight_bytes()
        assert full_weights == sum(p.numel() * p.element_size() for p in model.parameters())
        slots = 64 * 16
        runner.allocate_kv(slots)
        full_kv = slots * ref.spec.bytes_per_token
        report = runner.memory_report()
        assert [r["rank"] for r in report] == [0, 1]
        assert report[1]["pid"] == runner.worker_pids[0] != report[0]["pid"]  # measured in the worker process itself
        for r in report:
            assert 0.49 <= r["weight_bytes"] / full_weights <= 0.52, r  # replicated: norms and two biases per layer
            assert r["kv_bytes"] == full_kv // 2, r
        assert runner.kv_bytes_per_token_per_rank == [ref.spec.bytes_per_token // 2] * 2
    finally:
        runner.close()


def test_every_rank_holds_its_share_of_the_kv_and_of_the_weights(split):
    model, runner = split
    spec = runner.spec
    runner.allocate_kv(100)
    report = runner.memory_report()
    shares = runner.kv_bytes_per_token_per_rank
    assert [r["kv_bytes"] for r in report] == [100 * s for s in shares]
    assert sum(shares) == spec.bytes_per_token  # nothing duplicated, nothing lost
    full = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    if model.config.tie_word_embeddings:  # the blocked LM head (Transformer.block_weights) is a copy of wte
        full += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    limit = 0.52 if runner.mode == "tensor" else 0.75  # stages: whole layers, the embeddings on one side
    assert all(r["weight_bytes"] <= limit * full for r in report), (report, full)
    # and a lower bound: no rank is left (nearly) empty, and together they hold every weight
    floor = 0.49 if runner.mode == "tensor" else 0.25
    assert all(r["weight_bytes"] >= floor * full for r in report), (report, full)
    assert sum(r["weight_bytes"] for r in report) >= full, (report, full)


def test_plain_helpers():
    assert [split_range(10, 3, i) for i in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert micro_batch_bounds(5, 2) == [(0, 3), (3, 5)]
    assert micro_batch_bounds(1, 4) == [(0, 1)]
    spec = ModelShape("llama", num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=LLAMA_VOCAB, max_positions=64)
    assert kv_bytes_per_token_per_rank(spec, tensor_parallel_size=2) == [spec.bytes_per_token // 2] * 2
    assert kv_bytes_per_token_per_rank(spec, pipeline_parallel_size=2) == [2 * 2 * 2 * 16 * 4, 1 * 2 * 2 * 16 * 4]


# ---------------------------------------------------------------------------- bad config


@pytest.mark.parametrize(
    "arch, tp, pp, match",
    [
        ("gpt2", 3, 1, r"tensor_parallel_size: 3 does not divide the model's 4 attention heads"),
        ("llama", 4, 1, r"tensor_parallel_size: 4 does not divide the model's 2 key/value heads"),
        ("gpt2", 1, 3, r"pipeline_parallel_size: 3 stages for a model of 2 layers"),
    ],
)
def test_impossible_splits_refuse_to_load_naming_the_field(hf_dirs, arch, tp, pp, match):
    hf_dir, model = hf_dirs[arch]
    with pytest.raises(SettingsError, match=match):
        validate_parallel(TorchRunner(model).spec, tp, pp)
    mode, size = ("tensor", tp) if tp > 1 else ("pipeline", pp)
    before = set(worker_children())
    with pytest.raises(SettingsError, match=match):
        start(hf_dir, mode, size)  # refused before any worker starts
    assert set(worker_children()) <= before


@pytest.mark.parametrize(
    "params, match",
    [
        ({"tensor_parallel_size": "2", "pipeline_parallel_size": "2"}, "combining both is not supported"),
        ({"tensor_parallel_size": "0"}, "tensor_parallel_size: must be >= 1"),
        ({"pipeline_parallel_size": "two"}, "pipeline_parallel_size: 'two' is not an integer"),
        ({"parallel_timeout_s": "0"}, "parallel_timeout_s: must be > 0"),
    ],
)
def test_bad_parallel_parameters_name_the_field(tmp_path, params, match):
    (tmp_path / "1" / "hf").mkdir(parents=True)
    with pytest.raises(SettingsError, match=match):
        EngineSettings.from_params(params, tmp_path)


# ---------------------------------------------------------------------------- through the engine


def test_engine_built_from_settings_generates_hf_tokens_and_stops_its_workers(tmp_path):
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.request import GenerationRequest, SamplingParams

    model_dir = add_generation_model(tmp_path, "tp")
    settings = EngineSettings.from_params({"tensor_parallel_size": "2", "kv_cache_bytes": "300000"}, model_dir)
    engine = build_engine(settings)
    try:
        assert isinstance(engine.runner, ParallelRunner) and engine.cache.pool is None
        pids = engine.runner.worker_pids
        assert len(pids) == 1 and alive(pids[0])
        # the budget counts the whole model; each rank holds half of it
        report = engine.runner.memory_report()
        assert [r["kv_bytes"] for r in report] == [engine.cache.num_blocks * engine.cache.block_bytes // 2] * 2
        prompts = ["The capital of France is", "Hi", "Once upon a time there was a small robot who wanted"]
        events: dict[int, list] = {}
        rids = []
        for i, p in enumerate(prompts):
            req = GenerationRequest(engine.encode(p), SamplingParams(max_tokens=16 + 4 * i), lambda ev: events[ev.request_id].append(ev))
            events[req.request_id] = []
            rids.append(req.request_id)
            engine.submit(req)
        for _ in range(500):  # the engine's step loop, driven here (no thread)
            if all(events[r] and events[r][-1].finished for r in rids):
                break
            engine.step()
        for i, (rid, p) in enumerate(zip(rids, prompts)):
            assert events[rid][-1].error is None
            assert [t for ev in events[rid] for t in ev.token_ids] == hf_greedy_text(p, 16 + 4 * i)
        # prefix caching across the ranks: the same prompt again shares its full blocks
        again = GenerationRequest(engine.encode(prompts[2]), SamplingParams(max_tokens=16), lambda ev: events[ev.request_id].append(ev))
        events[again.request_id] = []
        engine.submit(again)
        while not (events[again.request_id] and events[again.request_id][-1].finished):
            engine.step()
        assert events[again.request_id][-1].num_cached_tokens == 16  # its first block, held by every rank
        assert [t for ev in events[again.request_id] for t in ev.token_ids] == hf_greedy_text(prompts[2], 16)
    finally:
        engine.shutdown()
    assert not alive(pids[0])
    assert pids[0] not in worker_children()


def test_bad_split_through_build_engine_starts_no_worker(tmp_path):
    from tritonlm.engine.loader import build_engine

    model_dir = add_generation_model(tmp_path, "tp3")
    settings = EngineSettings.from_params({"tensor_parallel_size": "3"}, model_dir)
    before = set(worker_children())
    with pytest.raises(SettingsError, match="tensor_parallel_size: 3 does not divide"):
        build_engine(settings)
    assert set(worker_children()) <= before


# ---------------------------------------------------------------------------- failures


def test_killed_worker_fails_the_step_at_once_and_reports_which_rank(hf_dirs):
    hf_dir, model = hf_dirs["gpt2"]
    runner = start(hf_dir, "tensor")
    reasons = []
    runner.on_failure(reasons.append)
    try:
        twin = Twin(model, runner)
        twin.add(1)
        twin.step([(1, random_tokens(5, 1))])
        victim = runner.worker_pids[0]
        os.kill(victim, signal.SIGKILL)
        assert wait_until(lambda: not runner.healthy, HANG_GUARD_S), "the monitor did not notice the dead worker"
        assert reasons and "rank 1" in reasons[0] and "SIGKILL" in reasons[0]
        batch = StepBatch.build([[7]], [5], [twin.cache.slots(1, 6)])
        with pytest.raises(WorkerFailure, match=r"out of service .*rank 1.*reload the model") as failed:
            runner.forward(batch, None)
        # at once: refused before any rank is asked to step (no collective waited on the dead
        # rank and failed: that would be the error's cause)
        assert failed.value.__cause__ is None, failed.value.__cause__
        assert len(reasons) == 1  # the callback runs once
    finally:
        runner.close()
    assert victim not in worker_children()


def test_hung_worker_times_out_the_step_instead_of_hanging(hf_dirs):
    hf_dir, model = hf_dirs["gpt2"]
    # the timeout also bounds joining the process group and every step before the hang: long
    # enough for a busy host, short enough that the test does not wait long for the hung step
    runner = start(hf_dir, "tensor", timeout_s=10.0)
    try:
        twin = Twin(model, runner)
        twin.add(1)
        twin.step([(1, random_tokens(4, 1))])
        victim = runner.worker_pids[0]
        os.kill(victim, signal.SIGSTOP)  # alive but not answering
        batch = StepBatch.build([[7]], [4], [twin.cache.slots(1, 5)])
        with pytest.raises(WorkerFailure):  # raised, not hung (pytest's timeout guards a hang)
            runner.forward(batch, None)
        assert not runner.healthy
        assert wait_until(lambda: not alive(victim), HANG_GUARD_S)  # the stuck worker was killed
    finally:
        runner.close()


def test_workers_die_with_their_parent(hf_dirs, tmp_path):
    """The engine process is SIGKILLed (no finalize, no atexit): its workers go too."""
    hf_dir, _ = hf_dirs["gpt2"]
    script = textwrap.dedent(f"""
        import time
        from tritonlm.engine.parallel import ParallelConfig, ParallelRunner
        r = ParallelRunner(ParallelConfig(hf_dir={str(hf_dir)!r}, mode="pipeline", size=2, num_threads=1))
        print("PIDS", *r.worker_pids, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while not line.startswith("PIDS") and time.monotonic() < deadline:
            line = parent.stdout.readline()
            if not line and parent.poll() is not None:
                break
        assert line.startswith("PIDS"), f"the runner did not start (exit {parent.poll()})"
        pids = [int(x) for x in line.split()[1:]]
        assert pids and all(alive(p) for p in pids)
        parent.kill()
        parent.wait(timeout=10)
        assert wait_until(lambda: not any(alive(p) for p in pids), HANG_GUARD_S), "orphaned workers"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_close_is_idempotent_and_joins_every_worker(hf_dirs):
    hf_dir, _ = hf_dirs["llama"]
    runner = start(hf_dir, "pipeline")
    pids = runner.worker_pids
    assert set(pids) <= set(worker_children())
    runner.close()
    runner.close()
    assert not any(alive(p) for p in pids)
    assert not set(pids) & set(worker_children())
    with pytest.raises(WorkerFailure, match="closed"):
        runner.forward(StepBatch.build([[1]], [0], [[4]]), None)


def test_each_rank_gets_its_share_of_the_usable_cores(monkeypatch):
    """num_threads auto: the cores split over every rank of every instance (a 2-rank model,
    3 instances, a 16-core quota: 2 threads a rank); a number is used as given."""
    from types import SimpleNamespace

    from tritonlm.engine.cpu_cores import CoreBudget
    from tritonlm.engine.parallel import runner as runner_module

    monkeypatch.setattr(runner_module, "usable_cores", lambda: CoreBudget(16.0, "quota"))
    auto = SimpleNamespace(config=ParallelConfig(hf_dir="x", mode="tensor", size=2, cpu_share=3), world=2)
    assert ParallelRunner.rank_threads(auto) == 2
    fixed = SimpleNamespace(config=ParallelConfig(hf_dir="x", mode="tensor", size=2, num_threads=5, cpu_share=3), world=2)
    assert ParallelRunner.rank_threads(fixed) == 5
