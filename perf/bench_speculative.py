"""Benchmark: speculative decoding speed-up, side by side in one run (in-process engine).

SmolLM2-135M (real weights) on two prompts: copying a passage it was given, the case prompt
lookup is for (summaries, code edits, quoting), and writing freely, where its guesses seldom
land. Per prompt: speculation off, prompt lookup, and the target drafting for itself
(acceptance 100%, the tokens per target pass the verifier reaches, at a draft's cost as
high as the target's), each with `adaptive_speculation` off (every step speculates) and on
(speculation only while this host's steps are faster with it). Output is checked identical
to the non-speculative run. Writes results/bench_speculative/bench_speculative.csv.

    .venv/bin/python perf/bench_speculative.py [--max-tokens 96] [--requests 3]
"""

from __future__ import annotations

import argparse
import csv
import sys
import threading
import time
from pathlib import Path

from tritonlm.engine.engine import Engine
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.request import GenerationRequest, SamplingParams
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.scheduler import SchedulerConfig
from tritonlm.engine.speculative import DraftModelDrafter, PromptLookupDrafter
from tritonlm.models.loading import load_model
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg

PASSAGE = (
    "Triton Inference Server is an open source inference serving software that streamlines AI inferencing. "
    "It enables teams to deploy any AI model from multiple deep learning and machine learning frameworks, "
    "including TensorRT, TensorFlow, PyTorch, ONNX, OpenVINO, Python, RAPIDS FIL, and more."
)


def run(model, tok, mode: str, prompt: str, max_tokens: int, k: int, adaptive: bool = False, requests: int = 1) -> dict:
    """`requests` requests one after another on one engine, as a server would run them: the
    first warms up (with adaptive_speculation it does most of the learning) and the figures
    are the last one's, timed from its first token (speculation does not change a prefill)."""
    runner = TorchRunner(model)
    cache = KVCacheManager(runner.spec, 4 * 1040 * runner.spec.bytes_per_token, 16, allocate_kv=runner.allocate_kv)
    drafter = None
    if mode == "prompt_lookup":
        drafter = PromptLookupDrafter(3)
    elif mode == "self_draft":
        drafter = DraftModelDrafter(TorchRunner(model), cache)
    engine = Engine(runner, tok, cache, SchedulerConfig(), max_context=1024, drafter=drafter, num_draft_tokens=k,
                    adaptive_speculation=adaptive)
    ids = list(tok(prompt).input_ids)
    for _ in range(requests):
        done = threading.Event()
        events = []

        def on_event(ev, events=events, done=done):
            events.append(ev)
            if ev.finished:
                done.set()

        engine.submit(GenerationRequest(ids, SamplingParams(max_tokens=max_tokens, end_id=-1), on_event, stream=True))
        engine.step()  # prefill outside the timing: decode speed is what speculation changes
        t0 = time.perf_counter()
        steps0 = engine.stats.steps
        while not done.is_set():
            engine.step()
        wall = time.perf_counter() - t0
    final = events[-1]
    text = "".join(e.text for e in events)
    return {
        "mode": mode + (" adaptive" if adaptive else ""),
        "tokens": final.num_output_tokens,
        "seconds": wall,
        "tokens_per_s": (final.num_output_tokens - 1) / wall,
        "target_passes": engine.stats.steps - steps0,
        "draft_tokens": final.draft_tokens,
        "accepted": final.accepted_draft_tokens,
        "acceptance": final.accepted_draft_tokens / final.draft_tokens if final.draft_tokens else 0.0,
        "text": text,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens generated, greedy (default 96)")
    ap.add_argument("--k", type=int, default=6, help="draft tokens proposed per target pass, at most (default 6)")
    ap.add_argument("--requests", type=int, default=3,
                    help="requests one after another on each engine; the last one is timed (default 3)")
    add_out_arg(ap, "bench_speculative")
    args = ap.parse_args()
    model, tok, _ = load_model("smollm2-135m")
    tasks = {
        "copy": f"Repeat this text exactly:\n\n{PASSAGE}",
        "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    }
    rows, same_all = [], True
    print(f"\nCPU: {describe_cpu()}")
    print(f"SmolLM2-135M, greedy, {args.max_tokens} tokens, K <= {args.k}; "
          f"request {args.requests} of {args.requests} on each engine timed")
    print(f"{'prompt':<6} {'mode':<24} {'tok/s':>7} {'speed-up':>9} {'target passes':>14} {'tokens/pass':>12} "
          f"{'acceptance':>11} {'same text':>10}")
    for task, content in tasks.items():
        prompt = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
        runs = [run(model, tok, "off", prompt, args.max_tokens, args.k, requests=args.requests)]
        for mode in ("prompt_lookup", "self_draft"):
            for adaptive in (False, True):
                runs.append(run(model, tok, mode, prompt, args.max_tokens, args.k, adaptive, args.requests))
        base = runs[0]
        for r in runs:
            r["prompt"] = task
            same = r["text"] == base["text"]
            same_all &= same
            print(
                f"{task:<6} {r['mode']:<24} {r['tokens_per_s']:>7.1f} {r['tokens_per_s'] / base['tokens_per_s']:>8.2f}x "
                f"{r['target_passes']:>14} {(r['tokens'] - 1) / max(r['target_passes'], 1):>12.2f} "
                f"{r['acceptance']:>10.0%} {str(same):>10}"
            )
            if not same:
                print(f"  MISMATCH: speculative output differs from the target alone ({r['mode']})")
        rows += runs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench_speculative.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[k for k in rows[0] if k != "text"])
        w.writeheader()
        for r in rows:
            w.writerow({k: v for k, v in r.items() if k != "text"})
    print(f"wrote {out / 'bench_speculative.csv'}")
    return 0 if same_all else 1


if __name__ == "__main__":
    sys.exit(main())
