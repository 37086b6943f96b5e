"""Latency SLOs: what each request got (the ledger) and keeping the next ones inside them
(the controller). Plain Python, no Triton; docs/slo.md says how to state an SLO.

    step_time.py   the step-time model, fitted online
    ledger.py      the targets, and what each request got against them
    controller.py  the token budget, the running cap and admission

The SLOs are vLLM's goodput definitions: a request is good when its time to first token
(arrival -> first token) is within slo_ttft_ms and its time per output token ((last token -
first token) / (tokens - 1)) within slo_tpot_ms; an SLO not set is not checked.

The controller turns the two targets into the scheduler's knobs, from a step-time model
fitted online (step_time.py):
- the step's token budget (the chunked-prefill size): the most tokens whose predicted step
  stays within slo_tpot, since every running stream waits one step per token; on top of it
  a step may spend the TPOT slack the running streams have (TPOT is a mean: a stream whose
  steps ran short, or with many tokens to come, can carry one longer step and end on target);
- the running cap: the most sequences whose decode step, plus one prefill chunk, stays
  within slo_tpot; beyond it requests wait in the queue rather than slow everyone;
- admission: a request whose predicted time to first token, behind the queue ahead of it,
  is past slo_ttft is refused at once (SloShedError, a 503 with Retry-After at the OpenAI
  API) rather than queued to miss its SLO and push the requests behind it past theirs; the
  steps to its first token are planned as the budget will size them (slack included), with
  a margin for the step model's measured error, stretched by how much later than planned
  the recent admitted requests' first tokens came; and a step that finishes prompts
  carries no more than keeps their first tokens within slo_ttft (never less than the
  steady budget; a prompt already past reach holds no one back).
The model's targets are smoothed over a few steps; a decision then drops as soon as the
smoothed target is clearly below it and rises only past a dead band, so noise in the fit
does not make it oscillate; each change is one log line. Until the model has seen a few
steps the configured knobs hold and every request is admitted; with slo_warmup (the
default) it has seen them before the first request (tritonlm/engine/slo_warmup.py).
"""

from tritonlm.engine.slo.controller import Decision, InFlightStep, SloController, SloShedError
from tritonlm.engine.slo.ledger import LatencyLedger, SloTargets
from tritonlm.engine.slo.step_time import StepTimeModel

__all__ = ["Decision", "InFlightStep", "LatencyLedger", "SloController", "SloShedError", "SloTargets", "StepTimeModel"]
