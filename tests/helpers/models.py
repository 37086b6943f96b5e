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
FAMILY_NAMES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "granite", "smollm3", "olmo2")
WINDOW = 8  # sliding window of the tiny windowed models: prompts plus answers run past it


def tiny_family(family: str, **overrides):
    """A tiny seeded model of `family` from transformers' own config class (hidden 64, 4 query
    heads over 2 kv heads, 512 tokens, no EOS: greedy references run to their length), with
    each family's feature switched on: Qwen2's q/k/v biases, Qwen3's per-head q/k norm with
    an explicit head_dim, Mistral's and Phi-3's sliding window, Granite's multipliers,
    SmolLM3's NoPE layers (every 2nd of 4), OLMo 2's post-norm blocks and whole q/k norm."""
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
        "phi3": dict(sliding_window=WINDOW, tie_word_embeddings=False),
        "granite": dict(embedding_multiplier=6.0, attention_multiplier=0.1, residual_multiplier=0.4,
                        logits_scaling=4.0),
        "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=2),
        "olmo2": {},
    }[family]
    args.update(extra)
    args.update(overrides)
    names = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "phi3": "Phi3",
             "granite": "Granite", "smollm3": "SmolLM3", "olmo2": "Olmo2"}
    config = getattr(transformers, f"{names[family]}Config")(**args)
    torch.manual_seed(77)
    model = getattr(transformers, f"{names[family]}ForCausalLM")(config).eval()
    with torch.no_grad():  # transformers initializes biases to zero and norms to one: make them matter
        for layer in model.model.layers:
            if family == "qwen2":
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
            if family in ("qwen3", "olmo2"):
                for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                    norm.weight.uniform_(0.5, 1.5)
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


def make_speculative_engine(drafter_kind: str, k: int = 4) -> Engine:
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
    return Engine(runner, tok, cache, SchedulerConfig(max_num_batched_tokens=16), max_context=256, drafter=drafter, num_draft_tokens=k)


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
