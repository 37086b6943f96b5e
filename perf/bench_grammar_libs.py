"""xgrammar against llguidance on this CPU: the grammar library choice of docs/structured-output.md.

For each tokenizer (the tiny models' byte-level BPE; SmolLM2-135M's 49k vocabulary when its
GGUF is in the package cache) and each library:
  - compile: a JSON schema -> a matcher with its first token mask ready (a schema the library
    has not seen: caches cleared), median over a few schemas;
  - mask: one step of 32 rows, each at its own point of a valid JSON answer: the bitmasks of
    all 32 filled (the library's own batch call) and one token accepted per row.

    pip install xgrammar==0.2.8   # not a dependency of tritonlm (llguidance is)
    python perf/bench_grammar_libs.py [--rows 32] [--steps 60]

Prints a table with the CPU model and writes results/grammar_libs.csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import torch

from tritonlm.perf.machine import describe_cpu

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "owner": {"type": "object", "properties": {"email": {"type": "string"}, "admin": {"type": "boolean"}},
                      "required": ["email", "admin"]},
        },
        "required": ["id", "tags", "owner"],
    },
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
            "temperature": {"type": "number"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "forecast": {"type": "array", "items": {"type": "object", "properties": {
                "day": {"type": "string"}, "high": {"type": "number"}, "low": {"type": "number"}},
                "required": ["day", "high", "low"]}},
        },
        "required": ["city", "temperature", "unit", "forecast"],
    },
]
# a valid answer of SCHEMAS[2] (compact JSON, as tritonlm's guides take it), long enough for the
# rows of the mask benchmark
ANSWER = json.dumps(separators=(",", ":"), obj={
    "city": "Paris", "temperature": 21.5, "unit": "celsius",
    "forecast": [{"day": f"day {i}", "high": 20 + i, "low": 10 - i} for i in range(12)],
})


def tokenizers() -> list[tuple[str, object]]:
    from tritonlm.models.builtin import tiny_tokenizer

    out = [("tiny-gpt2", tiny_tokenizer())]
    try:
        from tritonlm.models.loading import load_model

        _, tok, _ = load_model("smollm2-135m", progress=lambda *a: None)
        out.append(("smollm2-135m", tok))
    except Exception as e:  # noqa: BLE001 - the package cache may not hold it
        print(f"(SmolLM2 tokenizer not available: {e})")
    return out


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.vocab = vocab
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2)
        self.batch = xgr.BatchGrammarMatcher(max_threads=2)

    def matcher(self, schema: dict):
        return self.xgr.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":")))

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(rows, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def fill_one(self, matcher, bitmask) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)

    def clear(self) -> None:
        self.compiler.clear_cache()


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int):
        import llguidance
        import llguidance.hf

        from tritonlm.engine import guided

        self.ll, self.guided = llguidance, guided
        self.tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.vocab = vocab
        self.executor = llguidance.LLExecutor(num_threads=2)

    def matcher(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=self.guided.JSON_OPTIONS)
        m = self.ll.LLMatcher(self.tokenizer, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def bitmask(self, rows: int) -> torch.Tensor:
        return self.guided.allocate_masks(rows, self.vocab)

    def fill(self, matchers, bitmask) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def fill_one(self, matcher, bitmask) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)

    def accept(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def clear(self) -> None:
        pass  # LLMatcher has no grammar cache: each matcher builds its own


def measure(lib, tokens: list[int], rows: int, steps: int) -> tuple[float, float]:
    """(median ms from schema to first mask, mean ms of one 32-row mask step)."""
    compile_ms = []
    one = lib.bitmask(1)
    for schema in SCHEMAS:
        lib.clear()
        t0 = time.perf_counter()
        m = lib.matcher(schema)
        lib.fill_one(m, one)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    matchers = [lib.matcher(SCHEMAS[2]) for _ in range(rows)]
    for i, m in enumerate(matchers):  # row i starts i tokens into the answer
        for t in tokens[:i]:
            lib.accept(m, t)
    bitmask = lib.bitmask(rows)
    step_s = []
    for s in range(steps):
        t0 = time.perf_counter()
        lib.fill(matchers, bitmask)
        for i, m in enumerate(matchers):
            lib.accept(m, tokens[i + s])
        step_s.append(time.perf_counter() - t0)
    return statistics.median(compile_ms), statistics.mean(step_s) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(f"CPU: {describe_cpu()}; rows {args.rows}, {args.steps} steps")
    print(f"{'tokenizer':<14} {'vocab':>6} {'library':<11} {'schema->1st mask ms':>20} {'mask step ms':>13} {'per row us':>11}")
    results = []
    for tname, tok in tokenizers():
        vocab = len(tok)
        tokens = tok(ANSWER).input_ids
        assert len(tokens) >= args.rows + args.steps, f"answer too short for {tname}: {len(tokens)} tokens"
        for cls in (XGrammar, LLGuidance):
            try:
                lib = cls(tok, vocab)
            except ImportError as e:  # xgrammar is not a dependency: pip install xgrammar==0.2.8
                print(f"{tname:<14} {vocab:>6} {cls.name:<11} not installed ({e})")
                continue
            comp, step = measure(lib, tokens, args.rows, args.steps)
            results.append((tname, vocab, lib.name, comp, step))
            print(f"{tname:<14} {vocab:>6} {lib.name:<11} {comp:>20.1f} {step:>13.2f} {step * 1e3 / args.rows:>11.1f}")
    out = Path("results/grammar_libs.csv")
    out.parent.mkdir(exist_ok=True)
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cpu", "tokenizer", "vocab", "library", "compile_first_mask_ms", "mask_step_ms", "rows"])
        for r in results:
            w.writerow([describe_cpu(), *r[:3], f"{r[3]:.2f}", f"{r[4]:.3f}", args.rows])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
