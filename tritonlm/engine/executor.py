"""One step's model work: the forward pass(es) for a scheduled plan, then a next token
for every sequence whose pending tokens are all in the cache (sampled, or verified
against a speculative draft).

Kinds of rows in one step:
    decode        1 pending token -> logits of the last position
    prefill       a chunk of the prompt; a token only after the prompt's last chunk
    speculating   1 pending token + K guesses -> logits of all K+1 positions, verified
Speculating rows and decodes share one pass (all logits when anyone speculates). Prefill
chunks run in passes of their own, so decoding rows keep the decode-width kernels and no
prompt-long logits are made, except for a prompt whose log-probabilities are asked
(prompt_log_probs): its chunks run in passes that keep every position's logits; chunks share a pass while padding them to one width
costs little (`group_prefill`): 32 prompts arriving together take one pass, not 32.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tritonlm.engine.guided import GuideViolation
from tritonlm.engine.scheduler import ScheduledBatch, Scheduler
from tritonlm.engine.sampler import (
    NO_FINITE_LOGIT, decided_on_device, draw_rows, greedy_tokens, plain_greedy, sample_row, sample_rows, to_device,
    token_log_probs,
)
from tritonlm.engine.sequence import Sequence
from tritonlm.engine.speculative import AdaptiveK, Drafter, Proposal, verify_row

log = logging.getLogger(__name__)


@dataclass
class RowOutput:
    """What one sequence got from a step."""

    seq: Sequence
    tokens: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob) to append, in order
    proposed: int = 0  # speculative guesses checked this step
    accepted: int = 0  # of which the target accepted
    error: str | None = None  # this row failed (the others carry on)
    # with top_log_probs N: each token's N most likely (token id, log-probability); None: not asked
    top_log_probs: list[list[tuple[int, float]]] | None = None
    # with return_log_probs: each token's rank by raw log-probability (1: the most likely); None: not ranked
    ranks: list[int | None] | None = None


@dataclass
class ForwardResult:
    plan: ScheduledBatch
    rows: list[tuple[Sequence, list[int]]]  # (seq, tokens fed), in pass order
    proposals: dict[int, Proposal]  # seq id -> its draft
    len_before: dict[int, int]  # seq id -> its tokens (cached + the pending one) before the pass
    seconds: float
    # (index of its first row in `rows`, logits [B, V], or [B, T, V] where it kept every
    # position's) of each pass. A row's own logits are taken from its pass when asked
    # (logits()): a view per row made for every row of every step would cost more than
    # the greedy argmax that most rows need (docs/performance-notes.md)
    passes: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def picked_logits(self, picked: list[int]) -> list[tuple[list[int], torch.Tensor]]:
        """The logits of rows `picked` (ascending row indices), a part per pass that holds
        some: (those rows, their logits [n, V], or [n, T, V] from a pass that kept every
        position), in row order. One index per pass, not a view per row."""
        parts, at = [], 0
        for first, logits in self.passes:  # rows first .. first + B - 1
            rows = []
            while at < len(picked) and picked[at] < first + len(logits):
                rows.append(picked[at])
                at += 1
            if rows:
                index = [i - first for i in rows]
                chosen = logits if len(rows) == len(logits) else logits[to_device(index, torch.int64, logits.device)]
                parts.append((rows, chosen))
        return parts

    def logits(self, i: int) -> torch.Tensor:
        """Row i's logits: [V], or [T, V] from a pass that kept every position's."""
        for first, logits in reversed(self.passes):
            if i >= first:
                return logits[i - first]
        raise IndexError(f"row {i} is in no pass")


@dataclass
class StepOutput:
    rows: list[RowOutput]
    batch_size: int
    num_tokens: int  # tokens through the target model
    seconds: float


# the history entry of a token sampled on the device and not yet seen on the host (AheadTokens)
PENDING_TOKEN = -1


@dataclass
class AheadTokens:
    """A step's next tokens, chosen on the device and not yet waited for (Engine's
    schedule_ahead): each row that got one holds PENDING_TOKEN at the end of its history
    meanwhile, so the next step is scheduled and its forward pass launched, the rows feeding
    these tokens on the device (ModelExecutor.forward), before the host reads them (result)."""

    seqs: list[Sequence]  # the rows that got a token, in order
    slot: dict[int, int]  # seq id -> its index in tokens
    tokens: torch.Tensor  # [n] int64 on the logits' device
    batch_size: int
    num_tokens: int
    seconds: float
    host: torch.Tensor  # [2, n] int64 on the host: the tokens and which rows had no finite logit
    copied: torch.cuda.Event | None = None  # recorded after the copy into `host` (a GPU's)

    def result(self) -> StepOutput:
        """Wait for the tokens (a GPU's copy only; the forward pass launched after them runs on)."""
        if self.copied is not None:
            self.copied.synchronize()
        tokens, failed = self.host.tolist()
        rows = [RowOutput(seq, error=f"internal error while sampling: {NO_FINITE_LOGIT}") if bad else
                RowOutput(seq, [(token, 0.0)]) for seq, token, bad in zip(self.seqs, tokens, failed)]
        return StepOutput(rows, self.batch_size, self.num_tokens, self.seconds)


# a prompt token run as a one-token row reads its sequence's keys alone (the paged kernel
# shares a key's load only among one row's tokens): a chunk joins the decoding rows' pass
# while its tokens read at most this many keys each on average, so a chunk far into a long
# prompt (or after a long cached prefix) reads its keys once in a pass of its own
JOINED_KEYS_PER_TOKEN = 512
PREFILL_PADDING = 0.25  # padded attention a shared prefill pass may add, as a share of the useful attention
ATTENTION_SLACK = 256  # and padded (query, key) pairs per useful token on top


def group_prefill(chunks: list[tuple[Sequence, list[int]]]) -> list[list[tuple[Sequence, list[int]]]]:
    """Prefill chunks packed into passes, shortest first.

    Every pass reads all the weights once, so fewer passes are
    better; what sharing costs is padding. The runner drops padded positions before every
    projection and MLP (ForwardBatch.packed), so padding costs only attention: rows x widest
    chunk queries over the longest row's keys. A chunk joins the current pass while that
    stays within PREFILL_PADDING of the useful (query, key) pairs plus ATTENTION_SLACK pairs
    per token: one token's projections cost as much as attention over thousands of keys
    (SmolLM2-135M: ~3,000; GPT-2: ~4,600), so the slack is a few percent of the pass.
    32 short prompts share one pass; a 1-token chunk does not join a 2,000-token one."""
    groups: list[list[tuple[Sequence, list[int]]]] = []
    tokens = useful = width = keys = 0
    for chunk in sorted(chunks, key=lambda c: len(c[1])):
        seq, toks = chunk
        total = seq.num_computed + len(toks)  # keys of this row: cached + new
        w, k = max(width, len(toks)), max(keys, total)
        rows = len(groups[-1]) + 1 if groups else 1
        grown_useful, grown_tokens = useful + len(toks) * total, tokens + len(toks)
        if groups and rows * w * k <= grown_useful * (1 + PREFILL_PADDING) + ATTENTION_SLACK * grown_tokens:
            groups[-1].append(chunk)
            tokens, useful, width, keys = grown_tokens, grown_useful, w, k
        else:
            groups.append([chunk])
            tokens, useful, width, keys = len(toks), len(toks) * total, len(toks), total
    return groups


class ModelExecutor:
    def __init__(self, runner, scheduler: Scheduler, drafter: Drafter | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self.drafter = drafter
        self.pool = scheduler.cache.pool
        self._ahead: AheadTokens | None = None  # the tokens the pass being built may feed (forward's)
        # speculation_governor.SpeculationGovernor (Engine's adaptive_speculation): whether
        # this host decodes faster speculating; None: speculation as configured
        self.governor = None
        self.speculating = True  # the governor's word for the last step's switchable rows
        # prompt tokens a step may run as one-token rows in its decoding rows' pass (the
        # runner's word: where its decode-width kernels make that cheaper than a pass of their
        # own); 0: chunks beside decodes always run apart
        self.chunk_rows = getattr(runner, "chunk_rows", 0)
        self.chunk_keys = self.chunk_rows * JOINED_KEYS_PER_TOKEN  # (prompt token, key) pairs: the same rule

    # ---- forward ------------------------------------------------------------------------
    def forward(self, plan: ScheduledBatch, ahead: AheadTokens | None = None) -> ForwardResult:
        """The plan's passes; rows whose last token is still on the device (`ahead`, not
        yet resolved) feed it from there."""
        t0 = time.perf_counter()
        self._ahead = ahead
        ks = self._speculation(plan)
        proposals: dict[int, Proposal] = {}
        if ks:
            seqs = [seq for seq, _ in plan if seq.id in ks]
            proposals = dict(zip(ks, self.drafter.propose(seqs, [ks[s.id] for s in seqs])))
        # the rows by kind, in plan order, in one walk (it runs for every row of every step)
        verify: list[tuple[Sequence, list[int]]] = []  # pending token + guesses
        plain: list[tuple[Sequence, list[int]]] = []  # the rest but scored prompts: decodes and chunks
        scored: list[tuple[Sequence, list[int]]] = []  # prompts whose every position's logits are kept
        for seq, n in plan:
            done = seq.num_computed
            if proposals and seq.id in proposals:
                verify.append((seq, seq.token_ids[done:] + proposals[seq.id].tokens))
            elif seq.scores_prompt:
                scored.append((seq, seq.token_ids[done : done + n]))
            else:
                plain.append((seq, seq.token_ids[done : done + n]))
        len_before = {seq.id: seq.num_tokens for seq, _ in verify}  # pending token included
        result = ForwardResult(plan, [], proposals, len_before, 0.0)
        if self.scheduler.recompute:  # benchmark baseline: every row its whole history, one pass
            self._run(result, plain, all_logits=False)
            self._run(result, scored, all_logits=True)
        else:
            decode = [row for row in plain if not row[0].in_prefill]
            chunks = [row for row in plain if row[0].in_prefill]
            if decode and chunks and not verify and self._joins(chunks):
                self._run_beside_decodes(result, decode, chunks)
            else:
                self._run(result, verify + decode, all_logits=bool(verify))
                # prefill chunks apart from the decodes: a chunk's width would take the decoding
                # rows off the decode-width kernels (paged attention in place, the one-call
                # decoder stack)
                for group in group_prefill(chunks) if chunks else ():
                    self._run(result, group, all_logits=False)
            for group in group_prefill(scored):
                self._run(result, group, all_logits=True)
        result.seconds = time.perf_counter() - t0
        return result

    def _run(self, result: ForwardResult, rows: list[tuple[Sequence, list[int]]], all_logits: bool) -> None:
        """One pass over rows, its rows appended to result (and its logits to result.passes)."""
        if not rows:
            return
        result.passes.append((len(result.rows), self._pass(rows, all_logits)))
        result.rows += rows

    def _joins(self, chunks: list[tuple[Sequence, list[int]]]) -> bool:
        """Whether the chunks run in the decoding rows' pass: at most chunk_rows prompt
        tokens, reading at most chunk_keys (token, key) pairs."""
        tokens = sum(len(t) for _, t in chunks)
        if tokens > self.chunk_rows:
            return False
        return sum(len(t) * (seq.num_computed + len(t)) for seq, t in chunks) <= self.chunk_keys

    def _run_beside_decodes(self, result: ForwardResult, decode: list[tuple[Sequence, list[int]]],
                            chunks: list[tuple[Sequence, list[int]]]) -> None:
        """The decoding rows and the prefill chunks in one decode-width pass: each prompt
        token a one-token row of its own, at its position, over its sequence's slots. A pass
        writes every new key and value before any row reads them (the paged kernels', and the
        gathered path's), so a token sees the chunk's earlier tokens as in a chunk's pass. One
        pass reads the weights once, where a chunk's pass of its own reads them again: on a
        CPU that second read costs about as much as the decode step. The rows' logits are
        kept for each decoding row and each chunk's last token only."""
        rows, past, kept = [], [], []
        for seq, toks in decode:
            kept.append(len(rows))
            rows.append((seq, toks))
            past.append(seq.num_computed)
        for seq, toks in chunks:
            rows += [(seq, [token]) for token in toks]
            past += range(seq.num_computed, seq.num_computed + len(toks))
            kept.append(len(rows) - 1)
        logits = self._pass(rows, False, past)  # [len(rows), V]
        result.passes.append((len(result.rows), logits[to_device(kept, torch.int64, logits.device)]))
        result.rows += decode + chunks

    def _speculation(self, plan: ScheduledBatch) -> dict[int, int]:
        """seq id -> K for the decoding sequences that speculate this step: with a governor
        that finds plain decoding faster here, only the seeded sampled ones (whose tokens
        depend on it, speculation_governor.py)."""
        if self.drafter is None:
            return {}
        self.speculating = self.governor is None or self.governor.speculate(len(plan))
        out = {}
        for seq, _ in plan:
            if seq.in_prefill or seq.spec_k <= 0 or seq.num_pending != 1:
                continue
            if not self.speculating and (seq.sampling.params.greedy or seq.request.params.seed is None):
                continue
            room = min(
                seq.request.params.max_tokens - seq.num_output_tokens - 1,  # no guesses past max_tokens
                seq.reserve_tokens - seq.num_computed - 1,  # the verify pass writes K+1 slots
            )
            k = min(seq.spec_k, room)
            if k > 0:
                out[seq.id] = k
        return out

    def _pass(self, rows: list[tuple[Sequence, list[int]]], all_logits: bool,
              past: list[int] | None = None) -> torch.Tensor:
        """One forward pass -> logits [B, V], or [B, T, V] with all_logits (row i is rows[i]);
        past: each row's cached positions before it (None: its sequence's num_computed), for
        rows of one sequence side by side; each row moves its sequence on by its tokens."""
        past = [seq.num_computed for seq, _ in rows] if past is None else past
        batch = self.scheduler.batch(rows, past, all_logits)
        if self._ahead is not None:
            self._feed(batch, rows, self._ahead)
        logits = self.runner.forward(batch, self.pool)
        for seq, toks in rows:
            self.scheduler.advance(seq, len(toks))
        return logits

    @staticmethod
    def _feed(batch, rows: list[tuple[Sequence, list[int]]], ahead: AheadTokens) -> None:
        """The rows whose pending token is ahead's feed it in column 0 (their only new token):
        written into input_ids here on the host's own device, by the runner on a GPU."""
        fed = [(b, ahead.slot[seq.id]) for b, (seq, _) in enumerate(rows) if seq.id in ahead.slot]
        if not fed:
            return
        if batch.width != 1:
            raise AssertionError("a token still on the device can only feed a one-token row")
        at, src = (list(x) for x in zip(*fed))
        device = ahead.tokens.device
        if device.type == "cpu":
            batch.input_ids[at, 0] = ahead.tokens[src]
        else:
            batch.fed = (to_device(at, torch.int64, device), ahead.tokens[to_device(src, torch.int64, device)])

    # ---- next tokens ----------------------------------------------------------------------
    def sample_ahead(self, fwd: ForwardResult) -> AheadTokens | None:
        """The next tokens chosen on the device without waiting for them, where every row
        that gets one can be (sampler.decided_on_device; no speculation, no logits kept for
        every position); None: sample() decides this step. The copy of the tokens to the host
        is queued behind them, so the host waits for them, and only them, in result()."""
        if fwd.proposals or self.scheduler.recompute or any(logits.dim() != 2 for _, logits in fwd.passes):
            return None
        rows = fwd.rows
        ready = [i for i, (seq, _) in enumerate(rows) if seq.num_computed >= len(seq.token_ids)]
        if not ready or not all(decided_on_device(rows[i][0].sampling) for i in ready):
            return None
        parts = [logits for _, logits in fwd.picked_logits(ready)]
        stacked = parts[0] if len(parts) == 1 else torch.cat(parts)  # [n, V]
        seqs = [rows[i][0] for i in ready]
        tokens, _, no_finite = draw_rows(stacked, [seq.sampling for seq in seqs])
        both = torch.stack([tokens, no_finite.to(torch.int64)])  # [2, n]
        copied = None
        if both.device.type == "cuda":
            host = torch.empty(both.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(both, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(both.device))  # the tensors' device, not the current one
        else:
            host = both
        return AheadTokens(seqs, {seq.id: i for i, seq in enumerate(seqs)}, tokens, len(fwd.plan),
                           sum(len(fed) for _, fed in rows), fwd.seconds, host, copied)

    def sample(self, fwd: ForwardResult) -> StepOutput:
        """A RowOutput for every row that has a next token; a row whose sampling fails gets
        an error and leaves the others alone."""
        failed_prompts = self._score_prompts(fwd)
        # a row whose prompt scoring failed fails now, mid-prefill too (its list would be out of step)
        outputs = [RowOutput(seq, error=failed_prompts[seq.id]) for seq, _ in fwd.rows if seq.id in failed_prompts]
        # a prefill chunk that is not the prompt's last has no token yet
        ready = [i for i, (seq, _) in enumerate(fwd.rows)
                 if seq.num_computed >= len(seq.token_ids) and seq.id not in failed_prompts]
        try:
            greedy = self._greedy(fwd, ready)
        except Exception:  # noqa: BLE001 - every row then samples alone, each with its own error
            log.exception("batched greedy sampling failed; sampling row by row")
            greedy = {}

        def last(i: int) -> torch.Tensor:  # row i's logits at its last fed position: [V]
            logits = fwd.logits(i)
            return logits if logits.dim() == 1 else logits[len(fwd.rows[i][1]) - 1]

        # the other rows with a token to draw (not verifying): one sample_rows call, one wait
        # for the device; if it fails each samples alone (the same tokens, the draws being
        # per row), so only a faulty row fails
        proposals = fwd.proposals
        picked = [i for i in ready if i not in greedy and fwd.rows[i][0].id not in proposals]
        drawn: dict[int, tuple[int, float]] = {}
        if picked:
            try:
                stacked = torch.stack([last(i) for i in picked])  # [n, V]
                drawn = dict(zip(picked, sample_rows(stacked, [fwd.rows[i][0].sampling for i in picked])))
            except Exception:  # noqa: BLE001 - the rows sample alone, each with its own error
                log.warning("batched sampling failed; sampling row by row", exc_info=True)
        if len(greedy) == len(ready):  # every row plain greedy: nothing below can fail or ask more
            outputs += [RowOutput(fwd.rows[i][0], [(greedy[i], 0.0)]) for i in ready]
            return StepOutput(outputs, len(fwd.plan), sum(len(fed) for _, fed in fwd.rows), fwd.seconds)
        alternatives: list[tuple[RowOutput, int]] = []  # rows that asked for top log-probabilities
        for i in ready:
            seq = fwd.rows[i][0]
            try:
                if seq.id in proposals:
                    outputs.append(self._verify(seq, proposals[seq.id], fwd.logits(i), fwd.len_before[seq.id]))
                elif i in greedy:
                    outputs.append(RowOutput(seq, [(greedy[i], 0.0)]))
                elif i in drawn:
                    outputs.append(RowOutput(seq, [drawn[i]]))
                else:
                    outputs.append(RowOutput(seq, [sample_row(last(i), seq.sampling)]))
            except GuideViolation as e:  # the model's answer, not a fault of the server
                log.warning("request %s: %s", seq.id, e)
                outputs.append(RowOutput(seq, error=str(e)))
                continue
            except Exception as e:  # noqa: BLE001 - one bad row must not fail its batch
                log.exception("sampling failed for request %s", seq.id)
                outputs.append(RowOutput(seq, error=f"internal error while sampling: {e}"))
                continue
            if seq.request.params.return_log_probs and seq.id not in fwd.proposals:
                alternatives.append((outputs[-1], i))
        if alternatives:  # the chosen token's log-probability and rank, the most likely tokens: one source
            try:
                stacked = torch.stack([last(i) for _, i in alternatives])  # [n, V]
                counts = [out.seq.request.params.top_log_probs for out, _ in alternatives]
                details = token_log_probs(stacked, [out.tokens[0][0] for out, _ in alternatives], counts)
                for (out, _), found in zip(alternatives, details):
                    out.tokens = [(out.tokens[0][0], found.chosen)]
                    if out.seq.request.params.top_log_probs:
                        out.top_log_probs = [found.top]
                    out.ranks = [found.rank]
            except Exception as e:  # noqa: BLE001 - those rows fail, the others carry on
                log.exception("top log-probabilities failed")
                for out, _ in alternatives:
                    out.tokens, out.error = [], f"internal error while computing top log-probabilities: {e}"
        return StepOutput(outputs, len(fwd.plan), sum(len(fed) for _, fed in fwd.rows), fwd.seconds)

    def _score_prompts(self, fwd: ForwardResult) -> dict[int, str]:
        """The prompt log-probabilities of this step's scored prefill chunks, appended to their
        sequences' lists: position j's logits give the log-probability of prompt token j + 1.
        Returns seq id -> error for the rows where that failed (they fail, the others carry on)."""
        failed: dict[int, str] = {}
        if all(logits.dim() == 2 for _, logits in fwd.passes):  # no pass kept every position's logits
            return failed
        for i, (seq, fed) in enumerate(fwd.rows):
            if not seq.scores_prompt:
                continue
            logits = fwd.logits(i)
            if logits.dim() != 2:
                continue
            try:
                start = seq.num_computed - len(fed)  # the position of fed[0]
                first = len(seq.prompt_log_probs)  # the next prompt token to score
                end = min(start + len(fed) + 1, seq.num_prompt_tokens)  # this chunk predicts tokens up to end - 1
                if end <= first:
                    continue
                logprobs = torch.log_softmax(logits[first - 1 - start : end - 1 - start].to(torch.float32), dim=-1)  # [m, V]
                targets = torch.tensor(seq.token_ids[first:end], device=logprobs.device)  # [m]
                seq.prompt_log_probs.extend(logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist())
                n = seq.request.params.prompt_log_probs
                if n:
                    values, ids = torch.topk(logprobs, n, dim=-1)  # [m, n]
                    seq.prompt_top_log_probs.extend(list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist()))
                else:
                    seq.prompt_top_log_probs.extend([] for _ in range(end - first))
            except Exception as e:  # noqa: BLE001 - one bad row must not fail its batch
                log.exception("prompt log-probabilities failed for request %s", seq.id)
                failed[seq.id] = f"internal error while computing the prompt's log-probabilities: {e}"
        return failed

    @staticmethod
    def _greedy(fwd: ForwardResult, ready: list[int]) -> dict[int, int]:
        """Row index -> next token for the `ready` rows on plain greedy, one argmax per pass:
        the torch calls on [V], made per row, would be a visible share of a batched step
        (docs/performance-notes.md). A row whose winner is not finite is left to sample_rows,
        which masks NaN and clips +inf as sample_row does alone."""
        out: dict[int, int] = {}
        rows = fwd.rows
        for picked, chosen in fwd.picked_logits([i for i in ready if plain_greedy(rows[i][0].sampling)]):
            if chosen.dim() == 2:  # a pass that kept every position is not plain
                out.update((i, t) for i, t in zip(picked, greedy_tokens(chosen)) if t is not None)
        return out

    def _verify(self, seq: Sequence, proposal: Proposal, logits: torch.Tensor, len_before: int) -> RowOutput:
        """Accept the longest agreeing run of guesses plus one target token; both caches
        keep the pending token and the accepted guesses (the rest is overwritten later)."""
        k = len(proposal.tokens)
        tokens, accepted = verify_row(logits[: k + 1], proposal, seq.sampling)
        keep = len_before + accepted
        self.scheduler.rollback(seq, keep)
        self.drafter.on_verified(seq, keep)
        seq.spec_k = AdaptiveK.update(seq.spec_k, k, accepted, seq.spec_k_max)
        return RowOutput(seq, tokens, proposed=k, accepted=accepted)
