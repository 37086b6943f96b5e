"""The FastAPI application: OpenAI's /v1/models, /v1/completions and /v1/chat/completions
in front of Triton's generation models.

Each choice (a prompt, times n) is one Triton request (tritonlm/openai/triton.py). A
non-streamed answer waits for all of them; a streamed one waits for every choice's first
response (so a refused request still gets its HTTP status), then sends server-sent events
as pieces arrive and ends with `data: [DONE]`. A client that disconnects cancels every
Triton request it started, at once, whether it waits for an answer, a first response (a
queued request) or the next event (SSEResponse listens for the disconnect then).
The server behind it is a Backend (tritonlm/openai/backend.py): the Triton bridge, or a
test's fake.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tritonlm.openai.backend import Backend, GenerationStream
from tritonlm.openai.chat import ChatTemplates
from tritonlm.openai.errors import OpenAIError
from tritonlm.openai.frontdoor import FrontDoor
from tritonlm.openai.lora_admin import add_lora_routes
from tritonlm.openai.schemas import ChatCompletionRequest, CompletionRequest, parse_body
from tritonlm.openai.tokenize import DetokenizeRequest, TokenizeRequest
from tritonlm.openai.tokenize import detokenize as detokenize_ids
from tritonlm.openai.tokenize import tokenize as tokenize_text
from tritonlm.openai.tools import Reader, ToolDelta
from tritonlm.openai.tools import guide as tool_guide
from tritonlm.openai.tools import reader as tool_reader
from tritonlm.openai.triton import Piece, TritonBackend

log = logging.getLogger(__name__)
FINISH_REASONS = {"stop": "stop", "length": "length"}
BACKEND_CLOSE_TIMEOUT_S = 3.0  # uvicorn waits for the lifespan's end without a limit
RETRY_AFTER_S = 1


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read()


def _error_response(e: OpenAIError) -> JSONResponse:
    # 503: the model restarts or Triton is out of reach; clients (the openai SDK included) retry after this
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


# --- one choice ------------------------------------------------------------------------------
Token = tuple[str, float, "list[tuple[str, float]] | None"]  # (text, log-probability, most likely alternatives)


@dataclass
class Choice:
    index: int
    prompt_index: int
    first_of_prompt: bool  # counts the prompt's tokens in usage (once per prompt, not per choice)
    prompt: str
    gen: GenerationStream
    text: list[str] = field(default_factory=list)
    # (token text, log-probability, the most likely tokens there as (text, log-probability) or None)
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, served from the prefix cache
    completion_tokens: int = 0
    chars: int = 0  # characters of text so far
    piece_start: int = 0  # where the last piece's text starts in it (logprobs' text_offset)
    token_text: Callable[[int], str] | None = None  # a token id's text, for the most likely tokens
    # echo with logprobs: the prompt's tokens (the first one's log-probability None), from the first response
    echo_tokens: list[Token] | None = None
    reader: Reader | None = None  # chat with tools: reads the answer into content and tool calls

    def final_reason(self) -> str | None:
        """finish_reason: "tool_calls" for an answer that ended on its own with calls whose
        arguments all parse; a cut call keeps the answer's own reason (length or stop)."""
        if self.reader is not None and self.reader.calls and self.finish_reason == "stop" and self.reader.complete():
            return "tool_calls"
        return self.finish_reason

    def message(self) -> dict:
        """The whole answer as a chat message: content, and the calls when there are any. The
        reader reads it as the streamed pieces are read, so both tell the same."""
        text = "".join(self.text)
        if self.reader is None:
            return {"role": "assistant", "content": text}
        self.reader.feed(text)
        self.reader.finish()
        content, calls = self.reader.message()
        if not calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content, "tool_calls": calls}

    def absorb_prompt(self, piece: Piece) -> None:
        """The prompt's tokens and log-probabilities, when this response carries them."""
        if piece.prompt_log_probs is None or self.echo_tokens is not None or self.token_text is None:
            return
        tops = [None if top is None else [(self.token_text(i), lp) for i, lp in top] for top in piece.prompt_top]
        self.echo_tokens = [(self.token_text(t), lp, top)
                              for t, lp, top in zip(piece.prompt_ids, piece.prompt_log_probs, tops)]

    @property
    def prompt_chars(self) -> int:
        """Where the answer's tokens start in the logprobs' text_offset: after the prompt's tokens."""
        return sum(len(t) for t, _, _ in self.echo_tokens or [])

    def absorb(self, piece: Piece) -> list[Token]:
        """Add one Triton response; returns its tokens (text, logprob, top) when log-probs were
        asked. A response covering several tokens (a character split over tokens is held back
        until complete) gives its text to its last token, the others get ""."""
        self.absorb_prompt(piece)
        self.text.append(piece.text)
        self.piece_start, self.chars = self.chars, self.chars + len(piece.text)
        new: list[Token] = []
        if piece.log_probs:
            texts = [""] * (len(piece.log_probs) - 1) + [piece.text]
            tops: list = [None] * len(texts)
            if piece.top and self.token_text is not None:
                tops = [[(self.token_text(i), lp) for i, lp in top] for top in piece.top]
            new = list(zip(texts, piece.log_probs, tops))
            self.tokens.extend(new)
        elif piece.text and self.tokens:  # text released at the end without a new token
            t, lp, top = self.tokens[-1]
            self.tokens[-1] = (t + piece.text, lp, top)
        if piece.final:
            self.finish_reason = FINISH_REASONS.get(piece.finish_reason or "", "stop")
            self.prompt_tokens = piece.num_input_tokens or 0
            self.cached_tokens = piece.num_cached_tokens or 0
            self.completion_tokens = piece.num_output_tokens or 0
        return new


def _token_texts(tokenizer) -> Callable[[int], str]:
    """token id -> its text alone (tokenizer.decode), remembered: a vocabulary's few likely
    tokens recur from position to position."""
    known: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in known:
            known[token] = tokenizer.decode([token])
        return known[token]

    return text


def usage(choices: list[Choice]) -> dict:
    prompt = sum(c.prompt_tokens for c in choices if c.first_of_prompt)
    cached = sum(c.cached_tokens for c in choices if c.first_of_prompt)
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(tokens: list[Token], start: int = 0) -> dict:
    """OpenAI's legacy completions form; with echo the prompt's tokens come first, the first
    of them with a null log-probability and null top_logprobs (nothing predicts it)."""
    offsets, at = [], start
    for t, _, _ in tokens:
        offsets.append(at)
        at += len(t)
    # OpenAI's completions form: one {token text: log-probability} map per position
    tops = [None if top is None else dict(top) for _, _, top in tokens] if any(top is not None for _, _, top in tokens) else None
    return {"tokens": [t for t, _, _ in tokens], "token_logprobs": [lp for _, lp, _ in tokens], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tokens: list[Token]) -> dict:
    def entry(t: str, lp: float) -> dict:
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top or []]}
                        for t, lp, top in tokens]}


async def _start(backend: Backend, model: str, jobs: list[tuple[int, str, dict]], n: int, stream: bool, chat: bool
                 ) -> list[Choice]:
    """One Triton request per (prompt index, prompt, sampling); n choices per prompt."""
    choices = []
    try:
        for i, (p, prompt, sampling) in enumerate(jobs):
            gen = backend.generate(model, prompt, sampling, stream=stream, chat=chat)
            choices.append(Choice(i, p, i % n == 0, prompt, gen))
    except BaseException:
        for c in choices:
            c.gen.cancel()
        raise
    return choices


async def _first_pieces(choices: list[Choice]) -> list[Piece]:
    """Every choice's first response; the first error (after cancelling the rest) raises."""
    results = await asyncio.gather(*(c.gen.__anext__() for c in choices), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for c in choices:
            c.gen.cancel()
        raise errors[0]
    return results


async def _collect(choices: list[Choice], want_logprobs: bool) -> None:
    async def one(c: Choice):
        async for piece in c.gen:
            c.absorb(piece)

    results = await asyncio.gather(*(one(c) for c in choices), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for c in choices:
            c.gen.cancel()
        raise errors[0]


# --- streaming -------------------------------------------------------------------------------
class SSEResponse(StreamingResponse):
    """text/event-stream from an async iterator of str; a client disconnect cancels the
    stream at once (calling on_disconnect), also while no event is due (a queued request)."""

    def __init__(self, events, on_disconnect):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        async def stream():
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnected():
            while (await receive())["type"] != "http.disconnect":
                pass

        sending = asyncio.ensure_future(stream())
        listening = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({sending, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not sending.done():  # the client went away (or we are being cancelled)
                self.on_disconnect()
                sending.cancel()
            listening.cancel()
            await asyncio.gather(sending, listening, return_exceptions=True)
        if sending.done() and not sending.cancelled() and sending.exception() is not None:
            exc = sending.exception()
            if not isinstance(exc, OSError):  # OSError: the client went away mid-send
                raise exc


async def _pieces(choices: list[Choice], firsts: list[Piece]):
    """(choice, piece) as they arrive, the first pieces first; an error raises."""
    for c, p in zip(choices, firsts):
        yield c, p
    live = [c for c, p in zip(choices, firsts) if not p.final]
    if len(live) == 1:
        c = live[0]
        async for p in c.gen:
            yield c, p
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice):
        try:
            async for p in c.gen:
                queue.put_nowait((c, p, None))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((c, None, e))
            return
        queue.put_nowait((c, None, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in live]
    try:
        remaining = len(live)
        while remaining:
            c, p, err = await queue.get()
            if err is not None:
                raise err
            if p is None:
                remaining -= 1
                continue
            yield c, p
    finally:
        for t in tasks:
            t.cancel()


def _stream(choices: list[Choice], firsts: list[Piece], *, chat: bool, model: str, include_usage: bool,
            want_logprobs: bool, echo: bool) -> SSEResponse:
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = f'data: {{"id":"{rid}","object":"{obj}","created":{created},"model":{_dumps(model)},"choices":['

    def chunk(c: Choice, text: str | None, tokens, finish: str | None, role: bool = False, start: int | None = None,
              calls: list[ToolDelta] | None = None) -> str:
        lp = "null"
        if want_logprobs and tokens is not None:
            at = c.prompt_chars + c.piece_start if start is None else start
            lp = _dumps(chat_logprobs(tokens) if chat else completion_logprobs(tokens, at))
        fin = "null" if finish is None else f'"{finish}"'
        if chat:
            delta = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [d.chunk() for d in calls]
            body = f'{{"index":{c.index},"delta":{_dumps(delta)},"logprobs":{lp},"finish_reason":{fin}}}'
        else:
            body = f'{{"index":{c.index},"text":{_dumps(text or "")},"logprobs":{lp},"finish_reason":{fin}}}'
        return head + body + "]}\n\n"

    async def events():
        try:
            for c in choices:
                if chat:
                    yield chunk(c, "", None, None, role=True)
                elif echo:  # the prompt, with its log-probabilities when asked (they came with the first response)
                    c.absorb_prompt(firsts[c.index])
                    yield chunk(c, c.prompt, c.echo_tokens, None, start=0)
            async for c, piece in _pieces(choices, firsts):
                tokens = c.absorb(piece)
                if c.reader is not None:  # tools: the text becomes content and call deltas as it is read
                    reading = c.reader.feed(piece.text)
                    if piece.final:
                        end = c.reader.finish()
                        reading.content, reading.calls = reading.content + end.content, reading.calls + end.calls
                    if reading.content or reading.calls or tokens or piece.final:
                        yield chunk(c, reading.content or None, tokens, c.final_reason(), calls=reading.calls)
                elif piece.text or tokens or piece.final:
                    yield chunk(c, piece.text if (piece.text or not piece.final) else None, tokens, c.finish_reason)
            if include_usage:
                yield f'data: {{"id":"{rid}","object":"{obj}","created":{created},"model":{_dumps(model)},' \
                      f'"choices":[],"usage":{_dumps(usage(choices))}}}\n\n'
        except OpenAIError as e:
            yield "data: " + _dumps(e.body()) + "\n\n"
        except Exception as e:  # never leave the client hanging without the end of the stream
            log.exception("stream failed")
            yield "data: " + _dumps(OpenAIError(500, f"internal error: {e}").body()) + "\n\n"
        finally:
            for c in choices:
                c.gen.cancel()
        yield "data: [DONE]\n\n"

    def cancel_all():
        for c in choices:
            c.gen.cancel()

    return SSEResponse(events(), cancel_all)


# --- the application -------------------------------------------------------------------------
async def _body(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def _disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work, choices: list[Choice]) -> tuple[bool, Any]:
    """(False, work's result), or (True, None) when the client went away first: every
    choice's request is cancelled then. Until a streamed answer's first event, nothing else
    listens for the client: a request waiting in the model's queue is cancelled here too."""
    doing = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({doing, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not doing.done():  # the client left (or we are cancelled): end its requests
            for c in choices:
                c.gen.cancel()
            doing.cancel()
        gone.cancel()
        await asyncio.gather(doing, gone, return_exceptions=True)
    if doing.cancelled():
        return True, None
    return False, doing.result()  # its error, if any, raises


def create_app(triton_url: str | None = None, templates: ChatTemplates | None = None,
               headers: dict[str, str] | None = None, health=None, api_key: str | None = None,
               metrics_url: str | None = None, backend: Backend | None = None, allow_runtime_lora: bool = False
               ) -> FastAPI:
    """The OpenAI API in front of the Triton server whose gRPC endpoint is triton_url (host:port),
    reached through a TritonBackend the app builds (and closes) in its lifespan; or in front of
    `backend`, anything with the Backend interface (tritonlm/openai/backend.py), which the
    caller owns and closes (give one of the two).
    health (tritonlm serve's HealthBoard, optional): a model that is restarting gets a 503
    saying why, and a request that a dead model process held ends with that reason.
    api_key: every request but /health must carry it (Bearer). metrics_url: Triton's metrics
    page, shown on /metrics after the frontend's own. allow_runtime_lora: vLLM's
    /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_admin.py), which rewrite a model's
    multi_lora.json in templates.repo (the model repository, required then)."""
    if (triton_url is None) == (backend is None):
        raise ValueError("create_app: give exactly one of triton_url (the Triton bridge is built) and backend")
    templates = templates or ChatTemplates()
    if allow_runtime_lora and templates.repo is None:
        raise ValueError("runtime LoRA loading rewrites each model's multi_lora.json: it needs the model repository "
                         "(tritonlm openai --repo)")
    registry = CollectorRegistry()
    unavailable = health.unavailable if health is not None else (lambda model: None)

    def check_available(model: str) -> None:
        reason = unavailable(model)
        if reason is not None:
            raise OpenAIError(503, reason, param="model", code="model_unavailable")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if backend is not None:  # the caller's: it was there before the app and is closed by its owner
            yield
            return
        # grpc.aio binds the channel to the running loop: the bridge is made inside it
        app.state.backend = TritonBackend(triton_url, headers, health=health, repo=templates.repo)
        try:
            yield
        finally:
            try:  # grpc.aio's close waits for the channel's calls: bounded, so none can hold the shutdown
                await asyncio.wait_for(app.state.backend.close(), BACKEND_CLOSE_TIMEOUT_S)
            except asyncio.TimeoutError:  # not yet the builtin TimeoutError on Python 3.10
                log.warning("the gRPC channel to Triton did not close within %.0f s; left to the process exit",
                            BACKEND_CLOSE_TIMEOUT_S)

    app = FastAPI(title="tritonlm OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.templates = templates
    app.state.backend = backend  # None until the lifespan builds the Triton bridge
    app.add_middleware(FrontDoor, api_key=api_key, registry=registry, refuse=_error_response)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        kind = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{request.method} {request.url.path}: {e.detail}"
        return _error_response(OpenAIError(e.status_code, message, code=kind, type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("request failed")
        return _error_response(OpenAIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error"))

    if allow_runtime_lora:
        add_lora_routes(app, templates.repo, lambda: app.state.backend)

    @app.get("/health")
    async def health_check():
        if health is not None and not health.ready():
            raise OpenAIError(503, "not every model serves now: see the probes' /health", code="not_ready")
        if not await app.state.backend.live():
            raise OpenAIError(503, f"Triton at {app.state.backend.url} is not live", code="triton_unavailable")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        """The frontend's counts, tritonlm serve's health (when under it), then Triton's own page."""
        parts = [generate_latest(registry)]
        if health is not None:
            parts.append(generate_latest(health.registry))
        if metrics_url:
            try:
                parts.append(await asyncio.to_thread(_fetch, metrics_url))
            except OSError as e:
                parts.append(f"# Triton's metrics at {metrics_url} could not be read: {e}\n".encode())
        return Response(b"".join(parts), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse_body(TokenizeRequest, await _body(request))
        return await tokenize_text(templates, await app.state.backend.model(req.model), req)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse_body(DetokenizeRequest, await _body(request))
        return await detokenize_ids(templates, await app.state.backend.model(req.model), req)

    def model_card(m) -> dict:
        card = {"id": m.name, "object": "model", "created": m.created, "owned_by": "tritonlm"}
        if m.parent is not None:  # a LoRA adapter, served by its base model (vLLM's card has both)
            card.update(root=m.name, parent=m.parent)
        return card

    @app.get("/v1/models")
    async def list_models():
        models = await app.state.backend.models(refresh=True)
        return {"object": "list", "data": [model_card(m) for m in sorted(models.values(), key=lambda m: m.name)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        return model_card(await app.state.backend.model(model))

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_body(CompletionRequest, await _body(request))
        check_available(req.model)
        info = await app.state.backend.model(req.model)
        if info.parent is not None:  # an adapter: its base model serves it
            check_available(info.parent)
        n = req.n or 1
        jobs = [(p, text, req.sampling(j)) for p, text in enumerate(req.prompts()) for j in range(n)]
        return await _answer(request, req, info, jobs, n, chat=False, echo=bool(req.echo))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_body(ChatCompletionRequest, await _body(request))
        check_available(req.model)
        info = await app.state.backend.model(req.model)
        if info.parent is not None:  # an adapter: its base model serves it
            check_available(info.parent)
        functions, choice = req.functions_list, req.choice
        prompt = await templates.render(info.base, info.parameters, req.chat_messages(),
                                        tools=[f.given for f in functions], need_tools=choice == "auto")
        n = req.n or 1
        jobs = [(0, prompt, req.sampling(j)) for j in range(n)]
        call_guide = tool_guide(choice, functions, req.parallel)
        for _, _, sampling in jobs:  # named and required: the answer is kept a valid call
            if call_guide is not None:
                if "guided_decoding" in sampling:
                    raise OpenAIError(400, "tool_choice: a named or required tool call is itself a constraint on the "
                                      "answer; send it without response_format or another guide", param="tool_choice",
                                      code="invalid_value")
                sampling["guided_decoding"] = {**call_guide, **req.guide_options}  # e.g. disable_any_whitespace
                # the whole answer is the call: a stop string met inside its JSON would cut it into
                # arguments that do not parse, so stop strings do not apply (the guide ends it)
                sampling.pop("stop", None)
        readers = [tool_reader(choice, functions, req.parallel) for _ in jobs]  # each choice its own
        return await _answer(request, req, info, jobs, n, chat=True, echo=False, readers=readers)

    async def _answer(request: Request, req, info, jobs, n: int, *, chat: bool, echo: bool, readers=None):
        model = info.name  # what the answer names: the adapter when the request named one
        if info.lora_name is not None:  # an adapter runs on its base model, picked per request
            for _, _, sampling in jobs:
                sampling["lora_name"] = info.lora_name
        want_logprobs = req.wants_logprobs()
        stream = bool(req.stream)
        token_text = None
        # the most likely tokens and the echoed prompt's come back as ids: their text needs the tokenizer
        if req.top_alternatives() or (echo and want_logprobs):
            tok = await templates.tokenizer(info.base, info.parameters, param="top_logprobs" if chat else "logprobs")
            token_text = _token_texts(tok)
        # per-token responses from Triton when streaming, or to list each token's log-probability
        choices = await _start(app.state.backend, info.base, jobs, n, stream or want_logprobs, chat)
        for c in choices:
            c.token_text = token_text
            c.reader = readers[c.index] if readers else None
        if stream:
            gone, firsts = await _unless_gone(request, _first_pieces(choices), choices)
            if gone:
                return Response(status_code=499)  # nobody is listening any more
            return _stream(choices, firsts, chat=chat, model=model, include_usage=req.include_usage,
                           want_logprobs=want_logprobs, echo=echo)
        gone, _ = await _unless_gone(request, _collect(choices, want_logprobs), choices)
        if gone:
            return Response(status_code=499)
        out = []
        for c in choices:
            text = "".join(c.text)
            lp = None
            if want_logprobs:
                lp = chat_logprobs(c.tokens) if chat else completion_logprobs((c.echo_tokens or []) + c.tokens)
            if chat:
                out.append({"index": c.index, "message": c.message(), "logprobs": lp, "finish_reason": c.final_reason()})
            else:
                out.append({"index": c.index, "text": (c.prompt if echo else "") + text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
        return JSONResponse({
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": out,
            "usage": usage(choices),
        })

    return app
