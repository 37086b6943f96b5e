"""The latency SLOs' targets, and what each request got against them: vLLM's goodput
definitions, counted as requests finish, and the gaps between a request's tokens."""

from __future__ import annotations

import threading
from dataclasses import dataclass

# gaps kept until drained: the metrics thread drains them every 0.1 s; an engine that no
# one reads (in-process use) must not grow without bound
MAX_GAPS = 65536


@dataclass(frozen=True)
class SloTargets:
    ttft_s: float | None = None  # arrival -> first token
    tpot_s: float | None = None  # (last token - first token) / (tokens - 1)

    @property
    def active(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None

    @staticmethod
    def from_ms(ttft_ms: float, tpot_ms: float) -> "SloTargets":
        """The settings' form: 0 means not set."""
        return SloTargets(ttft_ms / 1000 if ttft_ms > 0 else None, tpot_ms / 1000 if tpot_ms > 0 else None)

    def met(self, ttft_s: float, tpot_s: float | None) -> bool:
        """vLLM's goodput test; a one-token answer has no TPOT and passes that half."""
        if self.ttft_s is not None and ttft_s > self.ttft_s:
            return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s


class LatencyLedger:
    """What requests got, recorded on the engine thread and read by the metrics thread:
    inter-token gaps (drained), and counters of requests that met or missed the SLOs and of
    requests shed (only ever growing, read like the prefix cache's)."""

    def __init__(self, targets: SloTargets):
        self.targets = targets
        self.met = 0
        self.missed = 0
        self.shed = 0
        self._lock = threading.Lock()  # the gap list: engine thread appends, metrics thread drains
        self._gaps: list[float] = []
        self._last_token: dict[int, float] = {}  # sequence id -> its last token time seen

    def step_done(self, seqs) -> None:
        """After a step: each sequence that got a token since the last look adds the gap."""
        gaps = []
        for seq in seqs:
            t = seq.last_token_time
            if t is None:
                continue
            before = self._last_token.get(seq.id)
            if before is not None and t > before:
                gaps.append(t - before)
            self._last_token[seq.id] = t
        if gaps:
            with self._lock:
                if len(self._gaps) < MAX_GAPS:
                    self._gaps.extend(gaps)

    def drain_gaps(self) -> list[float]:
        with self._lock:
            gaps, self._gaps = self._gaps, []
        return gaps

    def finished(self, seq, reason: str | None) -> None:
        """A request left; one that answered (stop / length) is judged against the SLOs.
        Its last gap is taken here: it leaves before the engine reports the step."""
        before = self._last_token.pop(seq.id, None)
        if before is not None and seq.last_token_time is not None and seq.last_token_time > before:
            with self._lock:
                if len(self._gaps) < MAX_GAPS:
                    self._gaps.append(seq.last_token_time - before)
        if reason not in ("stop", "length") or not self.targets.active or seq.first_token_time is None:
            return
        n = seq.num_output_tokens
        tpot = (seq.last_token_time - seq.first_token_time) / (n - 1) if n > 1 else None
        if self.targets.met(seq.first_token_time - seq.request.arrival, tpot):
            self.met += 1
        else:
            self.missed += 1
