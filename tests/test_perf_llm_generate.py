"""`tritonlm perf llm` against the real tritonlm generation model (perf_analyzer --streaming)."""

from __future__ import annotations

import csv
import subprocess
import sys

from tests.genrepo import add_generation_model


def test_perf_llm_measures_the_generation_model(tmp_path):
    repo = tmp_path / "repo"
    add_generation_model(repo, "tiny")
    results = tmp_path / "results"
    out = subprocess.run(
        [
            sys.executable, "-m", "tritonlm.cli", "perf", "llm", "--serve", "--repo", str(repo), "--model", "tiny",
            "--concurrency", "1,2", "--output-tokens", "12", "--fixed-output-length", "--prompt-tokens", "8",
            "--requests-per-concurrency", "5", "--results", str(results),
        ],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = list(csv.DictReader(open(results / "llm.csv")))
    assert [int(r["concurrency"]) for r in rows] == [1, 2]
    for row in rows:
        assert int(row["requests"]) >= 10
        assert float(row["tokens_per_request"]) == 12.0  # the server's own count, every request full length
        assert 0 < float(row["ttft_p50_ms"]) <= float(row["latency_p50_ms"])
        assert float(row["itl_avg_ms"]) > 0 and float(row["output_tokens_per_s"]) > 0
