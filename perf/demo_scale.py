"""Two `tritonlm serve` replicas behind a real nginx, one restarted under load.

Everything runs on this machine, on loopback: the script builds a tiny-gpt2 repository
(seeded random weights, no download), starts two `tritonlm serve` replicas on their own
ports and nginx (Debian's package, `make setup` installs it) as the current user with a
generated config in a temporary folder. Then, with --clients threads sending greedy
generation requests (Triton's HTTP generate extension, keep-alive connections) to nginx
without a pause:

  1. one replica behind nginx (an upstream with only A): req/s for --measure seconds;
  2. two replicas behind nginx (least_conn over A and B): req/s for --measure seconds;
  3. restart under load: SIGTERM B (it drains and exits), start it again, wait until it
     is ready and has served again, keep loading for --after seconds.

Every response is checked against transformers' generate() on the same weights (greedy:
the text must be equal, token for token). A request that errors, times out or comes back
different is lost; the goal is 0. The script exits 1 when a request was lost.

    .venv/bin/python perf/demo_scale.py [--clients 16] [--measure 15] [--after 5]

Writes results/demo_scale/demo_scale.csv (one row per phase). On a machine with few cores
the second replica adds little (both share the same cores; the CPU is printed): the point
here is the restart without loss, not the speed-up.
"""

from __future__ import annotations

import argparse
import csv
import getpass
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tritonlm.paths import REPO_ROOT
from tritonlm.perf.machine import describe_cpu
from tritonlm.perf.serverstats import metric_sum, read_metrics
from tritonlm.server import free_ports
from tritonlm_bench.benchrepo import tiny_model_repo

MODEL = "tiny"
PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "Numbers: 1 2 3 4 5",
    "def main(): return",
    "Hello, my name is",
    "The weather today is",
    "In the beginning",
    "A quick brown fox",
]
MAX_TOKENS = 16
OUT_DIR = REPO_ROOT / "results" / "demo_scale"

# nginx in front of the replicas. Why the retry settings look like this (tritonserver
# through `tritonlm serve`; deploy/README.md):
#   * a draining replica (SIGTERM) stops accepting on its HTTP port, but the socket stays
#     bound until the process exits: the kernel still completes the TCP handshake and Triton
#     then RESETS the connection without reading the request. nginx has already written the
#     request by then, so for a POST (inference) it counts as "sent" and, by default, does
#     not retry: the client would get a 502. `non_idempotent` lets it retry;
#   * once the replica has exited, connections are refused: `error`, retried for any method;
#   * 503 is Triton's UNAVAILABLE (not ready, shutting down) and 502 a proxy's "no upstream":
#     answers from something that could not take the request, retried.
# Retrying a POST is safe here because a generation request has no side effects: the reset
# case never reached the model, and the only other case `error` + `non_idempotent` covers
# (a replica killed mid-request, e.g. at its drain deadline) reruns a request whose answer
# the client never got. `timeout` is only the connect timeout in practice: the read timeout
# (the longest generation) is far longer, so a slow answer is never sent twice.
NGINX_CONF = """\
daemon off;
master_process on;
worker_processes 1;
{user}pid {pid};
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    log_format upstreams '$msec $status "$upstream_addr" "$upstream_status" $request_time';
    access_log {tmp}/access_{port}.log upstreams;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream tritonlm {{
        least_conn;
        {servers}
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 16m;
        location / {{
            proxy_pass http://tritonlm;
            proxy_connect_timeout 2s;
            proxy_send_timeout 60s;
            proxy_read_timeout 600s;
            proxy_next_upstream error timeout http_502 http_503 non_idempotent;
            proxy_next_upstream_tries 4;
            proxy_next_upstream_timeout 30s;
        }}
    }}
}}
"""


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
    if found is None:
        raise SystemExit("nginx is not installed: run `make setup` (scripts/setup_system.sh installs Debian's nginx)")
    return found


def reference_texts(model, tok, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """transformers' greedy generate() on the served weights: the text each prompt must get."""
    refs = {}
    for p in prompts:
        ids = tok(p, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        new = out[0, ids.input_ids.shape[1]:].tolist()
        if tok.eos_token_id in new:
            new = new[: new.index(tok.eos_token_id)]
        refs[p] = tok.decode(new)
    return refs


class Replica:
    """One `tritonlm serve` process on fixed ports (a restart comes back on the same ones)."""

    def __init__(self, name: str, repo: Path, workdir: Path, drain_s: float = 30.0):
        self.name, self.repo, self.workdir, self.drain_s = name, repo, workdir, drain_s
        self.http, self.grpc, self.metrics = free_ports(3)
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.workdir / f"replica_{self.name}_{self.starts}.out", "w")
        self.proc = subprocess.Popen(
            [str(REPO_ROOT / ".venv" / "bin" / "tritonlm"), "serve", "--repo", str(self.repo),
             "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
             "--openai-port", "0", "--health-port", "0", "--drain-timeout", f"{self.drain_s:g}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()

    @property
    def output(self) -> str:
        path = self.workdir / f"replica_{self.name}_{self.starts}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica {self.name} exited with {self.proc.returncode}:\n{self.output[-3000:]}")
            if self.ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"replica {self.name} not ready in {timeout_s:.0f} s:\n{self.output[-3000:]}")

    def successes(self) -> int:
        """Triton's own count of requests this process ran (it starts at 0 in a new process)."""
        try:
            samples = read_metrics(f"http://127.0.0.1:{self.metrics}/metrics", timeout_s=2)
        except (urllib.error.URLError, OSError):
            return 0
        return int(metric_sum(samples, "nv_inference_request_success", MODEL) or 0)

    def terminate_and_wait(self, timeout_s: float = 120) -> int:
        """SIGTERM (what Kubernetes sends): the replica drains and exits; its exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_s)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.send_signal(signal.SIGINT)  # the second one kills tritonserver outright
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


class Nginx:
    """nginx as the current user: config, pid, logs and temp files all in workdir."""

    def __init__(self, workdir: Path, upstreams: list[int]):
        self.workdir = workdir
        self.port = free_ports(1)[0]
        self.conf = workdir / f"nginx_{self.port}.conf"
        servers = "\n        ".join(f"server 127.0.0.1:{p} max_fails=1 fail_timeout=2s;" for p in upstreams)
        # a master started as root would hand its workers to `nobody`, who cannot write here
        user = f"user {getpass.getuser()};\n" if os.geteuid() == 0 else ""
        self.conf.write_text(NGINX_CONF.format(user=user, tmp=workdir, port=self.port, servers=servers,
                                               pid=workdir / f"nginx_{self.port}.pid"))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def access_log(self) -> Path:
        return self.workdir / f"access_{self.port}.log"

    def start(self, timeout_s: float = 20) -> None:
        binary = nginx_binary()
        check = subprocess.run([binary, "-t", "-p", str(self.workdir), "-c", str(self.conf), "-e",
                                str(self.workdir / "error.log")], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"nginx rejects its config:\n{check.stderr}")
        self.proc = subprocess.Popen([binary, "-p", str(self.workdir), "-c", str(self.conf), "-e",
                                      str(self.workdir / "error.log")], start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}: "
                                   f"{(self.workdir / 'error.log').read_text(errors='replace')[-2000:]}")
            try:
                urllib.request.urlopen(f"http://{self.url}/", timeout=2)
                return
            except urllib.error.HTTPError:
                return  # it answers (Triton's 4xx for "/" through the proxy, or a 502)
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        raise RuntimeError("nginx did not start listening")

    def retried(self, since: float = 0.0) -> int:
        """Requests nginx passed to more than one replica (its access log lists each one tried)."""
        if not self.access_log.exists():
            return 0
        n = 0
        for line in self.access_log.read_text().splitlines():
            m = re.match(r'(\S+) \d+ "([^"]*)"', line)
            if m and float(m.group(1)) >= since and ", " in m.group(2):
                n += 1
        return n

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish open requests
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


@dataclass
class LoadStats:
    ok: int = 0
    lost: int = 0
    reasons: Counter = field(default_factory=Counter)
    done_times: list[float] = field(default_factory=list)


class Load:
    """--clients threads, each sending one greedy generation request after another to url."""

    def __init__(self, url: str, clients: int, refs: dict[str, str], max_tokens: int, timeout_s: float = 120):
        self.url, self.clients, self.refs, self.max_tokens, self.timeout_s = url, clients, refs, max_tokens, timeout_s
        self.stats = LoadStats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s + 10)

    def count(self) -> tuple[int, int]:
        with self._lock:
            return self.stats.ok, self.stats.lost

    def _client(self, i: int) -> None:
        host, port = self.url.rsplit(":", 1)
        # one keep-alive connection per client, as a real client would hold; a new one after a failure
        conn: http.client.HTTPConnection | None = None
        n = 0
        while not self._stop.is_set():
            prompt = PROMPTS[(i + n) % len(PROMPTS)]
            n += 1
            if conn is None:
                conn = http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)
            verdict = self._one(conn, prompt)
            with self._lock:
                if verdict is None:
                    self.stats.ok += 1
                    self.stats.done_times.append(time.monotonic())
                else:
                    self.stats.lost += 1
                    self.stats.reasons[verdict] += 1
            if verdict is not None:
                conn.close()
                conn = None
                time.sleep(0.05)  # a failing client must not spin
        if conn is not None:
            conn.close()

    def _one(self, conn: http.client.HTTPConnection, prompt: str) -> str | None:
        """None when the answer is complete and equal to the reference; else why not.

        Triton's generate extension (POST /v2/models/NAME/generate, one JSON answer): its
        KServe infer endpoint, which tritonclient.http speaks, refuses decoupled models (501)."""
        body = json.dumps({"text_input": prompt, "max_tokens": self.max_tokens, "exclude_input_in_output": True})
        try:
            conn.request("POST", f"/v2/models/{MODEL}/generate", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read()
        except (OSError, http.client.HTTPException) as e:
            return f"{type(e).__name__}: {str(e)[:120]}"
        if r.status != 200:
            return f"HTTP {r.status}: {raw[:160].decode(errors='replace')}"
        try:
            answer = json.loads(raw)
        except ValueError:
            return "incomplete: the body is not JSON"
        if answer.get("finish_reason") not in ("length", "stop"):
            return f"finish_reason {answer.get('finish_reason')}"
        if answer.get("text_output") != self.refs[prompt]:
            return "text differs from transformers' greedy output"
        return None


def run_load(url: str, clients: int, refs: dict[str, str], max_tokens: int, seconds: float) -> tuple[LoadStats, float]:
    """Steady load for `seconds`; (stats, completed req/s after the first second's warm-up)."""
    with Load(url, clients, refs, max_tokens) as load:
        time.sleep(1.0)
        start_ok, t0 = load.count()[0], time.monotonic()
        time.sleep(seconds)
        ok, t1 = load.count()[0], time.monotonic()
    return load.stats, (ok - start_ok) / (t1 - t0)


@dataclass
class DemoResult:
    cpu: str
    cpus: int
    rps_one: float
    rps_two: float
    restart_ok: int
    restart_lost: int
    lost_total: int
    reasons: Counter
    retried: int
    drain_exit_code: int
    drain_s: float
    restart_ready_s: float
    served_after_restart: int
    rows: list[dict]
    crashes: list[str]  # replicas found exited without being asked to (their output is logged)


def run_demo(clients: int = 16, measure_s: float = 15.0, after_s: float = 5.0, max_tokens: int = MAX_TOKENS,
             out_dir: Path | None = OUT_DIR, log=print) -> DemoResult:
    cpu = describe_cpu()
    log(f"CPU: {cpu}")
    log(f"{os.cpu_count()} CPUs: both replicas, nginx and the {clients} client threads share them "
        f"(with few cores a second replica adds little)")
    with tempfile.TemporaryDirectory(prefix="tritonlm-scale-") as tmp_name:
        tmp = Path(tmp_name)
        repo = tmp / "repo"
        model, tok = tiny_model_repo(repo, MODEL)
        a, b = Replica("A", repo, tmp), Replica("B", repo, tmp)
        nginx_one = Nginx(tmp, [a.http])
        nginx_two = Nginx(tmp, [a.http, b.http])
        crashes: list[str] = []
        reported: set[int] = set()  # processes already reported

        def check_alive(phase: str) -> None:
            # nginx hides a dead replica (it retries on the other): look at the processes too
            for r in (a, b):
                if r.proc is not None and r.proc.poll() is not None and r.proc.pid not in reported:
                    reported.add(r.proc.pid)
                    crashes.append(f"{phase}: {r.name} exited with {r.proc.returncode}")
                    log(f"replica {r.name} exited on its own during {phase} (code {r.proc.returncode}):\n"
                        f"{r.output[-3000:]}")

        try:
            a.start()
            b.start()
            refs = reference_texts(model, tok, PROMPTS, max_tokens)  # while the replicas load
            a.wait_ready()
            b.wait_ready()
            nginx_one.start()
            nginx_two.start()
            log(f"replicas: A http {a.http}, B http {b.http}; nginx: 1 replica on {nginx_one.port}, "
                f"2 replicas on {nginx_two.port}")

            one, rps_one = run_load(nginx_one.url, clients, refs, max_tokens, measure_s)
            log(f"1 replica : {rps_one:7.1f} req/s ({one.ok} ok, {one.lost} lost)")
            check_alive("1 replica")
            two, rps_two = run_load(nginx_two.url, clients, refs, max_tokens, measure_s)
            log(f"2 replicas: {rps_two:7.1f} req/s ({two.ok} ok, {two.lost} lost)")
            check_alive("2 replicas")

            # restart B under load: SIGTERM (drain, exit), start, ready, serving again
            since = time.time()
            with Load(nginx_two.url, clients, refs, max_tokens) as load:
                time.sleep(1.0)
                check_alive("restart")
                t0 = time.monotonic()
                code = b.terminate_and_wait()
                drain_s = time.monotonic() - t0
                log(f"replica B: SIGTERM -> exit {code} after {drain_s:.1f} s; restarting")
                if code != 0:
                    log(f"----- replica B output -----\n{b.output[-3000:]}")
                t1 = time.monotonic()
                b.start()
                b.wait_ready()
                ready_s = time.monotonic() - t1
                log(f"replica B: ready again after {ready_s:.1f} s")
                # nginx tries a replica it marked failed again after fail_timeout (2 s): wait
                # until B has really served through it, then keep loading for after_s
                t2 = time.monotonic()
                while b.successes() == 0 and time.monotonic() - t2 < 30:
                    time.sleep(0.2)
                log(f"replica B: serving again {time.monotonic() - t2:.1f} s after ready")
                time.sleep(after_s)
                served = b.successes()
                check_alive("after the restart")
            restart = load.stats
            check_alive("end of the load")
            retried = nginx_two.retried(since)
            log(f"restart under load: {restart.ok} ok, {restart.lost} lost; nginx retried {retried} request(s) "
                f"on the other replica; B served {served} after its restart")
        except BaseException:
            for r in (a, b):
                log(f"----- replica {r.name} output -----\n{r.output[-3000:]}")
            err = tmp / "error.log"
            if err.exists():
                log(f"----- nginx error.log -----\n{err.read_text(errors='replace')[-3000:]}")
            raise
        finally:
            nginx_one.stop()
            nginx_two.stop()
            a.kill()
            b.kill()

    reasons = one.reasons + two.reasons + restart.reasons
    rows = [
        {"phase": "1 replica", "replicas": 1, "clients": clients, "seconds": measure_s, "req_per_s": round(rps_one, 2),
         "ok": one.ok, "lost": one.lost},
        {"phase": "2 replicas", "replicas": 2, "clients": clients, "seconds": measure_s, "req_per_s": round(rps_two, 2),
         "ok": two.ok, "lost": two.lost},
        {"phase": "restart B under load", "replicas": 2, "clients": clients, "seconds": round(drain_s + ready_s + after_s, 1),
         "req_per_s": "", "ok": restart.ok, "lost": restart.lost},
    ]
    result = DemoResult(cpu, os.cpu_count() or 0, rps_one, rps_two, restart.ok, restart.lost,
                        one.lost + two.lost + restart.lost, reasons, retried, code, drain_s, ready_s, served, rows,
                        crashes)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / "demo_scale.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["phase", "replicas", "clients", "seconds", "req_per_s", "ok", "lost",
                                              "cpu", "max_tokens"])
            w.writeheader()
            for row in rows:
                w.writerow({**row, "cpu": cpu, "max_tokens": max_tokens})
        log(f"wrote {out_dir / 'demo_scale.csv'}")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--measure", type=float, default=15.0, help="seconds of load per req/s figure")
    p.add_argument("--after", type=float, default=5.0, help="seconds of load after the restarted replica is ready")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--out", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    r = run_demo(args.clients, args.measure, args.after, args.max_tokens, args.out)
    print()
    print(f"CPU: {r.cpu}")
    print(f"req/s, {args.clients} clients, greedy {args.max_tokens} tokens: 1 replica {r.rps_one:.1f}, "
          f"2 replicas {r.rps_two:.1f} (x{r.rps_two / max(r.rps_one, 1e-9):.2f} on {r.cpus} CPUs)")
    print(f"lost requests: {r.lost_total} (restart phase: {r.restart_lost} of {r.restart_ok + r.restart_lost})"
          + (f"  {dict(r.reasons)}" if r.reasons else ""))
    if r.crashes:
        print(f"replicas that exited on their own (nginx sent their traffic to the other): {'; '.join(r.crashes)}")
    return 0 if r.lost_total == 0 and not r.crashes else 1


if __name__ == "__main__":
    sys.exit(main())
