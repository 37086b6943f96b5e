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
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from tritonlm.server import ServerStartError, TritonServer
from tritonlm.supervise.health import HealthBoard
from tritonlm.supervise.procs import describe_exit
from tritonlm.supervise.recovery import RestartPolicy
from tritonlm.supervise.watch import DEFAULT_DEADLINE_S, SERVER, Fault, ModelWatch

EXIT_GAVE_UP = 3  # serve's exit code when recovery gives up (1: tritonserver failed otherwise)
POLL_S = 0.2


def repository_models(repo: Path) -> list[str]:
    return sorted(p.name for p in Path(repo).iterdir() if (p / "config.pbtxt").is_file())


class Supervisor:
    """Watches one TritonServer's models; recover() restarts it after a fault."""

    def __init__(self, server: TritonServer, board: HealthBoard, health_dir: Path, policy: RestartPolicy,
                 deadline_s: float = DEFAULT_DEADLINE_S, start_timeout_s: float = 600.0,
                 say: Callable[[str], None] = print):
        self.server, self.board, self.health_dir, self.policy = server, board, Path(health_dir), policy
        self.deadline_s, self.start_timeout_s, self.say = deadline_s, start_timeout_s, say
        self.watch: ModelWatch | None = None
        self.stop_requested: Callable[[], bool] = lambda: False  # a stop signal came: no more restarts

    def clear_beats(self) -> None:
        """Beats of processes that are gone would only be read as silent ones."""
        shutil.rmtree(self.health_dir, ignore_errors=True)
        self.health_dir.mkdir(parents=True, exist_ok=True)

    def started(self) -> None:
        """After every (re)start: watch the new processes; every model serves."""
        assert self.server.process is not None
        self.watch = ModelWatch(self.server.process.pid, self.health_dir, self._model_served, self.deadline_s)
        self.watch.check()  # the first scan: every stub there is now
        processes = {pid: w.stub.model for pid, w in self.watch.watched.items()}
        for w in self.watch.watched.values():
            processes.update({worker: w.stub.model for worker in w.workers})
        self.board.set_models(repository_models(self.server.repo), processes)

    def _model_served(self, model: str) -> bool:
        """Triton's ready endpoint for the model; True when it cannot be asked (a dead server
        is the server check's business)."""
        try:
            with urllib.request.urlopen(f"http://{self.server.http_url}/v2/models/{model}/ready", timeout=2) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False
        except (urllib.error.URLError, OSError):
            return True

    def check(self) -> Fault | None:
        process = self.server.process
        if process is not None and process.poll() is not None:
            exited = f"tritonserver exited with {describe_exit(process.returncode)}"
            # a model's process that died first is the cause (tritonserver 2.51 has been seen
            # to abort right after a stub was killed): name it
            first = self.watch.check() if self.watch is not None else None
            if first is not None and first.kind in ("died", "worker_died"):
                return Fault(first.model, first.kind, f"{first.cause}, then {exited}")
            return Fault(SERVER, "server_exited", exited)
        return self.watch.check() if self.watch is not None else None

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
