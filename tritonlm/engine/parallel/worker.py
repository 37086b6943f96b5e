"""A parallel worker process: `python -m tritonlm.engine.parallel.worker --fd N --parent PID ...`.

Started by ParallelRunner (never by hand). It loads its share of the model, joins the
runner's process group, then serves control messages until `stop`, or until its parent
goes away:
    - PR_SET_PDEATHSIG(SIGKILL) when the spawning thread is the parent's main thread
      (the signal follows the creating THREAD, so it is only asked for when that thread
      lives as long as the process);
    - EOF on the control socket (the parent's end closes when it dies);
    - a watchdog thread that sees the parent pid change (reparenting) within 0.5 s.
SIGINT and SIGTERM are ignored: Ctrl-C / Triton's graceful shutdown reaches the whole
process group, and a worker must outlive its engine until the engine tells it to stop
(it still leaves when its parent dies, by the three ways above).

Any error in a step is fatal (logged, exit 1): the other ranks would otherwise wait in a
collective; the runner sees the exit and takes the model out of service.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
import traceback

PR_SET_PDEATHSIG = 1


def set_pdeathsig(sig: int = signal.SIGKILL) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux
        return False


def start_watchdog(parent_pid: int, interval_s: float = 0.5) -> None:
    def watch():
        while True:
            if os.getppid() != parent_pid:
                _say(f"parent {parent_pid} is gone; exiting")
                os._exit(0)
            time.sleep(interval_s)

    threading.Thread(target=watch, name="tritonlm-parent-watchdog", daemon=True).start()


_PREFIX = "tritonlm-parallel"


def _say(text: str) -> None:
    print(f"{_PREFIX} {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the process


def serve(conn, args) -> int:
    import torch

    from tritonlm.engine.parallel.comm import ProcessComm, batch_from_fields, make_store, pack, unpack
    from tritonlm.engine.memory import free_memory_bytes
    from tritonlm.engine.parallel.steps import load_shard, memory_line, run_pp_step, run_tp_step

    kind, cfg = unpack(conn.recv_bytes())
    assert kind == "init", kind
    device = cfg["device"]
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    try:
        dtype = getattr(torch, cfg["dtype"]) if cfg["dtype"] else None
        model, width = load_shard(cfg["mode"], cfg["hf_dir"], args.rank, args.world, device, dtype,
                                  cfg.get("attention", "auto"))
    except Exception:
        conn.send_bytes(pack("error", message=traceback.format_exc()))
        return 1
    conn.send_bytes(pack("loaded", pid=os.getpid(), weight_bytes=model.weight_bytes(),
                         free_memory=free_memory_bytes(device), logits_width=width))
    kind, f = unpack(conn.recv_bytes())
    if kind == "stop":
        return 0
    assert kind == "connect", kind
    store = make_store(args.rank, args.world, f["port"], cfg["timeout_s"])
    comm = ProcessComm(store, args.rank, args.world, device, cfg["timeout_s"])
    conn.send_bytes(pack("ready"))
    mode = cfg["mode"]
    pool = None  # this rank's KV pool (alloc_kv)
    while True:
        kind, f = unpack(conn.recv_bytes())
        if kind == "step":
            batch = batch_from_fields(f)
            if mode == "tensor":
                run_tp_step(model, pool, comm, batch)
            else:
                run_pp_step(model, pool, comm, batch, f["bounds"])
        elif kind == "alloc_kv":
            pool = None  # the old pool goes first: never two at once
            pool = model.allocate_kv(f["num_slots"])
            _say(memory_line(args.name, mode, args.rank, args.world, model, pool))
            conn.send_bytes(pack("kv", kv_bytes=pool.nbytes))
        elif kind == "report":
            conn.send_bytes(pack("report", rank=args.rank, pid=os.getpid(), device=str(model.device),
                                 weight_bytes=model.weight_bytes(), kv_bytes=0 if pool is None else pool.nbytes))
        elif kind == "stop":
            comm.shutdown()
            return 0
        else:
            raise RuntimeError(f"unknown control message {kind!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tritonlm.engine.parallel.worker")
    ap.add_argument("--fd", type=int, required=True, help="control socket (inherited)")
    ap.add_argument("--parent", type=int, required=True, help="pid of the engine process")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--name", default="model", help="model name (logs, and to find the process)")
    ap.add_argument("--pdeathsig", action="store_true")
    args = ap.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # group-wide stop signals: the engine says when
        signal.signal(sig, signal.SIG_IGN)
    if args.pdeathsig:
        set_pdeathsig()
    if os.getppid() != args.parent:  # the parent died before we could watch it
        return 0
    start_watchdog(args.parent)
    from multiprocessing.connection import Connection

    conn = Connection(args.fd)
    code = 1
    try:
        code = serve(conn, args)
    except (EOFError, ConnectionError):
        _say(f"model={args.name} rank={args.rank}: the engine process closed the control channel; exiting")
        code = 0
    except BaseException:  # noqa: BLE001 - any failure: say why, then leave (peers must not wait on us)
        _say(f"model={args.name} rank={args.rank} pid={os.getpid()} failed:\n{traceback.format_exc()}")
        code = 1
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)  # no interpreter teardown: process-group threads could block it


if __name__ == "__main__":
    main()
