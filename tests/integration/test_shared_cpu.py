"""A CPU the server does not have to itself: a tritonserver whose affinity is cut to one core
serves with one compute thread (num_threads auto) and finishes every stream, also with
another process spinning on that core; the engine lowers its OpenMP team while a neighbour
takes a core. Under a real cgroup CPU quota (where this host lets the test make one), a
model loads with one thread per quota core and a team over the quota is lowered from the
cgroup's own throttling. References are transformers' own generate() on the same weights;
every wait is for completion, never a deadline."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from tests.helpers.models import hf_greedy_text, tiny
from tests.helpers.servers import HANG_GUARD_S, add_generation_model, wait_until
from tritonlm.client.generate import generate_grpc
from tritonlm.paths import REPO_ROOT
from tritonlm.server import TritonServer, free_ports
from tritonlm_bench.quota_group import NoQuotaGroup, join_line, quota_group

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to cut the affinity to one")

PROMPTS = ["The capital of France is", "Once upon a time there was", "Numbers: 1 2 3 4 5", "def main(): return",
           "Hi", "A long time ago", "The quick brown fox", "Café naïve"]
ONE_CORE = min(os.sched_getaffinity(0))


class Spinner:
    """Another process busy on one core for the block (its own session, as a neighbour's)."""

    def __init__(self, core: int):
        self.core = core

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
        os.sched_setaffinity(self.proc.pid, {self.core})
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def one_core_server(tmp_path_factory, request):
    """tritonserver and its model's process on one core: a child takes the affinity of the
    thread that starts it, so this thread holds one core while it starts the server."""
    repo = tmp_path_factory.mktemp("onecore")
    add_generation_model(repo, "tiny")  # num_threads: auto, the default
    log = tmp_path_factory.mktemp("serverlog") / "tritonserver.log"
    server = TritonServer(repo, *free_ports(3), log_path=log)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {ONE_CORE})
    try:
        server.start(timeout_s=HANG_GUARD_S)
    finally:
        os.sched_setaffinity(0, before)
    try:
        yield server
    finally:
        server.stop()
        if getattr(request.node, "_tritonlm_failed", False):
            print(f"\n----- tritonserver log ({log}) -----\n" + server.log_text()[-20000:])


def streams_equal_hf(server) -> None:
    """Eight concurrent streams, each the same tokens as transformers' greedy generate()."""
    tok = tiny()[1]
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(
            lambda p: generate_grpc(server.grpc_url, "tiny", p, max_tokens=24, stream=True,
                                    exclude_input_in_output=True, timeout_s=HANG_GUARD_S), PROMPTS))
    for prompt, result in zip(PROMPTS, results):
        assert result.text == tok.decode(hf_greedy_text(prompt, 24)), prompt


def test_auto_threads_follow_the_affinity_mask(one_core_server):
    host = os.cpu_count()
    assert wait_until(lambda: "compute threads: 1 (auto: affinity: 1 of the host's" in one_core_server.log_text(),
                      HANG_GUARD_S), one_core_server.log_text()[-3000:]
    assert f"1 of the host's {host} CPUs" in one_core_server.log_text()


def test_streams_finish_on_one_core(one_core_server):
    streams_equal_hf(one_core_server)


def test_streams_finish_with_a_neighbour_spinning_on_that_core(one_core_server):
    with Spinner(ONE_CORE):
        streams_equal_hf(one_core_server)


def test_the_engine_lowers_its_team_while_a_neighbour_takes_a_core(tmp_path):
    """An in-process engine on two cores (num_threads auto) with a process spinning on one of
    them: the governor drops the compute thread's team to one thread while requests run."""
    import torch

    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.request import GenerationRequest, SamplingParams
    from tritonlm.engine.settings import EngineSettings

    two = sorted(os.sched_getaffinity(0))[:2]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(two))  # the engine's threads start here: they keep these two cores
    try:
        model, tok = tiny()
        model.save_pretrained(tmp_path / "1" / "hf")
        tok.save_pretrained(tmp_path / "1" / "hf")
        engine = build_engine(EngineSettings.from_params({"task": "generate", "hf_dir": "1/hf"}, tmp_path))
    finally:
        os.sched_setaffinity(0, before)
    assert engine.threads is not None and engine.threads.most == 2
    applied: list[tuple[str, int]] = []

    def set_threads(n: int) -> None:
        applied.append((threading.current_thread().name, n))
        torch.set_num_threads(n)

    engine.threads.set_threads = set_threads
    engine.start()
    stop = threading.Event()

    def keep_busy() -> None:
        """Back-to-back requests, so the loop keeps stepping (and ticking) until told."""
        while not stop.is_set():
            done = threading.Event()
            engine.submit(GenerationRequest(list(range(5, 40)), SamplingParams(max_tokens=64, end_id=-1),
                                            lambda ev: ev.finished and done.set()))
            done.wait(HANG_GUARD_S)

    load = threading.Thread(target=keep_busy)
    try:
        with Spinner(two[1]):
            load.start()
            assert wait_until(lambda: engine.threads.current == 1, HANG_GUARD_S)
        assert applied[0] == (engine.compute.thread.name, 1)  # on the thread that runs the steps: the team is its
    finally:
        stop.set()
        load.join()
        engine.shutdown()



# ---------------------------------------------------------------------------- a real CPU quota

@contextlib.contextmanager
def cpu_quota_group(quota_us: int):
    """A child cgroup with a CFS quota (perf/tritonlm_bench/quota_group.py); skips the test with
    the reason where this host does not let the test make one (not root, a read-only or
    delegated cgroup file system, no cpu controller)."""
    try:
        with quota_group(quota_us, name=f"tritonlm-test-{os.getpid()}") as procs:
            yield procs
    except NoQuotaGroup as e:
        pytest.skip(str(e))


def run_in_group(procs: Path, body: str, *args: str) -> dict:
    """`body` in a new Python that joins the group before it imports anything that starts a
    thread (so all its threads are under the quota); `body` prints one JSON line last."""
    script = join_line(procs) + "import sys\n" + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=HANG_GUARD_S)
    assert out.returncode == 0, out.stderr[-5000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


ONE_CORE_QUOTA_BODY = """
    import json
    from pathlib import Path
    import threading
    import torch
    from tritonlm.engine.cpu_cores import CoreWatch, usable_cores
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.request import GenerationRequest, SamplingParams
    from tritonlm.engine.settings import EngineSettings

    repo, prompts = Path(sys.argv[1]), json.loads(sys.argv[2])
    budget = usable_cores()
    engine = build_engine(EngineSettings.from_params({"task": "generate", "hf_dir": "1/hf"}, repo))
    engine.start()
    tokens, done = {}, {}
    for i, ids in enumerate(prompts):
        tokens[i], done[i] = [], threading.Event()
        def on_event(ev, i=i):
            tokens[i].extend(ev.token_ids)
            if ev.finished:
                done[i].set()
        engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=24), on_event))
    for event in done.values():
        event.wait()
    engine.shutdown()
    print(json.dumps({"cores": budget.cores, "why": budget.why, "torch_threads": torch.get_num_threads(),
                      "most": engine.threads.most, "current": engine.threads.current,
                      "quotas": [q.cores for q in CoreWatch().quotas], "tokens": [tokens[i] for i in sorted(tokens)]}))
"""


def test_a_one_core_cgroup_quota_gives_one_compute_thread(tmp_path):
    """A model loaded in a cgroup whose quota is one core (`100000 100000`) on a host with
    more: one compute thread from the quota, the governor watching that cgroup, and every
    request's tokens as transformers' own greedy generate()."""
    model, tok = tiny()
    model.save_pretrained(tmp_path / "1" / "hf")
    tok.save_pretrained(tmp_path / "1" / "hf")
    prompts = PROMPTS[:4]
    with cpu_quota_group(100_000) as procs:
        got = run_in_group(procs, ONE_CORE_QUOTA_BODY, str(tmp_path), json.dumps([tok(p).input_ids for p in prompts]))
    assert got["cores"] == 1.0 and got["why"].startswith("cgroup CPU quota 1 cores"), got["why"]
    assert got["torch_threads"] == 1 and got["most"] == 1 and got["current"] == 1
    assert 1.0 in got["quotas"]
    assert got["tokens"] == [hf_greedy_text(p, 24) for p in prompts]


OVER_QUOTA_BODY = """
    import json
    import threading
    import torch
    from tritonlm.engine.cpu_cores import COMPUTE_THREAD, CoreWatch, ThreadGovernor
    from tritonlm.engine.threads import named_thread

    readings, result = [], {}

    class Recording(CoreWatch):
        def reading(self):
            r = super().reading()
            if r is not None:
                readings.append((r.waiting, r.throttled))
            return r

    def compute():
        # a team larger than its quota, as when the frontend shares a pod's quota with it;
        # set on this thread, which runs the parallel ops: the team is its own
        torch.set_num_threads(2)
        gov = ThreadGovernor(2, torch.set_num_threads, watch=Recording(), interval_s=0.25)
        a, w = torch.randn(256, 512), torch.randn(512, 512)
        while gov.current == 2:
            for _ in range(20):
                a @ w
            gov.tick()
        result.update(current=gov.current, changes=gov.changes, torch_threads=torch.get_num_threads(),
                      quotas=[q.cores for q in gov.watch.quotas])

    thread = named_thread(compute, COMPUTE_THREAD, daemon=False)
    thread.start()
    thread.join()
    print(json.dumps({**result, "last": readings[-1]}))
"""


def test_a_team_over_its_cgroup_quota_is_lowered():
    """Two busy compute threads in a cgroup with a one-core quota: the cgroup is throttled
    (or the threads wait on each other where the host's cores are busy), and the governor
    lowers the team to one thread."""
    with cpu_quota_group(100_000) as procs:
        got = run_in_group(procs, OVER_QUOTA_BODY)
    assert got["current"] == 1 and got["torch_threads"] == 1 and got["changes"] == 1
    assert 1.0 in got["quotas"]
    waiting, throttled = got["last"]
    assert max(waiting, throttled) >= 0.5, got
