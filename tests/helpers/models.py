"""Models, engines and forward passes the tests share.

Seeded tiny models only (tiny-gpt2 from tritonlm.models.builtin, a tiny grouped-query
Llama built here): nothing is downloaded. transformers' own generate() and forward pass
are the references; the engine helpers drive an Engine step by step on the test's thread.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.engine import Engine
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.request import GenerationEvent, GenerationRequest, SamplingParams
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.scheduler import SchedulerConfig
from tritonlm.models.builtin import build_tiny

LLAMA_VOCAB = 512  # tiny_llama's vocabulary; random_tokens draws from it
ATOL = 1e-4  # float32 logits of a forward pass against transformers' own
# int8_weight_only against float activations, as a share of the largest logit: its kernel
# rounds activations to 16-bit codes (half a step is 2^-16 of a chunk's largest input, a
# relative 1.5e-5 at most per projection), and the errors of every projection add up over the
# layers; 1e-3 leaves that tens of projections' worth of room
W8_RTOL = 1e-3

# prompts of mixed lengths and scripts (multi-byte characters included)
MIXED_PROMPTS = [
    "The capital of France is",
    "Once upon a time there was a small robot who wanted",
    "Hi",
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25",
    "Café naïve — 你好，世界 🙂",
    "def main(): return",
]


# ---------------------------------------------------------------------------- models


@lru_cache(maxsize=None)
def tiny(name: str = "tiny-gpt2"):
    """(model, tokenizer) shared by every test of a process: the HF reference."""
    return build_tiny(name)


def sentencepiece_style_tokenizer():
    """A Llama-style tokenizer built offline: Unigram pieces with a "▁" for the space,
    byte fallback for what no piece covers, a decoder that strips the text's first space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["▁hello", "▁world", "▁the", "▁round", "▁is", "▁", "ro", "und"] + list("abcdefghijklmnopqrstuvwxyz,.")
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{i:02X}>", -20.0) for i in range(256)]
    vocab += [(p, -1.0) for p in pieces]
    tk = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_llama(**overrides):
    """Grouped-query Llama (4 query heads over 2 kv heads), tied embeddings, seeded weights;
    overrides go to its LlamaConfig."""
    from transformers import LlamaConfig, LlamaForCausalLM

    args = dict(
        vocab_size=LLAMA_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        # tied random embeddings at the default 0.02 make every token predict itself
        # (greedy text is one token repeated); larger weights give varied continuations
        initializer_range=0.2,
    )
    args.update(overrides)
    torch.manual_seed(77)
    return LlamaForCausalLM(LlamaConfig(**args)).eval()


# the Llama-shaped families served (runners.families.FAMILIES), each as a tiny seeded model
FAMILY_NAMES = ("llama", "qwen2", "qwen3", "mistral", "ministral", "phi3", "granite", "smollm3", "olmo2", "glm", "glm4", "gemma",
                "gemma2", "gemma3_text")
WINDOW = 8  # sliding window of the tiny windowed models: prompts plus answers run past it


def tiny_family(family: str, **overrides):
    """A tiny seeded model of `family` from transformers' own config class (hidden 64, 4 query
    heads over 2 kv heads, 512 tokens, no EOS: greedy references run to their length), with
    each family's feature switched on: Qwen2's q/k/v biases, Qwen3's per-head q/k norm with
    an explicit head_dim, Mistral's and Phi-3's sliding window, Granite's multipliers,
    SmolLM3's NoPE layers (every 2nd of 4), OLMo 2's post-norm blocks and whole q/k norm,
    Gemma's (1 + w) norms (random, not transformers' zeros) and GeGLU, Gemma 2's soft-caps
    (small enough to bite), query_pre_attn_scalar and alternating windows, Gemma 3's mixed
    local / global layers with a RoPE per layer type (linear scaling on the global ones)."""
    import transformers

    args = dict(vocab_size=LLAMA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                initializer_range=0.2)  # as tiny_llama: varied greedy continuations
    extra = {
        "llama": {},
        "qwen2": {},  # q/k/v biases are always on in Qwen2
        "qwen3": dict(head_dim=32),  # not hidden / heads: the explicit head_dim must be read
        "mistral": dict(sliding_window=WINDOW),
        "ministral": dict(num_hidden_layers=3, sliding_window=WINDOW, head_dim=16,  # as its checkpoints state it
                          layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
        "phi3": dict(sliding_window=WINDOW, tie_word_embeddings=False),
        "granite": dict(embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.4,
                        logits_scaling=4.0),
        "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=2),
        "olmo2": {},
        # GLM-4: half of each head's dims rotate, pairs interleaved; q/k/v biases
        "glm": dict(head_dim=32, partial_rotary_factor=0.5, attention_bias=True),
        "glm4": dict(head_dim=24, partial_rotary_factor=0.5, attention_bias=True),  # 12 rotating, 12 passing
        "gemma": dict(hidden_act="gelu_pytorch_tanh"),
        "gemma2": dict(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                       attn_logit_softcapping=4.0, final_logit_softcapping=8.0),
        "gemma3_text": dict(num_hidden_layers=4, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                         "sliding_attention"],
                            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                             "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                "rope_theta": 1000000.0}}),
    }[family]
    args.update(extra)
    args.update(overrides)
    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "ministral": "Ministral", "phi3": "Phi3",
             "granite": "Granite", "smollm3": "SmolLM3", "olmo2": "Olmo2", "glm": "Glm", "glm4": "Glm4", "gemma": "Gemma", "gemma2": "Gemma2",
             "gemma3_text": "Gemma3Text"}
    config = getattr(transformers, f"{names[family]}Config")(**args)
    torch.manual_seed(77)
    causal_lm = "Gemma3ForCausalLM" if family == "gemma3_text" else f"{names[family]}ForCausalLM"
    model = getattr(transformers, causal_lm)(config).eval()
    with torch.no_grad():  # transformers initializes biases to zero and norms to one: make them matter
        for layer in model.model.layers:
            if family in ("qwen2", "glm", "glm4"):
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
            if family in ("qwen3", "olmo2"):
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
        if family.startswith("gemma"):  # (1 + w) norms: transformers' w = 0 would hide a missing 1 +
            for module in model.modules():
                if type(module).__name__.endswith("RMSNorm"):
                    module.weight.uniform_(-0.5, 0.5)
    return model


def hf_greedy_text(prompt: str, max_tokens: int, builtin: str = "tiny-gpt2", **kwargs) -> list[int]:
    """transformers' own generate(), greedy, on a built-in tiny model's tokens of `prompt`:
    the reference token ids (EOS and after removed); kwargs go to generate()."""
    model, tok = tiny(builtin)
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id, **kwargs)
    new = out[0, ids.input_ids.shape[1]:].tolist()
    if tok.eos_token_id in new:
        new = new[: new.index(tok.eos_token_id)]
    return new


@torch.no_grad()
def reference_greedy(prompt_ids: list[int], new: int, builtin: str = "tiny-gpt2", frequency_penalty: float = 0.0,
                     presence_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
                     stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """A loop over transformers' own logits, one token at a time, with OpenAI's definitions of
    the frequency and presence penalties (over the answer so far) and logit bias applied in
    float64: the greedy ids, up to EOS or a stop token id (not included)."""
    model, tok = tiny(builtin)
    ids, out = list(prompt_ids), []
    for _ in range(new):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        for token in set(out):
            logits[token] -= frequency_penalty * out.count(token) + presence_penalty
        for token, bias in (logit_bias or {}).items():
            logits[token] += bias
        token = int(logits.argmax())
        if token == tok.eos_token_id or token in stop_token_ids:
            break
        out.append(token)
        ids.append(token)
    return out


@torch.no_grad()
def hf_greedy_ids(model, prompt: list[int], new: int) -> list[int]:
    """transformers' own greedy generate() of exactly `new` tokens after prompt ids (EOS does not stop it)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=new,
        min_new_tokens=new,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


# ---------------------------------------------------------------------------- one forward pass


def random_tokens(n: int, seed: int, vocab: int = LLAMA_VOCAB) -> list[int]:
    """n seeded token ids in [3, vocab): no special ids of tiny_llama."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] HF logits of the full sequence, run alone."""
    return model(torch.tensor([ids])).logits[0].float()


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    diff = (a - b).abs().max().item()
    assert diff <= atol, f"max abs diff {diff:.3g} > {atol}"


def paged_cache(runner, blocks: int = 40, block_size: int = 4) -> KVCacheManager:
    """A KV cache of `blocks` blocks with the runner's pool."""
    budget = runner.spec.bytes_per_token * block_size * blocks
    return KVCacheManager(runner.spec, budget, block_size=block_size, allocate_kv=runner.allocate_kv)


def forward_rows(runner, mgr: KVCacheManager, rows: list[tuple[int, int, list[int]]], all_logits: bool = False) -> torch.Tensor:
    """rows: list of (seq_id, past_len, new_tokens). Runs one forward, returns logits."""
    batch = StepBatch.build(
        [new for _, _, new in rows],
        [past for _, past, _ in rows],
        [mgr.slots(sid, past + len(new)) for sid, past, new in rows],
        all_logits=all_logits,
    )
    return runner.forward(batch, pool=mgr.pool)


def stack_and_loop_logits(runner, widths: list[int], first_past: int, blocks: int) -> list[list[torch.Tensor]]:
    """[the Python loop's logits, the DecoderStack's]: each over the same three steps of rows
    `widths` wide after seeded prefills (row i has first_past + 7 i tokens), every position's
    logits of each step."""
    tr = runner.transformer
    stack = tr.decoder_stack
    logits = []
    try:
        for use in (False, True):
            tr.decoder_stack = stack if use else None
            mgr = paged_cache(runner, blocks=blocks)
            pasts = [first_past + 7 * i for i in range(len(widths))]
            for sid, past in enumerate(pasts):
                mgr.allocate(sid, past + 3 * widths[sid])
                forward_rows(runner, mgr, [(sid, 0, random_tokens(past, seed=sid))])  # prefill (over 8 wide: the Python loop)
            out = []
            for t in range(3):
                rows = [(sid, pasts[sid] + t * w, random_tokens(w, seed=100 * t + sid)) for sid, w in enumerate(widths)]
                out.append(forward_rows(runner, mgr, rows, all_logits=True))
            logits.append(out)
    finally:
        tr.decoder_stack = stack
    return logits


def block_table_rows(runner, mgr: KVCacheManager, rows: list[tuple[int, int, list[int]]]) -> torch.Tensor:
    """forward_rows with the rows' block tables (the engine's batches), not a slot table."""
    batch = StepBatch.from_block_table(
        [new for _, _, new in rows], [past for _, past, _ in rows], mgr.device_table.gather([sid for sid, _, _ in rows]),
        mgr.block_size,
    )
    return runner.forward(batch, pool=mgr.pool)


def decode_step_and_python_logits(runner, pasts: list[int], steps: int, blocks: int) -> tuple[list[torch.Tensor], list[int]]:
    """[the Python path's logits, Transformer.decode_step's] over the same decode steps after
    seeded prefills of `pasts` tokens: the first step row 0 alone, then every row together
    (rows of different lengths, crossing blocks); and how many decode steps each path sent
    through Transformer.forward (the Python path's only)."""
    tr = runner.transformer
    logits, through_forward = [], []
    for lean in (False, True):
        runner.lean_decode = lean
        calls = [0]
        forward = tr.forward

        def counted(*args, **kwargs):
            calls[0] += 1
            return forward(*args, **kwargs)

        mgr = paged_cache(runner, blocks=blocks)
        for sid, past in enumerate(pasts):
            mgr.allocate(sid, past + steps)
            block_table_rows(runner, mgr, [(sid, 0, random_tokens(past, seed=sid, vocab=runner.spec.vocab_size))])
        tr.forward = counted
        try:
            cur, out = list(pasts), []
            for t in range(steps):
                ids = [0] if t == 0 else list(range(len(pasts)))
                new = [random_tokens(1, seed=100 * t + sid, vocab=runner.spec.vocab_size) for sid in ids]
                out.append(block_table_rows(runner, mgr, [(sid, cur[sid], toks) for sid, toks in zip(ids, new)]))
                for sid in ids:
                    cur[sid] += 1
        finally:
            del tr.forward
            runner.lean_decode = True
        logits.append(out)
        through_forward.append(calls[0])
    return logits, through_forward


# ---------------------------------------------------------------------------- engines


def make_engine(kv_sequences: float = 8, max_context: int = 256, use_kv_cache: bool = True, **sched) -> Engine:
    """tiny-gpt2 on TorchRunner, a KV budget of `kv_sequences` full contexts; sched goes to SchedulerConfig."""
    model, tok = tiny()
    runner = TorchRunner(model)
    budget = int(kv_sequences * (max_context + 16) * runner.spec.bytes_per_token) + 16 * runner.spec.bytes_per_token
    cache = KVCacheManager(runner.spec, budget, block_size=16, allocate_kv=runner.allocate_kv)
    return Engine(runner, tok, cache, SchedulerConfig(**sched), max_context=max_context, use_kv_cache=use_kv_cache)


def make_prefix_caching_engine(prefix_caching: bool, kv_blocks: int = 120, block_size: int = 16, **sched) -> Engine:
    """tiny-gpt2 on TorchRunner with prefix caching on or off, a cache of kv_blocks blocks."""
    model, tok = tiny()
    runner = TorchRunner(model)
    cache = KVCacheManager(runner.spec, kv_blocks * block_size * runner.spec.bytes_per_token, block_size,
                           allocate_kv=runner.allocate_kv, prefix_caching=prefix_caching)
    return Engine(runner, tok, cache, SchedulerConfig(**sched), max_context=256)


def make_speculative_engine(drafter_kind: str, k: int = 4, **engine) -> Engine:
    """tiny-gpt2 with a drafter: "self" (the target drafting for itself: every guess right),
    "random" (tiny-gpt2-draft: nearly every guess wrong) or prompt lookup (any other kind)."""
    from tritonlm.engine.speculative import DraftModelDrafter, PromptLookupDrafter

    model, tok = tiny()
    runner = TorchRunner(model)
    cache = KVCacheManager(runner.spec, 8 * 272 * runner.spec.bytes_per_token, block_size=16, allocate_kv=runner.allocate_kv)
    if drafter_kind == "self":
        drafter = DraftModelDrafter(TorchRunner(model), cache)
    elif drafter_kind == "random":
        drafter = DraftModelDrafter(TorchRunner(tiny("tiny-gpt2-draft")[0]), cache)
    else:
        drafter = PromptLookupDrafter(3)
    return Engine(runner, tok, cache, SchedulerConfig(max_num_batched_tokens=16), max_context=256, drafter=drafter,
                  num_draft_tokens=k, **engine)


class Collector:
    """Submits requests to an engine and keeps every event it sends back, per request."""

    def __init__(self):
        self.events: dict[int, list[GenerationEvent]] = {}

    def request(self, engine: Engine, prompt: str, stream: bool = True, **params) -> int:
        req = GenerationRequest(engine.encode(prompt), SamplingParams(**params), self._on_event, stream=stream)
        self.events[req.request_id] = []  # before submit: a started engine may answer at once
        try:
            engine.submit(req)
        except BaseException:  # refused (e.g. server busy): no request to follow
            del self.events[req.request_id]
            raise
        return req.request_id

    def _on_event(self, ev: GenerationEvent) -> None:
        self.events[ev.request_id].append(ev)

    def ids(self, rid: int) -> list[int]:
        return [t for e in self.events[rid] for t in e.token_ids]

    def text(self, rid: int) -> str:
        return "".join(e.text for e in self.events[rid])

    def final(self, rid: int) -> GenerationEvent:
        assert self.events[rid] and self.events[rid][-1].finished
        return self.events[rid][-1]


def drain(engine: Engine, max_steps: int = 10_000) -> None:
    """Step the engine until it has nothing left to do."""
    for _ in range(max_steps):
        if not (engine.has_work() or engine._inbox):
            return
        engine.step()
    raise AssertionError("engine did not finish")


def assert_greedy_answers(engine: Engine, jobs: list[tuple[str, int]]) -> None:
    """Run each (prompt, max_tokens) through `engine` (tiny-gpt2) to its length: each answer
    is transformers' greedy one."""
    col = Collector()
    rids = [col.request(engine, prompt, max_tokens=n, end_id=-1) for prompt, n in jobs]
    drain(engine)
    for (prompt, n), rid in zip(jobs, rids):
        assert col.ids(rid) == hf_greedy_text(prompt, n, eos_token_id=None)[:n]


# the mixture-of-experts families served, each as a tiny seeded model
MOE_NAMES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss")


def tiny_moe(family: str, **overrides):
    """A tiny seeded MoE model of `family` (hidden 64, 4 query heads over 2 kv heads, 3 layers,
    8 experts) with its features on: Mixtral's sliding window and renormalized top-2, Qwen3-MoE's
    per-head q/k norm, norm_topk_prob and a dense layer (mlp_only_layers), OLMoE's whole-projection
    q/k norm without renormalizing, Qwen2-MoE's q/k/v biases, top-3, a shared expert with its
    sigmoid gate and MoE on every 2nd layer only (decoder_sparse_step), gpt-oss's attention sinks,
    alternating sliding and full layers, q/k/v/o, router and expert biases, YaRN RoPE and a
    SwiGLU clamp low enough to bite."""
    import transformers

    args = dict(vocab_size=LLAMA_VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
                eos_token_id=None, pad_token_id=0, initializer_range=0.2)
    extra = {
        "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=WINDOW),
        "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
                          norm_topk_prob=True, head_dim=32, mlp_only_layers=[1]),
        "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False),
        "qwen2_moe": dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, intermediate_size=128,
                          shared_expert_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=False),
        "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        swiglu_limit=0.6, rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                           "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                           "original_max_position_embeddings": 64}),
    }[family]
    args.update(extra)
    args.update(overrides)
    names = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe", "qwen2_moe": "Qwen2Moe", "gpt_oss": "GptOss"}
    config = getattr(transformers, f"{names[family]}Config")(**args)
    torch.manual_seed(77)
    model = getattr(transformers, f"{names[family]}ForCausalLM")(config).eval()
    with torch.no_grad():  # transformers initializes biases to zero and norms to one: make them matter
        for layer in model.model.layers:
            if family == "qwen2_moe":
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
            if family in ("qwen3_moe", "olmoe"):
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
            if family == "gpt_oss":
                at, ex = layer.self_attn, layer.mlp.experts
                for bias in (at.q_proj.bias, at.k_proj.bias, at.v_proj.bias, at.o_proj.bias, layer.mlp.router.bias,
                             ex.gate_up_proj_bias, ex.down_proj_bias):
                    bias.normal_(0, 0.2)
    return model


def triton_decode_runner(model, monkeypatch) -> TorchRunner:
    """A runner on the GPU's decode path run on the CPU: the Triton paged-decode kernel under
    Triton's interpreter (the C++ kernels off, block tables kept where the pool is)."""
    import pytest

    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runner = TorchRunner(model, max_batch=8, max_context=128)
    runner.transformer.cpp_ops, runner.transformer.decoder_stack = False, None
    on, why = runner.transformer.use_decode_kernel()
    assert on, why
    return runner
