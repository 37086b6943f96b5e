"""tritonlm/engine/precision.py: the `dtype` setting (bfloat16, auto) through the engine."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.servers import add_generation_model
from tests.helpers.models import MIXED_PROMPTS, Collector, drain, hf_greedy_text, make_engine
from tritonlm.engine.loader import build_engine
from tritonlm.engine.precision import native_bf16, resolve_precision
from tritonlm.engine.settings import EngineSettings, SettingsError


def test_bfloat16_engine_halves_the_kv_bytes_and_mostly_agrees_with_fp32(tmp_path):
    folder = add_generation_model(tmp_path, "tiny", dtype="bfloat16")
    params = {"task": "generate", "max_context": "256", "dtype": "bfloat16"}
    engine = build_engine(EngineSettings.from_params(params, folder))
    fp32 = make_engine()
    assert engine.runner.spec.bytes_per_token * 2 == fp32.runner.spec.bytes_per_token
    assert engine.cache.pool.k[0].dtype == torch.bfloat16
    col = Collector()
    rids = [col.request(engine, p, max_tokens=8) for p in MIXED_PROMPTS]
    drain(engine)
    assert all(col.final(r).num_output_tokens == 8 for r in rids)
    # every generated token, not only the prefill's: whole 8-token continuations equal fp32
    # transformers' for all prompts but at most one (bf16 rounding may flip one near tie)
    same = [col.ids(r) == hf_greedy_text(p, 8) for p, r in zip(MIXED_PROMPTS, rids)]
    assert sum(same) >= len(MIXED_PROMPTS) - 1, same
    with pytest.raises(SettingsError, match="dtype"):
        EngineSettings.from_params({"dtype": "bfloat16", "runtime": "onnx", "onnx_model": "1/hf/config.json"}, folder)
    with pytest.raises(SettingsError, match="dtype: 'int3'"):
        EngineSettings.from_params({"dtype": "int3"}, folder)
    # the paged-attention kernel is float32: asked for by name it refuses, auto falls back
    assert engine.runner.attention == "gather"
    with pytest.raises(SettingsError, match=r"^attention_backend: 'paged' cannot run here: the kernel runs float32 on the CPU"):
        build_engine(EngineSettings.from_params({**params, "attention_backend": "paged"}, folder))


def test_auto_picks_bf16_only_where_the_device_multiplies_it_natively(tmp_path):
    native, found = native_bf16("cpu")
    flags = open("/proc/cpuinfo").read().split() if __import__("os").path.exists("/proc/cpuinfo") else []
    assert native == ("avx512_bf16" in flags or "amx_bf16" in flags), found  # the probe matches the CPU's flags
    p = resolve_precision("auto", "cpu")
    assert (p.name, p.compute) == (("bfloat16", torch.bfloat16) if native else ("float32", torch.float32))
    assert p.reason.startswith("auto: ") and found in p.reason
    folder = add_generation_model(tmp_path, "tinyauto", dtype="auto")
    engine = build_engine(EngineSettings.from_params({"task": "generate", "max_context": "256", "dtype": "auto"}, folder))
    assert engine.runner.spec.dtype == p.compute
    # the default stays float32: greedy parity with transformers float32
    assert EngineSettings.from_params({"task": "generate"}, folder).dtype == "float32"
    assert resolve_precision("float32", "cpu").compute == torch.float32
