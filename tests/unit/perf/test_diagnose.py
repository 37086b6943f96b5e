"""tritonlm/perf/diagnose.py without a server: server metrics (tritonlm/perf/serverstats.py's
Prometheus parser) summarized into an operating point, and the point classified with advice
that names the knobs to turn."""

from __future__ import annotations

import pytest

from tritonlm.perf import diagnose
from tritonlm.perf.serverstats import parse_prometheus


def _metrics(util, success, inferences, executions, queue_us, compute_us, gpu=False):
    lines = [
        f'nv_inference_request_success{{model="m",version="1"}} {success}',
        'nv_inference_request_success{model="other",version="1"} 999',
        f'nv_inference_count{{model="m",version="1"}} {inferences}',
        f'nv_inference_exec_count{{model="m",version="1"}} {executions}',
        f'nv_inference_queue_duration_us{{model="m",version="1"}} {queue_us}',
        f'nv_inference_compute_infer_duration_us{{model="m",version="1"}} {compute_us}',
        "# HELP nv_cpu_utilization CPU utilization rate [0.0 - 1.0]",
        f"nv_cpu_utilization {0.5 if gpu else util}",
    ]
    if gpu:
        lines += [f'nv_gpu_utilization{{gpu_uuid="GPU-a"}} {util}', f'nv_gpu_utilization{{gpu_uuid="GPU-b"}} {util}']
    return "\n".join(lines) + "\n"


def test_prometheus_samples_to_operating_point():
    parsed = parse_prometheus('a{x="1",y="q\\"z"} 2.5\nb 3\n# c 4\nbad line\n')
    assert parsed == {("a", (("x", "1"), ("y", 'q\\"z'))): 2.5, ("b", ()): 3.0}
    samples = [
        diagnose.Sample(0.0, parse_prometheus(_metrics(0.1, 100, 100, 50, 1000, 2000, gpu=True))),
        diagnose.Sample(0.5, parse_prometheus(_metrics(0.8, 300, 500, 100, 21000, 42000, gpu=True))),
        diagnose.Sample(1.0, parse_prometheus(_metrics(0.9, 500, 900, 150, 41000, 82000, gpu=True))),
    ]
    s = diagnose.summarize_samples(samples, "m")
    assert s["source"] == "gpu"
    assert s["utilization"] == pytest.approx(0.85)  # samples after the first, GPUs averaged
    assert (s["requests"], s["inferences"], s["executions"]) == (400, 800, 100)
    assert s["avg_batch"] == pytest.approx(8.0)
    assert s["queue_us"] == pytest.approx(100.0) and s["compute_us"] == pytest.approx(200.0)
    cpu = [diagnose.Sample(0, parse_prometheus(_metrics(0.3, 0, 0, 0, 0, 0))),
           diagnose.Sample(1, parse_prometheus(_metrics(0.4, 10, 10, 10, 0, 0)))]
    assert diagnose.summarize_samples(cpu, "m")["source"] == "cpu"
    assert diagnose.summarize_samples(cpu, "m")["utilization"] == pytest.approx(0.4)


@pytest.mark.parametrize(
    "util,p99,queue,compute,state",
    [
        (0.30, 20, 100, 900, diagnose.UNDER_BATCHED),
        (0.59, 200, 900, 100, diagnose.UNDER_BATCHED),
        (0.98, 150, 800, 200, diagnose.OVER_BATCHED),
        (0.98, 150, 100, 900, diagnose.MODEL_TOO_BIG),
        (0.78, 95, 300, 700, diagnose.ON_TARGET),
        (0.70, 40, 300, 700, diagnose.ON_TARGET),
        (0.85, 100, 300, 700, diagnose.ON_TARGET),
        (0.65, 50, 300, 700, diagnose.LIGHT_LOAD),
        (0.90, 80, 300, 700, diagnose.NEAR_SATURATION),
        (0.98, 80, 300, 700, diagnose.NEAR_SATURATION),
        (0.80, 130, 700, 300, diagnose.OVER_BUDGET),
    ],
)
def test_classify(util, p99, queue, compute, state):
    op = diagnose.OperatingPoint(util, "gpu", p99, 100.0, queue_us=queue, compute_us=compute, avg_batch=4, max_batch_size=8)
    d = diagnose.classify(op)
    assert d.state == state
    assert d.advice and d.summary


def test_classify_advice_names_the_knobs():
    under = diagnose.classify(diagnose.OperatingPoint(0.2, "cpu", 10, 100, avg_batch=1.2, max_batch_size=8))
    assert "max_batch_size" in under.advice[0] and "max_queue_delay" in under.advice[0]
    assert "average batch 1.2 of max 8" in under.summary
    big = diagnose.classify(diagnose.OperatingPoint(0.99, "gpu", 300, 100, queue_us=10, compute_us=990))
    assert "quantize" in big.advice[0] and "smaller model" in big.advice[0]
    assert any("instances" in a for a in big.advice)
