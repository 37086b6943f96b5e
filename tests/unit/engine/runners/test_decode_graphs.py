"""The GPU decode path's logic on the CPU: padded decode steps over persistent buffers
(runners.decode_graphs) with the Triton paged kernel run by triton's interpreter give the
logits of the general path, and the engine's tokens. Graph capture itself needs CUDA: the
bitwise graphs-on-vs-off check runs where CUDA is present (and in perf/gpu_check.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.models import Collector, assert_close, drain, tiny, tiny_family, tiny_llama
from tritonlm.engine.batch import StepBatch
from tritonlm.engine.engine import Engine
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.runners.decode_graphs import buckets
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.scheduler import SchedulerConfig

pytest.importorskip("triton")
# the interpreter's own numpy calls warn of a deprecation: not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def kernel_runner(model, device: str = "cpu", graphs: str = "auto") -> TorchRunner:
    """A runner whose decode steps take the Triton kernel and DecodeGraphs (the C++ CPU
    kernels off, so the CPU runs the GPU's path through the interpreter)."""
    runner = TorchRunner(model, device=device, cuda_graphs=graphs, max_batch=8, max_context=128)
    runner.transformer.cpp_ops, runner.transformer.decoder_stack = False, None
    on, why = runner.transformer.use_decode_kernel()
    assert on, why
    return runner


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 8]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def decode_logits(runner: TorchRunner, device_tables: bool, prompts: list[list[int]], steps: int) -> torch.Tensor:
    cache = KVCacheManager(runner.spec, runner.spec.bytes_per_token * 4 * 80, 4, allocate_kv=runner.allocate_kv,
                           device_tables=device_tables)
    ids = list(range(len(prompts)))
    for sid in ids:
        cache.allocate(sid, 40)

    def batch(feeds, pasts):
        if device_tables:
            return StepBatch.from_block_table(feeds, pasts, cache.device_table.gather(ids), 4)
        return StepBatch.from_slot_table(feeds, pasts, cache.slot_table(ids, [p + len(f) for p, f in zip(pasts, feeds)]))

    runner.forward(batch(prompts, [0] * len(prompts)), cache.pool)
    out = []
    for i in range(steps):
        out.append(runner.forward(batch([[20 + i + b] for b in ids], [len(p) + i for p in prompts]), cache.pool))
    return torch.stack(out)  # [steps, B, V]


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_padded_kernel_steps_equal_the_general_path(interpret, model: str):
    hf = tiny()[0] if model == "gpt2" else tiny_llama()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]  # 3 rows: a padded bucket of 4
    want = decode_logits(TorchRunner(hf, attention="gather"), False, prompts, steps=5)
    runner = kernel_runner(hf)
    got = decode_logits(runner, True, prompts, steps=5)
    assert runner.decode_graphs is not None and not runner.decode_graphs.use_graphs  # no capture on the CPU
    assert_close(got, want, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("path", ["general", "padded kernel steps", "C++ decode step"])
def test_tokens_fed_on_the_device_take_their_placeholders_place(interpret, path: str):
    """StepBatch.fed (a step scheduled ahead: rows whose token the last step chose on the
    device): each runner path writes those tokens into its input ids before the embedding,
    so the logits are those of the batch with the tokens in place."""
    hf = tiny_llama()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    logits = []
    for fed in (False, True):
        if path == "general":
            runner = TorchRunner(hf, attention="gather")
        elif path == "padded kernel steps":
            runner = kernel_runner(hf)
        else:
            runner = TorchRunner(hf)
            assert runner.transformer.decode_step_ready
        cache = KVCacheManager(runner.spec, runner.spec.bytes_per_token * 4 * 80, 4, allocate_kv=runner.allocate_kv,
                               device_tables=path != "general")
        ids = [0, 1, 2]
        for sid in ids:
            cache.allocate(sid, 40)

        def batch(feeds, pasts):
            if path != "general":
                return StepBatch.from_block_table(feeds, pasts, cache.device_table.gather(ids), 4)
            return StepBatch.from_slot_table(feeds, pasts, cache.slot_table(ids, [p + len(f) for p, f in zip(pasts, feeds)]))

        runner.forward(batch(prompts, [0] * 3), cache.pool)
        step = batch([[-1], [21], [-1]] if fed else [[30], [21], [40]], [len(p) for p in prompts])
        if fed:
            step.fed = (torch.tensor([2, 0]), torch.tensor([40, 30]))
        logits.append(runner.forward(step, cache.pool))
    if path == "padded kernel steps":
        assert runner.decode_graphs is not None
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_windowed_and_softcapped_kernel_steps_equal_the_general_path(interpret, family: str):
    """The Triton kernel takes each layer's sliding window (Mistral's on every layer, Gemma
    2's on every other one) and Gemma 2's logit soft-cap: decode steps that run past the
    window give the gather path's logits (transformers', tests/unit/engine/runners/test_families.py)."""
    hf = tiny_family(family)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    want = decode_logits(TorchRunner(hf, attention="gather"), False, prompts, steps=7)
    runner = kernel_runner(hf)
    got = decode_logits(runner, True, prompts, steps=7)
    assert_close(got, want, atol=1e-4)


@pytest.mark.parametrize("all_logits", [True, False])
def test_rows_of_several_tokens_run_as_one_token_rows(interpret, all_logits: bool):
    """Speculative verification (K + 1 tokens a row, all logits) and short prefill chunks
    (the last token's logits), rows of different widths in one batch."""
    hf = tiny_llama()
    feeds = [[5, 6, 7, 8, 9], [12], [14, 15, 16]]
    pasts = [3, 9, 0]
    got = []
    for runner in (TorchRunner(hf, attention="gather"), kernel_runner(hf)):
        cache = KVCacheManager(runner.spec, runner.spec.bytes_per_token * 4 * 80, 4, allocate_kv=runner.allocate_kv,
                               device_tables=True)
        ids = [0, 1, 2]
        for sid in ids:
            cache.allocate(sid, 40)
        torch.manual_seed(3)  # the same cached past in both pools
        for t in cache.pool.k + cache.pool.v:
            t.normal_()
        batch = StepBatch.from_block_table(feeds, pasts, cache.device_table.gather(ids), 4, all_logits=all_logits)
        got.append(runner.forward(batch, cache.pool))
    assert runner.decode_graphs is not None  # the kernel runner took the flattened path
    if all_logits:
        for b, f in enumerate(feeds):  # past a row's tokens: don't-care
            assert_close(got[1][b, : len(f)], got[0][b, : len(f)], atol=1e-4)
    else:
        assert_close(got[1], got[0], atol=1e-4)


@pytest.mark.parametrize("draft", ["self", "tiny-gpt2-draft"])
def test_speculative_engine_through_the_kernel_path(interpret, draft: str):
    """A draft model and the verify pass both through DecodeGraphs: the same tokens as the
    general path, greedy and seeded, with guesses all accepted (the target as its own draft)
    or nearly all rejected (a random draft)."""
    from tritonlm.engine.speculative import DraftModelDrafter

    model, tok = tiny()
    draft_model = model if draft == "self" else tiny(draft)[0]
    out = []
    for kernel in (False, True):
        make = kernel_runner if kernel else TorchRunner
        runner = make(model)
        cache = KVCacheManager(runner.spec, 8 * 272 * runner.spec.bytes_per_token, 16, allocate_kv=runner.allocate_kv,
                               device_tables=kernel)
        engine = Engine(runner, tok, cache, SchedulerConfig(max_num_batched_tokens=24), max_context=128,
                        drafter=DraftModelDrafter(make(draft_model), cache), num_draft_tokens=3)
        col = Collector()
        rids = [col.request(engine, p, max_tokens=10) for p in ("hello there", "a b c d e f g h")]
        rids.append(col.request(engine, "sampled", max_tokens=10, temperature=0.9, seed=3))
        drain(engine)
        out.append([col.ids(r) for r in rids])
        assert engine.runner.decode_graphs is not None or not kernel
    assert out[0] == out[1]


def test_engine_tokens_through_the_padded_kernel_path(interpret):
    model, tok = tiny()
    out = []
    for kernel in (False, True):
        runner = kernel_runner(model) if kernel else TorchRunner(model)
        cache = KVCacheManager(runner.spec, 8 * 272 * runner.spec.bytes_per_token, 16, allocate_kv=runner.allocate_kv,
                               device_tables=kernel)
        engine = Engine(runner, tok, cache, SchedulerConfig(max_num_batched_tokens=24), max_context=128)
        col = Collector()
        rids = [col.request(engine, p, max_tokens=12) for p in ("hello there", "a b c d e f g h", "x y")]
        rids.append(col.request(engine, "sampled", max_tokens=12, temperature=0.9, seed=3))
        drain(engine)
        out.append([col.ids(r) for r in rids])
    assert out[0] == out[1]


def test_compiled_step_equals_the_eager_step(interpret):
    """compile_decode: the same padded step through torch.compile (inductor's C++ backend
    here; float16, whose plain matmuls inductor takes, unlike the CPU's blocked ones)."""
    hf = tiny()[0]
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    got = []
    for compile_decode in (False, True):
        runner = TorchRunner(hf, dtype=torch.float16, max_batch=8, max_context=128, compile_decode=compile_decode)
        runner.transformer.cpp_ops, runner.transformer.decoder_stack = False, None
        assert runner.transformer.use_decode_kernel()[0]
        got.append(decode_logits(runner, True, prompts, steps=3).float())
        assert runner.decode_graphs.compiled is compile_decode
    assert_close(got[1], got[0], atol=2e-2)  # fused float16 arithmetic rounds differently
    assert torch.equal(got[1].argmax(-1), got[0].argmax(-1))


def test_prepare_decode_falls_back_when_compiling_fails(interpret, monkeypatch):
    from tritonlm.engine.runners import decode_graphs

    runner = TorchRunner(tiny()[0], dtype=torch.float16, max_batch=4, max_context=64, compile_decode=True)
    runner.transformer.cpp_ops, runner.transformer.decoder_stack = False, None
    runner.transformer.use_decode_kernel()
    cache = KVCacheManager(runner.spec, runner.spec.bytes_per_token * 4 * 40, 4, allocate_kv=runner.allocate_kv,
                           device_tables=True)

    def capture_all(self):
        if self.compiled:
            raise RuntimeError("inductor failed")

    monkeypatch.setattr(decode_graphs.DecodeGraphs, "capture_all", capture_all)
    what = runner.prepare_decode(cache.pool, 4)
    assert not runner.compile_decode and not runner.decode_graphs.compiled
    assert "buckets [1, 2, 4]" in what and "compiled" not in what


def test_cuda_graphs_off_is_validated():
    with pytest.raises(ValueError, match="cuda_graphs"):
        TorchRunner(tiny()[0], cuda_graphs="on")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_on_and_off_are_bitwise_equal_on_cuda():
    hf = tiny_llama()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
    on = decode_logits(kernel_runner(hf, "cuda", "auto"), True, prompts, steps=4)
    off = decode_logits(kernel_runner(hf, "cuda", "off"), True, prompts, steps=4)
    assert torch.equal(on, off)
