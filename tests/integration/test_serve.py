"""`make serve` for real: `tritonlm serve-default` as a subprocess (the command the Makefile
runs, with a draft model), on free ports. Every model of the repository it exports must
load, and the generation model must answer over gRPC and HTTP exactly as transformers'
generate() does. A repository with a weights file missing must not come up as ready."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.models import hf_greedy_text, tiny
from tritonlm.client.generate import generate_grpc, generate_http
from tritonlm.server import free_ports

NAME = "tiny-gpt2"
PROMPTS = ["The capital of France is", "Once upon a time there was", "Hi"]
MAX_TOKENS = 12


class ServeDefault:
    """`tritonlm serve-default ...` in its own process group; its output kept for failures."""

    def __init__(self, repo: Path, *extra: str):
        self.http, self.grpc, self.metrics, self.openai = free_ports(4)
        self.cmd = [str(Path(sys.executable).with_name("tritonlm")), "serve-default", "--model", NAME,
                    "--draft", "tiny-gpt2-draft", "--repo", str(repo), "--host", "127.0.0.1",
                    "--http-port", str(self.http), "--grpc-port", str(self.grpc),
                    "--metrics-port", str(self.metrics), "--openai-port", str(self.openai), *extra]
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("tritonserver ready"):
                self.ready.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def wait_ready(self, timeout_s: float = 600) -> bool:
        """True once it says ready; False when the process exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready.wait(0.5):
                return True
            if self.proc.poll() is not None:
                self._reader.join(5)
                return self.ready.is_set()
        raise AssertionError(f"serve-default neither ready nor exited in {timeout_s:.0f} s:\n{self.output}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C, as a user stops `make serve`
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._reader.join(5)
        return self.proc.returncode


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("serve_default") / "model_repository"
    server = ServeDefault(repo)
    try:
        assert server.wait_ready(), f"serve-default exited with {server.proc.returncode}:\n{server.output}"
        yield server, repo
    finally:
        code = server.stop()
        assert code == 0, f"serve-default stopped with {code}:\n{server.output}"


def test_the_exported_repository_is_the_generation_model_its_draft_and_forward_model(served):
    _, repo = served
    assert sorted(p.name for p in repo.iterdir()) == [NAME, f"{NAME}_draft", f"{NAME}_onnx"]


def test_every_exported_model_is_loaded_and_ready(served):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    server, repo = served
    names = sorted(p.name for p in repo.iterdir())
    with httpclient.InferenceServerClient(f"127.0.0.1:{server.http}") as c:
        assert c.is_server_ready()
        index = {m["name"]: m.get("state") for m in c.get_model_repository_index()}
        assert sorted(index) == names
        assert all(state == "READY" for state in index.values()), index
        for name in names:
            assert c.is_model_ready(name), name
    with grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}") as c:
        for name in names:
            assert c.is_model_ready(name), name


def test_serve_defaults_tiny_gpt2_is_the_seeded_reference_model(served):
    """The weights it exported are tests.helpers.models.tiny's (builtin seeded model), so
    hf_greedy_text is the reference for what it serves."""
    import torch
    from transformers import AutoModelForCausalLM

    _, repo = served
    exported = AutoModelForCausalLM.from_pretrained(str(repo / NAME / "1" / "hf"))
    ref, _ = tiny(NAME)
    ours, theirs = exported.state_dict(), ref.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_grpc_and_http_greedy_equal_transformers(served, prompt):
    server, _ = served
    _, tok = tiny(NAME)
    expected = tok.decode(hf_greedy_text(prompt, MAX_TOKENS, NAME))
    grpc = generate_grpc(f"127.0.0.1:{server.grpc}", NAME, prompt, max_tokens=MAX_TOKENS, stream=True,
                         exclude_input_in_output=True, timeout_s=120)
    assert grpc.text == expected
    http = generate_http(f"127.0.0.1:{server.http}", NAME, prompt, max_tokens=MAX_TOKENS,
                         exclude_input_in_output=True, timeout_s=120)
    assert http["text_output"] == expected


def test_sampled_speculative_request_through_the_served_draft_is_reproducible(served):
    server, _ = served
    url = f"127.0.0.1:{server.grpc}"
    runs = [generate_grpc(url, NAME, PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0.9, top_k=20, top_p=0.9,
                          seed=5, exclude_input_in_output=True, timeout_s=120) for _ in range(2)]
    assert runs[0].text == runs[1].text and runs[0].text
    drafted = runs[0].extra.get("total_draft_tokens")
    assert drafted is not None and drafted > 0, runs[0].extra  # NAME_draft proposed tokens


@pytest.mark.parametrize("model,pattern", [(f"{NAME}_onnx", "model.onnx"), (f"{NAME}_draft", "*.safetensors")])
def test_a_repository_with_a_weights_file_missing_does_not_come_up(served, tmp_path, model, pattern):
    """The same command on a copy of the exported repository with one model's weights file
    deleted (the forward model's ONNX file, the draft's weights): serve-default must fail
    (non-zero exit), never report ready."""
    _, repo = served
    broken = tmp_path / "model_repository"
    shutil.copytree(repo, broken)
    (weights,) = sorted((broken / model / "1").rglob(pattern))
    weights.unlink()
    server = ServeDefault(broken)
    try:
        came_up = server.wait_ready(timeout_s=300)
        code = server.stop()
    finally:
        if server.proc.poll() is None:
            server.stop()
    assert not came_up, f"a repository without {weights} came up as ready:\n{server.output}"
    assert code != 0
    assert "already in" in server.output  # it served the broken copy; it did not quietly export again
