"""The mixture-of-experts families (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, gpt-oss; runners.moe) served
exactly: each tiny seeded model from transformers' own config class against transformers'
forward pass and generate(), and the routing against transformers' own router modules.

Per family: every prefill-chunk and decode step's logits within ATOL of transformers' on the
kernel-or-default path and on the gather path; a mixed batch whose rows take different
experts; greedy answers of an Engine (chunked prefill, batched rows) equal to generate()'s.
The tiny models have 8 experts, top-2 or top-3, and some dense layers (Qwen-MoE's
mlp_only_layers / decoder_sparse_step), so a layer read as the wrong kind shows.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.greedy import assert_engine_greedy_equal, assert_greedy_equal, engine_answers, hf_generate
from tests.helpers.models import (
    MOE_NAMES, assert_close, forward_rows, hf_logits, paged_cache, random_tokens, tiny_moe,
)
from tritonlm.engine.runners.moe import MoE, route
from tritonlm.engine.runners.torch_runner import TorchRunner



@pytest.fixture(scope="module", params=MOE_NAMES)
def family(request):
    return request.param, tiny_moe(request.param)


# which layers are MoE in each tiny model
MOE_LAYERS = {"mixtral": [True] * 3, "qwen3_moe": [True, False, True], "olmoe": [True] * 3,
              "qwen2_moe": [False, True, False], "gpt_oss": [True] * 3}


@pytest.mark.parametrize("attention", ["auto", "gather"])
def test_steps_match_transformers_logits(family, attention):
    """A 12-token prefill chunk, a 3-token step and single-token decode steps up to 24 tokens
    (past Mixtral's window), each step's logits against transformers' over the whole sequence;
    MoE layers where the config puts them, the decoder stack off, saying why, and the attention
    path the layers' other features choose (experts do not switch the attention kernel off)."""
    from dataclasses import replace

    from tritonlm.engine.runners.families import fast_paths

    name, model = family
    runner = TorchRunner(model, attention=attention)
    blocks = [L.block for L in runner.transformer.layers]
    assert [b.moe for b in blocks] == [L.moe is not None for L in runner.transformer.layers] == MOE_LAYERS[name]
    assert runner.transformer.decoder_stack is None and not runner.transformer.fast_paths().cuda_graphs
    if attention == "auto":
        kernel = fast_paths([replace(b, moe=False) for b in blocks]).attention_kernel
        assert runner.attention == ("paged" if kernel else "gather"), runner.attention_why
        assert "mixture-of-experts" in runner.attention_why, runner.attention_why
    seq = random_tokens(24, seed=1)
    ref = hf_logits(model, seq)
    mgr = paged_cache(runner)
    mgr.allocate(1, len(seq))
    assert_close(forward_rows(runner, mgr, [(1, 0, seq[:12])], all_logits=True)[0], ref[:12])
    assert_close(forward_rows(runner, mgr, [(1, 12, seq[12:15])], all_logits=True)[0], ref[12:15])
    for p in range(15, len(seq)):
        assert_close(forward_rows(runner, mgr, [(1, p, [seq[p]])])[0], ref[p])


def test_mixed_batch_rows_take_different_experts(family):
    """One call: a prefill chunk, a decode and a 3-token step of rows with different pasts; the
    rows' tokens are routed to different experts (checked), each row's logits its own."""
    _, model = family
    runner = TorchRunner(model)
    mgr = paged_cache(runner, blocks=60)
    a, b, c = random_tokens(20, seed=2), random_tokens(14, seed=3), random_tokens(17, seed=4)
    for sid, seq, past in ((1, a, 11), (2, b, 13), (3, c, 14)):
        mgr.allocate(sid, len(seq))
        forward_rows(runner, mgr, [(sid, 0, seq[:past])])
    seen = []
    moe = next(L.moe for L in runner.transformer.layers if L.moe is not None)
    real_call = MoE.__call__

    def spy(self, x, glu):
        if self is moe:
            logits = torch.nn.functional.linear(x, self.router, self.router_bias)
            seen.append(route(logits, self.top_k, self.normalize, self.softmax_after_topk)[1])
        return real_call(self, x, glu)

    MoE.__call__ = spy
    try:
        out = forward_rows(runner, mgr, [(1, 11, a[11:20]), (2, 13, b[13:14]), (3, 14, c[14:17])], all_logits=True)
    finally:
        MoE.__call__ = real_call
    assert len(seen) == 1 and len({tuple(sorted(r)) for r in seen[0].tolist()}) > 1  # routes differ by row
    assert_close(out[0, :9], hf_logits(model, a)[11:20])
    assert_close(out[1, :1], hf_logits(model, b)[13:14])
    assert_close(out[2, :3], hf_logits(model, c)[14:17])


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_engine_greedy_equals_generate(family, prefix_caching):
    """An Engine over the family: prompts prefilled in 5-token chunks, batched with each other's
    decode steps, every answer equal to transformers' generate(); with the prefix cache on, the
    second round's shared prompt comes from the cache."""
    _, model = family
    shared = random_tokens(13, seed=11)
    prompts = [shared, random_tokens(6, seed=12), shared + random_tokens(3, seed=13)]
    assert_engine_greedy_equal(model, TorchRunner(model), prompts, 12, prefix_caching)


@pytest.mark.parametrize("drafter", ["self", "lookup"])
def test_speculative_decoding_greedy_equals_generate(family, drafter):
    """Speculative decoding over the family: the model drafting for itself (every guess right:
    K + 1-wide verification steps) and prompt lookup on repetitive prompts; every answer equal
    to transformers' generate()."""
    from tritonlm.engine.engine import Engine
    from tritonlm.engine.kv_cache import KVCacheManager
    from tritonlm.engine.scheduler import SchedulerConfig
    from tritonlm.engine.speculative import DraftModelDrafter, PromptLookupDrafter
    from tritonlm.models.builtin import tiny_tokenizer

    _, model = family
    runner = TorchRunner(model)
    cache = KVCacheManager(runner.spec, 64 * 4 * runner.spec.bytes_per_token, 4, allocate_kv=runner.allocate_kv)
    spec = DraftModelDrafter(TorchRunner(model), cache) if drafter == "self" else PromptLookupDrafter(3)
    engine = Engine(runner, tiny_tokenizer(), cache, SchedulerConfig(max_num_batched_tokens=16), max_context=128,
                    drafter=spec, num_draft_tokens=3)
    loop = random_tokens(5, seed=21)
    prompts = [loop * 3, random_tokens(7, seed=22) + loop * 2]
    new = 12
    ((col, ids),) = engine_answers(engine, prompts, new)
    for prompt, rid in zip(prompts, ids):
        assert_greedy_equal(model, prompt, col.ids(rid), hf_generate(model, prompt, new))
    proposed = sum(col.final(rid).draft_tokens for rid in ids)
    assert proposed > 0  # verification steps several tokens wide did run
    if drafter == "self":  # the target drafting for itself is always right
        assert sum(col.final(rid).accepted_draft_tokens for rid in ids) == proposed


@pytest.mark.parametrize("dtype", ["bfloat16", "int8_weight_only"])
def test_other_precisions_load_and_generate(family, dtype):
    """bfloat16, and int8 weights only (every expert's projections too): the family loads, and a
    prefill plus decode steps give finite logits that mostly agree with float32's choice."""
    from tritonlm.engine.runners.layers import WeightOnlyInt8Linear

    _, model = family
    runner = TorchRunner(model, dtype=torch.bfloat16 if dtype == "bfloat16" else None,
                         int8_weight_only=dtype == "int8_weight_only")
    if dtype == "int8_weight_only":
        experts = {n: p for n, p in runner.transformer.projection_names().items() if ".moe." in n}
        assert experts and all(isinstance(p, WeightOnlyInt8Linear) for p in experts.values())
    seq = random_tokens(20, seed=5)
    ref = hf_logits(model, seq)
    mgr = paged_cache(runner)
    mgr.allocate(1, len(seq))
    out = [forward_rows(runner, mgr, [(1, 0, seq[:12])], all_logits=True)[0]]
    out += [forward_rows(runner, mgr, [(1, p, [seq[p]])]) for p in range(12, len(seq))]
    logits = torch.cat(out)  # [20, V]
    assert torch.isfinite(logits).all()
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.5, f"top-1 agreement with float32 {agree:.2f}"


def test_exported_folder_serves_the_same_logits(tmp_path, family):
    """`tritonlm export --formats none` of a saved folder: the generation model, whose exported
    weights load and run to transformers' logits."""
    from tritonlm.export.pipeline import ExportOptions, export, parse_formats
    from tritonlm.models.builtin import tiny_tokenizer
    from tritonlm.models.loading import load_model

    name, model = family
    folder = tmp_path / f"Tiny-{name}"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    lines: list[str] = []
    result = export(ExportOptions(model=str(folder), repo=tmp_path / "repo", formats=parse_formats("none")),
                    out=lines.append)
    assert result.artifacts == [] and len(result.models) == 1
    loaded, _, _ = load_model(str(tmp_path / "repo" / result.models[0] / "1" / "hf"), progress=lambda *a, **k: None)
    runner = TorchRunner(loaded)
    seq = random_tokens(16, seed=8)
    mgr = paged_cache(runner)
    mgr.allocate(1, len(seq))
    assert_close(forward_rows(runner, mgr, [(1, 0, seq)], all_logits=True)[0], hf_logits(model, seq))


def test_int8_is_refused_by_name():
    with pytest.raises(ValueError, match="int8 is not supported for mixture-of-experts models"):
        TorchRunner(tiny_moe("olmoe"), int8=True)


def test_tensor_parallel_is_refused_pipeline_stages_run():
    """Experts are not split across tensor-parallel ranks (refused by name); two pipeline stages
    give the whole model's logits, each holding its own copy of its layers' experts."""
    from tritonlm.engine.parallel.shard import layer_slice, tensor_slice
    from tritonlm.engine.runners.model import Transformer

    from tests.unit.engine.runners.test_families import _golden_maker

    model = tiny_moe("qwen2_moe")
    with pytest.raises(ValueError, match="qwen2_moe: mixture-of-experts layers are not split"):
        tensor_slice(Transformer.from_hf(model), 0, 2)
    maker = _golden_maker()
    batches = maker.step_batches(model.config.vocab_size)
    whole = maker.run_whole(Transformer.from_hf(model), batches)
    for a, b in zip(whole, maker.run_stages(maker._ranks(model, "layer"), batches)):
        assert_close(a, b)
    full = Transformer.from_hf(model)
    stage = layer_slice(full, 0, 2)  # layers 0 and 1: layer 1 is the MoE one
    mine, theirs = stage.layers[1].moe, full.layers[1].moe
    assert mine is not theirs and mine.gate_up[0].w.data_ptr() != theirs.gate_up[0].w.data_ptr()
    assert torch.equal(mine.gate_up[0].w, theirs.gate_up[0].w) and torch.equal(mine.router, theirs.router)


@pytest.mark.parametrize("model_type, name", [("phimoe", "Phi-MoE"), ("granitemoe", "Granite MoE"),
                                              ("qwen3_next", "Qwen3-Next"), ("deepseek_v3", "DeepSeek-V3"),
                                              ("llama4", "Llama 4"), ("jamba", "Jamba")])
def test_mixture_of_experts_families_still_refused_are_named(model_type, name):
    """The MoE families not served are refused at load, naming the family and what it needs."""
    from tritonlm.engine.model_shape import ModelShape

    config = type("Config", (), {"model_type": model_type})()
    with pytest.raises(ValueError, match=rf"architecture '{model_type}' \({name}: .*\) is not supported; supported: "):
        ModelShape.from_hf_config(config)


def test_clip_qkv_is_refused_by_name():
    from tritonlm.engine.runners.families import check_config

    config = tiny_moe("olmoe").config
    config.clip_qkv = 8.0
    with pytest.raises(ValueError, match=r"OLMoE: clip_qkv=8.0 is not supported"):
        check_config(config)


# ---------------------------------------------------------------------------- routing


def _routers():
    """transformers' own router module of each family, with its config's top_k and norm flag,
    and the MoE that MoE.from_hf would make of it (its routing fields)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    out = []
    for name, cls in (("mixtral", MixtralTopKRouter), ("qwen3_moe", Qwen3MoeTopKRouter), ("olmoe", OlmoeTopKRouter),
                      ("qwen2_moe", Qwen2MoeTopKRouter), ("gpt_oss", GptOssTopKRouter)):
        for norm in (False, True):
            config = tiny_moe(name, norm_topk_prob=norm).config
            torch.manual_seed(5)
            router = cls(config)
            torch.nn.init.normal_(router.weight, 0, 0.5)
            bias = getattr(router, "bias", None)
            if bias is not None:
                torch.nn.init.normal_(bias, 0, 0.5)
            ours = MoE(router=router.weight, router_bias=bias, gate_up=[], down=[], top_k=config.num_experts_per_tok,
                       normalize=name == "mixtral" or (name != "gpt_oss" and norm), softmax_after_topk=name == "gpt_oss")
            out.append((f"{name}-norm{norm}", router, ours))
    return out


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_routing_matches_transformers_router(ties):
    """route() on the router's logits gives transformers' router's experts, in its order, and
    its weights, on random inputs; with ties: experts with equal router rows (and biases: equal
    logits, one or several in the top_k) and all-zero inputs (every expert tied, biases equal)
    break the tie as torch.topk does in transformers."""
    for label, router, ours in _routers():
        g = torch.Generator().manual_seed(3)
        x = torch.randn(64, router.weight.shape[1], generator=g)
        with torch.no_grad():
            if ties:
                for a, b in ((3, 1), (6, 1), (5, 2)):
                    router.weight[a] = router.weight[b]
                if ours.router_bias is not None:
                    ours.router_bias.zero_()
                x[:8] = 0.0  # every expert's logit the same: an 8-way tie
            _, want_w, want_e = router(x)
            logits = torch.nn.functional.linear(x, ours.router, ours.router_bias)
            got_w, got_e = route(logits, ours.top_k, ours.normalize, ours.softmax_after_topk)
        assert torch.equal(got_e, want_e), label
        assert torch.allclose(got_w, want_w.float(), rtol=0, atol=1e-7), label
        if ties:  # the constructed ties did reach the top_k: equal weights chosen among equals
            assert (got_w[:8] == got_w[:8, :1]).all(), label
            tied = [(1 in r and (3 in r or 6 in r)) or (2 in r and 5 in r) for r in got_e[8:].tolist()]
            assert any(tied), label


def test_grouped_experts_match_transformers_block():
    """MoE.__call__ (experts grouped, one matmul pair per expert hit) against transformers'
    own sparse MoE block on 40 random rows, for each family's block (shared expert included)."""
    from tritonlm.engine.runners.model import Transformer

    for name in MOE_NAMES:
        model = tiny_moe(name)
        layer = next(i for i, L in enumerate(Transformer.from_hf(model).layers) if L.moe is not None)
        block = model.model.layers[layer].mlp
        ours = MoE.from_hf(block, model.config, lambda p: p.detach())
        x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            out = block(x.unsqueeze(0))
            want = (out[0] if isinstance(out, tuple) else out)[0]  # gpt-oss's block also returns its scores
            gate_up = lambda gu: torch.nn.functional.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1]  # noqa: E731
            got = ours(x, gate_up)
        assert_close(got, want, atol=1e-5)
