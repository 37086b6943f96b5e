"""tritonlm/engine/output.py: what a step's tokens become for the client.

Driven directly (an OutputProcessor over a real Scheduler with an accounting-only cache,
tokens chosen by the test) and through the engine: finish reasons, token accounting,
stream events (one per step that made whole text, every N tokens with stream_interval,
one final event without streaming), checked against the tokenizer's own decode."""

from __future__ import annotations

import pytest

from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_engine, tiny
from tritonlm.engine.executor import RowOutput, StepOutput
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.model_shape import ModelShape
from tritonlm.engine.output import OutputProcessor
from tritonlm.engine.request import GenerationEvent, GenerationRequest, SamplingParams
from tritonlm.engine.scheduler import Scheduler, SchedulerConfig
from tritonlm.engine.sequence import Sequence, SeqState

LOGPROB = -0.25  # every fed token's log prob: the events must carry it through unchanged
TEXT = " naïve café 🙂 — 你好, done"  # multi-byte characters split across byte-level tokens


class Sent:
    """An OutputProcessor's deliveries, per request."""

    def __init__(self, out: OutputProcessor):
        self.events: list[GenerationEvent] = []
        out.deliver = lambda batch: self.events.extend(ev for _, ev in batch)

    def text(self) -> str:
        return "".join(e.text for e in self.events)

    def ids(self) -> list[int]:
        return [t for e in self.events for t in e.token_ids]


def processor(max_context: int = 256, stream_interval: int = 1, observer=None) -> tuple[OutputProcessor, Sent]:
    _, tok = tiny()
    spec = ModelShape("gpt2", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, vocab_size=len(tok),
                      max_positions=max_context)
    cache = KVCacheManager(spec, 64 * 16 * spec.bytes_per_token)  # accounting only: no tensors
    out = OutputProcessor(Scheduler(SchedulerConfig(), cache), max_context, observer, stream_interval)
    return out, Sent(out)


def sequence(prompt: str = "Once upon a time", stream: bool = True, spec_k_max: int = 0, **params) -> Sequence:
    """A sequence of the tiny tokenizer whose end token is its EOS."""
    _, tok = tiny()
    req = GenerationRequest(tok(prompt).input_ids, SamplingParams(**params), lambda ev: None, stream=stream)
    return Sequence.create(req, tok, tok.eos_token_id, spec_k_max)


def feed(out: OutputProcessor, seq: Sequence, tokens: list[int], **row) -> None:
    """One step that made `tokens` for seq (several: a speculative step)."""
    out.process(StepOutput([RowOutput(seq, [(t, LOGPROB) for t in tokens], **row)], 1, max(1, len(tokens)), 0.0))


def text_ids() -> list[int]:
    _, tok = tiny()
    ids = tok(TEXT).input_ids
    assert tok.eos_token_id not in ids
    return ids


# ---------------------------------------------------------------------------- driven directly


def test_a_stream_sends_each_steps_whole_text_and_a_length_finish_counts_every_token():
    """One token per step: an event for every step whose text ends on a whole character
    (decode of the tokens so far does not end in U+FFFD), the tokens of a step that ended
    inside a character riding with the next; the last token comes with the final event."""
    _, tok = tiny()
    ids = text_ids()
    seq = sequence(max_tokens=len(ids), return_log_probs=True)
    out, sent = processor()
    for t in ids:
        feed(out, seq, [t])
    whole = [k for k in range(1, len(ids)) if not tok.decode(ids[:k]).endswith("\ufffd")]
    assert len(whole) < len(ids) - 1  # some tokens end inside a character: the check has something to catch
    cuts = [0] + whole + [len(ids)]
    assert [e.token_ids for e in sent.events] == [ids[a:b] for a, b in zip(cuts, cuts[1:])]
    assert sent.text() == tok.decode(ids) and all("\ufffd" not in e.text for e in sent.events)
    assert [e.finished for e in sent.events] == [False] * (len(cuts) - 2) + [True]
    assert [lp for e in sent.events for lp in e.log_probs] == [LOGPROB] * len(ids)
    final = sent.events[-1]
    assert final.finish_reason == "length" and final.error is None
    assert (final.num_input_tokens, final.num_output_tokens) == (len(tok("Once upon a time").input_ids), len(ids))
    assert seq.state is SeqState.FINISHED and out.stats.finished == {"length": 1}
    assert out.stats.tokens_generated == len(ids) and out.stats.steps == len(ids)


def test_without_streaming_one_final_event_carries_everything():
    _, tok = tiny()
    ids = text_ids()
    seq = sequence(stream=False, max_tokens=len(ids))
    out, sent = processor()
    for t in ids[:5]:
        feed(out, seq, [t])
    assert sent.events == []  # nothing before the end
    feed(out, seq, ids[5:])  # the rest in one (speculative) step
    assert len(sent.events) == 1 and sent.events[0].finished
    assert sent.ids() == ids and sent.text() == tok.decode(ids)
    assert sent.events[0].log_probs == []  # not asked for


def test_eos_finishes_with_stop_and_is_neither_counted_nor_sent_nor_what_follows_it():
    _, tok = tiny()
    ids = text_ids()
    seq = sequence(max_tokens=50)
    prompt = list(seq.token_ids)
    out, sent = processor()
    feed(out, seq, ids[:3])
    feed(out, seq, [ids[3], tok.eos_token_id, ids[4]])  # a speculative step whose 2nd token is EOS
    assert seq.token_ids == prompt + ids[:4]
    assert sent.ids() == ids[:4] and sent.text() == tok.decode(ids[:4])
    final = sent.events[-1]
    assert final.finished and final.finish_reason == "stop" and final.num_output_tokens == 4
    assert out.stats.tokens_generated == 4


def test_max_context_finishes_with_length_before_max_tokens():
    ids = text_ids()
    seq = sequence(max_tokens=50)
    room = 3
    out, sent = processor(max_context=seq.num_prompt_tokens + room)
    feed(out, seq, ids[:2])
    feed(out, seq, ids[2:6])  # only one of these fits
    final = sent.events[-1]
    assert final.finish_reason == "length" and final.num_output_tokens == room
    assert sent.ids() == ids[:room] and seq.num_tokens == seq.num_prompt_tokens + room


def test_a_stop_string_ends_the_text_before_it_and_counts_the_tokens_that_made_it():
    _, tok = tiny()
    ids = text_ids()
    full = tok.decode(ids)
    stop = "fé 🙂"  # straddles several tokens, multi-byte ones among them
    made = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    seq = sequence(max_tokens=len(ids), stop_words=(stop,))
    out, sent = processor()
    for t in ids:
        if seq.state is SeqState.FINISHED:
            break
        feed(out, seq, [t])
    final = sent.events[-1]
    assert final.finish_reason == "stop" and final.num_output_tokens == made
    assert sent.text() == full[: full.index(stop)]
    assert sent.ids() == ids[:made]  # the tokens that made the stop string are reported, their text is not


def test_a_failed_row_ends_with_error_and_no_more_text():
    ids = text_ids()
    seq = sequence(max_tokens=50)
    out, sent = processor()
    feed(out, seq, ids[:2])
    out.process(StepOutput([RowOutput(seq, error="sampling: injected")], 1, 1, 0.0))
    final = sent.events[-1]
    assert (final.finished, final.finish_reason, final.error) == (True, "error", "sampling: injected")
    assert final.text == "" and final.token_ids == [] and final.num_output_tokens == 2
    assert seq.state is SeqState.FINISHED and out.stats.finished == {"error": 1}
    out.finish(seq, "length")  # a finished sequence ends once
    assert len([e for e in sent.events if e.finished]) == 1


def test_cancelled_drops_text_held_for_a_stop_string_and_a_normal_end_flushes_it():
    """Text that could still become a stop string is held back; a cancelled request does not
    get it, one that ends otherwise does."""
    _, tok = tiny()
    ids = text_ids()
    held = tok.decode(ids[:4])
    stop = held[-1] + "\u2603\u2603"  # starts with the text's last character, never completed
    for reason in ("cancelled", "length"):
        seq = sequence(max_tokens=50, stop_words=(stop,))
        out, sent = processor()
        for t in ids[:4]:
            feed(out, seq, [t])
        assert sent.text() == held[:-1]  # its last character is held
        out.finish(seq, reason)
        assert sent.events[-1].finish_reason == reason
        assert sent.text() == (held[:-1] if reason == "cancelled" else held)


@pytest.mark.parametrize("interval", [1, 3])
def test_stream_interval_groups_tokens_after_the_first_event(interval):
    _, tok = tiny()
    ids = tok(" one two three four five six seven eight nine ten").input_ids
    seq = sequence(max_tokens=len(ids))
    out, sent = processor(stream_interval=interval)
    for t in ids:
        feed(out, seq, [t])
    sizes = [len(e.token_ids) for e in sent.events]
    n = len(ids) - 1  # tokens after the first
    assert sizes == [1] + [interval] * (n // interval) + ([n % interval] if n % interval else [])
    assert sent.text() == tok.decode(ids)


class Recorder:
    def __init__(self, fail: bool = False):
        self.calls: list[tuple] = []
        self.fail = fail

    def _record(self, *call) -> None:
        self.calls.append(call)
        if self.fail:
            raise RuntimeError("a metrics hook failed")

    def on_step(self, batch_size, num_tokens, seconds, generated):
        self._record("step", batch_size, num_tokens, generated)

    def on_first_token(self, ttft_s):
        self._record("first", ttft_s >= 0)

    def on_finish(self, reason, tpot):
        self._record("finish", reason, tpot is not None)

    def on_speculation(self, proposed, accepted):
        self._record("speculation", proposed, accepted)


@pytest.mark.parametrize("fail", [False, True], ids=["observer", "failing-observer"])
def test_observer_hears_each_step_once_and_a_failing_one_costs_no_event(fail):
    ids = text_ids()
    seq = sequence(max_tokens=4, spec_k_max=4)
    rec = Recorder(fail)
    out, sent = processor(observer=rec)
    feed(out, seq, ids[:1])
    feed(out, seq, ids[1:4], proposed=3, accepted=2)
    assert rec.calls[:2] == [("first", True), ("step", 1, 1, 1)]
    assert sorted(rec.calls[2:-1]) == [("finish", "length", True), ("speculation", 3, 2)]
    assert rec.calls[-1] == ("step", 1, 3, 3)  # once per step, after the rows' hooks
    assert sent.ids() == ids[:4] and sent.events[-1].finish_reason == "length"
    assert seq.draft_tokens == 3 and seq.accepted_draft_tokens == 2


def test_the_final_event_counts_the_speculation_of_every_step_including_the_last():
    """accepted counts only guesses the sequence used: a step that ends the sequence after
    2 of its 3 tokens counts at most 2 accepted."""
    ids = text_ids()
    seq = sequence(max_tokens=4, spec_k_max=4)
    out, sent = processor()
    feed(out, seq, ids[:2], proposed=3, accepted=1)
    feed(out, seq, ids[2:5], proposed=3, accepted=3)  # the 3rd token is past max_tokens
    assert (seq.draft_tokens, seq.accepted_draft_tokens) == (6, 1 + 2)
    final = sent.events[-1]
    assert (final.draft_tokens, final.accepted_draft_tokens) == (6, 3)



# ---------------------------------------------------------------------------- through the engine


def test_a_streamed_token_without_text_is_still_sent_at_once():
    """A token whose text is empty (here an end token the request ignores, end_id=-1) is
    streamed at once, with its id, not held for the next token's text: a streaming client's
    first response is the first token, as llama-server's stream has it."""
    from tritonlm.engine.executor import RowOutput, StepOutput

    engine = make_engine()
    _, tok = tiny()
    col = Collector()
    rid = col.request(engine, "Once upon a time", max_tokens=8, end_id=-1)
    engine.step()  # prefill and a first token
    sent = len(col.events[rid])
    assert sent == 1 and col.events[rid][0].token_ids, col.events[rid]
    seq = engine.scheduler.get(rid)
    engine.output.process(StepOutput([RowOutput(seq, [(tok.eos_token_id, 0.0)])], 1, 1, 0.0))  # [eos]: text ""
    assert tok.decode([tok.eos_token_id], skip_special_tokens=True) == ""
    ev = col.events[rid][sent]
    assert ev.token_ids == [tok.eos_token_id] and ev.text == "" and not ev.finished


def test_stream_interval_sends_the_first_token_at_once_then_every_n_tokens(tmp_path):
    from tests.helpers.servers import add_generation_model
    from tritonlm.engine.loader import build_engine
    from tritonlm.engine.settings import EngineSettings

    folder = add_generation_model(tmp_path, "tiny", stream_interval=4)  # as config.pbtxt sets it
    engine = build_engine(EngineSettings.from_params({"task": "generate", "max_context": "256", "stream_interval": "4"}, folder))
    col = Collector()
    streams = [col.request(engine, p, max_tokens=30, end_id=-1) for p in MIXED_PROMPTS]
    wholes = [col.request(engine, p, stream=False, max_tokens=30, end_id=-1) for p in MIXED_PROMPTS]
    drain(engine)
    for p, s, w in zip(MIXED_PROMPTS, streams, wholes):
        assert col.text(s) == col.text(w) and col.ids(s) == col.ids(w), p
        sizes = [len(e.token_ids) for e in col.events[s]]
        assert sum(sizes) == 30 and col.events[s][-1].finished, (p, sizes)
        # the first event as soon as the first token's text is whole, then every 4 tokens
        # (more when a character spans the 4th), the rest with the final event
        assert sizes[0] <= 2 and all(n >= 4 for n in sizes[1:-1]) and len(sizes) >= 6, (p, sizes)
    assert sum(len(col.events[s]) for s in streams) < 0.4 * 30 * len(MIXED_PROMPTS)


def test_end_id_stops_and_min_tokens_defers_it():
    ref = hf_greedy_text(MIXED_PROMPTS[0], 20)
    end = ref[5]  # a token greedy decoding produces at step 6
    first = ref.index(end)
    engine = make_engine()
    col = Collector()
    a = col.request(engine, MIXED_PROMPTS[0], max_tokens=20, end_id=end)
    b = col.request(engine, MIXED_PROMPTS[0], max_tokens=20, end_id=end, min_tokens=first + 3)
    drain(engine)
    assert col.final(a).finish_reason == "stop" and col.ids(a) == ref[:first]
    assert end not in col.ids(b)[: first + 3] and len(col.ids(b)) >= first + 3
