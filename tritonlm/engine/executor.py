"""One step's model work: the forward pass(es) for a scheduled plan, then a next token
for every sequence whose pending tokens are all in the cache (sampled, or verified
against a speculative draft).

Kinds of rows in one step:
    decode        1 pending token -> logits of the last position
    prefill       a chunk of the prompt; a token only after the prompt's last chunk
    speculating   1 pending token + K guesses -> logits of all K+1 positions, verified
Speculating rows and decodes share one pass (all logits when anyone speculates). Prefill
chunks run in passes of their own, so no decoding row is padded to a chunk's width and no
prompt-long logits are ever made; chunks of similar width share a pass
(`group_by_width`): 32 prompts arriving together take a few passes, not 32.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from tritonlm.engine.scheduler import Plan, Scheduler
from tritonlm.engine.sampler import sample_row
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


@dataclass
class ForwardResult:
    plan: Plan
    rows: list[tuple[Sequence, list[int], torch.Tensor]]  # (seq, tokens fed, logits [V] or [T, V])
    proposals: dict[int, Proposal]  # seq id -> its draft
    len_before: dict[int, int]  # seq id -> its tokens (cached + the pending one) before the pass
    seconds: float


@dataclass
class StepOutput:
    rows: list[RowOutput]
    batch_size: int
    num_tokens: int  # tokens through the target model
    seconds: float


PREFILL_PADDING = 0.25  # padded positions a shared prefill pass may add, as a share of the useful ones


def group_by_width(chunks: list[tuple[Sequence, list[int]]]) -> list[list[tuple[Sequence, list[int]]]]:
    """Prefill chunks packed into passes: shortest first, a chunk joins the current pass
    while the padded batch (rows x widest chunk) stays within PREFILL_PADDING of the
    tokens it really holds. One pass per chunk wastes the per-pass cost (every layer's
    weights read again); one pass for all pads short prompts to the longest."""
    groups: list[list[tuple[Sequence, list[int]]]] = []
    useful = 0
    for chunk in sorted(chunks, key=lambda c: len(c[1])):
        width = len(chunk[1])  # the widest so far: sorted ascending
        if groups and (len(groups[-1]) + 1) * width <= (useful + width) * (1 + PREFILL_PADDING):
            groups[-1].append(chunk)
            useful += width
        else:
            groups.append([chunk])
            useful = width
    return groups


class ModelExecutor:
    def __init__(self, runner, scheduler: Scheduler, drafter: Drafter | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self.drafter = drafter
        self.pool = scheduler.cache.pool

    # ---- forward ------------------------------------------------------------------------
    def forward(self, plan: Plan) -> ForwardResult:
        t0 = time.perf_counter()
        ks = self._speculation(plan)
        proposals: dict[int, Proposal] = {}
        if ks:
            seqs = [seq for seq, _ in plan if seq.id in ks]
            proposals = dict(zip(ks, self.drafter.propose(seqs, [ks[s.id] for s in seqs])))
        verify = [(seq, seq.pending_tokens + proposals[seq.id].tokens) for seq, _ in plan if seq.id in proposals]
        plain = [(seq, seq.pending_tokens[:n]) for seq, n in plan if seq.id not in proposals]
        len_before = {seq.id: seq.num_tokens for seq, _ in verify}  # pending token included
        if self.scheduler.recompute:  # benchmark baseline: every row its whole history, one pass
            return ForwardResult(plan, self._pass(plain, all_logits=False), {}, {}, time.perf_counter() - t0)
        decode = [(seq, toks) for seq, toks in plain if not seq.in_prefill]
        rows = self._pass(verify + decode, all_logits=bool(verify))
        # prefill chunks apart from the decodes: in one padded batch, every decoding row would
        # be computed at a chunk's width (B x T positions for B + T useful ones)
        for group in group_by_width([(seq, toks) for seq, toks in plain if seq.in_prefill]):
            rows += self._pass(group, all_logits=False)
        return ForwardResult(plan, rows, proposals, len_before, time.perf_counter() - t0)

    def _speculation(self, plan: Plan) -> dict[int, int]:
        """seq id -> K for the decoding sequences that speculate this step."""
        if self.drafter is None:
            return {}
        out = {}
        for seq, _ in plan:
            if seq.in_prefill or seq.spec_k <= 0 or len(seq.pending_tokens) != 1:
                continue
            room = min(
                seq.request.params.max_tokens - seq.num_output_tokens - 1,  # no guesses past max_tokens
                seq.reserve_tokens - seq.num_computed - 1,  # the verify pass writes K+1 slots
            )
            k = min(seq.spec_k, room)
            if k > 0:
                out[seq.id] = k
        return out

    def _pass(self, rows: list[tuple[Sequence, list[int]]], all_logits: bool) -> list[tuple[Sequence, list[int], torch.Tensor]]:
        """One forward pass; (seq, tokens fed, logits [V], or [T, V] with all_logits) per row."""
        if not rows:
            return []
        batch = self.scheduler.batch(rows, [seq.num_computed for seq, _ in rows], all_logits)
        logits = self.runner.forward(batch, self.pool)
        for seq, toks in rows:
            self.scheduler.advance(seq, len(toks))
        return [(seq, toks, logits[i]) for i, (seq, toks) in enumerate(rows)]

    # ---- next tokens ----------------------------------------------------------------------
    def sample(self, fwd: ForwardResult) -> StepOutput:
        """A RowOutput for every row that has a next token; a row whose sampling fails gets
        an error and leaves the others alone."""
        outputs = []
        for seq, fed, logits in fwd.rows:
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk that is not the prompt's last: no token yet
            try:
                if seq.id in fwd.proposals:
                    outputs.append(self._verify(seq, fwd.proposals[seq.id], logits, fwd.len_before[seq.id]))
                else:
                    last = logits if logits.dim() == 1 else logits[len(fed) - 1]  # [V]
                    outputs.append(RowOutput(seq, [sample_row(last, seq.sampling)]))
            except Exception as e:  # noqa: BLE001 - one bad row must not fail its batch
                log.exception("sampling failed for request %s", seq.id)
                outputs.append(RowOutput(seq, error=f"internal error while sampling: {e}"))
        num_tokens = sum(len(fed) for _, fed, _ in fwd.rows)
        return StepOutput(outputs, len(fwd.plan), num_tokens, fwd.seconds)

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
