"""Speculative decoding: a cheap drafter guesses K tokens, the target checks all K
in one forward pass.

Verification (one row, position by position, as the target alone would go):
    p_i = the target's next-token distribution after the accepted prefix
          (the request's own sampling settings applied: one-hot for greedy)
    q_i = the drafter's distribution the guess d_i was drawn from
          (one-hot for deterministic drafters such as prompt lookup)
    accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); on rejection emit a
    token drawn from normalize(max(p_i - q_i, 0)) and stop; when all K pass, emit
    one more token drawn from p_K.
The emitted tokens have exactly the target's distribution (Leviathan et al. 2023;
Chen et al. 2023); for greedy requests this reduces to "accept while the guess
equals the target's argmax", so the text is identical to the target's alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.sampler import RowState, next_token_distribution, process_logits
from tritonlm.engine.sequence import Sequence


@dataclass
class Proposal:
    tokens: list[int]  # K guesses
    dists: list[torch.Tensor | None] = field(default_factory=list)  # q_i [V] per guess; None: one-hot


class Drafter(Protocol):
    def on_admit(self, seq: Sequence) -> None: ...
    def on_free(self, seq_id: int) -> None: ...
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]: ...
    def on_verified(self, seq: Sequence, len_before: int, accepted: int) -> None: ...


# ---- verification ------------------------------------------------------------------

def verify_row(
    logits: torch.Tensor,
    proposal: Proposal,
    row: RowState,
    emit: Callable[[int, float], bool],
) -> int:
    """logits [K+1, V]: the target's logits after the pending token and after each guess.
    emit(token, logprob) appends a token to the sequence (updating `row`) and returns
    False when the sequence finished. Returns the number of guesses accepted."""
    accepted = 0
    for i, guess in enumerate(proposal.tokens):
        p = next_token_distribution(logits[i], row)
        q = proposal.dists[i] if i < len(proposal.dists) else None
        q_guess = 1.0 if q is None else float(q[guess])
        p_guess = float(p[guess])
        if p_guess >= q_guess or (p_guess > 0 and _uniform(row) < p_guess / q_guess):
            accepted += 1
            if not emit(guess, _logprob(logits[i], row, guess)):
                return accepted
            continue
        residual = p.clone()
        if q is None:
            residual[guess] = 0.0
        else:
            residual = torch.clamp(p - q, min=0.0)
        token = _draw(residual, row)
        emit(token, _logprob(logits[i], row, token))
        return accepted
    p = next_token_distribution(logits[len(proposal.tokens)], row)
    token = _draw(p, row)
    emit(token, _logprob(logits[len(proposal.tokens)], row, token))
    return accepted


def _uniform(row: RowState) -> float:
    return float(torch.rand((), generator=row.generator)) if row.generator is not None else 1.0


def _draw(weights: torch.Tensor, row: RowState) -> int:
    total = float(weights.sum())
    if total <= 0:  # p == q exactly: nothing left to correct with; any p-token is fine
        raise AssertionError("empty residual distribution")
    if row.params.greedy or row.generator is None:
        return int(torch.argmax(weights))
    return int(torch.multinomial(weights / total, 1, generator=row.generator))


def _logprob(logits: torch.Tensor, row: RowState, token: int) -> float:
    if not row.params.return_log_probs:
        return 0.0
    return float(torch.log_softmax(process_logits(logits, row), dim=-1)[token])


# ---- drafters ----------------------------------------------------------------------

class PromptLookupDrafter:
    """Guess that the text repeats itself: find the latest earlier occurrence of the last
    n tokens (n = ngram .. 1) in prompt + output and propose what followed it."""

    def __init__(self, ngram: int = 3):
        self.ngram = ngram

    def on_admit(self, seq: Sequence) -> None:
        pass

    def on_free(self, seq_id: int) -> None:
        pass

    def on_verified(self, seq: Sequence, len_before: int, accepted: int) -> None:
        pass

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(lookup(seq.all_ids, k, self.ngram)) for seq, k in zip(seqs, ks)]


def lookup(ids: list[int], k: int, max_ngram: int) -> list[int]:
    n_ids = len(ids)
    for n in range(min(max_ngram, n_ids - 1), 0, -1):
        tail = ids[-n:]
        for start in range(n_ids - n - 1, -1, -1):  # latest earlier occurrence first
            if ids[start : start + n] == tail:
                follow = ids[start + n : start + n + k]
                if follow:
                    return follow
    return []


class DraftModelDrafter:
    """A small model with the target's vocabulary, with its own paged KV cache kept in
    step with the target's (same sequence ids, same block count)."""

    def __init__(self, runner, target_cache: KVCacheManager):
        self.runner = runner
        bytes_budget = (target_cache.num_blocks) * target_cache.block_size * runner.spec.bytes_per_token
        self.cache = KVCacheManager(runner.spec, bytes_budget, target_cache.block_size, device=runner.device)
        self.computed: dict[int, int] = {}  # seq id -> tokens in the draft cache

    def on_admit(self, seq: Sequence) -> None:
        self.cache.allocate(seq.id, seq.reserve_tokens)
        self.computed[seq.id] = 0

    def on_free(self, seq_id: int) -> None:
        self.cache.free(seq_id)
        self.computed.pop(seq_id, None)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        rows = [RowState(s.sampler_row.params, list(s.sampler_row.token_ids), s.sampler_row.num_generated,
                         s.sampler_row.eos_id, s.sampler_row.generator) for s in seqs]
        # round 0 catches the draft up on everything it has not seen (the prompt at first)
        feeds = [seq.all_ids[self.computed[seq.id]:] for seq in seqs]
        active = list(range(len(seqs)))
        for step in range(max(ks)):
            active = [i for i in active if ks[i] > step]
            if not active:
                break
            logits = self._run([seqs[i] for i in active], [feeds[i] for i in active])
            for row_index, i in enumerate(active):
                q = next_token_distribution(logits[row_index], rows[i])
                guess = _draw(q, rows[i])
                proposals[i].tokens.append(guess)
                proposals[i].dists.append(None if rows[i].params.greedy else q)
                rows[i].token_ids.append(guess)
                rows[i].num_generated += 1
                feeds[i] = [guess]
        return proposals

    def _run(self, seqs: list[Sequence], feeds: list[list[int]]) -> torch.Tensor:
        past = [self.computed[s.id] for s in seqs]
        slots = [self.cache.slots(s.id, p + len(f)) for s, p, f in zip(seqs, past, feeds)]
        logits = self.runner.forward(StepBatch.build(feeds, past, slots), self.cache.pool)
        for s, f in zip(seqs, feeds):
            self.cache.advance(s.id, len(f))
            self.computed[s.id] += len(f)
        return logits

    def on_verified(self, seq: Sequence, len_before: int, accepted: int) -> None:
        """The draft saw positions < len_before + K - 1; keep what the target accepted."""
        if seq.id not in self.computed:
            return
        keep = min(self.computed[seq.id], len_before + accepted)
        self.cache.truncate(seq.id, keep)
        self.computed[seq.id] = keep


class AdaptiveK:
    """K per sequence from its recent acceptance: longer drafts while the drafter is right,
    shorter when it is wrong (never below 1 while speculation is on)."""

    @staticmethod
    def update(k: int, proposed: int, accepted: int, k_max: int) -> int:
        if proposed == 0:
            return k
        if accepted == proposed:
            return min(k + 1, k_max)
        if accepted == 0:
            return max(k // 2, 1)
        return max(min(accepted + 1, k_max), 1)
