"""What every rank runs for one step, and how a rank loads its share (engine process and workers alike).

A rank's share is a runners.model.Transformer (shard.tensor_slice or shard.layer_slice of
the whole model) plus the KV pool it allocated for its own layers and kv heads.
"""

from __future__ import annotations

import os

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVPool
from tritonlm.engine.parallel.comm import Comm, ProcessComm, slice_batch
from tritonlm.engine.parallel.shard import layer_slice, split_range, tensor_slice
from tritonlm.engine.runners.base import plan_step
from tritonlm.engine.runners.model import Transformer

# ---------------------------------------------------------------------------- one step, any rank


def micro_batch_bounds(batch_size: int, wanted: int) -> list[tuple[int, int]]:
    m = max(1, min(batch_size, wanted))
    return [split_range(batch_size, m, i) for i in range(m)]


def run_tp_step(model: Transformer, pool: KVPool, comm: Comm, batch: StepBatch) -> torch.Tensor | None:
    """Every rank: plan, forward; rank 0 gets the logits."""
    plan = plan_step(batch, model.device, model.max_positions)
    return model.forward(plan, batch.all_logits, pool, comm)


def run_pp_step(
    model: Transformer, pool: KVPool, comm: ProcessComm, batch: StepBatch, bounds: list[tuple[int, int]], logits_width: int = 0
) -> torch.Tensor | None:
    """Stage s (= rank) of a pipelined step: micro-batch i goes stage 0 -> 1 -> ... -> last -> rank 0.

    Sends are asynchronous, so stage s works on micro-batch i+1 while stage s+1 works on
    micro-batch i. Rank 0 (stage 0) returns the logits of all micro-batches, in order."""
    s, last = comm.rank, comm.world - 1
    plans = [plan_step(slice_batch(batch, lo, hi), model.device, model.max_positions) for lo, hi in bounds]
    pending = []  # (work, tensor): a sent tensor stays alive until its send completed
    for i, plan in enumerate(plans):
        with torch.inference_mode():
            if s == 0:
                x = model.embed(plan)  # [b, T, C]
            else:
                x = torch.empty(plan.batch_size, plan.width, model.hidden, dtype=model.dtype, device=model.device)
                comm.recv(x, s - 1, i)
            x = model.run_layers(plan, x, pool)
            if s == last:
                x = model.head(plan, x, batch.all_logits)  # [b, V] / [b, T, V] float32 logits, for rank 0
        pending.append((comm.send(x, 0 if s == last else s + 1, i), x))
    outs = None
    if s == 0:
        outs = []
        for plan in plans:
            shape = (plan.batch_size, plan.width, logits_width) if batch.all_logits else (plan.batch_size, logits_width)
            buf = torch.empty(shape, dtype=torch.float32, device=model.device)
            comm.recv(buf, last, len(outs))
            outs.append(buf)
    for work, _ in pending:
        work.wait()
    return None if outs is None else torch.cat(outs, dim=0)


def load_shard(
    mode: str, hf_dir: str, rank: int, world: int, device: str, dtype: torch.dtype | None, attention: str = "auto"
) -> tuple[Transformer, int]:
    """(this rank's share of the model, the logits width). The full model is freed before
    returning. attention "auto" / "paged": decode steps use the paged-attention kernel
    where it runs (CPU, float32), as TorchRunner's do; "gather": never."""
    import gc

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), **({"dtype": dtype} if dtype is not None else {}))
    full = Transformer.from_hf(hf.eval(), device, dtype)
    del hf
    share = tensor_slice(full, rank, world) if mode == "tensor" else layer_slice(full, rank, world)
    width = full.lm_head.plain().w.shape[1]
    del full
    gc.collect()
    share.block_weights()  # CPU float: the same blocked weights as TorchRunner's
    if attention != "gather":
        share.use_paged_kernel()
    return share, width


def memory_line(name: str, mode: str, rank: int, world: int, model: Transformer, pool: KVPool | None) -> str:
    return (
        f"model={name} mode={mode} rank={rank}/{world} pid={os.getpid()} device={model.device} "
        f"weight_bytes={model.weight_bytes()} kv_bytes={0 if pool is None else pool.nbytes}"
    )
