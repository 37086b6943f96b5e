"""Golden logits of the Transformer forward pass, for test_model.py.

    .venv/bin/python tests/unit/engine/runners/make_golden_logits.py   # rewrites data/golden_logits.npz

Two seeded tiny models (the built-in tiny-gpt2; a grouped-query Llama with tied
embeddings, built here from a seeded LlamaConfig) run the same four steps through a
paged KV pool on scattered slots: a prefill of two prompts of different widths in one
batch (the packed path), two decode steps, and a 3-token step with every token's logits
(speculative verification). Each model runs in every variant of VARIANTS; the int8 variants
run twice, once per activation range (PARTS: 8 bits, what CPUs with VNNI run, and 7, what
the others run; TRITONLM_INT8_REDUCE_RANGE), so every host has the recording of its own
range. Recording therefore needs a CPU with VNNI. The logits are stored raw (float32), with
the host facts that decide their exact bits (HostFacts).
Rerun it only when a change of the logits is intended.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import sys
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kernels import kernels_available, loaded_build
from tritonlm.engine.parallel.comm import Comm
from tritonlm.engine.parallel.shard import layer_slice, tensor_slice
from tritonlm.engine.runners.base import plan_step
from tritonlm.engine.runners.layers import INT8_KERNEL_ENV, INT8_REDUCE_RANGE_ENV, INT8_VNNI
from tritonlm.engine.runners.model import Transformer
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.models.builtin import build_tiny

DATA = Path(__file__).resolve().parent / "data" / "golden_logits.npz"
LLAMA_VOCAB = 512
NUM_SLOTS = 96  # pool slots; every row's slots are scattered over them, never the scratch slot 0
PROMPT_WIDTHS = (11, 4)  # different widths: the prefill runs packed
VERIFY_WIDTH = 3
# CPU features that choose oneDNN's, fbgemm's and tritonlm's kernels (and so the bits)
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16",
             "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
# settings that cap the code paths below what the CPU has (perf/bench_peer.py's --as-avx2 sets them)
# (TRITONLM_KERNEL_ISA and ATEN_CPU_CAPABILITY show in the levels recorded)
CAP_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "FBGEMM_ENABLE_INSTRUCTIONS")


@dataclass(frozen=True)
class HostFacts:
    """What the logits' exact bits depend on besides the code: the same facts, the same bits.

    The CPU's features say what the host can run; the code paths it does run can be capped
    below them (TRITONLM_KERNEL_ISA, ATen's ATEN_CPU_CAPABILITY, oneDNN's and fbgemm's caps:
    how a host of an older kind is checked on a newer one), so those are facts too."""

    cpu_flags: tuple[str, ...]
    torch_version: str
    num_threads: int  # torch's intra-op threads: how oneDNN splits a matmul
    kernels: str | None  # the level of tritonlm's C++ ops loaded here (None: not built; their variants run torch's path)
    aten_capability: str  # the vector level ATen's own CPU kernels run (norms, softmax, elementwise)
    isa_caps: tuple[str, ...]  # the settings of CAP_ENV that are set ("ONEDNN_MAX_CPU_ISA=AVX2")

    @staticmethod
    def here() -> "HostFacts":
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
        except OSError:
            flags = [platform.machine()]
        build = loaded_build() if kernels_available()[0] else None
        caps = tuple(f"{name}={os.environ[name]}" for name in CAP_ENV if os.environ.get(name))
        return HostFacts(tuple(f for f in CPU_FLAGS if f in flags), torch.__version__, torch.get_num_threads(),
                         build.level if build is not None else None, torch.backends.cpu.get_cpu_capability(), caps)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "HostFacts":
        """A recording's facts; one made before a fact was recorded matches no host (its
        logits are compared within tolerance until it is made again)."""
        d = json.loads(text)
        kernels = d["kernels"] if isinstance(d["kernels"], str) or d["kernels"] is None else "unrecorded"
        return HostFacts(tuple(d["cpu_flags"]), d["torch_version"], d["num_threads"], kernels,
                         d.get("aten_capability", "unrecorded"), tuple(d.get("isa_caps", ("unrecorded",))))


def tiny_llama():
    """A grouped-query Llama (4 query heads over 2 kv heads), tied embeddings, seeded weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(77)
    config = LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


def hf_models() -> dict[str, torch.nn.Module]:
    return {"gpt2": build_tiny("tiny-gpt2")[0], "llama": tiny_llama()}


# ---------------------------------------------------------------------------- the steps


def step_batches(vocab: int) -> list[StepBatch]:
    """Prefill (both prompts in one packed batch), two decodes, one verify step; seeded tokens
    (never the model's own choices, so every variant sees the same inputs)."""
    g = torch.Generator().manual_seed(2024)
    total = max(PROMPT_WIDTHS) + 2 + VERIFY_WIDTH
    perm = (torch.randperm(NUM_SLOTS - 1, generator=g) + 1).tolist()
    slots = [perm[i * total:(i + 1) * total] for i in range(len(PROMPT_WIDTHS))]

    def toks(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    past = [0] * len(PROMPT_WIDTHS)
    batches = []
    for widths, all_logits in ((PROMPT_WIDTHS, False), ((1, 1), False), ((1, 1), False), ((VERIFY_WIDTH,) * 2, True)):
        batches.append(StepBatch.build([toks(w) for w in widths], list(past), slots, all_logits=all_logits))
        past = [p + w for p, w in zip(past, widths)]
    return batches


def run_whole(model: Transformer, batches: list[StepBatch]) -> list[torch.Tensor]:
    pool = model.allocate_kv(NUM_SLOTS)
    return [model.forward(plan_step(b, model.device, model.max_positions), b.all_logits, pool) for b in batches]


def run_stages(stages: list[Transformer], batches: list[StepBatch]) -> list[torch.Tensor]:
    """Pipeline stages one after the other (one micro-batch): embed, each stage's layers, head."""
    pools = [s.allocate_kv(NUM_SLOTS) for s in stages]
    out = []
    for b in batches:
        plan = plan_step(b, stages[0].device, stages[0].max_positions)
        with torch.inference_mode():
            x = stages[0].embed(plan)
            for stage, pool in zip(stages, pools):
                x = stage.run_layers(plan, x, pool)
            out.append(stages[-1].head(plan, x, b.all_logits))
    return out


class TurnComm(Comm):
    """The collectives of `world` ranks that run as threads of one process, one at a time:
    a rank computes until its next collective, then hands the turn to the next rank. Sums
    go in rank order, so the result does not depend on thread timing."""

    TIMEOUT_S = 120.0

    def __init__(self, rank: int, world: int, shared: dict):
        self.rank, self.world, self.shared = rank, world, shared
        self.calls = 0

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:  # every rank's t, in rank order
        sh, call = self.shared, self.calls
        self.calls += 1
        with sh["cond"]:
            sh["boxes"].setdefault(call, {})[self.rank] = t.clone()
            sh["turn"] = (self.rank + 1) % self.world
            sh["cond"].notify_all()
            if not sh["cond"].wait_for(lambda: sh["turn"] == self.rank or sh["failed"], self.TIMEOUT_S):
                raise TimeoutError(f"rank {self.rank}: no turn within {self.TIMEOUT_S} s")
            if sh["failed"]:
                raise RuntimeError("another rank failed")
            box = sh["boxes"][call]
            return [box[r] for r in range(self.world)]

    def allreduce(self, t: torch.Tensor) -> None:
        parts = self._exchange(t)
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        t.copy_(total)

    def gather_cols(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        parts = self._exchange(t)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def finish(self) -> None:
        """This rank is done: the turn goes on, so the others' last collective returns."""
        with self.shared["cond"]:
            self.shared["turn"] = (self.rank + 1) % self.world
            self.shared["cond"].notify_all()


def run_ranks(ranks: list[Transformer], batches: list[StepBatch]) -> list[torch.Tensor]:
    """Tensor-parallel ranks as threads taking turns (TurnComm); rank 0's logits."""
    shared = {"cond": threading.Condition(), "turn": 0, "boxes": {}, "failed": False}
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        comm = TurnComm(r, len(ranks), shared)
        try:
            with shared["cond"]:
                shared["cond"].wait_for(lambda: shared["turn"] == r)
            pool = ranks[r].allocate_kv(NUM_SLOTS)
            results[r] = [ranks[r].forward(plan_step(b, ranks[r].device, ranks[r].max_positions), b.all_logits,
                                           pool, comm) for b in batches]
            comm.finish()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errors.append(e)
            with shared["cond"]:
                shared["failed"] = True
                shared["cond"].notify_all()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"golden-rank{r}") for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results[0]


# ---------------------------------------------------------------------------- the variants


def _runner_model(**kw) -> Callable[[torch.nn.Module], Transformer]:
    return lambda hf: TorchRunner(hf, **kw).transformer


def _blocked(hf: torch.nn.Module) -> Transformer:
    """oneDNN's blocked float32 layout where the panel kernel would be the default."""
    t = Transformer.from_hf(hf)
    t.block_weights("blocked")
    t.use_paged_kernel()
    return t


def _plain(hf: torch.nn.Module) -> Transformer:
    return Transformer.from_hf(hf)  # plain [in, out] weights, torch ops only


def _ranks(hf: torch.nn.Module, mode: str) -> list[Transformer]:
    """Two shares of the model as parallel/steps.load_shard prepares them."""
    full = Transformer.from_hf(hf)
    shares = [tensor_slice(full, r, 2) if mode == "tensor" else layer_slice(full, r, 2) for r in range(2)]
    for share in shares:
        share.block_weights()
        share.use_paged_kernel()
    return shares


# name -> the logits of every step for (HF model, batches); names starting "int8" run once per
# int8 part of PARTS and are compared more loosely across hosts (test_model.py)
VARIANTS: dict[str, Callable[[torch.nn.Module, list[StepBatch]], list[torch.Tensor]]] = {
    "float32_plain": lambda hf, b: run_whole(_plain(hf), b),
    "float32_packed_gather": lambda hf, b: run_whole(_runner_model(attention="gather")(hf), b),
    "float32_kernels": lambda hf, b: run_whole(_runner_model()(hf), b),  # panels (or blocked), C++ ops, decoder stack
    "float32_blocked_kernels": lambda hf, b: run_whole(_blocked(hf), b),
    "int8_gather": lambda hf, b: run_whole(_runner_model(int8=True, attention="gather")(hf), b),
    "int8_kernels": lambda hf, b: run_whole(_runner_model(int8=True)(hf), b),
    "float32_tensor_slice2": lambda hf, b: run_ranks(_ranks(hf, "tensor"), b),
    "float32_layer_slice2": lambda hf, b: run_stages(_ranks(hf, "layer"), b),
}


# The recording's parts: the float32 variants; int8 through fbgemm with 8-bit activations
# (CPUs with VNNI) and with 7-bit ones (fbgemm without VNNI), each forced through
# TRITONLM_INT8_REDUCE_RANGE (fbgemm's integer sums are exact in both ranges, so a CPU with
# VNNI computes both); and int8 through tritonlm's own kernel (i8_linear, the default: 8 bits,
# the same integers on every x86 CPU).
PARTS = ("float32", "int8_act8", "int8_act7", "int8_i8")
INT8_PARTS = {"int8_act8": 8, "int8_act7": 7, "int8_i8": 8}  # part -> activation bits
# The i8 part's variants: the gather variant runs without tritonlm's C++ ops, so through
# fbgemm whatever the kernel setting (its int8_act8 recording)
I8_VARIANTS = ("int8_kernels",)


def part_of(key: str) -> str:
    """The part of PARTS a key of compute_logits belongs to: "llama/int8_gather_act7/step0" -> "int8_act7"."""
    label = key.split("/")[1]
    return "int8_" + label.rsplit("_", 1)[1] if label.startswith("int8") else "float32"


@contextlib.contextmanager
def activation_range(part: str) -> Iterator[None]:
    """The int8 part's kernel and range forced meanwhile: TRITONLM_INT8_KERNEL (fbgemm for the
    act parts, tritonlm for i8) and TRITONLM_INT8_REDUCE_RANGE (fbgemm's parts; float32:
    untouched)."""
    if part == "int8_i8":
        forced = {INT8_KERNEL_ENV: "tritonlm"}
    elif part in INT8_PARTS:
        forced = {INT8_REDUCE_RANGE_ENV: "1" if INT8_PARTS[part] == 7 else "0", INT8_KERNEL_ENV: "fbgemm"}
    else:
        forced = {}
    before = {name: os.environ.get(name) for name in forced}
    os.environ.update(forced)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def compute_logits(models: dict[str, torch.nn.Module] | None = None,
                   parts: tuple[str, ...] = PARTS) -> dict[str, np.ndarray]:
    """"{arch}/{variant}/step{i}" -> float32 logits ([B, V], or [B, T, V] for the verify step),
    for the variants of `parts`; an int8 variant's name ends in its part's range ("int8_gather_act7")."""
    models = hf_models() if models is None else models
    out = {}
    for part in parts:
        with activation_range(part):
            for arch, hf in models.items():
                batches = step_batches(hf.config.vocab_size)
                for name, run in VARIANTS.items():
                    if name.startswith("int8") != (part in INT8_PARTS):
                        continue
                    if part == "int8_i8" and name not in I8_VARIANTS:
                        continue
                    label = f"{name}_{part.removeprefix('int8_')}" if part in INT8_PARTS else name
                    for i, logits in enumerate(run(hf, batches)):
                        out[f"{arch}/{label}/step{i}"] = logits.detach().cpu().numpy().astype(np.float32, copy=False)
    return out


def load_golden(path: Path = DATA) -> tuple[HostFacts, dict[str, np.ndarray]]:
    with np.load(path) as data:
        facts = HostFacts.from_json(str(data["__host__"]))
        return facts, {k: data[k] for k in data.files if k != "__host__"}


def main() -> None:
    if not INT8_VNNI:
        sys.exit("record on a CPU with VNNI (avx512_vnni): the recording holds int8 with 8-bit activations, "
                 "which fbgemm computes correctly only there")
    logits = compute_logits()
    DATA.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(DATA, __host__=np.array(HostFacts.here().to_json()), **logits)
    print(f"{DATA}: {len(logits)} arrays, {DATA.stat().st_size} bytes; host {HostFacts.here()}")


if __name__ == "__main__":
    main()
