"""Model parallelism through the real tritonserver (explicit model control, CPU, gloo).

tiny-gpt2 split over 2 processes (tensor parallel, pipeline parallel) answers exactly
like transformers' generate() on the unsplit weights, alone and in concurrent batches,
streaming and not; two instances serve side by side; the workers' own tensor byte
counts are half the model's; unload/reload leaves no process behind; a killed worker
takes the model out of service within seconds (not ready, requests get errors); an
impossible split refuses to load naming the field.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.helpers.models import hf_greedy_text, tiny
from tests.helpers.servers import HANG_GUARD_S, add_generation_model, histogram_peak, wait_until
from tritonlm.client.generate import GenerateError, generate_grpc
from tritonlm.commands.instances import set_instances

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a small robot who wanted",
    "Hi",
    "Café naïve — 你好，世界 🙂",
]
BYTES_PER_TOKEN = 2 * 2 * 64 * 4  # tiny-gpt2: 2 layers x 64 wide x fp32
KV_BYTES = 8 * (256 + 16) * BYTES_PER_TOKEN  # 8 full-context sequences, whole model
SPLIT = ["tiny_tp2", "tiny_pp2"]
STARTUP = ["tiny_tp2", "tiny_pp2", "tiny_x2", "tiny_victim"]


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("parrepo")
    common = {"kv_cache_bytes": KV_BYTES, "max_num_batched_tokens": 64}
    add_generation_model(repo, "tiny_tp2", tensor_parallel_size=2, **common)
    set_instances(repo / "tiny_tp2", 1, "model")  # one KIND_MODEL instance owning its worker
    add_generation_model(repo, "tiny_pp2", pipeline_parallel_size=2, **common)
    add_generation_model(repo, "tiny_x2", **common)
    set_instances(repo / "tiny_x2", 2)  # data parallel: two engines
    add_generation_model(repo, "tiny_victim", tensor_parallel_size=2, parallel_timeout_s=10, **common)
    add_generation_model(repo, "tiny_unload", tensor_parallel_size=2, **common)
    add_generation_model(repo, "tiny_bad_tp3", tensor_parallel_size=3)
    add_generation_model(repo, "tiny_bad_pp3", pipeline_parallel_size=3)
    return repo


@pytest.fixture(scope="module")
def triton_server_options():
    return {"model_control": "explicit", "load_models": STARTUP}


def gen(server, prompt, model, **params):
    params.setdefault("exclude_input_in_output", True)
    params.setdefault("timeout_s", HANG_GUARD_S)
    return generate_grpc(server.grpc_url, model, prompt, **params)


def text_of(ids):
    return tiny()[1].decode(ids)


def model_ready(server, name) -> bool:
    try:
        # a probe a busy host answers late must not read as "not ready"
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{name}/ready", timeout=60) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) of every live (non-zombie) process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat[0] != "Z":
            out[int(entry.name)] = (int(stat[1]), cmd)
    return out


def descendants(root: int) -> dict[int, str]:
    procs = processes()
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmd) in procs.items():
            if ppid == parent and pid not in found:
                found[pid] = cmd
                frontier.append(pid)
    return found


def workers_of(server, model: str) -> list[int]:
    """Worker processes of `model` under the server (stub -> worker)."""
    return [
        pid for pid, cmd in descendants(server.process.pid).items()
        if "tritonlm.engine.parallel.worker" in cmd and f"--name {model} " in cmd + " "
    ]


def stubs_of(server, model: str) -> list[int]:
    return [pid for pid, cmd in descendants(server.process.pid).items() if "triton_python_backend_stub" in cmd and f" {model}_" in cmd]


# ---------------------------------------------------------------------------- answers


@pytest.mark.parametrize("model", SPLIT)
def test_split_model_answers_like_hf_generate_alone_streaming_or_not(triton_server, model):
    for prompt in PROMPTS:
        ref = text_of(hf_greedy_text(prompt, 20))
        for stream in (False, True):
            result = gen(triton_server, prompt, model, max_tokens=20, stream=stream)
            assert result.text == ref, (model, prompt, stream)
            assert result.finish_reason == "length" and result.num_output_tokens == 20


@pytest.mark.parametrize("model", SPLIT + ["tiny_x2"])
def test_concurrent_mixed_requests_get_their_solo_answers(triton_server, model):
    prompts = [PROMPTS[i % len(PROMPTS)] + "!" * (i // len(PROMPTS)) for i in range(10)]
    lengths = [6 + 4 * i for i in range(10)]
    expected = [text_of(hf_greedy_text(p, n)) for p, n in zip(prompts, lengths)]
    with cf.ThreadPoolExecutor(10) as pool:
        futures = [
            pool.submit(gen, triton_server, p, model, max_tokens=n, stream=bool(i % 2))
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ]
        results = [f.result(timeout=300) for f in futures]
    assert [r.text for r in results] == expected
    if model in SPLIT:  # continuous batching really batched the split model's steps
        assert histogram_peak(triton_server, "tritonlm_batch_size_bucket", model) >= 1


def test_two_instances_are_two_engines(triton_server):
    stubs = stubs_of(triton_server, "tiny_x2")
    assert len(stubs) == 2, descendants(triton_server.process.pid)
    log = triton_server.log_text()
    assert "tiny_x2_0_0" in log and "tiny_x2_0_1" in log


# ---------------------------------------------------------------------------- memory


def test_each_tensor_parallel_worker_holds_half_the_weights_and_kv(triton_server):
    full_weights = sum(p.numel() * p.element_size() for p in tiny()[0].parameters())
    lines = re.findall(
        r"tritonlm-parallel model=tiny_tp2 mode=tensor rank=(\d)/2 pid=(\d+) device=cpu weight_bytes=(\d+) kv_bytes=(\d+)",
        triton_server.log_text(),
    )
    ranks = {int(r): (int(pid), int(w), int(k)) for r, pid, w, k in lines}
    assert set(ranks) == {0, 1}, lines
    assert ranks[0][0] != ranks[1][0]  # two processes, each reporting what it holds
    assert ranks[1][0] in workers_of(triton_server, "tiny_tp2")
    for _pid, weights, kv in ranks.values():
        assert 0.49 <= weights / full_weights <= 0.52
        assert kv == KV_BYTES // 2  # the whole model's budget, half on each rank


# ---------------------------------------------------------------------------- lifecycle


def test_unload_and_reload_leave_no_worker_behind(triton_server):
    client = httpclient.InferenceServerClient(triton_server.http_url)
    for round_ in range(2):  # load, unload, load again (a reload), unload
        client.load_model("tiny_unload")
        assert model_ready(triton_server, "tiny_unload")
        workers = workers_of(triton_server, "tiny_unload")
        stubs = stubs_of(triton_server, "tiny_unload")
        assert len(workers) == 1 and len(stubs) == 1, descendants(triton_server.process.pid)
        assert processes()[workers[0]][0] == stubs[0]  # the worker is the engine process's child
        prompt = PROMPTS[round_]
        assert gen(triton_server, prompt, "tiny_unload", max_tokens=8).text == text_of(hf_greedy_text(prompt, 8))
        client.unload_model("tiny_unload")
        assert wait_until(lambda: not (set(workers + stubs) & set(processes())), HANG_GUARD_S), "processes left after unload"
        assert not model_ready(triton_server, "tiny_unload")


def test_killed_worker_takes_the_model_out_of_service_within_seconds(triton_server):
    model = "tiny_victim"
    assert gen(triton_server, PROMPTS[0], model, max_tokens=4).num_output_tokens == 4
    [victim] = workers_of(triton_server, model)
    started = threading.Event()
    outcomes: list = []

    def long_request(i):
        try:
            gen(triton_server, PROMPTS[i % 3], model, max_tokens=230, stream=True, on_piece=lambda _: started.set())
            outcomes.append("ok")
        except GenerateError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=long_request, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert started.wait(HANG_GUARD_S)
    os.kill(victim, signal.SIGKILL)
    # it goes out of service by itself (no request needed to notice), however slow the host
    assert wait_until(lambda: not model_ready(triton_server, model), HANG_GUARD_S), "the model still reports ready"
    for t in threads:
        t.join(timeout=HANG_GUARD_S)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert any(o != "ok" for o in outcomes), outcomes  # in-flight requests got an error, not a hang
    with pytest.raises(GenerateError):  # and so does a new one
        gen(triton_server, "anyone there?", model, max_tokens=4)
    log = triton_server.log_text()
    assert f"tensor-parallel worker rank 1 (pid {victim}) died with signal SIGKILL" in log
    assert wait_until(lambda: not stubs_of(triton_server, model) and not workers_of(triton_server, model), HANG_GUARD_S)
    assert model_ready(triton_server, "tiny_tp2")  # the other models keep serving
    assert gen(triton_server, PROMPTS[0], "tiny_tp2", max_tokens=5).text == text_of(hf_greedy_text(PROMPTS[0], 5))


# ---------------------------------------------------------------------------- bad config


@pytest.mark.parametrize(
    "model, field",
    [("tiny_bad_tp3", "tensor_parallel_size: 3 does not divide"), ("tiny_bad_pp3", "pipeline_parallel_size: 3 stages")],
)
def test_impossible_split_refuses_to_load_naming_the_field(triton_server, model, field):
    client = httpclient.InferenceServerClient(triton_server.http_url)
    with pytest.raises(InferenceServerException, match=field):
        client.load_model(model)
    assert not model_ready(triton_server, model)
    assert wait_until(lambda: not workers_of(triton_server, model) and not stubs_of(triton_server, model), HANG_GUARD_S)
