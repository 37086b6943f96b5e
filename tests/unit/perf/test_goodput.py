"""tritonlm/perf/goodput.py: per-request TTFT/TPOT/ITL and the goodput summary on hand-made
records, against figures worked out here by hand and with numpy (vLLM's definitions: a target
not set is not checked, a one-token answer has no TPOT, a shed request never meets the SLO);
bad options are named before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest

from tritonlm.cli import main as cli_main
from tritonlm.perf.goodput import Slo, meets_slo, parse_rates, request_metrics, request_rows, summarize_run
from tritonlm.perf.openloop import RequestRecord


def answered(index: int, sent: float, chunks: list[float], tokens: int | None = None, end: float | None = None) -> RequestRecord:
    r = RequestRecord(index, sent, 16, len(chunks) if tokens is None else tokens)
    r.sent_s, r.status, r.chunk_s = sent, "ok", list(chunks)
    r.served_output_tokens = tokens
    r.end_s = chunks[-1] if end is None else end
    return r


def refused(index: int, sent: float, status: str = "shed") -> RequestRecord:
    r = RequestRecord(index, sent, 16, 8)
    r.sent_s, r.status, r.end_s, r.error = sent, status, sent + 0.001, "HTTP 503: overloaded"
    return r


def test_ttft_tpot_and_itls_of_one_request():
    # sent at 1.0 s; tokens at 1.25, 1.30, 1.40, 1.45 s; the server counted 4
    r = answered(0, 1.0, [1.25, 1.30, 1.40, 1.45], tokens=4, end=1.46)
    m = request_metrics(r)
    assert m.ttft_ms == pytest.approx(250.0)
    assert m.tpot_ms == pytest.approx((1.45 - 1.25) * 1000 / 3)
    assert m.itls_ms == pytest.approx((50.0, 100.0, 50.0))
    assert m.latency_ms == pytest.approx(460.0) and m.output_tokens == 4
    # the server's count beats the responses (here: 6 tokens in 4 responses)
    assert request_metrics(answered(0, 1.0, [1.25, 1.30, 1.40, 1.45], tokens=6)).tpot_ms == pytest.approx(200.0 / 5)
    # one token: no TPOT; a refusal: nothing
    assert request_metrics(answered(0, 0.0, [0.1], tokens=1)).tpot_ms is None
    shed = request_metrics(refused(0, 0.0))
    assert shed.ttft_ms is None and shed.tpot_ms is None and shed.itls_ms == () and shed.output_tokens == 0


def test_the_slo_checks_only_the_targets_set():
    r = answered(0, 0.0, [0.25, 0.3125, 0.375], tokens=3)  # TTFT 250 ms, TPOT 62.5 ms (exact in binary)
    m = request_metrics(r)
    assert meets_slo(r, m, Slo()) and meets_slo(r, m, Slo(ttft_ms=250)) and meets_slo(r, m, Slo(tpot_ms=62.5))
    assert not meets_slo(r, m, Slo(ttft_ms=249)) and not meets_slo(r, m, Slo(ttft_ms=1000, tpot_ms=62))
    one = answered(1, 0.0, [0.1], tokens=1)
    assert meets_slo(one, request_metrics(one), Slo(ttft_ms=200, tpot_ms=1e-6))  # no TPOT to miss
    shed = refused(2, 0.0)
    assert not meets_slo(shed, request_metrics(shed), Slo())


def test_the_summary_against_numpy():
    rng = np.random.default_rng(3)
    records = []
    for i in range(40):
        sent = i * 0.25
        if i % 7 == 3:
            records.append(refused(i, sent))
        elif i == 20:
            records.append(refused(i, sent, "error"))
        else:
            ttft = rng.uniform(0.05, 0.6)
            gaps = rng.uniform(0.01, 0.09, size=int(rng.integers(0, 12)))
            chunks = (sent + ttft + np.concatenate([[0.0], np.cumsum(gaps)])).tolist()
            records.append(answered(i, sent, chunks, tokens=len(chunks)))
    slo = Slo(ttft_ms=400.0, tpot_ms=60.0)
    row = summarize_run(records, 4.0, slo)

    ok = [r for r in records if r.status == "ok"]
    ttft = np.array([(r.chunk_s[0] - r.sent_s) * 1e3 for r in ok])
    tpot = np.array([(r.chunk_s[-1] - r.chunk_s[0]) * 1e3 / (len(r.chunk_s) - 1) for r in ok if len(r.chunk_s) > 1])
    itl = np.concatenate([np.diff(r.chunk_s) * 1e3 for r in ok])
    met = sum(1 for r in ok if (r.chunk_s[0] - r.sent_s) * 1e3 <= 400
              and (len(r.chunk_s) < 2 or (r.chunk_s[-1] - r.chunk_s[0]) * 1e3 / (len(r.chunk_s) - 1) <= 60))
    duration = max(r.end_s for r in records)
    assert 0 < met < len(ok)  # the data exercise both sides of the targets
    assert (row["requests"], row["ok"], row["shed"], row["errors"], row["met_slo"]) == (40, len(ok), 6, 1, met)
    assert row["goodput_rps"] == pytest.approx(met / duration, abs=1e-3)
    assert row["throughput_rps"] == pytest.approx(len(ok) / duration, abs=1e-3)
    assert row["attainment_pct"] == pytest.approx(100 * met / 40, abs=0.05)
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 99):
            assert row[f"{name}_p{q}_ms"] == pytest.approx(np.percentile(values, q), abs=0.006)
    assert row["sent_rate"] == pytest.approx(40 / (39 * 0.25), abs=1e-3)
    rows = request_rows(records, 4.0, slo)
    assert sum(r["met_slo"] for r in rows) == met and [r["status"] for r in rows] == [r.status for r in records]


def test_a_run_with_every_request_shed_has_no_goodput():
    row = summarize_run([refused(i, i * 0.5) for i in range(4)], 2.0, Slo(ttft_ms=100))
    assert (row["shed"], row["ok"], row["met_slo"], row["goodput_rps"], row["attainment_pct"]) == (4, 0, 0, 0.0, 0.0)
    assert np.isnan(row["ttft_p50_ms"])


@pytest.mark.parametrize("text", ["", "1,x", "0.5,-1", "nan"])
def test_bad_rates_are_named(text):
    from tritonlm.perf.target import PerfError

    with pytest.raises(PerfError, match="--rates: a comma-separated list of positive requests per second"):
        parse_rates(text)


@pytest.mark.parametrize("argv, message", [
    (["--arrivals", "gamma:1"], "arrivals: 'gamma:1' is not 'poisson:RATE' or 'gamma:RATE:CV'"),
    (["--rates", "1,fast"], "--rates: a comma-separated list"),
    (["--slo-ttft-ms", "-5"], "--slo-ttft-ms: a positive number of milliseconds, got -5.0"),
    (["--count", "0"], "--count: at least 1 request, got 0"),
    (["--duration", "0.001", "--arrivals", "poisson:0.001"], "--duration 0.001 s holds no arrival at poisson:0.001"),
    (["--tokenizer", "/nonexistent/tok"], "--tokenizer /nonexistent/tok: cannot load it"),
])
def test_bad_options_are_one_line_before_anything_is_sent(tmp_path, capsys, argv, message):
    # nothing listens at port 9: an option error must come before any request
    rc = cli_main(["perf", "goodput", "--openai", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert rc == 1 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
