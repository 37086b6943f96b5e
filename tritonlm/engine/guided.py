"""Guided decoding (structured output): a request's guide compiled into a grammar matcher, and
each sequence's matcher state, which says which tokens may come next.

The grammar library is llguidance (docs/structured-output.md says why). `GuideCompiler` turns
a `GuidedDecoding` (JSON schema, any JSON object, regex, grammar, choice) into a matcher for
one tokenizer, keeping the most recent ones (an LRU keyed by (kind, spec)); each sequence gets
a copy, a `GuideState`. The state follows the sequence's own token history lazily: before a
mask is computed it consumes the tokens appended since the last one and rolls back those that
are no longer there (speculative guesses the target rejected, a drafter's guesses), so no
other component has to tell it about appends or rollbacks.

Ending: the tokens that end a row (its EOS, its stop token ids) are allowed only where the
guide is complete, so an answer that finishes with reason "stop" on one of them always
matches the guide.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np
import torch

from tritonlm.engine.request import GuidedDecoding, InvalidRequestError

GUIDE_CACHE_SIZE = 256  # compiled guides kept per tokenizer (least recently used dropped first)
MASK_THREADS = 2  # llguidance's pool filling a batch's masks (the GIL is released meanwhile)

# JSON-schema compile options: compact JSON, no whitespace between its tokens (a model
# cannot loop on spaces or newlines inside the answer)
JSON_OPTIONS = {"whitespace_flexible": False}


def guide_grammar(guide: GuidedDecoding) -> str:
    """The llguidance grammar text of a guide. Raises InvalidRequestError for a spec that is
    not even well-formed (a schema that is not JSON, a choice that is not a list of strings)."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    kind, spec = guide.kind, guide.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as e:
            raise InvalidRequestError(f"guided_decoding: the json_schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"guided_decoding: a json_schema must be a JSON object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError("guided_decoding: a choice must be a non-empty list of non-empty strings")
        # Lark string literals take JSON's escapes
        return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    if kind == "grammar":
        try:
            return any_to_lark(spec)  # GBNF / EBNF (llama.cpp's, xgrammar's) -> Lark; Lark as it is
        except Exception as e:  # noqa: BLE001 - the converter raises its own error types
            raise InvalidRequestError(f"guided_decoding: the grammar does not parse: {e}") from None
    raise InvalidRequestError(f"guided_decoding: unknown kind {kind!r}")


def check_guide(guide: GuidedDecoding) -> None:
    """Refuse a guide llguidance would not compile, without a tokenizer (the OpenAI frontend
    checks bodies this way before sending them): InvalidRequestError with the library's
    message. Unsupported JSON-schema keywords are refused by name ("Unimplemented keys")."""
    import llguidance

    guide.validate()
    try:
        error = llguidance.LLMatcher.validate_grammar(guide_grammar(guide))
    except InvalidRequestError:
        raise
    except Exception as e:  # noqa: BLE001 - the library's own errors for a malformed guide
        error = str(e)
    if error:
        raise InvalidRequestError(f"guided_decoding: invalid {guide.kind}: {error.strip()}")


class GuideCompiler:
    """Guides compiled for one tokenizer; thread-safe (submit runs on the callers' threads).

    vocab_size: the model's logits' width, which may exceed the tokenizer's (padding ids):
    the masks cover it and never allow an id the tokenizer has no text for."""

    def __init__(self, tokenizer, vocab_size: int, capacity: int = GUIDE_CACHE_SIZE):
        import llguidance
        import llguidance.hf

        self._llguidance = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.vocab_size = vocab_size
        self.capacity = capacity
        self.eos_id = self.tokenizer.eos_token  # the id llguidance's masks allow where a guide may end
        self._compiled: OrderedDict[GuidedDecoding, object] = OrderedDict()  # guide -> template LLMatcher
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        self.hits = self.misses = 0

    def start(self, guide: GuidedDecoding) -> "GuideState":
        """A fresh matcher state for one sequence. Raises InvalidRequestError for a guide the
        library refuses, with its message."""
        return GuideState(self._template(guide).deep_copy(), self)

    def _template(self, guide: GuidedDecoding):
        with self._lock:
            template = self._compiled.get(guide)
            if template is not None:
                self._compiled.move_to_end(guide)
                self.hits += 1
                return template
        guide.validate()
        # built outside the lock: the constructor releases the GIL and can take a while
        try:
            template = self._llguidance.LLMatcher(self.tokenizer, guide_grammar(guide), log_level=0)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001 - the library's own errors for a malformed guide
            raise InvalidRequestError(f"guided_decoding: invalid {guide.kind}: {e}") from None
        if template.is_error():
            raise InvalidRequestError(f"guided_decoding: invalid {guide.kind}: {template.get_error().strip()}")
        # the first mask builds the lexer's first states: later copies start from them
        fill_masks([GuideState(template, self)], allocate_masks(1, self.vocab_size), self)
        with self._lock:
            self.misses += 1
            self._compiled[guide] = template
            self._compiled.move_to_end(guide)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return template


class GuideState:
    """One sequence's place in its guide: the tokens its matcher has consumed."""

    def __init__(self, matcher, compiler: GuideCompiler):
        self.matcher = matcher
        self.compiler = compiler
        self.consumed: list[int] = []  # generated tokens the matcher has taken, in order

    def sync(self, generated: list[int], end_ids: list[int]) -> None:
        """Bring the matcher to the end of `generated` (the row's answer so far): roll back
        what is no longer there, consume what is new up to an end token (end_ids; only a
        drafter's guesses go on past one, and the verifier drops them). ValueError when a
        token is outside the guide (the row fails; nothing can make that text valid again)."""
        n = len(self.consumed)
        if generated[:n] != self.consumed:
            keep = 0
            while keep < n and keep < len(generated) and generated[keep] == self.consumed[keep]:
                keep += 1
            self.matcher.rollback(n - keep)
            del self.consumed[keep:]
        new = generated[len(self.consumed):]
        for i, token in enumerate(new):
            if token in end_ids:
                new = new[:i]
                break
        if new:
            taken = self.matcher.try_consume_tokens(new)
            self.consumed.extend(new[:taken])
            if taken < len(new):
                raise ValueError(f"guided decoding: token {new[taken]} does not continue the guide")

    def can_end(self) -> bool:
        """The text so far is a complete answer of the guide."""
        return self.matcher.is_accepting()

    def must_end(self) -> bool:
        """The guide takes no more text: only ending the answer is left."""
        return self.matcher.is_stopped()


def allocate_masks(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32 bitmasks, on the host (llguidance writes them there)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_masks(states: list[GuideState], masks: torch.Tensor, compiler: GuideCompiler) -> None:
    """masks[i] = the tokens allowed after states[i]'s consumed tokens, all rows at once on
    llguidance's thread pool (the GIL released). The states must be synced first.

    llguidance's pointer API, not its llguidance.torch helpers: importing those compiles a
    torch.compile kernel's dependencies (inductor), seconds at every model load."""
    assert masks.dtype == torch.int32 and masks.is_contiguous() and masks.device.type == "cpu"
    rows, words = masks.shape
    compiler._executor.unsafe_compute_mask_ptr([(s.matcher, i) for i, s in enumerate(states)], masks.data_ptr(), words * 4, rows)


def allowed_tokens(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, ceil(V / 32)] int32 bitmasks (bit i of word w: token 32 w + i) -> [n, V] bool."""
    bits = np.unpackbits(masks.numpy().view(np.uint8), axis=-1, bitorder="little")  # [n, 32 ceil(V / 32)]
    return torch.from_numpy(bits[:, :vocab_size]).bool()


def apply_masks(logits: torch.Tensor, masks: torch.Tensor, states: list[GuideState], end_ids: list[list[int]]) -> None:
    """logits [n, V] (float32, changed in place): row i's tokens outside its guide set to -inf.
    Row i's end tokens (end_ids[i]: its EOS and stop token ids) keep their logits only where
    its guide is complete; llguidance's own EOS bit counts for nothing else."""
    allowed = allowed_tokens(masks, logits.shape[-1])  # [n, V]
    for i, (state, ends) in enumerate(zip(states, end_ids)):
        eos = state.compiler.eos_id
        if eos is not None and 0 <= eos < allowed.shape[-1]:
            allowed[i, eos] = False
        if ends:
            # an end token the guide also takes as text still only ends the answer
            allowed[i, torch.tensor(ends, dtype=torch.int64)] = state.can_end()
    logits.masked_fill_(~allowed.to(logits.device, non_blocking=True), float("-inf"))
