"""How often a runner's greedy choice equals transformers' float32 greedy choice.

Reference: transformers' own `generate()` (greedy, float32, the independent reference)
continues each prompt by `max_tokens`. The runner under test then reads each reference
sequence in one pass (teacher forcing) and predicts every continuation token; agreement
is the fraction of those predictions equal to the reference token. Teacher forcing
counts each disagreement once, where free-running text would differ from the first one
on; that fraction is reported too (tokens equal at the same position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVCacheManager


@dataclass(frozen=True)
class Agreement:
    agreed: int
    total: int

    @property
    def fraction(self) -> float:
        return self.agreed / self.total if self.total else 1.0


def reference_continuations(model, prompt_ids: list[list[int]], max_tokens: int, batch: int = 32) -> list[list[int]]:
    """transformers' float32 greedy continuation of each prompt, exactly max_tokens long.
    Prompts go `batch` at a time, left-padded with an attention mask (positions follow the
    mask, as transformers generates for a padded batch)."""
    out = []
    with torch.no_grad():
        for i in range(0, len(prompt_ids), batch):
            group = prompt_ids[i:i + batch]
            width = max(len(ids) for ids in group)
            input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids in group])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in group])
            seq = model.generate(
                input_ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, pad_token_id=0, eos_token_id=None,
            )
            out.extend(seq[:, width:].tolist())
    return out


def teacher_forced_agreement(
    runner, prompt_ids: list[list[int]], continuations: list[list[int]], batch: int = 8, chunk: int | None = None
) -> Agreement:
    """The runner's argmax after every reference prefix, against the reference's next token
    (`batch` sequences per forward pass). chunk: feed the sequences `chunk` tokens a pass,
    each pass reading the KV cache of the ones before, so that a projection sees at most
    batch x chunk rows, as in decoding (int8_weight_only's kernel takes another path for a
    prefill-sized batch); None: each whole sequence in one pass."""
    agreed = total = 0
    block = 16
    for i in range(0, len(prompt_ids), batch):
        rows = [ids + cont for ids, cont in zip(prompt_ids[i:i + batch], continuations[i:i + batch])]
        blocks = sum(len(r) // block + 2 for r in rows) + 1
        cache = KVCacheManager(runner.spec, blocks * block * runner.spec.bytes_per_token, block,
                               allocate_kv=runner.allocate_kv)
        for b, row in enumerate(rows):
            cache.allocate(b, len(row))
        fed = [r[:-1] for r in rows]
        step_len = chunk or max(len(f) for f in fed)
        row_logits: list[list[torch.Tensor]] = [[] for _ in rows]
        for start in range(0, max(len(f) for f in fed), step_len):
            live = [b for b, f in enumerate(fed) if start < len(f)]
            step = StepBatch.build([fed[b][start:start + step_len] for b in live], [start] * len(live),
                                   [cache.slots(b, len(fed[b])) for b in live], all_logits=True)
            logits = runner.forward(step, cache.pool)  # [len(live), T, V]
            for n, b in enumerate(live):
                row_logits[b].append(logits[n, :len(fed[b][start:start + step_len])])
        for b, (ids, cont) in enumerate(zip(prompt_ids[i:i + batch], continuations[i:i + batch])):
            logits = torch.cat(row_logits[b])  # [len(fed[b]), V]
            predicted = logits[len(ids) - 1:len(ids) - 1 + len(cont)].argmax(-1).tolist()  # the token after each prefix
            agreed += sum(p == c for p, c in zip(predicted, cont))
            total += len(cont)
    return Agreement(agreed, total)


def positional_agreement(generated: list[list[int]], continuations: list[list[int]]) -> Agreement:
    """Free-running outputs against the reference, position by position."""
    agreed = sum(a == b for g, c in zip(generated, continuations) for a, b in zip(g, c))
    return Agreement(agreed, sum(len(c) for c in continuations))


# the prompts bench_precision.py and int8_sensitivity.py measure agreement on: short
# instructions and openings of several kinds, so no single style decides the figure
SUBJECTS = ["a harbour town", "black holes", "the printing press", "a jazz trio", "desert plants",
            "a lost passport", "solar panels", "ancient Egypt"]
FORMS = ["Describe {} in a few sentences.", "What is interesting about {}?", "Write a diary entry about {}.",
         "Notes on {}:\n-"]


def smollm2_reference(n_prompts: int, tokens: int, log=print):
    """(SmolLM2-135M in float32, the first n_prompts of the prompts above as token ids,
    transformers' float32 greedy continuation of each, `tokens` long)."""
    import time

    from tritonlm.models.loading import load_model

    model, tok, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)
    prompts = [tok(f.format(s)).input_ids for s in SUBJECTS for f in FORMS][:n_prompts]
    t0 = time.perf_counter()
    reference = reference_continuations(model, prompts, tokens)
    log(f"reference: transformers float32 greedy, {len(prompts)} x {tokens} tokens ({time.perf_counter() - t0:.0f} s)")
    return model, prompts, reference
