"""tritonlm/export/forward_runtime.py, the forward handler's batching without a server: compatible
requests share one pass, different past lengths are padded into one, each request gets its
own error; the layout read from Triton's JSON config."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers.exports import FORWARD, artifact
from tritonlm.export.forward_runtime import ForwardBatcher, Layout, RequestError, onnx_run_fn
from tritonlm.export.repository import parse_config
from tritonlm.export.verify import DecoderInputs
from tritonlm.export.wrapper import input_names


@pytest.fixture(scope="module")
def batcher(exported):
    repo = exported[0]
    cfg = parse_config((repo / FORWARD["onnx"] / "config.pbtxt").read_text())
    layout = Layout(num_layers=2, num_kv_heads=cfg.input[3].dims[0], head_dim=cfg.input[3].dims[2], vocab_size=512)
    calls: list[int] = []
    run = onnx_run_fn(artifact(repo, "onnx"))

    def counting(feed):
        calls.append(feed["input_ids"].shape[0])
        return run(feed)

    return ForwardBatcher(counting, layout, max_positions=256), calls, run


def _request(rng, t=3, p=0, b=1):
    feed = {"input_ids": rng.integers(0, 512, size=(b, t)).astype(np.int64),
            "attention_mask": np.ones((b, p + t), dtype=np.int64),
            "position_ids": np.tile(np.arange(p, p + t), (b, 1)).astype(np.int64)}
    for name in input_names(2)[3:]:
        feed[name] = rng.standard_normal((b, 4, p, 16)).astype(np.float32)
    return feed


def test_batcher_stacks_compatible_requests_into_one_pass(batcher):
    b, calls, run = batcher
    rng = np.random.default_rng(0)
    reqs = [_request(rng), _request(rng, b=2), _request(rng), _request(rng, t=1, p=4), _request(rng, t=1, p=4)]
    calls.clear()
    results = b.run(reqs)
    assert sorted(calls) == [2, 4]  # two groups by T: T=3 with 4 rows, T=1 with 2 rows
    for req, res in zip(reqs, results):
        alone = run(req)
        assert res["logits"].shape == alone[0].shape
        assert np.abs(res["logits"] - alone[0]).max() < 1e-4
        assert np.abs(res["present.1.value"] - alone[-1]).max() < 1e-5


def test_batcher_pads_different_past_lengths_into_one_pass(batcher, model):
    """Decode requests whose caches differ in length share one pass (pasts right-padded,
    the padding masked); each gets exactly what it would get alone."""
    from tritonlm.export.verify import eager_decoder_fn

    b, calls, run = batcher
    eager = eager_decoder_fn(model)
    rng = np.random.default_rng(11)
    reqs, prompts = [], []
    for n in (2, 6, 4):
        prompt = rng.integers(0, 512, size=n).tolist()
        m = torch.ones(1, n, dtype=torch.long)
        empty = tuple(torch.zeros(1, 4, 0, 16) for _ in range(4))
        cache = eager(DecoderInputs(torch.tensor([prompt]), m, torch.arange(n).unsqueeze(0), empty))[1:]
        nxt = int(rng.integers(0, 512))
        prompts.append(prompt + [nxt])
        feed = {"input_ids": np.array([[nxt]]), "attention_mask": np.ones((1, n + 1), dtype=np.int64),
                "position_ids": np.array([[n]])}
        for name, c in zip(input_names(2)[3:], cache):
            feed[name] = c
        reqs.append(feed)
    calls.clear()
    results = b.run(reqs)
    assert calls == [3]
    for req, res, prompt in zip(reqs, results, prompts):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt])).logits[0, -1].numpy()
        assert np.abs(res["logits"][0, 0] - ref).max() < 1e-4
        alone = run(req)
        assert res["present.0.key"].shape == (1, 4, len(prompt), 16)
        assert np.abs(res["present.1.value"] - alone[-1]).max() < 1e-5


def test_batcher_gives_per_request_errors(batcher):
    b, calls, _ = batcher
    rng = np.random.default_rng(1)
    good = _request(rng)
    short_mask = _request(rng)
    short_mask["attention_mask"] = short_mask["attention_mask"][:, :1]
    bad_ids = _request(rng)
    bad_ids["input_ids"][0, 0] = 9999
    missing = _request(rng)
    del missing["past_key_values.1.value"]
    bad_heads = _request(rng, p=2)
    bad_heads["past_key_values.0.key"] = np.zeros((1, 3, 2, 16), dtype=np.float32)
    far = _request(rng)
    far["position_ids"] += 1000
    results = b.run([good, short_mask, bad_ids, missing, bad_heads, far])
    assert isinstance(results[0], dict)
    messages = [str(r) for r in results[1:]]
    assert all(isinstance(r, RequestError) for r in results[1:])
    assert "attention_mask must be [batch, P+T]" in messages[0]
    assert "input_ids must be in [0, 512)" in messages[1]
    assert "missing input" in messages[2] and "past_key_values.1.value" in messages[2]
    assert "past_key_values.0.key must be [1, 4, P, 16]" in messages[3]
    assert "position_ids must be < 256" in messages[4]


def test_layout_from_triton_json_config(exported):
    from google.protobuf import json_format

    cfg = parse_config((exported[0] / FORWARD["onnx"] / "config.pbtxt").read_text())
    as_json = json.loads(json_format.MessageToJson(cfg, preserving_proto_field_name=True))
    layout = Layout.from_model_config(as_json)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.vocab_size) == (2, 4, 16, 512)
