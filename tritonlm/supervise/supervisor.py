"""`tritonlm serve`'s recovery: after a fault, tritonserver restarts with the same repository
and flags.

Why the whole server: Triton 2.51 neither restarts a decoupled model's dead stub nor ends the
requests that stub held (triton-inference-server/server#8604), and unloading the model waits
for those requests, which never end. Killing the server closes every connection at once:
each in-flight request ends with an error now (gRPC UNAVAILABLE; the OpenAI frontend says
which model died and why) instead of hanging until its client gives up. While it restarts,
the probes say not ready and the OpenAI frontend answers 503 with Retry-After.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

from tritonlm.proc_exit import describe_exit
from tritonlm.server import ServerStartError, TritonServer, parse_restriction
from tritonlm.supervise.health import HealthBoard
from tritonlm.supervise.recovery import RestartPolicy
from tritonlm.supervise.served import TritonModels
from tritonlm.supervise.watch import DEFAULT_DEADLINE_S, SERVER, Fault, ModelWatch

EXIT_GAVE_UP = 3  # serve's exit code when recovery gives up (1: tritonserver failed otherwise)
POLL_S = 0.2


def triton_models(server: TritonServer) -> TritonModels:
    """The client of the server's model states, with the model-control restriction's header
    (the repository index is a model-control request)."""
    restriction = getattr(server, "restrict_model_control", None)
    headers = dict([parse_restriction(restriction)]) if restriction else None
    return TritonModels(server.http_url, headers)


class Supervisor:
    """Watches one TritonServer's models; recover() restarts it after a fault."""

    def __init__(self, server: TritonServer, board: HealthBoard, health_dir: Path, policy: RestartPolicy,
                 deadline_s: float = DEFAULT_DEADLINE_S, start_timeout_s: float = 600.0,
                 say: Callable[[str], None] = print):
        self.server, self.board, self.health_dir, self.policy = server, board, Path(health_dir), policy
        self.deadline_s, self.start_timeout_s, self.say = deadline_s, start_timeout_s, say
        self.watch: ModelWatch | None = None
        self._first_fault: Fault | None = None  # found by the first scan after a start, reported by check()
        self.stop_requested: Callable[[], bool] = lambda: False  # a stop signal came: no more restarts

    def clear_beats(self) -> None:
        """Beats of processes that are gone would only be read as silent ones."""
        shutil.rmtree(self.health_dir, ignore_errors=True)
        self.health_dir.mkdir(parents=True, exist_ok=True)

    def started(self) -> None:
        """After every (re)start: watch the new processes and the models the server serves.
        A fault the first scan finds (a stub that died while the server came up) is the
        next check()'s answer."""
        assert self.server.process is not None
        self.watch = ModelWatch(self.server.process.pid, self.health_dir, triton_models(self.server), self.deadline_s)
        self._first_fault = self.watch.check()
        self.board.follow(self.watch.views())

    def check(self) -> Fault | None:
        """The first fault now, or None; the board follows what the server serves."""
        process = self.server.process
        if process is not None and process.poll() is not None:
            exited = f"tritonserver exited with {describe_exit(process.returncode)}"
            # a model's process that died first is the cause (tritonserver 2.51 has been seen
            # to abort right after a stub was killed): name it
            first = self.watch.first_death() if self.watch is not None else None
            if first is not None:
                return Fault(first.model, first.kind, f"{first.cause}, then {exited}")
            return Fault(SERVER, "server_exited", exited)
        if self.watch is None:
            return None
        fault, self._first_fault = self._first_fault, None
        if fault is None:
            fault = self.watch.check()
        self.board.follow(self.watch.views())
        return fault

    def recover(self, fault: Fault) -> int | None:
        """Kill the server and start it again, backing off between failed attempts. None
        once it serves again; EXIT_GAVE_UP when the policy says stop. A signal during the
        wait or the start raises KeyboardInterrupt (serve's handler), the server stopped."""
        what = fault.describe()
        t0 = time.monotonic()
        cause, kind = what, fault.kind
        # the board first: the clients' connections break at the kill, and the OpenAI frontend
        # reads the reason from the board when they do
        delay = self._mark(fault.model, cause, kind)
        self.say(f"FAULT {what}: restarting tritonserver (in-flight requests end with an error; "
                 f"readiness is off until it serves again)")
        self.server.kill()
        while delay is not None:
            if self.stop_requested():
                raise KeyboardInterrupt
            if delay:
                self.say(f"restarting tritonserver in {delay:g} s")
                time.sleep(delay)
            self.clear_beats()
            try:
                self.server.start(timeout_s=self.start_timeout_s, append_log=True)
            except ServerStartError as e:
                first = str(e).splitlines()
                cause, kind = f"the restart failed: {'; '.join(first[:2])}", "load_failed"
                self.say(f"FAULT {cause}")
                delay = self._mark(fault.model, cause, kind)
                continue
            self.started()
            self.say(f"recovered: tritonserver serves again {time.monotonic() - t0:.1f} s after the fault "
                     f"({self.policy.recent()} restart(s) in the last {self.policy.window_s:g} s)")
            return None
        self.say(f"recovery {self.board.status()['gave_up']}; exiting with code {EXIT_GAVE_UP} so that the "
                 "orchestrator restarts the pod")
        return EXIT_GAVE_UP

    def _mark(self, model: str, cause: str, kind: str) -> float | None:
        """Count a restart of `model` and return the wait before it; None (and the board
        says so) when the policy gives up."""
        delay = self.policy.next_delay()
        if delay is None:
            self.board.give_up(f"gave up after {self.policy.max_restarts} restarts within {self.policy.window_s:g} s; "
                               f"last fault: {cause}")
        else:
            self.board.recovering(model, cause, kind)
        return delay
