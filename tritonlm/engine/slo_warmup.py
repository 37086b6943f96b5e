"""The SLO controller's warm-up at load: a short synthetic workload run through the engine
before it serves, so that its first requests are judged by a fitted step-time model.

Without it the model learns the host from the first requests. Until it has seen prompt
chunks of several sizes beside decoding rows, its fit is loose and its measured error large;
admission keeps a margin for that error, so it sheds requests the host could serve. A
replica that a scale-out starts under load would refuse part of its share for its first
seconds. vLLM profiles a forward pass at load, and TGI warms up its batch sizes, for the
same reason: what a server decides from measurements is measured before it takes traffic.

The workload: prompts of several sizes (WARMUP_PROMPTS, up to a full step's tokens) arriving
one every other step beside the streams already decoding, so the steps have chunks of
several sizes beside one to several decoding rows, with decode-only steps between; halfway
through them a burst of short prompts, as many as may run at once, for decode steps as wide
as max_num_seqs. Its prompt tokens are ordinary tokens of the vocabulary drawn with a fixed
seed; its answers run to their length. While it runs the controller only watches: the
steps take the configured knobs, so the fit sees the whole range the controller may later
plan in, not the narrow one a half-fitted model would choose. The steps run on the calling
thread (the model's compute thread, before the loop starts) with prefix caching off, and
nothing of them reaches a client or the metrics. Afterwards the engine forgets them
(Engine.forget_steps): the controller keeps the step-time model, which describes the host,
and forgets the warm-up's load.

A warm-up that fails is logged and its requests cancelled, and the model loads anyway: the
controller then learns from the first requests, as without one (only an engine that cannot
even end them fails the load: it could not serve).
"""

from __future__ import annotations

import logging
import random
import time

from tritonlm.engine.engine import Engine
from tritonlm.engine.request import GenerationEvent, GenerationRequest, InvalidRequestError, SamplingParams, ServerBusyError
from tritonlm.engine.slo import SloTargets

log = logging.getLogger(__name__)

# prompt tokens of the requests that arrive one every ARRIVAL_EVERY steps (each cut to what
# a step and the context allow): chunks from a few tokens to a full step's
WARMUP_PROMPTS = (16, 64, 8, 128, 32, 256, 24, 96, 48, 192, 512)
ARRIVAL_EVERY = 2
ANSWER_TOKENS = 12  # each of those answers: they decode beside the later arrivals
# halfway through them, min(max_num_seqs, MAX_BURST) short prompts at once: the widest decode
# steps, beside the larger chunks still to come (and early, should the time bound cut the rest)
MAX_BURST = 256
BURST_AFTER = 5  # arrivals before it
BURST_PROMPT, BURST_ANSWER = 8, 8
SEED = 0
# the workload takes a few dozen steps; past either bound something holds it back (a cache
# too small for its requests together, a very slow model): what is left is cancelled
MAX_STEPS = 400
MAX_SECONDS = 60.0


def warm_up_slo(engine: Engine) -> None:
    """Run the warm-up workload through `engine` (nothing when it has no SLO controller).
    Call before engine.start(), on the thread that will run its loop."""
    slo = engine.scheduler.slo
    if slo is None:
        return
    started = time.monotonic()
    cache, observer, targets = engine.scheduler.cache, engine.output.observer, slo.targets
    prefix_caching = cache.prefix_caching
    cache.prefix_caching, engine.output.observer, slo.targets = False, None, SloTargets(None, None)
    steps, requests, open_ids = 0, 0, set()  # open_ids: the warm-up's requests not yet ended
    try:
        steps, requests = _run(engine, _workload(engine), started, open_ids)
    except Exception:  # noqa: BLE001 - the model still serves; the controller learns from the first requests
        log.exception("SLO warm-up failed; the SLO controller learns the host from the first requests")
        _end(engine, open_ids)
    finally:
        cache.prefix_caching, engine.output.observer, slo.targets = prefix_caching, observer, targets
    engine.forget_steps()
    if slo.model.ready:
        log.info("SLO warm-up: %d requests in %d steps, %.2f s; step model: %s", requests, steps,
                 time.monotonic() - started, slo.model.describe())
    else:
        log.warning("SLO warm-up: %d steps did not fit the step model; the SLO controller learns the host from "
                    "the first requests", steps)


def _workload(engine: Engine) -> list[tuple[int, int, int]]:
    """(the step it arrives before, prompt tokens, answer tokens) of each warm-up request,
    each within one step's tokens, the context and the cache's room for one sequence."""
    config = engine.scheduler.config
    room = min(engine.max_context, engine.scheduler.cache.max_tokens_per_sequence)
    jobs = []
    answer = max(1, min(ANSWER_TOKENS, room // 2))
    for i, prompt in enumerate(WARMUP_PROMPTS):
        jobs.append((i * ARRIVAL_EVERY, max(1, min(prompt, config.max_num_batched_tokens, room - answer)), answer))
    burst_at = BURST_AFTER * ARRIVAL_EVERY
    answer = max(1, min(BURST_ANSWER, room // 2))
    jobs += [(burst_at, max(1, min(BURST_PROMPT, room - answer)), answer)] * min(MAX_BURST, config.max_num_seqs)
    return jobs


def _run(engine: Engine, jobs: list[tuple[int, int, int]], started: float, open_ids: set[int]) -> tuple[int, int]:
    """Submit each job at its step and step the engine until every one has ended, or a
    bound is reached (the rest cancelled); (steps, requests submitted). open_ids: the ids
    of those submitted and not yet ended."""
    draw = _token_draw(engine)

    def ended(event: GenerationEvent) -> None:
        if event.finished:
            open_ids.discard(event.request_id)

    pending = sorted(jobs)  # by the step each arrives before
    steps = submitted = 0
    while (pending or open_ids) and steps < MAX_STEPS and time.monotonic() - started < MAX_SECONDS:
        while pending and pending[0][0] <= steps:
            _, prompt, answer = pending.pop(0)
            request = GenerationRequest([draw() for _ in range(prompt)], SamplingParams(max_tokens=answer, end_id=-1), ended)
            try:
                engine.submit(request, admission=False)
            except (InvalidRequestError, ServerBusyError) as e:
                log.warning("SLO warm-up: a request of %d prompt tokens was refused (%s); it is left out", prompt, e)
                continue
            open_ids.add(request.request_id)
            submitted += 1
        engine.step()
        steps += 1
    if open_ids:
        log.warning("SLO warm-up: %d requests still running after %d steps, %.1f s; cancelled", len(open_ids), steps,
                    time.monotonic() - started)
    _end(engine, open_ids)
    return steps, submitted


def _end(engine: Engine, request_ids: set[int]) -> None:
    """Cancel the requests still open, and run the step that ends them (and what a last
    step left on the device or for its events)."""
    for request_id in list(request_ids):
        engine.cancel(request_id)
    engine.step()


def _token_draw(engine: Engine):
    """A function drawing ordinary token ids (in both the model's and the tokenizer's
    vocabulary, no special token), seeded."""
    rng = random.Random(SEED)
    limit = engine.runner.spec.vocab_size
    try:
        limit = min(limit, len(engine.tokenizer))
    except TypeError:  # a tokenizer without a length: the model's vocabulary
        pass
    special = set(getattr(engine.tokenizer, "all_special_ids", None) or ())
    if len(special) >= limit:
        special = set()

    def draw() -> int:
        while (token := rng.randrange(limit)) in special:
            pass
        return token

    return draw
