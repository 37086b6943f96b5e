"""RoPE beyond one table of positions (runners.rope), served exactly against transformers:
Phi-4-mini's partial rotary with longrope, Phi-3's longrope, Llama's dynamic NTK scaling and
longrope, and GLM's interleaved partial rotary under a yarn attention factor.

The tiny models switch tables at THRESHOLD tokens (original_max_position_embeddings, or
max_position_embeddings for dynamic). Prompts start below it and answers run past it, or
start above it; the reference is transformers' generate() on a fresh copy of the model
(its dynamic RoPE keeps state from one call to the next). Phi-3's generate() recomputes its
cache when a sequence first passes the threshold, as the Engine does (Scheduler.rotate_again):
the runner-level step test compares Phi-3 up to that point, the Engine tests past it. Per step, the logits of the
runner's prefill and decode steps equal generate()'s within ATOL on the kernel and the gather
paths; an Engine that prefills in 5-token chunks, batches the rows and reuses cached
prefixes answers as generate() does, token for token.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from tests.helpers.greedy import assert_engine_greedy_equal, assert_greedy_equal, engine_answers
from tests.helpers.models import LLAMA_VOCAB, assert_close, forward_rows, paged_cache, random_tokens, triton_decode_runner
from tritonlm.engine.runners.rope import rotary_order
from tritonlm.engine.runners.torch_runner import TorchRunner

THRESHOLD = 32
HEAD_DIM = 16  # hidden 64 over 4 heads


def _factors(base: float, step: float, n: int) -> list[float]:
    return [base + step * i for i in range(n)]


def _longrope(rotating: int) -> dict:
    half = rotating // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": _factors(1.0, 0.1, half),
            "long_factor": _factors(2.0, 0.5, half), "original_max_position_embeddings": THRESHOLD}


VARIANTS = {
    # Phi-4-mini's layout: 3/4 of each head rotates, longrope over 4x the original context
    "phi4_mini": ("Phi3", dict(partial_rotary_factor=0.75, max_position_embeddings=4 * THRESHOLD,
                               original_max_position_embeddings=THRESHOLD,
                               rope_parameters={**_longrope(12), "partial_rotary_factor": 0.75})),
    "phi3_longrope": ("Phi3", dict(max_position_embeddings=4 * THRESHOLD, original_max_position_embeddings=THRESHOLD,
                                   rope_parameters=_longrope(HEAD_DIM))),
    "llama_dynamic": ("Llama", dict(max_position_embeddings=THRESHOLD,
                                    rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "llama_longrope": ("Llama", dict(max_position_embeddings=4 * THRESHOLD, rope_parameters=_longrope(HEAD_DIM))),
    # an attention factor that must stay off the dims that do not rotate
    "glm_partial_yarn": ("Glm", dict(partial_rotary_factor=0.5, head_dim=HEAD_DIM, max_position_embeddings=4 * THRESHOLD,
                                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                        "original_max_position_embeddings": THRESHOLD,
                                                        "partial_rotary_factor": 0.5})),
}


# transformers' Phi-3 generate() recomputes the whole cache with the long factors when a
# sequence first passes the threshold; the Engine does too (Scheduler.rotate_again), the
# runner's steps alone (test_steps_match_generate) cannot
RECOMPUTES_AT_THRESHOLD = ("phi4_mini", "phi3_longrope")


def tiny_variant(name: str):
    family, extra = copy.deepcopy(VARIANTS[name])  # the config class takes rope_parameters apart
    args = dict(vocab_size=LLAMA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, bos_token_id=None,
                eos_token_id=None, pad_token_id=0, initializer_range=0.2, **extra)
    config = getattr(transformers, f"{family}Config")(**args)
    torch.manual_seed(31)
    return getattr(transformers, f"{family}ForCausalLM")(config).eval()


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request):
    return request.param, tiny_variant(request.param)


def generate(model, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy answer and each step's logits [V], from a fresh copy of the model."""
    with torch.no_grad():
        out = copy.deepcopy(model).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            max_new_tokens=new, min_new_tokens=new, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float() for s in out.logits]


def test_the_tiny_models_use_what_they_claim(variant):
    name, model = variant
    params = model.config.rope_parameters
    assert params["rope_type"] == {"phi4_mini": "longrope", "phi3_longrope": "longrope", "llama_dynamic": "dynamic",
                                   "llama_longrope": "longrope", "glm_partial_yarn": "yarn"}[name]
    partial = params.get("partial_rotary_factor", 1.0)
    assert (partial < 1.0) == (name in ("phi4_mini", "glm_partial_yarn"))
    runner = TorchRunner(model)
    length = runner.transformer.length_rope
    assert (length is not None) == (params["rope_type"] != "yarn")
    if length is not None:
        assert length.threshold == THRESHOLD
        assert "longrope / dynamic" in runner.attention_why


@pytest.mark.parametrize("prompt_len", [20, 40], ids=["crosses", "above"])
@pytest.mark.parametrize("attention", ["auto", "gather"])
def test_steps_match_generate(variant, prompt_len, attention):
    """The prompt in one prefill step, then one decode step per answer token: each step's
    logits equal generate()'s (the answer runs past THRESHOLD: the tables switch there)."""
    name, model = variant
    prompt, new = random_tokens(prompt_len, seed=prompt_len), 24
    answer, ref = generate(model, prompt, new)
    runner = TorchRunner(model, attention=attention)
    mgr = paged_cache(runner, blocks=32)
    mgr.allocate(1, prompt_len + new)
    got = [forward_rows(runner, mgr, [(1, 0, prompt)])[0]]
    for i, tok in enumerate(answer[:-1]):
        got.append(forward_rows(runner, mgr, [(1, prompt_len + i, [tok])])[0])
    if name in RECOMPUTES_AT_THRESHOLD:  # up to the step whose token passes the threshold
        got, ref = got[: THRESHOLD - prompt_len + 1], ref[: THRESHOLD - prompt_len + 1]
    for g, r in zip(got, ref):
        assert_close(g.view(1, -1), r.view(1, -1))


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_engine_greedy_equals_generate(variant, prefix_caching):
    """Prompts below and above THRESHOLD prefilled in 5-token chunks, batched with each other's
    decode steps, two rounds (the second from the prefix cache where it is on): every answer
    is generate()'s, however the prompt was chunked (Phi-3: the 21-token prompt's answer
    passes the threshold, and its sequence runs again whole there, as generate()'s does)."""
    name, model = variant
    shared = random_tokens(21, seed=21)
    prompts = [shared, shared + random_tokens(19, seed=22), random_tokens(9, seed=23)]  # 21, 40 and 9 tokens
    new = 20
    assert_engine_greedy_equal(model, TorchRunner(model), prompts, new, prefix_caching,
                               reference=lambda prompt, n: generate(model, prompt, n)[0], kv_tokens=384)


@pytest.mark.parametrize("model_type, rotating, pairs", [
    ("phi3", 12, [(0, 6), (5, 11)]),  # rotate-half over the first 12 dims: dim i with i + 6
    ("glm", 8, [(0, 1), (6, 7)]),  # interleaved over the first 8: dim 2i with 2i + 1
])
def test_rotary_order_pairs_the_models_dims_as_rotate_half(model_type, rotating, pairs):
    """After the reorder, dim j pairs with j + D/2 (the kernels' rotate-half): the model's own
    pairs land there, and the dims that do not rotate fill the rest, each once."""
    config = transformers.AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4,
                                               partial_rotary_factor=rotating / HEAD_DIM, head_dim=HEAD_DIM)
    order = rotary_order(config, HEAD_DIM).tolist()
    assert sorted(order) == list(range(HEAD_DIM))
    half = HEAD_DIM // 2
    placed = {(order[j], order[j + half]) for j in range(half)}
    for a, b in pairs:
        assert (a, b) in placed
    assert set(order[rotating // 2 : half] + order[half + rotating // 2 :]) == set(range(rotating, HEAD_DIM))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Triton interpreter's numpy calls
@pytest.mark.parametrize("name", ["llama_dynamic", "llama_longrope"])
def test_the_gpu_decode_path_keeps_each_rows_tables(monkeypatch, name):
    """The GPU's path (the Triton decode kernel, run by its interpreter; block tables on the
    device): a 40-token prompt prefilled in 5-token chunks and decoded answers as generate():
    short chunks and decode rows must not fall to padded steps that know no prompt length."""
    from tritonlm.engine.engine import Engine
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.scheduler import SchedulerConfig
    from tritonlm.models.builtin import tiny_tokenizer

    model = tiny_variant(name)
    runner = triton_decode_runner(model, monkeypatch)
    cache = KVCacheManager(runner.spec, 64 * 4 * runner.spec.bytes_per_token, 4, allocate_kv=runner.allocate_kv,
                           device_tables=True)
    engine = Engine(runner, tiny_tokenizer(), cache, SchedulerConfig(max_num_batched_tokens=5), max_context=128)
    prompt, new = random_tokens(40, seed=40), 6
    ((col, (rid,)),) = engine_answers(engine, [prompt], new)
    assert_greedy_equal(model, prompt, col.ids(rid), generate(model, prompt, new)[0])
