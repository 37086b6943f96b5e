"""The exported forward models in a real tritonserver (python runtime: backend tritonlm,
task=forward): answers equal transformers', requests are batched by the dynamic batcher.

The generation entry (NAME) is left out of the served repository: its handler is not
part of the export.
"""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch

from tritonlm.export.pipeline import ExportOptions, export
from tritonlm.export.wrapper import input_names, output_names
from tritonlm.models.builtin import build_tiny

NAME = "tg"
FORWARD_MODELS = {
    "onnx": f"{NAME}_onnx",
    "onnx-int8": f"{NAME}_onnx_int8",
    "onnx-fp16": f"{NAME}_onnx_fp16",
    "torchscript": f"{NAME}_torchscript",
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    repo = tmp_path_factory.mktemp("export") / "repo"
    export(ExportOptions(model="tiny-gpt2", name=NAME, repo=repo, runtime="python", max_queue_delay_us=20000),
           out=lambda s: None)
    return repo


@pytest.fixture(scope="module")
def triton_repo(exported, tmp_path_factory):
    served = tmp_path_factory.mktemp("served")
    for model in FORWARD_MODELS.values():
        shutil.copytree(exported / model, served / model)
    return served


@pytest.fixture(scope="module")
def model():
    m, _ = build_tiny("tiny-gpt2")
    return m


@pytest.fixture(scope="module")
def client(triton_server):
    import tritonclient.http as httpclient

    with httpclient.InferenceServerClient(triton_server.http_url, concurrency=8, network_timeout=120) as c:
        yield c


def _infer(client, model_name: str, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import tritonclient.http as httpclient

    inputs = []
    for name, arr in feed.items():
        dtype = "INT64" if arr.dtype == np.int64 else "FP32"
        t = httpclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr, binary_data=True)
        inputs.append(t)
    num_layers = sum(1 for n in feed if n.startswith("past_key_values.")) // 2
    outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in output_names(num_layers)]
    res = client.infer(model_name, inputs, outputs=outputs)
    return {n: res.as_numpy(n) for n in output_names(num_layers)}


def _prefill_feed(rng, model, lengths):
    """A left-padded batch of fresh prompts with an empty past."""
    cfg = model.config
    width = max(lengths)
    ids = np.zeros((len(lengths), width), dtype=np.int64)
    mask = np.zeros((len(lengths), width), dtype=np.int64)
    prompts = []
    for b, n in enumerate(lengths):
        p = rng.integers(0, cfg.vocab_size, size=n)
        prompts.append(p.tolist())
        ids[b, width - n:] = p
        mask[b, width - n:] = 1
    pos = np.clip(mask.cumsum(-1) - 1, 0, None)
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    head = cfg.n_embd // cfg.n_head
    for name in input_names(cfg.n_layer)[3:]:
        feed[name] = np.zeros((len(lengths), cfg.n_head, 0, head), dtype=np.float32)
    return feed, prompts


def _reference(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].numpy()


@pytest.mark.parametrize("fmt", list(FORWARD_MODELS))
def test_forward_model_matches_transformers(client, model, fmt):
    rng = np.random.default_rng(101)
    feed, prompts = _prefill_feed(rng, model, [6, 3])
    out = _infer(client, FORWARD_MODELS[fmt], feed)
    width = feed["input_ids"].shape[1]
    assert out["logits"].shape == (2, width, model.config.vocab_size)
    assert out["present.0.key"].shape[2] == width
    # one decode step feeding back the returned cache
    new = rng.integers(0, model.config.vocab_size, size=(2, 1))
    mask = np.concatenate([feed["attention_mask"], np.ones((2, 1), dtype=np.int64)], axis=1)
    step = {"input_ids": new.astype(np.int64), "attention_mask": mask,
            "position_ids": np.array([[6], [3]], dtype=np.int64)}
    for i in range(model.config.n_layer):
        step[f"past_key_values.{i}.key"] = out[f"present.{i}.key"]
        step[f"past_key_values.{i}.value"] = out[f"present.{i}.value"]
    out2 = _infer(client, FORWARD_MODELS[fmt], step)
    exact = fmt in ("onnx", "torchscript")
    agree = total = 0
    worst = 0.0
    for b, p in enumerate(prompts):
        ref = _reference(model, p + [int(new[b, 0])])
        got = np.concatenate([out["logits"][b, width - len(p):], out2["logits"][b]], axis=0)
        worst = max(worst, float(np.abs(got - ref).max()))
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
    if exact:
        assert worst < 1e-4, worst
        assert agree == total
    else:
        assert agree / total >= 0.8, (agree, total)
        if fmt == "onnx-fp16":
            assert worst < 0.05, worst


def test_concurrent_requests_are_batched(client, model, triton_server):
    """Decode-step requests from 8 client threads, each with a cache of a different length:
    Triton's dynamic batcher puts them into shared executions (ragged batching) and the
    handler pads them into one forward pass; every answer is still that request's own."""
    import tritonclient.http as httpclient

    from tritonlm.export.verify import eager_decoder_fn
    from tritonlm.export.wrapper import DecoderInputs

    name = FORWARD_MODELS["onnx"]
    before = _stats(client, name)
    rng = np.random.default_rng(7)
    eager = eager_decoder_fn(model)
    cfg = model.config
    head = cfg.n_embd // cfg.n_head
    feeds, sequences = [], []
    for k in range(24):
        n = 2 + k % 5
        prompt = rng.integers(0, cfg.vocab_size, size=n).tolist()
        empty = tuple(torch.zeros(1, cfg.n_head, 0, head) for _ in range(2 * cfg.n_layer))
        m = torch.ones(1, n, dtype=torch.long)
        cache = eager(DecoderInputs(torch.tensor([prompt]), m, torch.arange(n).unsqueeze(0), empty))[1:]
        nxt = int(rng.integers(0, cfg.vocab_size))
        feed = {"input_ids": np.array([[nxt]], dtype=np.int64), "attention_mask": np.ones((1, n + 1), dtype=np.int64),
                "position_ids": np.array([[n]], dtype=np.int64)}
        feed.update(zip(input_names(cfg.n_layer)[3:], (np.ascontiguousarray(c) for c in cache)))
        feeds.append(feed)
        sequences.append(prompt + [nxt])
    results: dict[int, dict] = {}
    errors: list[Exception] = []

    def worker(k):
        try:
            with httpclient.InferenceServerClient(triton_server.http_url, network_timeout=120) as c:
                for i in range(k, len(feeds), 8):
                    results[i] = _infer(c, name, feeds[i])
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, seq in enumerate(sequences):
        assert np.abs(results[i]["logits"][0, 0] - _reference(model, seq)[-1]).max() < 1e-4
        assert results[i]["present.1.key"].shape == (1, cfg.n_head, len(seq), head)
    after = _stats(client, name)
    inferences = after[0] - before[0]
    executions = after[1] - before[1]
    assert inferences == len(feeds)
    assert executions < inferences, (executions, inferences)


def _stats(client, name):
    s = client.get_inference_statistics(name)["model_stats"][0]
    return int(s["inference_count"]), int(s["execution_count"])


def test_bad_request_gets_a_clear_error(client, model):
    from tritonclient.utils import InferenceServerException

    rng = np.random.default_rng(3)
    feed, _ = _prefill_feed(rng, model, [4])
    feed["attention_mask"] = feed["attention_mask"][:, :2]  # P + T = 4, mask says 2
    with pytest.raises(InferenceServerException, match="attention_mask must be"):
        _infer(client, FORWARD_MODELS["onnx"], feed)
    feed, _ = _prefill_feed(rng, model, [4])
    feed["input_ids"][0, 0] = model.config.vocab_size + 5
    with pytest.raises(InferenceServerException, match="input_ids must be in"):
        _infer(client, FORWARD_MODELS["torchscript"], feed)
