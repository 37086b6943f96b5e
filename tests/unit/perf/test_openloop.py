"""tritonlm/perf/openloop.py: prompts have the length asked (exactly, counted by the tokenizer
itself, when one is given) and differ between requests; the sender is open loop: every
request goes out while none has been answered (a closed loop would wait forever here, which
the hang guard turns into a failure); a refusal's wording decides shed or error."""

from __future__ import annotations

import asyncio

import pytest
from tokenizers import Tokenizer

from tritonlm.perf.openloop import PromptMaker, RequestRecord, _is_overload, run_schedule
from tritonlm.perf.trace import ScheduledRequest
from tritonlm.perf.target import PerfError
from tritonlm.paths import REPO_ROOT

TOKENIZER = REPO_ROOT / "tritonlm" / "models" / "tiny_tokenizer" / "tokenizer.json"
HANG_GUARD_S = 600.0


@pytest.mark.parametrize("tokens", [1, 2, 7, 40, 200])
def test_prompts_have_exactly_the_tokens_asked_with_a_tokenizer(tokens):
    tok = Tokenizer.from_file(str(TOKENIZER))
    maker = PromptMaker(str(TOKENIZER), seed=1)
    for index in range(5):
        assert len(tok.encode(maker.make(index, tokens), add_special_tokens=False).ids) == tokens


def test_prompts_without_a_tokenizer_are_that_many_words_and_differ_per_request():
    maker = PromptMaker(None, seed=1)
    assert len(maker.make(0, 30).split()) == 30
    assert maker.make(0, 30) == PromptMaker(None, seed=1).make(0, 30)
    assert len({maker.make(i, 30).split()[0] + maker.make(i, 30).split()[1] for i in range(20)}) > 5
    assert maker.make(0, 30) != PromptMaker(None, seed=2).make(0, 30)


def test_a_tokenizer_that_does_not_load_is_named(tmp_path):
    with pytest.raises(PerfError, match=r"--tokenizer .*missing: cannot load it"):
        PromptMaker(str(tmp_path / "missing"), seed=0)


class HoldingTarget:
    """Answers nothing until every request of the schedule has been sent."""

    def __init__(self, total: int):
        self.total = total
        self.sent = 0
        self.all_sent = asyncio.Event()

    async def send(self, record: RequestRecord, prompt: str, clock) -> None:
        self.sent += 1
        if self.sent == self.total:
            self.all_sent.set()
        await self.all_sent.wait()
        record.chunk_s.append(clock())
        record.status, record.served_output_tokens, record.end_s = "ok", 1, clock()


def test_every_request_goes_out_without_waiting_for_answers():
    schedule = [ScheduledRequest(0.002 * i, 4, 1) for i in range(12)]
    target = HoldingTarget(len(schedule))

    async def run():
        return await asyncio.wait_for(run_schedule(target, schedule, PromptMaker(None, 0)), HANG_GUARD_S)

    records = asyncio.run(run())
    assert [r.status for r in records] == ["ok"] * 12
    assert all(r.sent_s >= r.scheduled_s for r in records)
    assert [r.sent_s for r in records] == sorted(r.sent_s for r in records)
    assert max(r.sent_s for r in records) <= min(r.end_s for r in records)  # all were out before any answer


@pytest.mark.parametrize("message, shed", [
    ("overloaded: predicted time to first token 2400 ms is past slo_ttft_ms=1000", True),
    ("Server busy: the queue is full", True),
    ("model 'x' is not found", False),
])
def test_a_refusal_for_load_is_shed_and_anything_else_an_error(message, shed):
    assert _is_overload(message) is shed
