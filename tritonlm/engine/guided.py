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

JSON whitespace: between JSON tokens the grammar takes at most one newline and a bounded run
of spaces or tabs (JSON_WHITESPACE), so a model writes JSON pretty-printed as it learned
to, yet cannot loop on whitespace; `GuidedDecoding.compact` takes none at all.

Schemas the grammar enforces only in part: `oneOf` whose branches may overlap (enforced as
`anyOf`) and the keywords of CHECKED_AFTER (left out of the grammar). Such a guide keeps its
full schema (`AnswerCheck`): once the grammar's answer is complete it is validated against
it with jsonschema; an answer that violates it cannot end with "stop", and the row fails
with the violation as its error once nothing more can be added.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

import numpy as np
import torch

from tritonlm.engine.request import GuidedDecoding, InvalidRequestError

GUIDE_CACHE_SIZE = 256  # compiled guides kept per tokenizer (least recently used dropped first)
MASK_THREADS = 2  # llguidance's pool filling a batch's masks (the GIL is released meanwhile)

# Whitespace between two JSON tokens: at most one newline, then at most JSON_INDENT_MAX spaces
# or tabs (a space after a colon, an indentation deep enough for pretty-printed nesting).
# Each run is bounded and runs are separated by JSON tokens, so whitespace cannot fill an answer.
JSON_INDENT_MAX = 32
JSON_WHITESPACE = rf"\n?[ \t]{{0,{JSON_INDENT_MAX}}}"
# llguidance's JSON options per whitespace mode. Given as overrides, after the schema's own
# "x-guidance" options, so a schema cannot loosen them.
JSON_WHITESPACE_OPTIONS = {
    "flexible": {"whitespace_flexible": False, "whitespace_pattern": JSON_WHITESPACE},
    "compact": {"whitespace_flexible": False, "whitespace_pattern": None},
}
JSON_WHITESPACE_DEFAULT = "flexible"  # chosen by perf/bench_json_whitespace.py (docs/benchmarks.md)
# Keywords llguidance does not implement that the grammar may leave out, the finished answer
# being validated against the full schema (AnswerCheck): each relates parts of a value to each
# other (items unlike each other, keys that need other keys), which llguidance's grammar does
# not express. Others (`not`, `if`/`then`, `contains`, ...) shape what may be written at all:
# without them the grammar would lead the model into answers the check then fails.
CHECKED_AFTER = ("uniqueItems", "dependencies", "dependentRequired", "dependentSchemas")
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*\])")
_ONE_OF_AS_ANY_OF = "falling back to anyOf"  # llguidance's warning where oneOf branches may overlap
_MIN_MAX_PROPERTIES = "min/maxProperties only supported"  # ... where some listed keys are optional


def json_options(compact: bool, lenient: bool = False) -> dict:
    """llguidance's JSON compile options. lenient: unimplemented keywords left out (warnings)."""
    mode = "compact" if compact else JSON_WHITESPACE_DEFAULT
    return {**JSON_WHITESPACE_OPTIONS[mode], "item_separator": ",", "key_separator": ":", "coerce_one_of": True,
            "lenient": lenient}


class GuideViolation(ValueError):
    """The model's complete answer breaks a rule of the schema that the grammar could not
    enforce (it is checked after): the request fails with this, not an internal error."""


class AnswerCheck:
    """A JSON schema the grammar enforces only in part: the finished answer validated against
    all of it. approximated: what the grammar leaves to this check (for the error message)."""

    def __init__(self, validator, approximated: tuple[str, ...]):
        self.validator = validator  # a jsonschema validator of the full schema
        self.approximated = approximated
        parts = ["oneOf only as anyOf" if k == "oneOf" else f"{k} not at all" for k in approximated]
        self.why = f"the grammar enforces {', '.join(parts)}, and the finished answer is checked against the whole schema"

    def violation(self, text: str) -> str | None:
        """None when text is a JSON value valid for the schema; else what is wrong, and where."""
        import jsonschema

        try:
            value = json.loads(text)
        except ValueError as e:
            return f"not JSON ({e})"
        error = jsonschema.exceptions.best_match(self.validator.iter_errors(value))
        if error is None:
            return None
        return f"{error.message} (at {error.json_path}, keyword {error.validator})"


def json_schema_grammar(schema: dict, compact: bool) -> tuple[str, AnswerCheck | None]:
    """The grammar of a JSON schema and, where it enforces the schema only in part, the check
    of the finished answer. InvalidRequestError for a schema that cannot be enforced: a
    keyword llguidance does not implement and CHECKED_AFTER does not list is refused by name."""
    import llguidance

    matcher = llguidance.LLMatcher
    grammar = matcher.grammar_from_json_schema(schema, overrides=json_options(compact))
    error, messages = matcher.validate_grammar_with_warnings(grammar)
    if error:  # a keyword it does not implement, maybe one the answer's check can take
        lenient = matcher.grammar_from_json_schema(schema, overrides=json_options(compact, lenient=True))
        lenient_error, warnings = matcher.validate_grammar_with_warnings(lenient)
        approximated, refused = _approximated(warnings)
        if lenient_error or refused:
            raise InvalidRequestError(f"guided_decoding: invalid json_schema: {'; '.join(refused or messages).strip()}")
        grammar = lenient
    else:
        approximated, _ = _approximated(messages)  # the others are the library's own warnings of a grammar it compiles
    if not approximated:
        return grammar, None
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        raise InvalidRequestError(f"guided_decoding: invalid json_schema: {e.message} (at {e.json_path})") from None
    missing = [k for k in approximated if k in CHECKED_AFTER and k not in cls.VALIDATORS]
    if missing:  # e.g. `dependencies` under draft 2020-12 (the default): nothing would check it
        raise InvalidRequestError(
            f"guided_decoding: invalid json_schema: {', '.join(missing)} is not a keyword of the schema's draft "
            f"({cls.__name__.removesuffix('Validator')}); set $schema to the draft that has it, or use "
            "dependentRequired / dependentSchemas")
    return grammar, AnswerCheck(cls(schema), approximated)


def _approximated(warnings: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """llguidance's warnings -> (what the grammar leaves to the answer's check: oneOf enforced
    as anyOf, the keywords of CHECKED_AFTER, min/maxProperties; the warnings about anything else)."""
    left_out: list[str] = []
    others: list[str] = []
    for warning in warnings:
        unimplemented = _UNIMPLEMENTED.search(warning)
        if unimplemented:
            keys = json.loads(unimplemented.group(1))
            left_out += [k for k in keys if k in CHECKED_AFTER]
            refused = [k for k in keys if k not in CHECKED_AFTER]
            if refused:
                others.append(f"Unimplemented keys: {json.dumps(refused)}")
        elif _ONE_OF_AS_ANY_OF in warning:
            left_out.append("oneOf")
        elif _MIN_MAX_PROPERTIES in warning:
            left_out.append("minProperties/maxProperties")
        else:
            others.append(warning)
    return tuple(dict.fromkeys(left_out)), others


def guide_grammar(guide: GuidedDecoding) -> str:
    """The llguidance grammar text of a guide. Raises InvalidRequestError for a spec that is
    not even well-formed (a schema that is not JSON, a choice that is not a list of strings)."""
    return compile_guide(guide)[0]


def compile_guide(guide: GuidedDecoding) -> tuple[str, AnswerCheck | None]:
    """The grammar text of a guide and the check of its finished answer (None: the grammar
    is the whole guide). InvalidRequestError as guide_grammar."""
    import llguidance

    kind, spec = guide.kind, guide.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=json_options(guide.compact)), None
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as e:
            raise InvalidRequestError(f"guided_decoding: the json_schema is not valid JSON ({e})") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"guided_decoding: a json_schema must be a JSON object, got {type(schema).__name__}")
        return json_schema_grammar(schema, guide.compact)
    return _other_grammar(guide), None


def _other_grammar(guide: GuidedDecoding) -> str:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind, spec = guide.kind, guide.spec
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
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
    message. Unsupported JSON-schema keywords are refused by name ("Unimplemented keys"), but
    for those whose answers are checked after (json_schema_grammar)."""
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
        # guide -> (template LLMatcher, the check of its finished answers)
        self._compiled: OrderedDict[GuidedDecoding, tuple[object, AnswerCheck | None]] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        self.hits = self.misses = 0

    def start(self, guide: GuidedDecoding) -> "GuideState":
        """A fresh matcher state for one sequence. Raises InvalidRequestError for a guide the
        library refuses, with its message."""
        template, check = self._template(guide)
        return GuideState(template.deep_copy(), self, check)

    def _template(self, guide: GuidedDecoding) -> tuple[object, AnswerCheck | None]:
        with self._lock:
            compiled = self._compiled.get(guide)
            if compiled is not None:
                self._compiled.move_to_end(guide)
                self.hits += 1
                return compiled
        guide.validate()
        # built outside the lock: the constructor releases the GIL and can take a while
        grammar, check = compile_guide(guide)
        try:
            template = self._llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
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
            self._compiled[guide] = template, check
            self._compiled.move_to_end(guide)
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        return template, check


class GuideState:
    """One sequence's place in its guide: the tokens its matcher has consumed."""

    def __init__(self, matcher, compiler: GuideCompiler, check: AnswerCheck | None = None):
        self.matcher = matcher
        self.compiler = compiler
        self.check = check
        self.consumed: list[int] = []  # generated tokens the matcher has taken, in order
        self.violation: str | None = None  # with a check: how the complete answer so far violates the schema

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
        if self.check is not None:
            self._check_answer()

    def _check_answer(self) -> None:
        """With a check: validate a complete answer against the full schema. A violation
        keeps the answer from ending; ValueError (the row fails with it) once the grammar
        takes nothing more, since nothing can then make it valid."""
        self.violation = None
        if not self.matcher.is_accepting():
            return
        self.violation = self.check.violation(self.compiler.tokenizer.decode_str(self.consumed))
        if self.violation is not None and self.matcher.is_stopped():
            raise GuideViolation(f"guided_decoding: the answer violates the json_schema: {self.violation}; {self.check.why}")

    def can_end(self) -> bool:
        """The text so far is a complete answer of the guide."""
        return self.matcher.is_accepting() and self.violation is None

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
