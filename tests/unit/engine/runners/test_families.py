"""The Llama-shaped families (runners.families) served exactly: each tiny seeded model of
tests.helpers.models.tiny_family against transformers' own forward pass and generate(),
on the paths its features allow (families.fast_paths), and the families still refused.

Per family: every prefill-chunk and decode step's logits within ATOL of transformers' on the
kernel-or-default path and on the gather path, a mixed batch in one call; greedy answers
of an Engine (chunked prefill, rows batched together, prefix cache on and off) equal to
generate()'s; int8 and int8_weight_only load and generate. Sequences run past the tiny
windowed models' window, so a window off by one shows. Then every family, the
mixture-of-experts ones and each RoPE type included, at other shapes, seeds and windows
("other shapes" below).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from tests.helpers.greedy import assert_engine_greedy_equal, assert_greedy_equal, engine_answers, hf_generate
from tests.helpers.models import (
    FAMILY_NAMES,
    LLAMA_VOCAB,
    WINDOW,
    assert_close,
    block_table_rows,
    forward_rows,
    hf_logits,
    paged_cache,
    random_tokens,
    stack_and_loop_logits,
    tiny_family,
)
from tritonlm.engine.runners.families import REFUSED, fast_paths
from tritonlm.engine.runners.torch_runner import TorchRunner

@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request):
    return request.param, tiny_family(request.param)


# what each family's layers allow: (the paged-attention kernel, the one-call decoder stack)
EXPECTED_PATHS = {
    "llama": (True, True), "qwen2": (True, True), "granite": (True, True), "phi3": (True, True), "glm": (True, True), "glm4": (True, False),
    "qwen3": (True, False), "mistral": (True, True), "ministral": (True, True), "smollm3": (True, False), "olmo2": (True, False),
    # Gemma: the stack has no GeGLU (the kernels take Gemma 2 / 3's windows and Gemma 2's soft-cap)
    "gemma": (True, False), "gemma2": (True, False), "gemma3_text": (True, False),
}


@pytest.mark.parametrize("attention", ["auto", "gather"])
def test_steps_match_transformers_logits(family, attention):
    """A 12-token prefill chunk, a 3-token step (the kernel's width) and single-token decode
    steps up to 28 tokens, each step's logits against transformers' over the whole sequence;
    the fast paths taken are the ones the family's features allow, and say why."""
    name, model = family
    runner = TorchRunner(model, attention=attention)
    kernel, stack = EXPECTED_PATHS[name]
    if attention == "auto":
        assert runner.attention == ("paged" if kernel else "gather"), runner.attention_why
        assert (runner.transformer.decoder_stack is not None) == stack
        assert (name in runner.attention_why) == (not stack), runner.attention_why
    seq = random_tokens(28, seed=1)
    ref = hf_logits(model, seq)
    mgr = paged_cache(runner)
    mgr.allocate(1, len(seq))
    assert_close(forward_rows(runner, mgr, [(1, 0, seq[:12])], all_logits=True)[0], ref[:12])
    assert_close(forward_rows(runner, mgr, [(1, 12, seq[12:15])], all_logits=True)[0], ref[12:15])
    for p in range(15, len(seq)):
        assert_close(forward_rows(runner, mgr, [(1, p, [seq[p]])])[0], ref[p])


def test_mixed_batch_matches_each_alone(family):
    """One call: a prefill chunk, a decode and a 3-token step of rows with different pasts."""
    _, model = family
    runner = TorchRunner(model)
    mgr = paged_cache(runner, blocks=60)
    a, b, c = random_tokens(20, seed=2), random_tokens(14, seed=3), random_tokens(17, seed=4)
    for sid, seq, past in ((1, a, 11), (2, b, 13), (3, c, 14)):
        mgr.allocate(sid, len(seq))
        forward_rows(runner, mgr, [(sid, 0, seq[:past])])
    out = forward_rows(runner, mgr, [(1, 11, a[11:20]), (2, 13, b[13:14]), (3, 14, c[14:17])], all_logits=True)
    assert_close(out[0, :9], hf_logits(model, a)[11:20])
    assert_close(out[1, :1], hf_logits(model, b)[13:14])
    assert_close(out[2, :3], hf_logits(model, c)[14:17])


def test_the_window_is_exercised():
    """The windowed tiny models' logits past the window differ from the same weights without
    one (so the tests above would see a window off by one), and agree inside it."""
    seq = random_tokens(20, seed=1)
    windowed, whole = tiny_family("mistral"), tiny_family("mistral", sliding_window=None)
    a, b = hf_logits(windowed, seq), hf_logits(whole, seq)
    assert_close(a[:WINDOW], b[:WINDOW])
    assert (a[WINDOW:] - b[WINDOW:]).abs().max() > 1e-2


@pytest.mark.parametrize("attention", ["auto", "gather"])
def test_windowed_and_full_layers_in_one_model(attention):
    """Qwen2 with use_sliding_window: layers from max_window_layers on are windowed, the others
    not; each layer reads its own mask, past the window."""
    from tritonlm.engine.runners.families import block_specs

    model = tiny_family("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert [b.sliding_window for b in block_specs(model.config)] == [None, WINDOW]
    runner = TorchRunner(model, attention=attention)
    assert runner.attention == ("paged" if attention == "auto" else "gather"), runner.attention_why
    seq = random_tokens(24, seed=6)
    ref = hf_logits(model, seq)
    mgr = paged_cache(runner)
    mgr.allocate(1, len(seq))
    assert_close(forward_rows(runner, mgr, [(1, 0, seq[:10])], all_logits=True)[0], ref[:10])
    for p in range(10, len(seq)):
        assert_close(forward_rows(runner, mgr, [(1, p, [seq[p]])])[0], ref[p])
    whole = hf_logits(tiny_family("qwen2"), seq)
    assert (whole[WINDOW:] - ref[WINDOW:]).abs().max() > 1e-2  # the window changed the answer


def test_a_gemma3_with_sliding_layers_only_loads_and_matches():
    """Gemma 3 types every layer sliding but each 6th: a 2-layer model has no full-attention
    layer, so no full-attention RoPE table, and is served all the same."""
    model = tiny_family("gemma3_text", num_hidden_layers=2, layer_types=None,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    assert set(model.config.layer_types) == {"sliding_attention"}
    runner = TorchRunner(model)
    seq = random_tokens(20, seed=8)
    ref = hf_logits(model, seq)
    mgr = paged_cache(runner)
    mgr.allocate(1, len(seq))
    assert_close(forward_rows(runner, mgr, [(1, 0, seq[:12])], all_logits=True)[0], ref[:12])
    for p in range(12, len(seq)):
        assert_close(forward_rows(runner, mgr, [(1, p, [seq[p]])])[0], ref[p])


@pytest.mark.parametrize("name", ["mistral", "phi3"])
def test_windowed_decode_steps_run_in_one_call_and_match_transformers(name):
    """Mistral / Phi-3 with a window shorter than the sequence: the paged kernel and the
    one-call decode step take every layer's window (decode_step_ready), each decode step's
    logits are transformers' past the window, and the C++ decoder stack gives the Python
    loop's bits with the window (decode, and verification-width steps)."""
    model = tiny_family(name)
    runner = TorchRunner(model)
    assert runner.attention == "paged" and runner.transformer.decode_step_ready, runner.attention_why
    assert {L.block.sliding_window for L in runner.transformer.layers} == {WINDOW}
    seq = random_tokens(30, seed=8)
    ref = hf_logits(model, seq)
    mgr = paged_cache(runner)
    mgr.allocate(1, len(seq))
    assert_close(block_table_rows(runner, mgr, [(1, 0, seq[:5])])[0], ref[4])
    for p in range(5, len(seq)):  # one token per step: Transformer.decode_step, past the window from p = 8
        assert_close(block_table_rows(runner, mgr, [(1, p, [seq[p]])])[0], ref[p])
    for widths in ([1] * 4, [3, 1, 2, 8]):
        loop, stack = stack_and_loop_logits(runner, widths, first_past=5, blocks=60)
        for a, b in zip(loop, stack):
            assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("name", ["mistral", "phi3"])
def test_without_a_window_every_fast_path_runs(name):
    """Mistral v0.2+ and Phi-3 configs without a window are Llama's block: the paged kernel
    and the one-call decode step run them, and their logits are transformers'."""
    model = tiny_family(name, sliding_window=None)
    runner = TorchRunner(model)
    assert runner.attention == "paged" and runner.transformer.decode_step_ready, runner.attention_why
    seq = random_tokens(16, seed=7)
    ref = hf_logits(model, seq)
    mgr = paged_cache(runner)
    mgr.allocate(1, len(seq))
    assert_close(forward_rows(runner, mgr, [(1, 0, seq[:10])], all_logits=True)[0], ref[:10])
    for p in range(10, len(seq)):
        assert_close(forward_rows(runner, mgr, [(1, p, [seq[p]])])[0], ref[p])


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_engine_greedy_equals_generate(family, prefix_caching):
    """An Engine over the family: prompts prefilled in 5-token chunks, batched with each
    other's decode steps, every answer equal to transformers' generate(); with the prefix
    cache on, the second round's shared prompt comes from the cache."""
    _, model = family
    shared = random_tokens(13, seed=11)
    prompts = [shared, random_tokens(6, seed=12), shared + random_tokens(3, seed=13)]
    assert_engine_greedy_equal(model, TorchRunner(model), prompts, 12, prefix_caching)


@pytest.mark.parametrize("dtype", ["int8", "int8_weight_only", "bfloat16"])
def test_other_precisions_load_and_generate(family, dtype):
    """int8 (x int8), int8 weights only (the same projections as float32's) and bfloat16: the
    family loads, and a prefill plus decode steps give finite logits that mostly agree with
    float32's choice."""
    _, model = family
    runner = TorchRunner(model, int8=dtype == "int8", int8_weight_only=dtype == "int8_weight_only",
                         dtype=torch.bfloat16 if dtype == "bfloat16" else None)
    seq = random_tokens(24, seed=5)
    ref = hf_logits(model, seq)
    mgr = paged_cache(runner)
    mgr.allocate(1, len(seq))
    out = [forward_rows(runner, mgr, [(1, 0, seq[:12])], all_logits=True)[0]]
    out += [forward_rows(runner, mgr, [(1, p, [seq[p]])]) for p in range(12, len(seq))]
    logits = torch.cat(out)  # [24, V]
    assert torch.isfinite(logits).all()
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.5, f"top-1 agreement with float32 {agree:.2f}"


def test_fast_paths_name_what_switches_them_off():
    from tritonlm.engine.runners.families import BlockSpec

    assert fast_paths([BlockSpec()] * 2).why == ""
    windowed = fast_paths([BlockSpec(), BlockSpec(sliding_window=8)])  # the kernels take the window per layer
    assert windowed.attention_kernel and windowed.decoder_stack and windowed.why == ""
    normed = fast_paths([BlockSpec(qk_norm="per_head")])
    assert normed.attention_kernel and not normed.decoder_stack and "q/k norm" in normed.why
    capped = fast_paths([BlockSpec(softcap=50.0)])  # and the soft-cap
    assert capped.attention_kernel and capped.decoder_stack and capped.why == ""
    geglu = fast_paths([BlockSpec(mlp="gelu")])
    assert geglu.attention_kernel and not geglu.decoder_stack and "GeGLU" in geglu.why


@pytest.mark.parametrize("name, off", [
    ("gemma2", dict(attn_logit_softcapping=None)),
    ("gemma2", dict(final_logit_softcapping=None)),
    ("gemma2", dict(query_pre_attn_scalar=16)),  # = head_dim: 1/sqrt(D), the scale without the scalar
    ("gemma3_text", dict(rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                                          for t in ("sliding_attention", "full_attention")})),
], ids=["attn-softcap", "final-softcap", "query-pre-attn-scalar", "rope-per-layer-type"])
def test_the_gemma_features_are_exercised(name, off):
    """Each Gemma feature the tiny models switch on changes transformers' logits on the tests'
    sequences (so serving without it would fail the tests above)."""
    seq = random_tokens(20, seed=1)
    assert (hf_logits(tiny_family(name), seq) - hf_logits(tiny_family(name, **off), seq)).abs().max() > 1e-2


def test_gemma_layers_read_their_own_window_rope_and_norms():
    """Gemma 3's BlockSpecs: a window and the local RoPE table on the sliding layers, the
    global table (linear scaling) and no window on the full one; sandwich norms, per-head q/k
    norm, no soft-cap (Gemma 3 ignores attn_logit_softcapping); Gemma 2's alternate."""
    from tritonlm.engine.runners.families import block_specs
    from tritonlm.engine.runners.model import Transformer

    g3 = block_specs(tiny_family("gemma3_text").config)
    assert [b.sliding_window for b in g3] == [WINDOW, WINDOW, None, WINDOW]
    assert [b.rope_table for b in g3] == ["sliding_attention"] * 2 + ["full_attention", "sliding_attention"]
    assert all(b.norm == "sandwich" and b.qk_norm == "per_head" and b.softcap is None and b.mlp == "gelu" for b in g3)
    g2 = block_specs(tiny_family("gemma2").config)
    assert [b.sliding_window for b in g2] == [WINDOW, None, WINDOW, None] and {b.softcap for b in g2} == {4.0}
    model = Transformer.from_hf(tiny_family("gemma3_text"))
    local, full = model.rope_tables["sliding_attention"], model.rope_tables["full_attention"]
    assert not torch.equal(local[0], full[0]) and torch.equal(model.inv_freq, full[0])


def test_gemma3_multimodal_is_refused_pointing_to_the_text_model():
    from tritonlm.engine.runners.families import check_config

    config = type("Config", (), {"model_type": "gemma3"})()
    with pytest.raises(ValueError) as e:
        check_config(config)
    assert "'gemma3'" in str(e.value) and "gemma3_text" in str(e.value) and "Gemma3ForCausalLM" in str(e.value)


# Gemma's chat format (turns as <start_of_turn>role ... <end_of_turn>, the assistant named
# "model", a system message folded into the first user turn: Gemma 3's template's rules)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for m in turns -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ (prefix if loop.first else '') + m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def test_a_gemma_chat_template_renders_through_the_chat_path(tmp_path):
    """The OpenAI frontend's chat path (openai.chat.ChatTemplates) renders a Gemma-format
    template as transformers does, and a conversation it refuses is a 400 naming messages."""
    import asyncio

    from tritonlm.models.builtin import tiny_tokenizer
    from tritonlm.openai.chat import ChatTemplates
    from tritonlm.openai.errors import OpenAIError

    tok = tiny_tokenizer()
    tok.chat_template = GEMMA_TEMPLATE
    tok.save_pretrained(tmp_path)
    templates = ChatTemplates(tokenizers={"*": tmp_path})
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "A colour?"}]
    text = asyncio.run(templates.render("tiny-gemma", {}, messages))
    assert text == (f"{tok.bos_token}<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
                    "Hello<end_of_turn>\n<start_of_turn>user\nA colour?<end_of_turn>\n<start_of_turn>model\n")
    assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(OpenAIError, match="messages: the chat template of 'tiny-gemma' refused them"):
        asyncio.run(templates.render("tiny-gemma", {}, messages[1:2] * 2))


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_families_are_named_with_the_supported_list(model_type):
    from tritonlm.engine.model_shape import ModelShape
    from tritonlm.engine.runners.families import FAMILIES

    config = type("Config", (), {"model_type": model_type})()
    with pytest.raises(ValueError) as e:
        ModelShape.from_hf_config(config)
    message = str(e.value)
    assert f"architecture {model_type!r}" in message and REFUSED[model_type] in message
    assert all(k in message for k in FAMILIES)


def test_partial_rotary_where_transformers_rotates_every_dim_is_refused_by_name():
    """A partial rotary factor in the config of a family whose transformers forward rotates
    every head dim (Llama) is refused naming the family, not served half-rotated."""
    from tritonlm.engine.runners.families import check_config

    config = tiny_family("llama").config
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.75}
    with pytest.raises(ValueError, match=r"Llama: rope partial_rotary_factor=0.75 is not supported for llama"):
        check_config(config)


def test_rope_per_layer_type_is_refused_by_name():
    """RoPE parameters per layer type (a nested dict) are not one frequency table: refused,
    not read as the default."""
    from tritonlm.engine.runners.families import check_config

    config = tiny_family("qwen3").config
    config.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ValueError, match=r"Qwen3 dense: rope parameters per layer type \(full_attention, sliding_attention\)"):
        check_config(config)


def _golden_maker():
    """make_golden_logits.py beside this file (its tensor-parallel and pipeline harness)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent / "make_golden_logits.py"
    spec = importlib.util.spec_from_file_location("make_golden_logits", path)
    if spec.name in sys.modules:
        return sys.modules[spec.name]
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["qwen3", "mistral", "granite", "smollm3", "olmo2", "gemma2", "gemma3_text"])
def test_parallel_shares_keep_the_family_features(name):
    """Two tensor-parallel ranks and two pipeline stages of the family (the shares carry each
    layer's BlockSpec, q/k and sandwich norms, Gemma's ends and RoPE tables) give the whole model's logits; OLMo 2's whole-projection
    q/k norm, whose RMS spans every rank's heads, is refused by tensor slicing, naming it."""
    from tritonlm.engine.parallel.shard import tensor_slice
    from tritonlm.engine.runners.model import Transformer

    maker = _golden_maker()
    model = tiny_family(name)
    batches = maker.step_batches(model.config.vocab_size)
    whole = maker.run_whole(Transformer.from_hf(model), batches)
    modes = ["layer"] if name == "olmo2" else ["tensor", "layer"]
    for mode in modes:
        run = maker.run_ranks if mode == "tensor" else maker.run_stages
        for a, b in zip(whole, run(maker._ranks(model, mode), batches)):
            assert_close(a, b)
    if name == "olmo2":
        with pytest.raises(ValueError, match="olmo2: q/k norm over the whole projection is not split"):
            tensor_slice(Transformer.from_hf(model), 0, 2)

# ---------------------------------------------------------------------------- other shapes
# Every family again at other shapes, seeds and windows than tests/helpers/models.py's tiny
# ones: hidden 96, 6 query heads over 3 KV heads, head dims 16 / 24 / 32, windows of 6, norms
# and biases random, every RoPE type Llama takes. An Engine (7-token prefill chunks, rows
# batched, the prefix cache on, two rounds) answers each prompt as transformers' generate()
# does, so a shape the tests above happen to avoid (a head_dim that is not hidden / heads, an
# odd window) cannot hide a bug.

SHAPE_WINDOW = 6
BASE = dict(vocab_size=LLAMA_VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
            num_key_value_heads=3, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0,
            initializer_range=0.15, tie_word_embeddings=False)
SHAPES = {  # name -> (config class prefix, its fields beyond BASE)
    "llama": ("Llama", {}),
    "llama_yarn": ("Llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                                  "original_max_position_embeddings": 128})),
    "llama_llama3": ("Llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64})),
    "llama_linear": ("Llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})),
    "llama_dynamic": ("Llama", dict(max_position_embeddings=24,
                                    rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 3.0})),
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", dict(head_dim=24)),
    "mistral": ("Mistral", dict(sliding_window=SHAPE_WINDOW)),
    "ministral": ("Ministral", dict(head_dim=16, sliding_window=SHAPE_WINDOW,
                                    layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
    "phi3": ("Phi3", dict(sliding_window=SHAPE_WINDOW)),
    "phi4_mini": ("Phi3", dict(partial_rotary_factor=0.75, max_position_embeddings=96, original_max_position_embeddings=24,
                               rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
                                                "original_max_position_embeddings": 24,
                                                "short_factor": [1.0 + 0.05 * i for i in range(6)],
                                                "long_factor": [1.5 + 0.3 * i for i in range(6)]})),
    "granite": ("Granite", dict(embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5,
                                logits_scaling=2.0)),
    "smollm3": ("SmolLM3", dict(num_hidden_layers=4, no_rope_layer_interval=3)),
    "olmo2": ("Olmo2", {}),
    "glm": ("Glm", dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True)),
    "glm4": ("Glm4", dict(head_dim=32, partial_rotary_factor=0.5)),
    "gemma2": ("Gemma2", dict(num_hidden_layers=4, head_dim=32, sliding_window=SHAPE_WINDOW, query_pre_attn_scalar=20,
                              attn_logit_softcapping=5.0, final_logit_softcapping=10.0)),
    "gemma3_text": ("Gemma3Text", dict(num_hidden_layers=5, head_dim=16, sliding_window=SHAPE_WINDOW, query_pre_attn_scalar=16,
                                       layer_types=["sliding_attention"] * 2 + ["full_attention"]
                                       + ["sliding_attention"] * 2)),
    "mixtral": ("Mixtral", dict(num_local_experts=5, num_experts_per_tok=2, sliding_window=SHAPE_WINDOW)),
    "qwen3_moe": ("Qwen3Moe", dict(head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48,
                                   decoder_sparse_step=1, norm_topk_prob=True)),
    "olmoe": ("Olmoe", dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False)),
    "gpt_oss": ("GptOss", dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=SHAPE_WINDOW,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def shaped_model(name: str, seed: int):
    family, extra = SHAPES[name]
    config = getattr(transformers, f"{family}Config")(**{**BASE, **copy.deepcopy(extra)})
    torch.manual_seed(seed)
    causal_lm = "Gemma3ForCausalLM" if family == "Gemma3Text" else f"{family}ForCausalLM"
    model = getattr(transformers, causal_lm)(config).eval()
    with torch.no_grad():  # transformers' ones and zeros would hide a norm or a bias left out
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
                module.weight.uniform_(-0.4, 0.4) if family.startswith("Gemma") else module.weight.uniform_(0.6, 1.4)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("name", list(SHAPES))
def test_engine_greedy_equals_generate_at_other_shapes(name):
    from tritonlm.engine.engine import Engine
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.scheduler import SchedulerConfig
    from tritonlm.models.builtin import tiny_tokenizer

    seed = list(SHAPES).index(name)
    model = shaped_model(name, 1000 + seed)
    runner = TorchRunner(model)
    cache = KVCacheManager(runner.spec, 300 * 4 * runner.spec.bytes_per_token, 4, allocate_kv=runner.allocate_kv,
                           prefix_caching=True)
    engine = Engine(runner, tiny_tokenizer(), cache, SchedulerConfig(max_num_batched_tokens=7), max_context=256)
    shared = random_tokens(17, seed=70 + seed)
    prompts = [shared, shared + random_tokens(14, seed=80 + seed), random_tokens(5, seed=90 + seed)]
    new = 22
    for col, ids in engine_answers(engine, prompts, new, rounds=2):
        for prompt, rid in zip(prompts, ids):
            # a fresh copy: transformers' dynamic RoPE keeps state from one generate() to the next
            assert_greedy_equal(model, prompt, col.ids(rid), hf_generate(copy.deepcopy(model), prompt, new))
