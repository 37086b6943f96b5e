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
from typing import Protocol

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.draws import ACCEPT, DRAFT, RESIDUAL, SAMPLE, inverse_cdf
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.sampler import RowState, next_token_distribution, raw_log_probs
from tritonlm.engine.sequence import Sequence


@dataclass
class Proposal:
    tokens: list[int]  # K guesses
    dists: list[torch.Tensor | None] = field(default_factory=list)  # q_i [V] per guess; None: one-hot


class Drafter(Protocol):
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]: ...
    def on_verified(self, seq: Sequence, keep: int) -> None:
        """The target kept the first `keep` tokens of the sequence's cache."""


# ---- verification ------------------------------------------------------------------

def verify_row(logits: torch.Tensor, proposal: Proposal, row: RowState) -> tuple[list[tuple[int, float]], int]:
    """logits [K+1, V]: the target's logits after the pending token and after each guess.

    Returns ((token, logprob) to append, in order; guesses accepted). The distributions
    see the accepted guesses in the history (penalties, bad words, min_tokens), on a
    fork of `row`: the caller appends the tokens to the sequence itself."""
    row = row.fork()
    out: list[tuple[int, float]] = []
    for i, guess in enumerate(proposal.tokens):
        p = next_token_distribution(logits[i], row)
        q = proposal.dists[i] if i < len(proposal.dists) else None
        q_guess = 1.0 if q is None else float(q[guess])
        p_guess = float(p[guess])
        if p_guess >= q_guess or (p_guess > 0 and row.uniform(ACCEPT) < p_guess / q_guess):
            out.append((guess, _logprob(logits[i], row, guess)))
            if row.ends_on(guess):  # the sequence ends here: nothing after it counts
                return out, len(out)
            row.token_ids.append(guess)
            continue
        residual = p.clone()
        if q is None:
            residual[guess] = 0.0
        else:
            residual = torch.clamp(p - q, min=0.0)
        # its own stream: given a rejection the acceptance uniform is no longer uniform
        token = _draw(residual, row, RESIDUAL)
        out.append((token, _logprob(logits[i], row, token)))
        return out, i
    k = len(proposal.tokens)
    # a fresh draw from p_K, as plain sampling would make at this index
    token = _draw(next_token_distribution(logits[k], row), row, SAMPLE)
    out.append((token, _logprob(logits[k], row, token)))
    return out, k


def _draw(weights: torch.Tensor, row: RowState, stream: int) -> int:
    """[V] non-negative weights -> a token: the argmax for greedy rows, else an inverse-CDF
    draw with the row's uniform of `stream` for the index it decides (row.num_generated)."""
    total = float(weights.sum())
    if not total > 0:
        # cannot happen for a rejected guess (p(guess) < q(guess) leaves mass elsewhere in
        # p - q); an all-zero (or NaN) distribution means the logits were not finite
        raise ValueError("empty distribution to draw from (non-finite logits?)")
    if row.params.greedy:
        return int(torch.argmax(weights))
    u = torch.tensor([row.uniform(stream)], dtype=torch.float64)  # [1]
    return int(inverse_cdf(weights.unsqueeze(0), u)[0])


def _logprob(logits: torch.Tensor, row: RowState, token: int) -> float:
    """The token's raw log-probability (the sampler's one source), 0.0 unless asked for."""
    if not row.params.return_log_probs:
        return 0.0
    return float(raw_log_probs(logits)[token])


# ---- drafters ----------------------------------------------------------------------

class PromptLookupDrafter:
    """Guess that the text repeats itself: find the latest earlier occurrence of the last
    n tokens (n = ngram .. 1) in prompt + output and propose what followed it."""

    def __init__(self, ngram: int = 3):
        self.ngram = ngram

    def on_verified(self, seq: Sequence, keep: int) -> None:
        pass

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(lookup(seq.token_ids, k, self.ngram)) for seq, k in zip(seqs, ks)]


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
    """A small model with the target's vocabulary. Its KV pool has as many slots as the
    target's and is indexed by the SAME block tables (the scheduler's), so admission and
    release cover both models; the drafter only counts how far its own cache has got
    (`Sequence.draft_computed`)."""

    def __init__(self, runner, target_cache: KVCacheManager):
        self.runner = runner
        self.cache = target_cache  # read only: slot tables
        self.pool = runner.allocate_kv(target_cache.num_slots)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        rows = [seq.sampling.fork() for seq in seqs]
        # round 0 catches the draft up on everything it has not seen (the prompt at first)
        feeds = [seq.token_ids[seq.draft_computed :] for seq in seqs]
        active = list(range(len(seqs)))
        for step in range(max(ks)):
            active = [i for i in active if ks[i] > step]
            if not active:
                break
            logits = self._run([seqs[i] for i in active], [feeds[i] for i in active])  # [b, V]
            for row_index, i in enumerate(active):
                try:
                    q = next_token_distribution(logits[row_index], rows[i])
                except ValueError:  # e.g. an answer its guide refuses (guided.py): the verifier fails that row alone
                    ks[i] = step  # no more guesses for it
                    continue
                guess = _draw(q, rows[i], DRAFT)  # independent of the verifier's uniforms
                proposals[i].tokens.append(guess)
                proposals[i].dists.append(None if rows[i].params.greedy else q)
                rows[i].token_ids.append(guess)
                feeds[i] = [guess]
        return proposals

    def _run(self, seqs: list[Sequence], feeds: list[list[int]]) -> torch.Tensor:
        past = [s.draft_computed for s in seqs]
        ids = [s.id for s in seqs]
        table = self.cache.device_table
        if table is not None and self.pool is not None and table.device == self.pool.k[0].device:
            # the rows' block tables where the pool is: a GPU draft maps slots there and can
            # replay its steps as CUDA graphs (runners/decode_graphs.py)
            blocks = table.gather(ids)  # [B, M]
            batch = StepBatch.from_block_table(feeds, past, blocks, self.cache.block_size)
        else:
            slots = self.cache.slot_table(ids, [p + len(f) for p, f in zip(past, feeds)])
            batch = StepBatch.from_slot_table(feeds, past, slots)
        batch.prompt_lens = torch.tensor([s.rope_length for s in seqs], dtype=torch.int64)
        logits = self.runner.forward(batch, self.pool)
        for s, f in zip(seqs, feeds):
            s.draft_computed += len(f)
        return logits

    def on_verified(self, seq: Sequence, keep: int) -> None:
        """The draft saw positions < len_before + K - 1; keep what the target kept."""
        seq.draft_computed = min(seq.draft_computed, keep)


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
