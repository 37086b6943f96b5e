"""Benchmark: a mixture-of-experts model's decode step against a dense model's with the same
active parameters.

Two seeded random-weight models, the torch runner in-process, float32 on the CPU:
    moe     Mixtral-shaped: --experts experts of width --expert-ffn, top --top-k per token
    dense   Llama with the same attention and hidden size, MLP width top_k x expert-ffn: the
            weights one token's step reads in the MoE model, in one MLP
Both step --rows sequences (distinct random tokens, contexts prefilled with distinct random
prompts, so the rows' tokens are routed to different experts) by one token each, timed in
alternating rounds (a shared host's speed drifts over minutes). The dense model runs twice:
on its default path (the C++ decoder stack, one call for every layer, where the kernels
build) and on the Python layer loop that the MoE model runs ("dense_loop"), so the ratio of
the MoE's own block is apart from the ratio of the paths.
    step_ms          median decode step
    experts_hit      mean experts with any row routed to it, per MoE layer of the step
    ratio_vs_dense   step_ms / dense's; ratio_vs_dense_loop likewise

    .venv/bin/python perf/bench_moe.py [--rows 32] [--rounds 5] [--hidden 1024] [--experts 8] [--top-k 2]
Prints the CPU it ran on; writes results/bench_moe/bench_moe.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVCacheManager
from tritonlm.engine.runners.moe import MoE
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.report import add_out_arg, table, write_csv
from tritonlm_bench.steptime import BLOCK, time_calls


def models(args) -> dict:
    """{"moe": MixtralForCausalLM, "dense": LlamaForCausalLM}, seeded, the same shapes but the MLP."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                  max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    moe = MixtralForCausalLM(MixtralConfig(**common, intermediate_size=args.expert_ffn, num_local_experts=args.experts,
                                           num_experts_per_tok=args.top_k)).eval()
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(**common, intermediate_size=args.top_k * args.expert_ffn)).eval()
    return {"moe": moe, "dense": dense}


class Step:
    """`rows` sequences with context - 1 tokens cached (a prefill of distinct random prompts),
    and the decode step that adds one distinct random token to each."""

    def __init__(self, runner, rows: int, context: int, seed: int = 1) -> None:
        vocab = runner.spec.vocab_size
        g = torch.Generator().manual_seed(seed)
        self.runner = runner
        self.cache = KVCacheManager(runner.spec, (rows * (context // BLOCK + 2) + 1) * BLOCK * runner.spec.bytes_per_token,
                                    BLOCK, allocate_kv=runner.allocate_kv)
        for r in range(rows):
            self.cache.allocate(r, context)
            prompt = torch.randint(0, vocab, (context - 1,), generator=g).tolist()
            runner.forward(StepBatch.build([prompt], [0], [self.cache.slots(r, context - 1)]), self.cache.pool)
        tokens = torch.randint(0, vocab, (rows,), generator=g).tolist()
        self.batch = StepBatch.build([[t] for t in tokens], [context - 1] * rows,
                                     [self.cache.slots(r, context) for r in range(rows)])

    def __call__(self) -> torch.Tensor:
        return self.runner.forward(self.batch, self.cache.pool)


def experts_hit(step: Step) -> float:
    """Mean number of experts with any row routed to it, per MoE layer, in one step."""
    hits: list[int] = []
    real = MoE.__call__

    def counting(self, x, glu):
        from tritonlm.engine.runners.moe import route

        logits = torch.nn.functional.linear(x, self.router, self.router_bias)
        experts = route(logits, self.top_k, self.normalize, self.softmax_after_topk)[1]
        hits.append(int(experts.unique().numel()))
        return real(self, x, glu)

    MoE.__call__ = counting
    try:
        step()
    finally:
        MoE.__call__ = real
    return statistics.mean(hits) if hits else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32, help="sequences per decode step (default 32)")
    ap.add_argument("--context", type=int, default=128, help="tokens per sequence after the step (default 128)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="timed steps per round and model (default 5)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=1024, help="an expert's MLP width (dense: top_k x this)")
    ap.add_argument("--vocab", type=int, default=8192)
    add_out_arg(ap, "bench_moe")
    args = ap.parse_args()
    cpu = describe_cpu()
    print(f"CPU: {cpu}", flush=True)
    torch.set_grad_enabled(False)
    hf = models(args)
    runners = {"moe": TorchRunner(hf["moe"]), "dense": TorchRunner(hf["dense"]), "dense_loop": TorchRunner(hf["dense"])}
    runners["dense_loop"].transformer.decoder_stack = None  # the Python layer loop, as the MoE model runs
    for name, runner in runners.items():
        print(f"{name}: attention {runner.attention} ({runner.attention_why})", flush=True)
    steps = {name: Step(runner, args.rows, args.context) for name, runner in runners.items()}
    hit = experts_hit(steps["moe"])
    times: dict[str, list[float]] = {name: [] for name in steps}
    for rnd in range(args.rounds):
        for name, step in steps.items():
            times[name].append(statistics.median(time_calls(step, args.reps)) * 1000)
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    ms = {name: statistics.median(t) for name, t in times.items()}
    rows = [{"model": name, "step_ms": round(ms[name], 2), "experts_hit": round(hit, 2) if name == "moe" else "",
             "ratio_vs_dense": round(ms[name] / ms["dense"], 2), "ratio_vs_dense_loop": round(ms[name] / ms["dense_loop"], 2)}
            for name in steps]
    shape = (f"hidden {args.hidden}, {args.layers} layers, {args.experts} experts x {args.expert_ffn} top-{args.top_k} "
             f"vs dense {args.top_k * args.expert_ffn}; {args.rows} rows at context {args.context}, float32")
    print(f"\nCPU: {cpu}; {shape}; medians of {args.rounds} alternating rounds")
    print(table(rows, list(rows[0])))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "bench_moe.csv", [{"cpu": cpu, "shape": shape, **r} for r in rows])
    print(f"wrote {out / 'bench_moe.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
