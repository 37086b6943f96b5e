"""Speculative decoding through the real server: the output is the target's alone,
token for token, for single and concurrent mixed requests, streaming and not. The models
speculate on every step (`adaptive_speculation` off), so what they guess is the same on any
host; spec_adaptive keeps the default, whose guesses follow the host's timing: only its
text is checked."""

from __future__ import annotations

import concurrent.futures as cf
import re
import urllib.request

import pytest

from tests.helpers.models import hf_greedy_text, tiny
from tests.helpers.servers import add_generation_model
from tritonlm.client.generate import generate_grpc

PROMPTS = [
    "The capital of France is",
    "one two three four, one two three four, one two three four, one",
    "Café naïve — 你好",
    "Hi",
]


@pytest.fixture(scope="module")
def triton_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("specrepo")
    always = {"adaptive_speculation": "false"}
    add_generation_model(repo, "spec_self", draft_model="1/hf", num_draft_tokens=4, **always)  # acceptance 100%
    add_generation_model(repo, "spec_adaptive", draft_model="1/hf", num_draft_tokens=4)
    folder = add_generation_model(repo, "spec_random", num_draft_tokens=3, **always)
    model, tok = tiny("tiny-gpt2-draft")
    model.save_pretrained(folder / "1" / "draft_hf")
    tok.save_pretrained(folder / "1" / "draft_hf")
    text = (folder / "config.pbtxt").read_text()
    (folder / "config.pbtxt").write_text(text + 'parameters { key: "draft_model" value: { string_value: "1/draft_hf" } }\n')
    add_generation_model(repo, "spec_lookup", speculative="prompt_lookup", num_draft_tokens=4, **always)
    return repo


def run(server, model, prompt, **params):
    return generate_grpc(server.grpc_url, model, prompt, exclude_input_in_output=True, **params)


@pytest.mark.parametrize("model", ["spec_self", "spec_random", "spec_lookup"])
def test_greedy_speculation_equals_the_target_alone(triton_server, model):
    for prompt in PROMPTS:
        expected = tiny()[1].decode(hf_greedy_text(prompt, 24))
        for stream in (False, True):
            result = run(triton_server, model, prompt, max_tokens=24, stream=stream)
            assert result.text == expected, (model, prompt, stream)
            assert result.num_output_tokens == 24
    rate = result.extra["acceptance_rate"]
    proposed = result.extra["total_draft_tokens"]
    assert proposed > 0
    if model == "spec_self":
        assert rate == 1.0 and result.extra["total_accepted_draft_tokens"] == proposed
    if model == "spec_random":
        assert rate < 0.3


def test_adaptive_speculation_serves_the_targets_text(triton_server):
    for prompt in PROMPTS:
        for stream in (False, True):
            result = run(triton_server, "spec_adaptive", prompt, max_tokens=24, stream=stream)
            assert result.text == tiny()[1].decode(hf_greedy_text(prompt, 24)), (prompt, stream)


def test_concurrent_mixed_requests_with_speculation(triton_server):
    jobs = [
        (PROMPTS[i % len(PROMPTS)], 10 + 2 * i, bool(i % 2), (None if i % 3 else 0)) for i in range(10)
    ]
    with cf.ThreadPoolExecutor(10) as pool:
        futures = [
            pool.submit(run, triton_server, "spec_random", p, max_tokens=n, stream=s, num_draft_tokens=k)
            for p, n, s, k in jobs
        ]
        results = [f.result(timeout=300) for f in futures]
    for (p, n, _, k), r in zip(jobs, results):
        assert r.text == tiny()[1].decode(hf_greedy_text(p, n))
        if k == 0:
            assert r.extra["total_draft_tokens"] == 0


def test_speculation_metrics(triton_server):
    run(triton_server, "spec_self", PROMPTS[0], max_tokens=16)
    text = urllib.request.urlopen(triton_server.metrics_url).read().decode()
    rate = [l for l in text.splitlines() if re.match(r'tritonlm_draft_acceptance_rate\{instance="[^"]+",model="spec_self"', l)]
    assert rate and float(rate[0].rsplit(" ", 1)[1]) == 1.0
    assert re.search(r'tritonlm_tokens_per_target_pass_count\{instance="[^"]+",model="spec_self"', text)
