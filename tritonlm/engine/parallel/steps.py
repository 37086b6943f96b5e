"""What every rank runs for one step, and how a rank loads its shard (engine process and workers alike)."""

from __future__ import annotations

import os


def free_memory(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    from tritonlm.engine.loader import free_memory_bytes

    return free_memory_bytes("cpu")


# ---------------------------------------------------------------------------- one step, any rank


def micro_batch_bounds(batch_size: int, wanted: int) -> list[tuple[int, int]]:
    from tritonlm.engine.parallel.shard import split_range

    m = max(1, min(batch_size, wanted))
    return [split_range(batch_size, m, i) for i in range(m)]


def run_tp_step(shard, comm, batch):
    """Every rank: plan, forward; rank 0 gets the logits."""
    from tritonlm.engine.runners.base import plan_step

    plan = plan_step(batch, shard.device, shard.max_positions)
    return shard.forward(plan, batch.all_logits, comm)


def run_pp_step(shard, comm, batch, bounds, logits_width: int = 0):
    """Stage s of a pipelined step: micro-batch i goes stage 0 -> 1 -> ... -> last -> rank 0.

    Sends are asynchronous, so stage s works on micro-batch i+1 while stage s+1 works on
    micro-batch i. Rank 0 (stage 0) returns the logits of all micro-batches, in order."""
    import torch

    from tritonlm.engine.parallel.comm import slice_batch
    from tritonlm.engine.runners.base import plan_step

    s, last = shard.stage, shard.stages - 1
    plans = [plan_step(slice_batch(batch, lo, hi), shard.device, shard.max_positions) for lo, hi in bounds]
    pending = []  # (work, tensor): a sent tensor stays alive until its send completed
    for i, plan in enumerate(plans):
        if s == 0:
            x = shard.embed(plan)
        else:
            x = torch.empty(plan.batch_size, plan.width, shard.hidden, dtype=shard.dtype, device=shard.device)
            comm.recv(x, s - 1, i)
        x = shard.run_layers(plan, x)
        if s == last:
            out = shard.head(plan, x, batch.all_logits)
            pending.append((comm.send(out, 0, i), out))
        else:
            pending.append((comm.send(x, s + 1, i), x))
    outs = None
    if s == 0:
        outs = []
        for plan in plans:
            shape = (plan.batch_size, plan.width, logits_width) if batch.all_logits else (plan.batch_size, logits_width)
            buf = torch.empty(shape, dtype=torch.float32, device=shard.device)
            comm.recv(buf, last, len(outs))
            outs.append(buf)
    for work, _ in pending:
        work.wait()
    return None if outs is None else torch.cat(outs, dim=0)


def load_shard(mode: str, hf_dir: str, rank: int, world: int, device: str, dtype):
    import gc

    from tritonlm.engine.parallel.shard import StageShard, TPShard, load_parts

    parts = load_parts(hf_dir, device, dtype)
    shard = TPShard.from_parts(parts, rank, world) if mode == "tensor" else StageShard.from_parts(parts, rank, world)
    width = parts.lm_head.w.shape[1]
    del parts
    gc.collect()
    return shard, width


def memory_line(name: str, mode: str, rank: int, world: int, shard) -> str:
    return (
        f"model={name} mode={mode} rank={rank}/{world} pid={os.getpid()} device={shard.device} "
        f"weight_bytes={shard.weight_bytes()} kv_bytes={shard.kv_bytes()}"
    )
