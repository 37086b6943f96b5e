"""Triton glue of the generation model (decoupled): tensors in, engine events out.

execute() only parses each request and hands it to the engine; the engine thread
generates for everyone at once and each event becomes a response sent through
the request's response sender (the last one flagged final).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import threading
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils

from tritonlm.engine.cpu_cores import instances_in_config
from tritonlm.engine.loader import build_engine
from tritonlm.engine.slo import SloShedError
from tritonlm.engine.request import GenerationEvent, GenerationRequest, InvalidRequestError, ServerBusyError
from tritonlm.engine.settings import EngineSettings
from tritonlm.glue.heap import freeze_startup_heap
from tritonlm.glue.heartbeat import Heartbeat
from tritonlm.glue.metrics import TritonMetrics
from tritonlm.protocol import RequestLimits, bad_word_token_ids, event_outputs, parse_request, rename_error

log = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def instance_device(settings: EngineSettings, args) -> EngineSettings:
    """A KIND_GPU instance runs on the GPU Triton placed it on (instance_group gpus: [...])."""
    if args.get("model_instance_kind") == "GPU" and settings.device.startswith("cuda"):
        return dataclasses.replace(settings, device=f"cuda:{int(args.get('model_instance_device_id', 0))}")
    return settings


class GenerateHandler:
    def __init__(self, config, params, args):
        self.name = config["name"]
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise ValueError(
                f"model '{self.name}': the generation model must be decoupled "
                "(add model_transaction_policy { decoupled: true } to config.pbtxt)"
            )
        # The engine thread drops the GIL inside every torch op and needs it back after
        # each (thousands per step); when the response thread holds it, Python makes the
        # engine wait up to the switch interval, 5 ms by default. This process serves only
        # this model: 0.5 ms, which brings served throughput closer to in-process
        # (docs/performance-notes.md).
        sys.setswitchinterval(0.0005)
        model_dir = Path(args["model_repository"])
        self.settings = dataclasses.replace(
            instance_device(EngineSettings.from_params(params, model_dir), args), cpu_share=instances_in_config(config)
        )
        self.metrics = TritonMetrics(self.name, args.get("model_version", "1"), args.get("model_instance_name", ""))
        self.engine = build_engine(self.settings, observer=self.metrics)
        self.vocab_size = self.engine.runner.spec.vocab_size
        self.limits = RequestLimits.for_model(self.settings, self.engine.max_context)
        self.metrics.set_kv_capacity(self.engine.cache.total_bytes, self.engine.runner.spec.bytes_per_token)
        self.lora_file = None  # the multi_lora.json the frontend rewrites to load / unload adapters at run time
        if self.engine.lora_registry is not None:
            from tritonlm.engine.lora.multi_lora import MultiLoraFile
            from tritonlm.engine.settings import adapter_pairs

            fixed = {name for name, _ in adapter_pairs(params.get("lora_adapters", ""))}
            self.lora_file = MultiLoraFile(self.engine.lora_registry, model_dir, fixed)
        self.engine.start()
        self.metrics.watch(self.engine)
        self.heartbeat = Heartbeat(self.name, args.get("model_instance_name", ""), self.engine.fault,
                                   progress=self.engine.progress).start()
        freeze_startup_heap()  # this process serves this model alone: its start-up heap lives as long

    def execute(self, requests):
        # a request's time to first token counts from here, before its prompt is parsed and
        # tokenized, as its client's does (vLLM stamps arrival at its API server likewise)
        arrival = time.monotonic()
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender, arrival)
            except (InvalidRequestError, ServerBusyError) as e:
                if isinstance(e, SloShedError):  # counted before the client hears of it, as a finish is
                    self.metrics.publish()
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))), flags=FINAL)
            except Exception as e:  # never leave a client without its final response
                log.exception("request failed")
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"internal error: {e}")), flags=FINAL)
        return None

    def _submit(self, request, sender, arrival: float) -> None:
        inputs = {t.name(): t.as_numpy() for t in request.inputs()}
        parsed = parse_request(inputs, self.settings.default_max_tokens, self.vocab_size, self.limits)
        params = parsed.params
        if parsed.bad_words_text:
            params = type(params)(**{**params.__dict__, "bad_words": bad_word_token_ids(self.engine.tokenizer, parsed.bad_words_text)})
        prefix = "" if (parsed.exclude_input_in_output or parsed.stream) else parsed.text
        want_logprobs = params.return_log_probs
        lora = self._adapter(parsed)
        prompt_ids = self.engine.encode(parsed.text)
        token_text = self._token_text if parsed.vllm_logprobs else None

        link = ClientLink(request, sender)

        def on_event(event: GenerationEvent) -> None:
            nonlocal prefix
            if event.error is not None:
                link.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(event.error)), final=True)
                return
            outputs = event_outputs(event, prefix, with_log_probs=want_logprobs, top_log_probs=params.top_log_probs,
                                    token_text=token_text, prompt_ids=prompt_ids)
            prefix = ""
            tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
            link.send(pb_utils.InferenceResponse(output_tensors=tensors), final=event.finished)

        try:
            self.engine.submit(
                GenerationRequest(
                    prompt_ids=prompt_ids,
                    params=params,
                    on_event=on_event,
                    stream=parsed.stream,
                    num_draft_tokens=parsed.num_draft_tokens,
                    is_cancelled=link.is_cancelled,
                    lora=lora,
                    priority=parsed.priority,
                    arrival=arrival,
                )
            )
        except InvalidRequestError as e:  # name the field as the request did (a sampling_parameters key)
            raise InvalidRequestError(rename_error(str(e), parsed.renames)) from None

    def _adapter(self, parsed):
        """The LoRA adapter a request names: a lora.LoraAdapter when it is loaded, a
        registry.PendingAdapter while it loads (the request waits for it in the engine, off this
        thread), or None for the base model."""
        if parsed.lora_name is None:
            return None
        field = parsed.renames.get("lora_name", "lora_name")
        registry = self.engine.lora_registry
        if registry is None:
            raise InvalidRequestError(f"{field}: model '{self.name}' serves no LoRA adapters, so {parsed.lora_name!r} "
                                      "cannot run; leave it out for the base model")
        self.lora_file.check()  # an adapter loaded or unloaded at run time is in force from this request on
        try:
            return registry.acquire(parsed.lora_name)
        except ValueError as e:
            raise InvalidRequestError(f"{field}: {e}") from None

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one handler per model process
    def _token_text(self, token: int) -> str:
        """A token id's text alone (vLLM's decoded_token): a vocabulary's likely tokens recur."""
        return self.engine.tokenizer.decode([token])

    def finalize(self):
        self.heartbeat.stop()
        self.metrics.unwatch()
        self.engine.shutdown()


class ClientLink:
    """One request's responses and cancellation flag, used from two threads (the event
    dispatcher sends, the cancellation poller asks). Once the final response is sent,
    Triton frees the request's response factory: is_cancelled() after that read freed
    memory and crashed tritonserver 2.51 (SIGSEGV in
    TRITONBACKEND_ResponseFactoryIsCancelled) under load. The lock makes "final sent"
    and "ask" exclusive, and nothing is asked after the final response."""

    def __init__(self, request, sender):
        self._request, self._sender = request, sender
        self._lock = threading.Lock()
        self._done = False

    def send(self, response, final: bool) -> None:
        with self._lock:
            if self._done:
                return  # a response after the final one would be an error in Triton
            self._sender.send(response, flags=FINAL if final else 0)
            self._done = final

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self._done and self._request.is_cancelled()
