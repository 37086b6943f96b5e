"""The step loop: continuous batching over a paged KV cache.

    step:  schedule -> forward -> sample / verify -> process outputs
           (scheduler)  (executor)  (executor)        (output processor)

The Engine itself only holds the thread, the inbox of new requests and
cancellations, and request validation; `docs/architecture.md` follows one request
through every component.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from tritonlm.engine.client_io import CancellationPoller, EventDispatcher
from tritonlm.engine.compute_thread import ComputeThread
from tritonlm.engine.cpu_cores import ThreadGovernor
from tritonlm.engine.executor import PENDING_TOKEN, AheadTokens, ModelExecutor
from tritonlm.engine.guided import GuideCompiler
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.lora.registry import PendingAdapter
from tritonlm.engine.output import Deferred, EngineObserver, EngineStats, OutputProcessor
from tritonlm.engine.request import GenerationRequest, InvalidRequestError, ServerBusyError, check_priority
from tritonlm.engine.scheduler import Scheduler, SchedulerConfig
from tritonlm.engine.sequence import Sequence, SeqState
from tritonlm.engine.speculation_governor import SpeculationGovernor
from tritonlm.engine.speculative import Drafter
from tritonlm.engine.threads import ENGINE_THREAD, named_thread
from tritonlm.engine.token_bytes import token_bytes

__all__ = ["Engine", "EngineObserver", "EngineStats"]

log = logging.getLogger(__name__)

EXPIRY_CHECK_S = 0.05  # how often waiting requests are checked against queue_timeout_s
# Tests only (tests/integration/test_model_control.py): while the file this names exists,
# every step that has rows to run waits in time.sleep, which frees the GIL: a step that
# hangs the way a stuck OpenMP barrier or a CUDA deadlock does. Unset: no check at all.
STALL_FILE_ENV = "TRITONLM_TEST_STALL_FILE"


class Engine:
    def __init__(
        self,
        runner,
        tokenizer,
        cache: KVCacheManager,
        scheduler_config: SchedulerConfig,
        max_context: int,
        use_kv_cache: bool = True,
        queue_timeout_s: float = 0.0,
        cancellation_check_s: float = 0.1,
        stream_interval: int = 1,
        observer: EngineObserver | None = None,
        drafter: Drafter | None = None,
        num_draft_tokens: int = 4,
        overlap: bool | None = None,
        schedule_ahead: bool = False,
        adaptive_speculation: bool = False,
    ):
        """The scheduler takes ownership of `cache`; `drafter` turns on speculative
        decoding with drafts of up to num_draft_tokens tokens. overlap: a step's text and
        events are made while the next step's forward pass runs (OutputProcessor.append /
        complete); None: where the forward pass runs asynchronously, on a GPU.
        schedule_ahead: the next step is scheduled and launched before this step's tokens
        reach the host, its rows feeding them on the device (step()); where it cannot run
        (speculation, no KV cache, a runner that takes no tokens on its device) it stays off.
        adaptive_speculation: with a drafter, decode steps are timed with and without
        speculation and rows whose output cannot change with it speculate only where that is
        faster (speculation_governor.py)."""
        self.runner = runner
        self.tokenizer = tokenizer
        token_bytes(tokenizer)  # the detokenizer's table, made now rather than for the first request
        self.max_context = max_context
        self.queue_timeout_s = queue_timeout_s
        self.cancellation_check_s = cancellation_check_s
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens if drafter is not None and use_kv_cache else 0
        self.eos_id = tokenizer.eos_token_id
        self.scheduler = Scheduler(scheduler_config, cache, recompute=not use_kv_cache)
        self.scheduler.rope_key = getattr(runner, "rope_key", None)
        self.scheduler.rope_recompute_at = getattr(runner, "rope_recompute_at", None)
        self.executor = ModelExecutor(runner, self.scheduler, drafter)
        if self.scheduler.slo is not None:  # the steps whose chunks pay no pass of their own
            self.scheduler.slo.model.joined = self.executor.chunk_rows
        if drafter is not None and adaptive_speculation and self.num_draft_tokens > 0:
            self.executor.governor = SpeculationGovernor()
        self.output = OutputProcessor(self.scheduler, max_context, observer, stream_interval)
        if overlap is None:
            overlap = getattr(getattr(runner, "device", None), "type", "cpu") == "cuda"
        self.overlap = overlap
        self._deferred: list[Deferred] = []  # the last step's rows whose text and events are due
        self.schedule_ahead = schedule_ahead and self._ahead_possible(runner, use_kv_cache)
        self._ahead: AheadTokens | None = None  # the last step's tokens, still on the device
        # that step's plan, its rows' cached positions after its passes, and when it began:
        # the step-time model learns from it once its tokens are read
        self._ahead_step: tuple[list, list[int], float, int] = ([], [], 0.0, 1)
        self._resolved_at = 0.0  # when the last such step's tokens were read
        self._inbox: list[Sequence] = []
        # requests whose LoRA adapter is being loaded (lora.registry.PendingAdapter), by request
        # id: they join the queue when it is ready, so a cold load never holds up a step
        self._loading: dict[int, Sequence] = {}
        self._load_failures: list[tuple[Sequence, str]] = []  # (request, why its adapter did not load)
        self._cancel: set[int] = set()
        self._cond = threading.Condition()
        self._stop = False
        self._stop_reason = ""
        self._stop_finish: str | None = None  # shutdown(finish_reason=...): how pending requests end
        self._thread: threading.Thread | None = None
        self.compute: ComputeThread | None = None  # build_engine's: the thread that loaded the model runs the loop
        self.threads: ThreadGovernor | None = None  # build_engine's with num_threads auto: sizes the OpenMP team
        self.lora_registry = None  # build_engine's with lora_adapters: lora.registry.LoraRegistry, adapters by name
        self._last_expiry_check = 0.0
        self._dispatcher: EventDispatcher | None = None
        self._poller: CancellationPoller | None = None
        self._guides: GuideCompiler | None = None
        self._guides_lock = threading.Lock()
        self._step_at = time.time()  # when the last step began (wall clock): the heartbeat's step watchdog
        self._idle = False  # the loop waits for work (under _cond)
        # the watchdog's yardsticks (tritonlm/supervise/watch.py step_limit), from the steps
        # that ran tokens: how many the current one runs (0 until scheduled), the slowest
        # pace per token, the longest, and how many have finished
        self._step_tokens = 0
        self._sec_per_token = 0.0
        self._longest_step_s = 0.0
        self._steps_done = 0
        self._stall_file = os.environ.get(STALL_FILE_ENV) or None

    def _ahead_possible(self, runner, use_kv_cache: bool) -> bool:
        """schedule_ahead can run with this engine (else it is logged and left off)."""
        device = getattr(getattr(runner, "device", None), "type", "cpu")
        why = ("speculative decoding verifies on the host" if self.drafter is not None else
               "the KV cache is off" if not use_kv_cache else
               "a length-dependent RoPE runs sequences again" if self.scheduler.rope_recompute_at is not None else
               f"{type(runner).__name__} takes no tokens on {device}"
               if device != "cpu" and not getattr(runner, "feeds_device_tokens", False) else None)
        if why:
            log.warning("schedule_ahead: off, %s", why)
        return why is None

    @property
    def cache(self) -> KVCacheManager:
        """The KV accounting, read only (the scheduler owns it)."""
        return self.scheduler.cache

    @property
    def guides(self) -> GuideCompiler:
        """Guided decoding's compiled guides for this model's tokenizer, made at the first
        guided request (reading the vocabulary takes a moment)."""
        with self._guides_lock:
            if self._guides is None:
                try:
                    self._guides = GuideCompiler(self.tokenizer, self.runner.spec.vocab_size)
                except Exception as e:  # noqa: BLE001 - e.g. a tokenizer llguidance cannot read (not a fast one)
                    log.exception("guided decoding is not available for this model's tokenizer")
                    raise InvalidRequestError(
                        f"guided_decoding: not available for this model: its tokenizer could not be read by the "
                        f"grammar library ({type(e).__name__}: {e})") from None
            return self._guides

    @property
    def stats(self) -> EngineStats:
        return self.output.stats

    # ---- client side (any thread) ------------------------------------------
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def validate(self, request: GenerationRequest) -> None:
        p = request.params
        p.validate()
        check_priority(request.priority)
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidRequestError("text_input: the prompt is empty (it encodes to no tokens); send some text")
        if n >= self.max_context:
            raise InvalidRequestError(
                f"text_input: the prompt has {n} tokens; the model's context is {self.max_context} tokens, "
                f"so prompts must have at most {self.max_context - 1}"
            )
        if n + p.max_tokens > self.max_context:
            raise InvalidRequestError(
                f"max_tokens: {p.max_tokens} new tokens after a {n}-token prompt exceed the context of "
                f"{self.max_context} tokens; ask for at most {self.max_context - n}"
            )
        if request.lora is not None and getattr(getattr(self.runner, "transformer", None), "lora", None) is None:
            raise InvalidRequestError(f"lora: this model serves no LoRA adapters, so {request.lora.name!r} cannot run")
        vocab = self.runner.spec.vocab_size
        for seq in p.bad_words:
            if any(not 0 <= t < vocab for t in seq):
                raise InvalidRequestError(f"bad_words: token ids must be in [0, {vocab})")
        for name, ids in (("logit_bias", [t for t, _ in p.logit_bias]), ("stop_token_ids", p.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"{name}: token ids must be in [0, {vocab}), got {bad[:5]}")
        if p.guided is not None and p.end_id is not None and p.end_id < 0 and not p.stop_token_ids:
            raise InvalidRequestError(
                "guided_decoding: a guided answer ends on a token once the guide is complete, but end_id is -1 "
                "and there are no stop_token_ids; keep the EOS (no end_id) or give stop_token_ids"
            )

    def submit(self, request: GenerationRequest, admission: bool = True) -> None:
        """Validate and queue. Raises InvalidRequestError / ServerBusyError (nothing queued then).
        admission=False: past the queue bound and the SLO controller's admission (the
        engine's own warm-up, slo_warmup.py)."""
        self.validate(request)
        end_id = request.params.end_id
        eos = self.eos_id if end_id is None else (None if end_id < 0 else end_id)
        asked = request.num_draft_tokens
        k_max = self.num_draft_tokens if asked is None else min(asked, self.num_draft_tokens)
        if request.params.top_log_probs:  # alternatives come from one position's logits: no speculation
            k_max = 0
        # the guide compiled here, on the caller's thread: a bad one is refused before queueing
        guide = self.guides.start(request.params.guided) if request.params.guided is not None else None
        seq = Sequence.create(request, self.tokenizer, eos, k_max, guide)
        pending = request.lora if isinstance(request.lora, PendingAdapter) else None
        with self._cond:
            if self._stop:
                raise ServerBusyError("the model is shutting down; retry on another instance")
            if admission:
                self.scheduler.check_room(self.scheduler.num_waiting + len(self._inbox) + len(self._loading))
                # judged now whether or not its adapter is loaded (a cold adapter is no way past
                # shedding), behind those accepted before it, their adapters loading or not
                self.scheduler.check_slo(seq, self._inbox + list(self._loading.values()))
            if pending is not None:  # queued when its adapter is ready (_adapter_loaded)
                seq.slo_plan = None  # no plan counts its adapter's load: its first token is no measure of one
                self._loading[seq.id] = seq
                self._cond.notify()  # an idle loop now waits with queue_timeout_s in view
            else:
                if self._idle:  # owed a step from now, not from the last step before the idle time
                    self._step_at = time.time()  # before the append: a beat never pairs the request with the old mark
                self._inbox.append(seq)
                self._cond.notify()
        if pending is not None:  # runs at once, on this thread, if the load is already done
            pending.future.add_done_callback(lambda future: self._adapter_loaded(seq, future))

    def _adapter_loaded(self, seq: Sequence, future) -> None:
        """The loader thread finished the adapter `seq` waits for: it joins the queue, or
        fails with the load's error (the engine thread sends it)."""
        with self._cond:
            if self._loading.pop(seq.id, None) is None:
                return  # cancelled or shut down meanwhile
            # a load cancelled at shutdown fails its request like a refused one
            error = "its load was cancelled: the model is shutting down" if future.cancelled() else future.exception()
            if error is None:
                seq.request.lora = future.result()
                if self._idle:
                    self._step_at = time.time()
                self._inbox.append(seq)
            else:
                self._load_failures.append((seq, f"lora_name: {error}"))
            self._cond.notify()

    def cancel(self, request_id: int) -> None:
        with self._cond:
            self._cancel.add(request_id)
            self._cond.notify()

    def forget_steps(self) -> None:
        """Forget the steps run so far (a warm-up's, before the loop starts): the counts the
        metrics read, the speculation governor's timings, the watchdog's current step, and
        the scheduler's own (Scheduler.forget_steps)."""
        self.output.stats = EngineStats()
        if self.executor.governor is not None:
            self.executor.governor = SpeculationGovernor()
        self._step_tokens = 0
        self.scheduler.forget_steps()

    # ---- the loop ------------------------------------------------------------
    def start(self) -> "Engine":
        """Run the loop on its own thread; events go out, and cancellations come in, on two
        more threads (client_io), so client round trips never stall a step."""
        self._dispatcher = EventDispatcher(before_delivery=getattr(self.output.observer, "before_delivery", None))
        self.output.deliver = self._dispatcher.submit
        self._poller = CancellationPoller(self._live, self.cancel, interval_s=self.cancellation_check_s)
        if self.compute is not None:
            self._thread = self.compute.thread
            self.compute.run_last(self._loop)
        else:
            self._thread = named_thread(self._loop, ENGINE_THREAD)
            self._thread.start()
        return self

    def fault(self) -> str | None:
        """Why this engine can no longer serve anyone (None while it can): its runner failed
        (a model-parallel worker died) or its loop thread ended without a shutdown."""
        failure = getattr(self.runner, "failure", None)
        if failure:
            return failure
        thread = self._thread
        if thread is not None and not thread.is_alive() and not self._stop:
            return "the engine thread stopped"
        return None

    def progress(self) -> dict:
        """What the step watchdog needs, read by the heartbeat thread (health_beat.py names
        the fields): when the current step began (wall clock), the requests owed a step
        (queued or running), the tokens the step runs, and the yardsticks of the steps done.
        A step begins as soon as the one before ends (or the loop wakes with new work), so
        while requests are owed, now minus step_at is how long the current step has run."""
        owed = len(self._inbox) + self.scheduler.num_waiting + len(self.scheduler.running)
        return {"step_at": self._step_at, "waiting": owed, "step_tokens": self._step_tokens,
                "sec_per_token": self._sec_per_token, "longest_step": self._longest_step_s,
                "steps_done": self._steps_done}

    def _live(self) -> tuple[list[Sequence], list[Sequence]]:
        # list() of a list, deque or dict view copies in one C call: safe beside the engine thread
        return list(self.scheduler.running), list(self.scheduler.waiting) + list(self._loading.values())

    def shutdown(self, reason: str = "the model is being unloaded", finish_reason: str | None = None) -> None:
        """Stop the loop, end what is pending, and release the runner (worker processes).

        Pending requests fail with `reason` as their error; with finish_reason="cancelled"
        (a drain deadline) they get a normal final response with that finish reason instead.
        A second call (finalize after the drain deadline already shut the engine down) does
        nothing. The engine thread ends the pending requests itself when it leaves its loop,
        so a step still running when the join times out cannot race this thread into sending
        a second final response."""
        with self._cond:
            if self._stop:
                return
            self._stop, self._stop_reason, self._stop_finish = True, reason, finish_reason
            self._cond.notify()
        try:
            if self._poller is not None:
                self._poller.close()
            if self._thread is None:
                if self.compute is not None:
                    self.compute.stop()
                self._fail_pending()
                return
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                log.error("engine thread still in a step after 30 s; it fails the pending requests when it returns")
            elif self._dispatcher is not None:
                self._dispatcher.close()  # the final responses go out before the model unloads
        finally:
            if self.lora_registry is not None:
                self.lora_registry.close()
            self.runner.close()

    def _fail_pending(self) -> None:
        self._resolve_ahead()
        self._complete_deferred()
        with self._cond:
            loading = list(self._loading.values()) + [seq for seq, _ in self._load_failures]
            pending, self._inbox = self.scheduler.sequences() + self._inbox + loading, []
            self._loading, self._load_failures = {}, []
        for seq in pending:
            if self._stop_finish is not None:
                self.output.finish(seq, self._stop_finish)
            else:
                self.output.fail(seq, self._stop_reason)

    def _loop(self) -> None:
        while True:
            idle_since = None
            with self._cond:
                while (not self._stop and not self._inbox and not self._cancel and not self._load_failures
                       and not self.has_work() and not self._loading_overdue()):
                    idle_since = idle_since or time.monotonic()
                    self._idle = True
                    timed = self.scheduler.num_waiting or (self._loading and self.queue_timeout_s > 0)
                    self._cond.wait(timeout=EXPIRY_CHECK_S if timed else None)
                self._idle = False
                if self._stop:
                    break
            try:
                if self.threads is not None:  # between steps, on this thread: the team is this thread's
                    self.threads.tick(idle_s=time.monotonic() - idle_since if idle_since else 0.0)
                self._step_at = time.time()
                self.step()
                self._step_done(time.time() - self._step_at)
            except Exception:  # the loop must survive anything one step does
                log.exception("engine step failed")
        self._fail_pending()

    def _step_done(self, seconds: float) -> None:
        tokens, self._step_tokens = self._step_tokens, 0
        if tokens:
            self._sec_per_token = max(self._sec_per_token, seconds / tokens)
            self._longest_step_s = max(self._longest_step_s, seconds)
            self._steps_done += 1

    def _loading_overdue(self) -> bool:
        """A request waiting for its adapter has waited past queue_timeout_s (lock held)."""
        return bool(self._overdue_loading(time.monotonic()))

    def _overdue_loading(self, now: float) -> list[int]:
        """Ids of the requests waiting for their adapter past queue_timeout_s (lock held)."""
        if not self._loading or self.queue_timeout_s <= 0:
            return []
        return [rid for rid, seq in self._loading.items() if seq.waited(now) > self.queue_timeout_s]

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    def step(self) -> None:
        """One iteration: intake, then schedule -> forward -> sample/verify -> outputs.

        With overlap the previous step's text and events are made between launching this
        step's forward pass and reading its logits: on a GPU, while the pass runs.

        With schedule_ahead a step whose rows can all choose their tokens on the device
        (executor.sample_ahead) does not wait for them: each row's history holds a
        placeholder, and the next step is scheduled and launched at once, its rows feeding
        those tokens on the device. Only then does the host wait for them (the one copy) and
        append them, finish the rows that an end token or max_tokens ends (their row in the
        step just launched is dropped), and make their text and events, while that step
        runs. Tokens, text, events and finish reasons are the plain loop's."""
        started = time.monotonic()
        self._intake()
        plan = self.scheduler.schedule()
        if not plan:
            self._resolve_ahead()
            self._complete_deferred()
            return
        self._step_tokens = sum(n for _, n in plan)
        if self._stall_file is not None:
            _stall_while(self._stall_file)
        ahead = None
        decoding_only = not any(seq.in_prefill for seq, _ in plan)  # a step the governor may time
        try:
            fwd = self.executor.forward(plan, self._ahead)
            if self.schedule_ahead:
                try:
                    ahead = self.executor.sample_ahead(fwd)
                except Exception:  # noqa: BLE001 - sample() decides it, failing only a faulty row
                    log.exception("sampling on the device failed; the step is sampled on the host")
            self._resolve_ahead()
            self._complete_deferred()
            outputs = None if ahead is not None else self.executor.sample(fwd)
        except Exception as e:  # a failed pass fails its sequences, not the server
            log.exception("forward pass failed")
            self._resolve_ahead()
            self._complete_deferred()
            for seq, _ in plan:
                self.output.fail(seq, f"internal error in the forward pass: {e}")
            self.scheduler.step_ended(plan)
            return
        if ahead is not None:
            self._ahead_step = (plan, [seq.num_computed for seq, _ in plan], started, len(fwd.passes))
            self._place(ahead)
            return  # the step-time model learns from it when its tokens are read
        if self.overlap and all(len(out.tokens) == 1 or out.error is not None for out in outputs.rows):
            self._deferred = self.output.append(outputs)
        else:  # speculative rows (several tokens, of which a stop string may cut some): at once
            self.output.process(outputs)
        seconds = time.monotonic() - started
        if self.executor.governor is not None:
            self._time_speculation(plan, fwd, outputs, seconds if decoding_only else None)
        self.scheduler.step_done(plan, seconds, passes=len(fwd.passes))

    def _time_speculation(self, plan, fwd, outputs, seconds: float | None) -> None:
        """A decode step's whole time (its passes, sampling or verifying, outputs) per token
        it made, for the way the governor gave it. Counted without a time: a step with a
        prompt chunk (seconds None), or whose rows did not run that way (nothing to guess,
        or seeded rows guessing while the others did not)."""
        speculated = self.executor.speculating
        if bool(fwd.proposals) != speculated:
            seconds = None
        tokens = sum(len(out.tokens) for out in outputs.rows)
        self.executor.governor.observe(len(plan), speculated, seconds, tokens)

    def _place(self, ahead: AheadTokens) -> None:
        """Each row still running holds a placeholder for its token until _resolve_ahead;
        a row whose token is its last (max_tokens, the context) runs no more steps."""
        placed = 0
        for seq in ahead.seqs:
            if seq.state is not SeqState.FINISHED:  # a stop string ended it meanwhile: its token is dropped
                seq.token_ids.append(PENDING_TOKEN)
                seq.last_token_pending = self.output.full(seq)
                placed += 1
        self._ahead = ahead
        if not placed:  # no step follows to wait behind: the step is counted now
            self._resolve_ahead()

    def _resolve_ahead(self) -> None:
        """The last step's tokens, waited for, in place of their placeholders; their text and
        events are due (_complete_deferred). Where that fails, the rows fail."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        try:
            self._deferred += self.output.append(ahead.result(), placed=True)
        except Exception as e:  # noqa: BLE001 - those rows fail, the server serves on
            log.exception("reading the sampled tokens failed")
            for seq in ahead.seqs:
                if seq.state is not SeqState.FINISHED and seq.token_ids and seq.token_ids[-1] == PENDING_TOKEN:
                    seq.token_ids.pop()
                self.output.fail(seq, f"internal error while sampling: {e}")
        # its time: from its start, or from when the step before it was read, whichever is
        # later (the steps overlap; in a run of them, the time between their tokens)
        plan, computed, started, passes = self._ahead_step
        now = time.monotonic()
        self.scheduler.step_done(plan, now - max(started, self._resolved_at), computed, passes)
        self._resolved_at = now

    def _complete_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        if deferred:
            self.output.complete(deferred)

    def _intake(self) -> None:
        """New requests join the queue; cancelled and expired ones leave it.

        Cancellations arrive through cancel(): from the CancellationPoller in a server,
        which asks Triton off this thread, or from a caller directly."""
        with self._cond:
            for seq in self._inbox:
                self.scheduler.add(seq)
            self._inbox = []
            cancel, self._cancel = self._cancel, set()
            failed, self._load_failures = self._load_failures, []
            # cancelled while their adapter loads: they leave now (the load goes on for others)
            cancelled_loading = [self._loading.pop(rid) for rid in cancel if rid in self._loading]
            # a request waiting for its adapter is queued too: a load that hangs (a stalled
            # volume) must not hold it for good; the load goes on for the requests after it.
            # Checked at every intake: the idle loop wakes for it (_loading_overdue)
            now = time.monotonic()
            expired = [self._loading.pop(rid) for rid in self._overdue_loading(now)]
        for seq, why in failed:
            self.output.fail(seq, why)
        for seq in cancelled_loading:
            self.output.finish(seq, "cancelled")
        if cancel:  # a cancelled row's last token is reported before its final event
            self._resolve_ahead()
            self._complete_deferred()
        for rid in cancel:
            seq = self.scheduler.get(rid)
            if seq is not None:
                self.output.finish(seq, "cancelled")
        for seq in expired:
            self.output.fail(
                seq,
                f"lora_name: timed out after waiting {seq.waited(now):.1f} s for LoRA adapter "
                f"{seq.request.lora.name!r} to load (queue_timeout_s={self.queue_timeout_s}); retry later",
            )
        now = time.monotonic()
        if self.queue_timeout_s > 0 and now - self._last_expiry_check >= EXPIRY_CHECK_S:
            self._last_expiry_check = now
            for seq in list(self.scheduler.waiting):
                if seq.waited(now) > self.queue_timeout_s:
                    self.output.fail(
                        seq,
                        f"timed out after waiting {seq.waited(now):.1f} s for a free slot "
                        f"(queue_timeout_s={self.queue_timeout_s}); retry later",
                    )


def _stall_while(path: str) -> None:
    """STALL_FILE_ENV's hang (tests only): sleep, the GIL free, while path exists."""
    while os.path.exists(path):
        time.sleep(0.05)
