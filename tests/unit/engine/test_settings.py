"""tritonlm/engine/settings.py: config.pbtxt parameters checked when the model is read,
before anything loads (the path the server takes), each refusal naming the field. The paths
a config names (hf_dir, onnx_model, draft_model) stay inside the model repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tritonlm.engine.settings import EngineSettings, SettingsError


@pytest.fixture()
def repo(tmp_path) -> Path:
    """A repository like an export writes: NAME (1/hf), NAME_onnx, NAME_draft; and a file outside."""
    repo = tmp_path / "repo"
    for sub in ("gen/1/hf", "gen_onnx/1", "gen_draft/1/hf", "gen/1/draft_hf"):
        (repo / sub).mkdir(parents=True)
    (repo / "gen_onnx/1/model.onnx").write_bytes(b"")
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret/model.onnx").write_bytes(b"")
    return repo


def test_paths_an_export_writes_load(repo):
    s = EngineSettings.from_params(
        {"hf_dir": "1/hf", "runtime": "onnx", "onnx_model": "../gen_onnx/1/model.onnx", "draft_model": "../gen_draft/1/hf"},
        repo / "gen",
    )
    assert s.hf_dir == repo / "gen/1/hf" and s.onnx_model == repo / "gen_onnx/1/model.onnx"
    assert s.draft_model == repo / "gen_draft/1/hf"
    assert EngineSettings.from_params({}, repo / "gen").hf_dir == repo / "gen/1/hf"  # the default


@pytest.mark.parametrize("field", ["hf_dir", "onnx_model", "draft_model"])
def test_absolute_path_refuses_to_load_naming_the_field(repo, field):
    target = repo / ("gen_onnx/1/model.onnx" if field == "onnx_model" else "gen/1/hf")  # exists, and inside
    with pytest.raises(SettingsError, match=rf"^{field}: .* is an absolute path; paths are relative to the model folder"):
        EngineSettings.from_params({field: str(target)}, repo / "gen")


@pytest.mark.parametrize("field", ["hf_dir", "onnx_model", "draft_model"])
@pytest.mark.parametrize("raw", ["../../secret/model.onnx", "1/hf/../../../../secret", "..", "../..", "./../../secret"])
def test_dotdot_out_of_the_repository_refuses_to_load(repo, field, raw):
    with pytest.raises(SettingsError, match=rf"^{field}: '{re.escape(raw)}' leaves the model repository"):
        EngineSettings.from_params({field: raw}, repo / "gen")


def test_model_folder_given_relative_or_through_a_symlinked_repository(repo, tmp_path, monkeypatch):
    monkeypatch.chdir(repo.parent)
    assert EngineSettings.from_params({"draft_model": "../gen_draft/1/hf"}, Path("repo/gen")).draft_model.is_dir()
    # tritonlm perf serves a private repository of symlinks to model folders
    private = tmp_path / "private"
    private.mkdir()
    for name in ("gen", "gen_onnx"):
        (private / name).symlink_to(repo / name, target_is_directory=True)
    s = EngineSettings.from_params({"runtime": "onnx", "onnx_model": "../gen_onnx/1/model.onnx"}, private / "gen")
    assert s.onnx_model == private / "gen_onnx/1/model.onnx" and s.onnx_model.is_file()
    with pytest.raises(SettingsError, match="leaves the model repository"):
        EngineSettings.from_params({"hf_dir": "../../repo/gen/1/hf"}, private / "gen")


def test_symlink_in_the_repository_is_followed_but_dotdot_is_applied_to_the_text(repo, tmp_path):
    (repo / "gen/1/linked").symlink_to(tmp_path / "secret", target_is_directory=True)  # placed by the owner
    assert EngineSettings.from_params({"hf_dir": "1/linked"}, repo / "gen").hf_dir.resolve() == (tmp_path / "secret").resolve()
    # through the link, '1/linked/../repo' would be tmp_path/repo (it exists); as written it is gen/1/repo
    with pytest.raises(SettingsError, match=r"hf_dir: '1/linked/\.\./repo' does not exist \(looked at \S+/gen/1/repo\)"):
        EngineSettings.from_params({"hf_dir": "1/linked/../repo"}, repo / "gen")


@pytest.mark.parametrize(
    "params, message",
    [
        ({"kv_cache_bytez": "1"}, r"unknown parameter\(s\) \['kv_cache_bytez'\]; known: \[.*'kv_cache_bytes'"),
        ({"max_queue_size": "0"}, r"max_queue_size: must be >= 1, got 0"),
        ({"queue_timeout_s": "-1"}, r"queue_timeout_s: must be >= 0 seconds \(0: wait as long as it takes\), got -1.0"),
        ({"max_num_seqs": "many"}, r"max_num_seqs: 'many' is not an integer"),
        ({"cancellation_check_period_ms": "0"}, r"cancellation_check_period_ms: must be >= 1, got 0"),
        ({"stream_interval": "0"}, r"stream_interval: must be >= 1, got 0"),
        ({"attention_backend": "flash"}, r"attention_backend: 'flash'; use one of auto, paged, gather"),
        ({"cuda_graphs": "on"}, r"cuda_graphs: 'on'; use one of auto, off"),
        ({"compile_decode": "sometimes"}, r"compile_decode: 'sometimes' is not a boolean \(true/false\)"),
        ({"attention_backend": "paged", "tensor_parallel_size": "2"},
         r"attention_backend: 'paged' \(refuse to load without the kernel\) is checked for the torch runtime "
         r"without model parallelism; use 'auto' \(model-parallel ranks use the kernel where it runs\) or 'gather'"),
        ({"kv_cache_bytes": "lots"}, r"kv_cache_bytes: 'lots' is not a size \(examples: .*\)"),
    ],
)
def test_settings_that_would_misbehave_are_refused_naming_the_field(tmp_path, params, message):
    """Checked when config.pbtxt is read, before anything loads (same path as the server's)."""
    (tmp_path / "1" / "hf").mkdir(parents=True)
    with pytest.raises(SettingsError, match=message):
        EngineSettings.from_params({"task": "generate", **params}, tmp_path)


@pytest.mark.parametrize("raw, threads", [("", 0), ("auto", 0), ("AUTO", 0), ("0", 0), ("3", 3)])
def test_num_threads_is_auto_by_default_or_a_whole_number(repo, raw, threads):
    params = {"num_threads": raw} if raw else {}
    assert EngineSettings.from_params(params, repo / "gen").num_threads == threads


@pytest.mark.parametrize("raw", ["-1", "1.5", "many"])
def test_num_threads_other_than_auto_or_a_count_is_refused(repo, raw):
    with pytest.raises(SettingsError, match=r"^num_threads: .* is neither 'auto' nor a whole number of threads"):
        EngineSettings.from_params({"num_threads": raw}, repo / "gen")


def test_cpu_share_is_the_glue_s_not_a_parameter(repo):
    with pytest.raises(SettingsError, match=r"unknown parameter\(s\) \['cpu_share'\]"):
        EngineSettings.from_params({"cpu_share": "2"}, repo / "gen")


def test_auto_threads_split_the_cores_over_the_model_s_instances(repo, monkeypatch):
    """The loader's count: num_threads when given, else the usable cores / instances."""
    import dataclasses

    from tritonlm.engine import loader
    from tritonlm.engine.cpu_cores import CoreBudget

    monkeypatch.setattr(loader, "usable_cores", lambda: CoreBudget(8.0, "cgroup CPU quota 8 cores (affinity allows 64)"))
    s = EngineSettings.from_params({}, repo / "gen")
    assert loader.compute_threads(s) == (8, "auto: cgroup CPU quota 8 cores (affinity allows 64)")
    assert loader.compute_threads(dataclasses.replace(s, cpu_share=3)) == (
        2, "auto: cgroup CPU quota 8 cores (affinity allows 64), split over 3 instances")
    assert loader.compute_threads(dataclasses.replace(s, cpu_share=2, tensor_parallel_size=2)) == (
        2, "auto: cgroup CPU quota 8 cores (affinity allows 64), split over 2 instances x 2 ranks each")
    assert loader.compute_threads(dataclasses.replace(s, num_threads=5, cpu_share=3)) == (5, "num_threads")


def test_the_step_loops_switches_parse_as_booleans(repo):
    default = EngineSettings.from_params({}, repo / "gen")
    assert default.schedule_ahead is False and default.adaptive_speculation is True
    s = EngineSettings.from_params({"schedule_ahead": "true", "adaptive_speculation": "off"}, repo / "gen")
    assert s.schedule_ahead is True and s.adaptive_speculation is False
    with pytest.raises(SettingsError, match="schedule_ahead"):
        EngineSettings.from_params({"schedule_ahead": "sometimes"}, repo / "gen")
