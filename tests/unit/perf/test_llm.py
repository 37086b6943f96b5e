"""tritonlm/perf/llm.py without a server: the profile export parser's exact timings, and the
datasets and input data `tritonlm perf llm` sends."""

from __future__ import annotations

import pytest

from tritonlm.perf import llm


MS = 1_000_000  # ns


def _request(sent_ms, token_ms, final_ms=None, pieces=None):
    pieces = pieces or [f" t{i}" for i in range(len(token_ms))]
    stamps = [int((sent_ms + t) * MS) for t in token_ms]
    outputs = [{"text_output": p} for p in pieces]
    if final_ms is not None:  # the empty response that carries the final flag
        stamps.append(int((sent_ms + final_ms) * MS))
        outputs.append({})
    return {"timestamp": int(sent_ms * MS), "request_inputs": {}, "response_timestamps": stamps, "response_outputs": outputs}


def test_parse_profile_export_exact():
    export = {
        "experiments": [
            {
                "experiment": {"mode": "concurrency", "value": 2},
                "requests": [
                    _request(0, [40, 55, 70, 85], final_ms=86),  # TTFT 40, ITL 15, 4 tokens
                    _request(10, [30, 50], final_ms=60),  # TTFT 30, ITL 20, 2 tokens
                    _request(20, [25]),  # one token: no ITL
                    {"timestamp": 30 * MS, "response_timestamps": [int(35 * MS)], "response_outputs": [{"text_output": ""}]},
                ],
            }
        ]
    }
    (m,) = llm.parse_profile_export(export)
    assert (m.mode, m.load, m.requests, m.empty_requests) == ("concurrency", 2.0, 4, 1)
    assert [t.ttft_ms for t in m.timings] == pytest.approx([40, 30, 25])
    assert m.timings[0].itl_ms == pytest.approx(15) and m.timings[1].itl_ms == pytest.approx(20) and m.timings[2].itl_ms is None
    assert [t.latency_ms for t in m.timings] == pytest.approx([86, 60, 25])
    assert [t.output_tokens for t in m.timings] == [4, 2, 1]
    assert m.output_tokens == 7
    assert m.duration_s == pytest.approx(0.086)  # first request sent at 0, last response at 86 ms
    assert m.output_tokens_per_s == pytest.approx(7 / 0.086)
    assert m.itl_ms["avg"] == pytest.approx(17.5)
    assert m.ttft_ms["p50"] == pytest.approx(30) and m.ttft_ms["max"] == pytest.approx(40)
    # re-tokenizing the text instead of counting pieces
    (m2,) = llm.parse_profile_export(export, count_tokens=lambda s: 2 * len(s.split()))
    assert m2.timings[0].output_tokens == 8 and m2.timings[0].itl_ms == pytest.approx(45 / 7)


def test_llm_input_data_and_datasets(tmp_path):
    ds = llm.synthetic_dataset(20, prompt_mean=10, prompt_stddev=3, output_mean=8, output_stddev=2, seed=1)
    assert len(ds) == 20 and all(p.max_tokens >= 1 for p in ds)
    assert 6 <= sum(len(p.text.split()) for p in ds) / 20 <= 14
    assert ds == llm.synthetic_dataset(20, prompt_mean=10, prompt_stddev=3, output_mean=8, output_stddev=2, seed=1)
    data = llm.input_data(ds[:2], {"text_input", "max_tokens", "stream", "min_tokens"}, fixed_length=True)
    assert data["data"][0] == {
        "text_input": [ds[0].text], "max_tokens": [ds[0].max_tokens], "stream": [True], "min_tokens": [ds[0].max_tokens]
    }
    with pytest.raises(llm.PerfError, match="no input max_tokens"):
        llm.input_data(ds, {"text_input"})
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "hello there", "max_tokens": 3}\n\n{"text_input": "x", "output_tokens": 5}\n')
    assert llm.load_dataset(f) == [llm.Prompt("hello there", 3), llm.Prompt("x", 5)]
    f.write_text('{"prompt": "hello"}\n')
    with pytest.raises(llm.PerfError, match="d.jsonl:1"):
        llm.load_dataset(f)
