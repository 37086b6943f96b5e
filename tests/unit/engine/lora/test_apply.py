"""Adapters applied per row (lora.apply) against PEFT's merge_and_unload(): one mixed batch of
base rows and rows of adapters of ranks 4, 8 and 16 (rsLoRA, rank / alpha patterns, all-linear,
a regex, layers_to_transform, a replacement LM head and embedding), prefill and decode steps,
every logit within ATOL of transformers' forward of each merged model; greedy answers equal to
the merged models' generate(); bfloat16 and int8_weight_only bases."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.lora import ADAPTERS, lora_rows, make_adapter
from tests.helpers.models import (
    W8_RTOL,
    assert_close,
    hf_greedy_ids,
    hf_logits,
    paged_cache,
    random_tokens,
    tiny_family,
    tiny_llama,
)
from tritonlm.engine.lora import attach_lora, load_adapter
from tritonlm.engine.runners.torch_runner import TorchRunner

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def llama_adapters(tmp_path_factory):
    """(base model, {name: (folder, merged model)}) on tiny_llama (tied embeddings)."""
    model = tiny_llama()
    root = tmp_path_factory.mktemp("adapters")
    made = {name: (root / name, make_adapter(model, root / name, seed=i, **kw))
            for i, (name, kw) in enumerate(ADAPTERS.items())}
    return model, made


def loaded(runner, made) -> dict:
    attach_lora(runner.transformer)
    return {name: load_adapter(folder, runner.transformer, name) for name, (folder, _) in made.items()}


def test_adapters_change_the_answer(llama_adapters):
    """Each merged model's logits differ from the base's by far more than ATOL: the tests below
    would see an adapter dropped or applied to the wrong rows."""
    model, made = llama_adapters
    seq = random_tokens(12, seed=9)
    base = hf_logits(model, seq)
    for name, (_, merged) in made.items():
        assert (hf_logits(merged, seq) - base).abs().max() > 0.05, name


@pytest.mark.parametrize("block_tables", [False, True])
@pytest.mark.parametrize("attention", ["auto", "gather"])
def test_mixed_batch_matches_peft_merged(llama_adapters, attention, block_tables):
    """Rows of the base and of every adapter in each call: a padded prefill (packed on the gather
    path), then decode steps (the paged kernel's width on the auto path, where base-only steps
    would take the decoder stack), every row's logits against its merged model's."""
    model, made = llama_adapters
    runner = TorchRunner(model, attention=attention)
    adapters = loaded(runner, made)
    names = [None, "all4", "rs8", None, "regex16", "embed4"]
    row_adapters = [None if n is None else adapters[n] for n in names]
    refs = [model if n is None else made[n][1] for n in names]
    seqs = [random_tokens(20, seed=30 + i) for i in range(len(names))]
    mgr = paged_cache(runner, blocks=60)
    prefill = [9, 13, 6, 11, 13, 7]
    for sid, seq in enumerate(seqs):
        mgr.allocate(sid, len(seq))
    out = lora_rows(runner, mgr, [(sid, 0, seqs[sid][:n]) for sid, n in enumerate(prefill)], row_adapters,
                    all_logits=True, block_tables=block_tables)
    want = [hf_logits(ref, seq) for ref, seq in zip(refs, seqs)]
    for sid, n in enumerate(prefill):
        assert_close(out[sid, :n], want[sid][:n])
    past = list(prefill)
    for _ in range(3):  # decode steps, one token per row
        rows = [(sid, past[sid], [seqs[sid][past[sid]]]) for sid in range(len(seqs))]
        out = lora_rows(runner, mgr, rows, row_adapters, block_tables=block_tables)
        for sid in range(len(seqs)):
            assert_close(out[sid], want[sid][past[sid]])
            past[sid] += 1
    # a step of base rows only afterwards: the base model, adapters gone (the decoder stack again)
    out = lora_rows(runner, mgr, [(0, past[0], [seqs[0][past[0]]])], [None], block_tables=block_tables)
    assert_close(out[0], want[0][past[0]])


def test_greedy_answers_equal_peft_generate(llama_adapters):
    """Greedy decoding of three rows together (base, all4, regex16: a replacement LM head) from
    block tables, as the engine batches them: each row's tokens equal its merged model's generate()."""
    model, made = llama_adapters
    runner = TorchRunner(model)
    adapters = loaded(runner, made)
    names = [None, "all4", "regex16"]
    row_adapters = [None if n is None else adapters[n] for n in names]
    prompts = [random_tokens(n, seed=50 + n) for n in (7, 10, 5)]
    new = 12
    mgr = paged_cache(runner, blocks=60)
    for sid, p in enumerate(prompts):
        mgr.allocate(sid, len(p) + new)
    out = lora_rows(runner, mgr, [(sid, 0, p) for sid, p in enumerate(prompts)], row_adapters, block_tables=True)
    answers = [[int(out[sid].argmax())] for sid in range(len(prompts))]
    for _ in range(new - 1):
        rows = [(sid, len(p) + len(answers[sid]) - 1, [answers[sid][-1]]) for sid, p in enumerate(prompts)]
        out = lora_rows(runner, mgr, rows, row_adapters, block_tables=True)
        for sid in range(len(prompts)):
            answers[sid].append(int(out[sid].argmax()))
    for sid, name in enumerate(names):
        ref = model if name is None else made[name][1]
        assert answers[sid] == hf_greedy_ids(ref, prompts[sid], new), name
    assert answers[1] != hf_greedy_ids(model, prompts[1], new)  # the adapter changed the text


@pytest.mark.parametrize("family", ["qwen3", "glm"])
def test_adapter_matches_peft_merged_where_q_k_are_not_plain(tmp_path, family):
    """Qwen3 (per-head q/k norms after the qkv projection, an explicit head_dim) and GLM (an
    interleaved partial rotary: q's and k's head dims reordered at load, and so the adapter's
    q / k updates): an all-linear rank-8 adapter's rows beside base rows, prefill and a decode step."""
    model = tiny_family(family)
    merged = make_adapter(model, tmp_path / "q", seed=3, r=8, lora_alpha=16, target_modules="all-linear")
    runner = TorchRunner(model)
    attach_lora(runner.transformer)
    adapter = load_adapter(tmp_path / "q", runner.transformer)
    seqs = [random_tokens(14, seed=s) for s in (1, 2)]
    mgr = paged_cache(runner)
    for sid, seq in enumerate(seqs):
        mgr.allocate(sid, len(seq))
    out = lora_rows(runner, mgr, [(0, 0, seqs[0][:12]), (1, 0, seqs[1][:9])], [adapter, None], all_logits=True)
    assert_close(out[0, :12], hf_logits(merged, seqs[0])[:12])
    assert_close(out[1, :9], hf_logits(model, seqs[1])[:9])
    out = lora_rows(runner, mgr, [(0, 12, [seqs[0][12]]), (1, 9, [seqs[1][9]])], [adapter, None])
    assert_close(out[0], hf_logits(merged, seqs[0])[12])
    assert_close(out[1], hf_logits(model, seqs[1])[9])


def test_bfloat16_base(llama_adapters):
    """A bfloat16 base with float32 adapter arithmetic: each row near its merged model's float32
    logits (bfloat16's rounding), far nearer than to the base's."""
    model, made = llama_adapters
    runner = TorchRunner(copy.deepcopy(model).to(torch.bfloat16), dtype=torch.bfloat16)
    adapters = loaded(runner, made)
    seq = random_tokens(10, seed=4)
    mgr = paged_cache(runner)
    mgr.allocate(0, len(seq))
    mgr.allocate(1, len(seq))
    out = lora_rows(runner, mgr, [(0, 0, seq), (1, 0, seq)], [adapters["all4"], None], all_logits=True)
    want, base = hf_logits(made["all4"][1], seq), hf_logits(model, seq)
    err, effect = (out[0] - want).abs().max(), (want - base).abs().max()
    assert err < 0.1 * effect, (float(err), float(effect))
    assert (out[1] - base).abs().max() < 0.1 * effect


def test_int8_weight_only_base(tmp_path):
    """int8_weight_only base weights, float adapters on top: equal (W8_RTOL of the largest logit:
    the kernel's 16-bit activation codes) to PEFT's merge of the adapter into the dequantized
    weights, in one batch with a base row."""
    from peft import PeftModel

    model = tiny_llama(tie_word_embeddings=False)
    make_adapter(model, tmp_path / "a", seed=5, r=8, lora_alpha=16, target_modules="all-linear")
    runner = TorchRunner(model, int8_weight_only=True)
    tr = runner.transformer
    deq = copy.deepcopy(model)  # the same weights as the runner holds, dequantized
    q_rows, kv_rows = tr.heads * tr.spec.head_dim, tr.kv_heads * tr.spec.head_dim
    with torch.no_grad():
        for layer, ours in zip(deq.model.layers, tr.layers):
            at, mlp = layer.self_attn, layer.mlp
            q, k, v = ours.qkv.dequantized().split([q_rows, kv_rows, kv_rows])
            gate, up = ours.gate_up.dequantized().chunk(2)
            for mod, w in ((at.q_proj, q), (at.k_proj, k), (at.v_proj, v), (at.o_proj, ours.o.dequantized()),
                           (mlp.gate_proj, gate), (mlp.up_proj, up), (mlp.down_proj, ours.down.dequantized())):
                mod.weight.copy_(w)
        deq.lm_head.weight.copy_(tr.lm_head.dequantized())
    ref = PeftModel.from_pretrained(copy.deepcopy(deq), str(tmp_path / "a")).merge_and_unload().eval()
    attach_lora(tr)
    adapter = load_adapter(tmp_path / "a", tr)
    seq = random_tokens(11, seed=6)
    mgr = paged_cache(runner)
    mgr.allocate(0, len(seq))
    mgr.allocate(1, len(seq))
    out = lora_rows(runner, mgr, [(0, 0, seq[:10]), (1, 0, seq[:10])], [adapter, None], all_logits=True)
    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        assert_close(got, want, atol=W8_RTOL * want.abs().max().item())

    with_adapter, base = hf_logits(ref, seq), hf_logits(deq, seq)
    # the allowance is far below what the adapter changes, so a lost or wrong adapter fails
    assert (with_adapter - base).abs().max() > 20 * W8_RTOL * with_adapter.abs().max()
    close(out[0], with_adapter[:10])
    close(out[1], base[:10])
    out = lora_rows(runner, mgr, [(0, 10, seq[10:]), (1, 10, seq[10:])], [adapter, None], block_tables=True)
    close(out[0], with_adapter[10])
    close(out[1], base[10])


def test_adapters_need_attaching(llama_adapters):
    model, made = llama_adapters
    runner = TorchRunner(model)
    other = TorchRunner(model)
    attach_lora(other.transformer)
    adapter = load_adapter(made["all4"][0], other.transformer)
    mgr = paged_cache(runner)
    mgr.allocate(0, 4)
    with pytest.raises(ValueError, match="none are attached"):
        lora_rows(runner, mgr, [(0, 0, [5, 6, 7])], [adapter])


@pytest.mark.parametrize("drafter", ["none", "prompt_lookup", "draft_model"])
def test_engine_serves_adapters_exactly_with_prefix_cache_and_speculation(llama_adapters, drafter):
    """An Engine (prefix cache on, 5-token prefill chunks): the same prompt under the base, all4
    and regex16 in one batch, twice. Every answer equals its merged model's generate() (speculation
    by prompt lookup or by the unadapted base as draft model stays exact), and the second round
    reads each one's blocks from the cache (its own: the adapters key the chains)."""
    from tritonlm.engine.engine import Engine
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.request import GenerationRequest, SamplingParams
    from tritonlm.engine.scheduler import SchedulerConfig
    from tritonlm.engine.speculative import DraftModelDrafter, PromptLookupDrafter
    from tritonlm.models.builtin import tiny_tokenizer

    from tests.helpers.models import Collector, drain

    model, made = llama_adapters
    runner = TorchRunner(model)
    adapters = loaded(runner, made)
    cache = KVCacheManager(runner.spec, 96 * 4 * runner.spec.bytes_per_token, 4, allocate_kv=runner.allocate_kv,
                           prefix_caching=True)
    spec = {"none": {}, "prompt_lookup": dict(drafter=PromptLookupDrafter(2), num_draft_tokens=3),
            "draft_model": dict(drafter=DraftModelDrafter(TorchRunner(model), cache), num_draft_tokens=3)}[drafter]
    engine = Engine(runner, tiny_tokenizer(), cache, SchedulerConfig(max_num_batched_tokens=5), max_context=128,
                    **spec)
    prompt, new = random_tokens(13, seed=21), 10
    names = [None, "all4", "regex16"]
    col = Collector()
    for round_ in range(2):
        ids = []
        for name in names:
            req = GenerationRequest(list(prompt), SamplingParams(max_tokens=new, end_id=-1), col._on_event,
                                    lora=None if name is None else adapters[name])
            col.events[req.request_id] = []
            engine.submit(req)
            ids.append(req.request_id)
        drain(engine)
        for name, rid in zip(names, ids):
            ref = model if name is None else made[name][1]
            assert col.ids(rid) == hf_greedy_ids(ref, prompt, new), (round_, name)
            if round_ == 1:
                assert col.final(rid).num_cached_tokens > 0, name
    assert len({tuple(col.ids(rid)) for rid in ids}) == 3  # three different answers to one prompt


def test_engine_refuses_an_adapter_where_none_are_attached(llama_adapters):
    from tritonlm.engine.engine import Engine
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.request import GenerationRequest, InvalidRequestError, SamplingParams
    from tritonlm.engine.scheduler import SchedulerConfig
    from tritonlm.models.builtin import tiny_tokenizer

    model, made = llama_adapters
    other = TorchRunner(model)
    adapter = loaded(other, made)["all4"]
    runner = TorchRunner(model)
    cache = KVCacheManager(runner.spec, 32 * 4 * runner.spec.bytes_per_token, 4, allocate_kv=runner.allocate_kv)
    engine = Engine(runner, tiny_tokenizer(), cache, SchedulerConfig(), max_context=64)
    with pytest.raises(InvalidRequestError, match="this model serves no LoRA adapters, so 'all4' cannot run"):
        engine.submit(GenerationRequest([5, 6, 7], SamplingParams(max_tokens=2), lambda ev: None, lora=adapter))


# ---- the C++ kernels: the adapters inside the decoder stack and the one-call decode step --------


@pytest.fixture(scope="module")
def plain_adapters(tmp_path_factory, llama_adapters):
    """llama_adapters' all4 (rank 4) and rs8 (rank 8, one layer) and a rank-16 all-linear one,
    none of them replacing the embedding or the LM head: their decode steps can stay in C++."""
    model, made = llama_adapters
    root = tmp_path_factory.mktemp("plain")
    made16 = make_adapter(model, root / "all16", seed=11, r=16, lora_alpha=32, target_modules="all-linear")
    return model, {"all4": made["all4"], "rs8": made["rs8"], "all16": (root / "all16", made16)}


def stack_runner(model, made):
    runner = TorchRunner(model)
    if not runner.transformer.decode_step_ready:
        pytest.skip(f"no C++ decode step here: {runner.attention_why}")
    return runner, loaded(runner, made)


def test_mixed_decode_step_runs_in_one_cpp_call_exactly(plain_adapters):
    """Base rows and rows of adapters of ranks 4, 8 and 16 in decode steps from block tables:
    the step runs as one C++ decode step (the state's counter says so), every row's logits are
    within ATOL of its PEFT-merged model's, and they are the same bits as the Python layer loop
    (the stack off) and as the stack inside run_layers give for that step."""
    model, made = plain_adapters
    runner, adapters = stack_runner(model, made)
    tr, state = runner.transformer, runner.transformer.lora
    names = [None, "all4", "rs8", "all16", None, "all16", "all4"]
    row_adapters = [None if n is None else adapters[n] for n in names]
    refs = [model if n is None else made[n][1] for n in names]
    seqs = [random_tokens(16, seed=60 + i) for i in range(len(names))]
    want = [hf_logits(ref, seq) for ref, seq in zip(refs, seqs)]
    mgr = paged_cache(runner, blocks=60)
    prefill = [9, 12, 5, 10, 7, 11, 6]
    for sid, seq in enumerate(seqs):
        mgr.allocate(sid, len(seq))
    lora_rows(runner, mgr, [(sid, 0, seqs[sid][:n]) for sid, n in enumerate(prefill)], row_adapters,
              block_tables=True)
    past = list(prefill)
    for _ in range(3):
        rows = [(sid, past[sid], [seqs[sid][past[sid]]]) for sid in range(len(seqs))]
        before = state.stack_steps
        fast = lora_rows(runner, mgr, rows, row_adapters, block_tables=True)
        assert state.stack_steps == before + 1  # Transformer.decode_step with the adapters
        for sid in range(len(seqs)):
            assert_close(fast[sid], want[sid][past[sid]])
        runner.lean_decode = False  # Transformer.forward: the stack inside run_layers
        in_stack = lora_rows(runner, mgr, rows, row_adapters, block_tables=True)
        assert state.stack_steps == before + 2
        stack, tr.decoder_stack = tr.decoder_stack, None  # the Python layer loop
        try:
            loop = lora_rows(runner, mgr, rows, row_adapters, block_tables=True)
        finally:
            tr.decoder_stack, runner.lean_decode = stack, True
        assert state.stack_steps == before + 2
        assert torch.equal(fast, in_stack) and torch.equal(fast, loop)
        past = [p + 1 for p in past]


def test_greedy_answers_through_the_cpp_decode_step_equal_peft_generate(plain_adapters):
    """Greedy decoding of four rows (base, ranks 4, 8, 16) with every decode step in one C++
    call: each row's tokens equal its merged model's generate()."""
    model, made = plain_adapters
    runner, adapters = stack_runner(model, made)
    names = [None, "all4", "rs8", "all16"]
    row_adapters = [None if n is None else adapters[n] for n in names]
    prompts = [random_tokens(n, seed=90 + n) for n in (6, 9, 4, 8)]  # none of them greedily reaches EOS
    new = 10
    mgr = paged_cache(runner, blocks=60)
    for sid, p in enumerate(prompts):
        mgr.allocate(sid, len(p) + new)
    out = lora_rows(runner, mgr, [(sid, 0, p) for sid, p in enumerate(prompts)], row_adapters, block_tables=True)
    answers = [[int(out[sid].argmax())] for sid in range(len(prompts))]
    steps = runner.transformer.lora.stack_steps
    for _ in range(new - 1):
        rows = [(sid, len(p) + len(answers[sid]) - 1, [answers[sid][-1]]) for sid, p in enumerate(prompts)]
        out = lora_rows(runner, mgr, rows, row_adapters, block_tables=True)
        for sid in range(len(prompts)):
            answers[sid].append(int(out[sid].argmax()))
    assert runner.transformer.lora.stack_steps == steps + new - 1
    for sid, name in enumerate(names):
        ref = model if name is None else made[name][1]
        assert answers[sid] == hf_greedy_ids(ref, prompts[sid], new), name


def test_replacement_head_keeps_the_python_ends(llama_adapters):
    """A decode step whose adapter replaces the LM head (modules_to_save) is not one C++ call:
    its layers still run in the stack, the head in Python, and its logits stay its merged model's."""
    model, made = llama_adapters
    runner, adapters = stack_runner(model, made)
    seq = random_tokens(10, seed=80)
    mgr = paged_cache(runner)
    mgr.allocate(0, len(seq))
    lora_rows(runner, mgr, [(0, 0, seq[:9])], [adapters["regex16"]], block_tables=True)
    state = runner.transformer.lora
    before = state.stack_steps
    out = lora_rows(runner, mgr, [(0, 9, seq[9:])], [adapters["regex16"]], block_tables=True)
    assert state.stack_steps == before + 1  # run_layers' stack, not decode_step
    assert_close(out[0], hf_logits(made["regex16"][1], seq)[9])

