"""tritonlm/commands/instances.py: `tritonlm instances` rewrites a model's instance group
and nothing else of its config.pbtxt."""

from __future__ import annotations

from tests.helpers.servers import add_generation_model


def test_instances_command_rewrites_only_the_instance_group(tmp_path, capsys):
    from tritonlm.cli import main as cli_main
    from tritonlm.commands.instances import read_config

    model_dir = add_generation_model(tmp_path, "m", kv_cache_bytes=1_000_000)
    before = read_config(model_dir)
    assert cli_main(["instances", str(model_dir), "3"]) == 0
    out = capsys.readouterr().out
    assert "count 3 KIND_CPU" in out and "kv_cache_bytes=1000000 per instance -> 3000000 bytes for 3 instance(s)" in out
    after = read_config(model_dir)
    assert [(g.count, g.kind) for g in after.instance_group] == [(3, after.instance_group[0].KIND_CPU)]
    del before.instance_group[:], after.instance_group[:]
    assert before == after  # nothing else changed
    assert (model_dir / "config.pbtxt").read_text().startswith("# Text generation with m")  # header comment kept
    assert cli_main(["instances", str(model_dir)]) == 0
    assert "count 3 KIND_CPU" in capsys.readouterr().out

    tp_dir = add_generation_model(tmp_path, "tp", tensor_parallel_size=2)
    assert cli_main(["instances", str(tp_dir), "2"]) == 0
    out = capsys.readouterr().out
    assert "count 2 KIND_MODEL" in out and "4 processes in all" in out
    assert cli_main(["instances", str(tp_dir), "1", "--kind", "gpu"]) == 1
    assert "--kind gpu" in capsys.readouterr().err
    assert cli_main(["instances", str(model_dir), "0"]) == 1
    assert "count: must be >= 1" in capsys.readouterr().err
    assert cli_main(["instances", str(model_dir), "1", "--gpus", "0"]) == 1
    assert "--gpus: only with --kind gpu" in capsys.readouterr().err

    gpu_dir = add_generation_model(tmp_path, "g")
    from tritonlm.export.repository import write_generate_config

    write_generate_config(gpu_dir, "g", max_context=256, device="cuda:1")
    assert cli_main(["instances", str(gpu_dir), "2"]) == 0
    g = read_config(gpu_dir).instance_group[0]
    assert (g.count, g.kind, list(g.gpus)) == (2, g.KIND_GPU, [1])
