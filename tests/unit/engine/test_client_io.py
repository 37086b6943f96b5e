"""tritonlm/engine/client_io.py: the response thread: a stream's events that queued up while it was sending go out as one."""

from __future__ import annotations

import threading
import types

from tritonlm.engine.client_io import EventDispatcher, coalesce
from tritonlm.engine.request import GenerationEvent


def seq(request_id: int, on_event=None):
    """What the dispatcher reads of a Sequence: its id and its request's callback."""
    return types.SimpleNamespace(id=request_id, request=types.SimpleNamespace(on_event=on_event))


def tokens(request_id: int, text: str, ids: list[int], **final) -> GenerationEvent:
    return GenerationEvent(request_id, text=text, token_ids=ids, log_probs=[-0.5] * len(ids),
                           top_log_probs=[[(t, -0.5)] for t in ids], **final)


def test_coalesce_merges_a_streams_waiting_events_in_order_and_never_an_error():
    a, b, c = seq(1), seq(2), seq(3)
    done = {"finished": True, "finish_reason": "length", "num_input_tokens": 4, "num_output_tokens": 3}
    error = GenerationEvent(2, finished=True, finish_reason="error", error="internal error")
    out = coalesce([
        [(a, tokens(1, "Hel", [1])), (b, tokens(2, "x", [9]))],
        [(a, tokens(1, "lo", [2])), (b, error), (c, tokens(3, "", [7]))],
        [(a, tokens(1, "!", [3], **done)), (c, tokens(3, "é", [8]))],
    ])
    assert [(s.id, e.text, e.token_ids, e.finished) for s, e in out] == [
        (1, "Hello!", [1, 2, 3], True),  # everything of the stream in one event, the final one
        (2, "x", [9], False),  # the text before an error still reaches its client ...
        (2, "", [], True),  # ... and the error stays an error
        (3, "é", [7, 8], False),
    ]
    final = out[0][1]
    assert final.log_probs == [-0.5] * 3 and final.finish_reason == "length" and final.num_output_tokens == 3
    assert final.top_log_probs == [[(1, -0.5)], [(2, -0.5)], [(3, -0.5)]]  # every token's alternatives, in order
    assert out[2][1] is error


def test_dispatcher_coalesces_only_what_queued_while_it_was_sending():
    got: list[GenerationEvent] = []
    sending = threading.Event()
    release = threading.Event()

    def slow_client(event: GenerationEvent) -> None:  # the first send takes a while
        got.append(event)
        if len(got) == 1:
            sending.set()
            assert release.wait(10)

    s = seq(1, slow_client)
    dispatcher = EventDispatcher()
    try:
        dispatcher.submit([(s, tokens(1, "a", [1]))])
        assert sending.wait(10)
        for i, text in enumerate("bcd", start=2):  # three steps while the first is being sent
            dispatcher.submit([(s, tokens(1, text, [i]))])
        release.set()
    finally:
        dispatcher.close()
    assert [(e.text, e.token_ids) for e in got] == [("a", [1]), ("bcd", [2, 3, 4])]


def test_dispatcher_shows_each_batch_to_its_hook_before_delivery_and_a_failing_hook_costs_no_response():
    order: list[str] = []
    sent = threading.Semaphore(0)

    def client(event: GenerationEvent) -> None:
        order.append(f"sent {event.text}")
        sent.release()

    def hook(batch) -> None:
        order.append("hook " + "".join(e.text for _, e in batch))
        if batch[0][1].text == "b":
            raise RuntimeError("a metrics update failed")

    s = seq(1, client)
    dispatcher = EventDispatcher(before_delivery=hook)
    try:
        for text in "abc":  # one batch at a time: none coalesced
            dispatcher.submit([(s, tokens(1, text, [ord(text)]))])
            assert sent.acquire(timeout=10)
    finally:
        dispatcher.close()
    assert order == ["hook a", "sent a", "hook b", "sent b", "hook c", "sent c"]


def test_coalesce_keeps_the_prompts_log_probabilities_and_every_tokens_rank():
    a = seq(1)
    first = GenerationEvent(1, text="a", token_ids=[1], log_probs=[-0.5], ranks=[2], prompt_log_probs=[None, -1.0],
                            prompt_top_log_probs=[[], [(4, -1.0)]])
    then = GenerationEvent(1, text="b", token_ids=[2], log_probs=[-0.7], ranks=[1], finished=True, finish_reason="stop")
    (_, merged), = coalesce([[(a, first)], [(a, then)]])
    assert merged.ranks == [2, 1] and merged.finished
    assert merged.prompt_log_probs == [None, -1.0] and merged.prompt_top_log_probs == [[], [(4, -1.0)]]
