"""The two planes between the engine process (rank 0) and its workers.

Control plane: one socket pair per worker (multiprocessing.connection framing, plain
pickle of Python/NumPy objects, never torch tensors, so nothing depends on
torch.multiprocessing's shared-memory handles). It carries `init`, `connect`,
`alloc_kv`, `step` (the StepBatch's index tensors), `report` and `stop`. A worker
blocks on it while idle, so an idle model needs no heartbeat, and the parent's death
is an EOF there.

Data plane: what a tensor-parallel shard's forward pass calls, `Comm` (all-reduce, the
logits gather; `ONE_RANK` is the world of one rank, where both do nothing) and
`row_parallel`. ProcessComm implements it over a torch.distributed process group of the
runner's own (not the global default group, so several models, or a test, can hold
groups in one process): gloo over loopback on CPU, NCCL on GPUs. It carries all-reduces,
the logits gather and the pipeline's activations; every op has the `parallel_timeout_s`
deadline, so a hung peer fails the step instead of blocking it forever (a dead peer
fails it at once: the socket closes).
"""

from __future__ import annotations

import datetime
import pickle
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from tritonlm.engine.batch import StepBatch

if TYPE_CHECKING:
    from tritonlm.engine.runners.layers import Linear

LOOPBACK = "127.0.0.1"


# ---------------------------------------------------------------------------- control plane


def pack(kind: str, **fields) -> bytes:
    return pickle.dumps((kind, fields), protocol=pickle.HIGHEST_PROTOCOL)


def unpack(data: bytes) -> tuple[str, dict]:
    return pickle.loads(data)


def batch_fields(batch: StepBatch) -> dict:
    return {
        "input_ids": batch.input_ids.cpu().numpy().astype(np.int64, copy=False),
        "num_new": batch.num_new.cpu().numpy().astype(np.int64, copy=False),
        "past_len": batch.past_len.cpu().numpy().astype(np.int64, copy=False),
        "slot_table": batch.slot_table.cpu().numpy().astype(np.int64, copy=False),
        "all_logits": bool(batch.all_logits),
        "prompt_lens": None if batch.prompt_lens is None else batch.prompt_lens.cpu().numpy().astype(np.int64, copy=False),
    }


def batch_from_fields(f: dict) -> StepBatch:
    return StepBatch(
        input_ids=torch.from_numpy(np.ascontiguousarray(f["input_ids"])),
        num_new=torch.from_numpy(np.ascontiguousarray(f["num_new"])),
        past_len=torch.from_numpy(np.ascontiguousarray(f["past_len"])),
        slot_table=torch.from_numpy(np.ascontiguousarray(f["slot_table"])),
        all_logits=bool(f["all_logits"]),
        prompt_lens=None if f.get("prompt_lens") is None else torch.from_numpy(np.ascontiguousarray(f["prompt_lens"])),
    )


def slice_batch(batch: StepBatch, lo: int, hi: int) -> StepBatch:
    """Rows [lo, hi) of a batch (a pipeline micro-batch)."""
    return StepBatch(
        input_ids=batch.input_ids[lo:hi],
        num_new=batch.num_new[lo:hi],
        past_len=batch.past_len[lo:hi],
        slot_table=batch.slot_table[lo:hi],
        all_logits=batch.all_logits,
        prompt_lens=None if batch.prompt_lens is None else batch.prompt_lens[lo:hi],
    )


# ---------------------------------------------------------------------------- data plane


class Comm:
    """The collectives a tensor-parallel shard needs; this base is the world of one rank
    (no-op all-reduce, identity gather). ProcessComm implements them."""

    rank = 0
    world = 1

    def allreduce(self, t: torch.Tensor) -> None:  # in place, sum over ranks
        pass

    def gather_cols(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        return t  # [..., widths[r]] of every rank r -> [..., sum(widths)] on rank 0 (None elsewhere)


ONE_RANK = Comm()


def row_parallel(p: Linear, x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """x @ w summed over ranks, then the bias once. World 1: exactly p(x)."""
    y = p.matmul(x)  # [..., out], this rank's partial sum
    comm.allreduce(y)
    return y if p.b is None else y + p.b


def backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def make_store(rank: int, world: int, port: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the rendezvous store on a free loopback port (port 0); the others join it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        return dist.TCPStore(LOOPBACK, port, world, True, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(LOOPBACK, port, world, False, timeout=timeout)


class ProcessComm(Comm):
    """Collectives over this runner's own process group (and the pipeline's send/recv)."""

    def __init__(self, store, rank: int, world: int, device: str | torch.device, timeout_s: float):
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.backend = backend_for(str(device))
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]  # loopback only
            opts._timeout = timeout
            self.pg = dist.ProcessGroupGloo(store, rank, world, opts)
        else:  # NCCL: one GPU per rank (the caller set torch.cuda.set_device)
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise RuntimeError("this torch build has no NCCL: tensor/pipeline parallel on GPUs needs a CUDA build")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world, opts)

    def allreduce(self, t: torch.Tensor) -> None:
        self.pg.allreduce([t]).wait()

    def gather_cols(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Every rank's [..., widths[r]] slice -> [..., sum(widths)] on rank 0 (None elsewhere)."""
        wmax = max(widths)
        if t.shape[-1] < wmax:  # one shape for the collective: pad, trim on rank 0
            t = torch.nn.functional.pad(t, (0, wmax - t.shape[-1]))
        t = t.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            bufs = [torch.empty_like(t) for _ in range(self.world)]
            self.pg.gather([bufs], [t], opts).wait()
            return torch.cat([b[..., :w] for b, w in zip(bufs, widths)], dim=-1)
        self.pg.gather([], [t], opts).wait()
        return None

    def send(self, t: torch.Tensor, dst: int, tag: int):
        """Asynchronous: returns the work; keep `t` alive until work.wait()."""
        return self.pg.send([t], dst, tag)

    def recv(self, t: torch.Tensor, src: int, tag: int) -> None:
        self.pg.recv([t], src, tag).wait()

    def shutdown(self) -> None:
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # best effort: the peers may be gone already
                pass
