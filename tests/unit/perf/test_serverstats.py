"""tritonlm/perf/serverstats.py: Prometheus text parsed as prometheus_client's own parser reads
what its own exposition writes; process trees and their memory against /proc read another way;
waiting for an engine to go idle against a metrics endpoint that says when it is."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tritonlm.perf.serverstats import (
    is_idle,
    metric_sum,
    parse_prometheus,
    process_tree,
    process_tree_rss,
    wait_idle,
)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")


def exposition() -> str:
    """Metrics shaped like Triton's and tritonlm's: labelled counters and gauges for two
    models, a histogram (its +Inf bucket), a metric with no labels, a NaN gauge."""
    registry = CollectorRegistry()
    success = Counter("nv_inference_request_success", "ok requests", ["model", "version"], registry=registry)
    success.labels("gpt2", "1").inc(7)
    success.labels("gpt2", "2").inc(5)
    success.labels("llama", "1").inc(3)
    waiting = Gauge("tritonlm_requests_waiting", "queued", ["model", "instance"], registry=registry)
    waiting.labels("gpt2", "gpt2_0").set(2)
    waiting.labels("gpt2", "gpt2_1").set(4.5)
    waiting.labels("llama", "llama_0").set(1)
    ttft = Histogram("tritonlm_ttft_seconds", "ttft", ["model"], buckets=(0.1, 1.0), registry=registry)
    for v in (0.05, 0.5, 3.0):
        ttft.labels("gpt2").observe(v)
    Gauge("process_up", "no labels", registry=registry).set(1)
    Gauge("odd_value", "nan", ["model"], registry=registry).labels("gpt2").set(float("nan"))
    return generate_latest(registry).decode()


def reference(text: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def test_parse_prometheus_reads_what_prometheus_client_reads():
    text = exposition()
    got = parse_prometheus(text)
    expected = reference(text)
    assert len(expected) > 15  # counters with _created, histogram buckets, ...
    assert same(got, expected), set(got.items()) ^ set(expected.items())
    assert got[("tritonlm_ttft_seconds_bucket", (("le", "+Inf"), ("model", "gpt2")))] == 3
    assert got[("process_up", ())] == 1


def test_parse_prometheus_skips_what_is_no_sample():
    text = "# HELP x a metric\n# TYPE x gauge\n\nx{model=\"m\"} 2 1700000000000\nnot a sample line\ny{model=\"m\"} many\n"
    assert parse_prometheus(text) == {("x", (("model", "m"),)): 2.0}


def test_metric_sum_sums_a_models_series_and_says_when_a_metric_is_absent():
    samples = parse_prometheus(exposition())
    assert metric_sum(samples, "nv_inference_request_success_total", "gpt2") == 12  # both versions
    assert metric_sum(samples, "nv_inference_request_success_total", "llama") == 3
    assert metric_sum(samples, "nv_inference_request_success_total") == 15
    assert metric_sum(samples, "tritonlm_requests_waiting", "gpt2") == 6.5  # both instances
    assert metric_sum(samples, "tritonlm_requests_waiting", "mistral") is None
    assert metric_sum(samples, "no_such_metric") is None


def test_is_idle_needs_gauges_all_zero():
    assert is_idle({"requests_waiting": 0, "requests_running": 0.0, "kv_cache_used_bytes": 0})
    assert not is_idle({"requests_waiting": 0, "requests_running": 1, "kv_cache_used_bytes": 0})
    assert not is_idle({})  # nothing read is not idle


class _Metrics(BaseHTTPRequestHandler):
    """/metrics: the engine busy for the first `busy_reads` reads, idle after."""

    def do_GET(self):
        server = self.server
        with server.lock:
            server.reads += 1
            busy = server.reads <= server.busy_reads
        body = (
            f'tritonlm_requests_waiting{{model="m",instance="m_0"}} {1 if busy else 0}\n'
            f'tritonlm_requests_running{{model="m",instance="m_0"}} {2 if busy else 0}\n'
            f'tritonlm_kv_cache_used_bytes{{model="m",instance="m_0"}} {4096 if busy else 0}\n'
            f'tritonlm_requests_running{{model="other",instance="other_0"}} 9\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    server.lock, server.reads, server.busy_reads = threading.Lock(), 0, 3
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_wait_idle_polls_until_the_models_gauges_are_zero(metrics_server):
    server, url = metrics_server
    gauges, waited = wait_idle(url, "m", timeout_s=600, poll_s=0.001)
    assert gauges == {"requests_waiting": 0, "requests_running": 0, "kv_cache_used_bytes": 0}
    assert server.reads == server.busy_reads + 1  # stopped at the first idle read
    assert waited >= 0


def test_wait_idle_gives_up_after_its_timeout_with_the_last_gauges(metrics_server):
    server, url = metrics_server
    server.busy_reads = 10**9
    gauges, waited = wait_idle(url, "m", timeout_s=0.0, poll_s=0.001)
    assert not is_idle(gauges) and gauges["requests_running"] == 2  # the other model's 9 not counted
    assert waited > 0


@pytest.fixture
def child_with_grandchild():
    """A child process that started a grandchild and waits on its stdin."""
    code = (
        "import subprocess, sys\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import sys; print(flush=True); sys.stdin.read()'],\n"
        "                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
        "g.stdout.readline()\n"  # the grandchild is up and waiting
        "print(g.pid, flush=True)\n"
        "sys.stdin.read()\n"
        "g.stdin.close(); g.wait()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    yield child.pid, grandchild
    child.stdin.close()
    child.wait(timeout=60)


@linux_only
def test_process_tree_holds_the_process_and_its_descendants(child_with_grandchild):
    child, grandchild = child_with_grandchild
    tree = process_tree(child)
    assert tree[0] == child and set(tree) == {child, grandchild}
    assert {child, grandchild} <= set(process_tree(os.getpid()))


@linux_only
def test_process_tree_rss_adds_each_processes_resident_pages(child_with_grandchild):
    child, grandchild = child_with_grandchild
    page = os.sysconf("SC_PAGE_SIZE")

    def statm() -> int:  # /proc/PID/statm's second field: resident pages, the counters VmRSS also sums
        return sum(int(open(f"/proc/{p}/statm").read().split()[1]) * page for p in (child, grandchild))

    before = statm()
    total, count = process_tree_rss(child)
    after = statm()
    assert count == 2
    assert min(before, after) <= total <= max(before, after)  # both wait on stdin: their memory holds still
    assert process_tree_rss(2**22 + 12345) == (0, 0)  # no such process
