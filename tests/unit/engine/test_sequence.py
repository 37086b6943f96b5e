"""tritonlm/engine/sequence.py: one request's state. Its token history is one list that the
sampler and the detokenizer read by reference; the request's prompt is never changed; the
token counts follow the history."""

from __future__ import annotations

from tests.helpers.models import tiny
from tritonlm.engine.request import GenerationRequest, SamplingParams
from tritonlm.engine.sampler import banned_tokens
from tritonlm.engine.sequence import Sequence, SeqState


def request(prompt: list[int], **params) -> GenerationRequest:
    return GenerationRequest(list(prompt), SamplingParams(**params), lambda ev: None)


def test_the_history_is_one_list_shared_with_sampler_and_detokenizer_and_the_prompt_is_kept():
    _, tok = tiny()
    prompt = tok("Once upon a time").input_ids
    req = request(prompt, max_tokens=8, min_tokens=2, stop_words=("end",))
    seq = Sequence.create(req, tok, tok.eos_token_id, spec_k_max=3)
    assert seq.token_ids == prompt and seq.token_ids is not req.prompt_ids
    assert seq.sampling.token_ids is seq.token_ids and seq.detok.ids is seq.token_ids
    assert seq.detok.stop_words == ("end",) and seq.sampling.eos_id == tok.eos_token_id
    assert (seq.spec_k_max, seq.spec_k, seq.state) == (3, 3, SeqState.WAITING)
    # min_tokens=2 bans EOS until two tokens are in the history the sampler reads
    generated = tok(" there was").input_ids
    assert len(generated) >= 2
    assert banned_tokens(seq.sampling) == [tok.eos_token_id]
    seq.token_ids.append(generated[0])
    assert banned_tokens(seq.sampling) == [tok.eos_token_id]
    seq.token_ids.append(generated[1])
    assert banned_tokens(seq.sampling) == []
    # the detokenizer reads the same appended tokens: its text is their decode
    assert seq.detok.update() + seq.detok.flush() == tok.decode(generated[:2])
    assert req.prompt_ids == prompt  # the request's prompt is untouched


def test_counts_follow_the_history_and_the_cache():
    _, tok = tiny()
    prompt = list(range(10, 17))
    seq = Sequence.create(request(prompt, max_tokens=5), tok, None)
    assert seq.reserve_tokens == 7 + 5
    assert (seq.num_prompt_tokens, seq.num_tokens, seq.num_output_tokens) == (7, 7, 0)
    assert seq.in_prefill and seq.pending_tokens == prompt
    seq.num_computed = 4  # a prefill chunk of 4 went through
    assert seq.in_prefill and seq.pending_tokens == prompt[4:]
    seq.num_computed = 7
    seq.token_ids.append(99)
    assert not seq.in_prefill and seq.pending_tokens == [99]  # decoding: the last sampled token
    assert (seq.num_tokens, seq.num_output_tokens) == (8, 1)
    assert seq.id == seq.request.request_id


def test_waited_is_measured_from_the_requests_arrival():
    _, tok = tiny()
    req = request([5, 6], max_tokens=1)
    seq = Sequence.create(req, tok, None)
    assert seq.waited(req.arrival + 2.5) == 2.5
    assert seq.waited() >= 0
