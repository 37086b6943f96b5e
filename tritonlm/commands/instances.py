"""`tritonlm instances REPO/NAME [COUNT]`: show or change a model's instance_group.

Data parallel: Triton runs COUNT copies (instances) of the model; each instance is its own
Python backend process with its own engine, weights and KV cache, and Triton spreads the
requests over them. The KV budget parameters are PER INSTANCE:
    kv_cache_bytes     every instance reserves that many bytes (COUNT x in all);
    kv_cache_fraction  every instance takes that fraction of the memory free on its device
                       WHEN IT LOADS, so instances that load later see what the earlier
                       ones already took (on one device: f, then f x (1 - f), ...).
A tensor/pipeline-parallel model (tensor_parallel_size / pipeline_parallel_size > 1) is
one KIND_MODEL instance per copy that owns its worker processes (its ranks pick their
GPUs: device cuda:K puts rank r on cuda:K+r), so COUNT copies start COUNT x N processes.

The file is edited through Triton's ModelConfig protobuf (parsed, changed, printed and
parsed again before it is written); comment lines at its top are kept. With --reload
HOST:PORT, a server running with --model-control-mode=explicit reloads the model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tritonlm.errors import CliError

KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU", "model": "KIND_MODEL"}


def add_parser(sub) -> None:
    p = sub.add_parser("instances", help="show or set how many instances (copies) of a model Triton runs")
    p.add_argument("model", help="the model's folder in a repository: REPO/NAME (holds config.pbtxt)")
    p.add_argument("count", nargs="?", type=int, default=None, help="instances to run (omit to show the current setting)")
    p.add_argument("--kind", choices=["auto", *KINDS], default="auto",
                   help="auto (default): model for tensor/pipeline-parallel models, gpu when the model's device is cuda, else cpu")
    p.add_argument("--gpus", default=None, help="KIND_GPU: comma-separated GPU ids; COUNT instances on EACH (default: the device's)")
    p.add_argument("--reload", metavar="HOST:PORT", default=None,
                   help="after writing, ask this server (HTTP, --model-control-mode=explicit) to reload the model")
    p.set_defaults(func=run)


def _parse(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise CliError(f"config.pbtxt does not parse as Triton's ModelConfig: {e}") from None


def read_config(model_dir: Path):
    path = Path(model_dir) / "config.pbtxt"
    if not path.is_file():
        raise CliError(f"{path} does not exist: give the model's folder, REPO/NAME")
    return _parse(path.read_text())


def _params(cfg) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


def parallel_ranks(cfg) -> int:
    p = _params(cfg)
    try:
        return max(int(p.get("tensor_parallel_size") or 1), 1) * max(int(p.get("pipeline_parallel_size") or 1), 1)
    except ValueError:
        return 1


def set_instances(model_dir: Path, count: int, kind: str = "auto", gpus: list[int] | None = None):
    """Rewrite MODEL_DIR/config.pbtxt with one instance_group {count, kind[, gpus]}; returns the new ModelConfig."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    model_dir = Path(model_dir)
    if count < 1:
        raise CliError(f"count: must be >= 1, got {count}")
    path = model_dir / "config.pbtxt"
    original = path.read_text() if path.is_file() else ""
    cfg = read_config(model_dir)
    params = _params(cfg)
    ranks = parallel_ranks(cfg)
    device = params.get("device", "cpu") or "cpu"
    if kind == "auto":
        kind = "model" if ranks > 1 else ("gpu" if device.startswith("cuda") else "cpu")
    if kind not in KINDS:
        raise CliError(f"--kind: {kind!r}; use one of auto, {', '.join(KINDS)}")
    if ranks > 1 and kind == "gpu":
        raise CliError(
            "--kind gpu: this model is split over processes (tensor/pipeline parallel); it runs as KIND_MODEL "
            "instances whose ranks choose their GPUs from the device parameter (cuda:K -> K, K+1, ...)"
        )
    if gpus and kind != "gpu":
        raise CliError("--gpus: only with --kind gpu")
    if kind == "gpu" and not gpus:
        gpus = [int(device.split(":", 1)[1])] if ":" in device else [0]
    group = model_config_pb2.ModelInstanceGroup(count=count, kind=getattr(model_config_pb2.ModelInstanceGroup, KINDS[kind]))
    if kind == "gpu":
        group.gpus.extend(gpus)
    del cfg.instance_group[:]
    cfg.instance_group.append(group)
    header = "".join(line + "\n" for line in original.splitlines() if line.startswith("#"))
    text = header + text_format.MessageToString(cfg)
    _parse(text)  # what is written parses again
    path.write_text(text)
    return cfg


def describe(cfg) -> str:
    from tritonclient.grpc import model_config_pb2

    kind_names = {v: k for k, v in model_config_pb2.ModelInstanceGroup.Kind.items()}
    params = _params(cfg)
    lines = []
    groups = list(cfg.instance_group) or []
    total = 0
    for g in groups:
        gpus = f" gpus {list(g.gpus)}" if g.gpus else ""
        n = g.count * (len(g.gpus) if g.gpus else 1)
        total += n
        lines.append(f"instance_group: count {g.count} {kind_names.get(g.kind, g.kind)}{gpus} -> {n} instance(s)")
    if not groups:
        lines.append("instance_group: none written (Triton's default: one instance per GPU, or one on the CPU)")
        total = 1
    ranks = parallel_ranks(cfg)
    if ranks > 1:
        lines.append(f"each instance is split over {ranks} processes (tensor/pipeline parallel): {total * ranks} processes in all")
    if params.get("kv_cache_bytes"):
        from tritonlm.engine.settings import parse_bytes

        per = parse_bytes("kv_cache_bytes", params["kv_cache_bytes"])
        lines.append(f"KV cache: kv_cache_bytes={per} per instance -> {per * total} bytes for {total} instance(s)")
    elif params.get("kv_cache_fraction"):
        lines.append(
            f"KV cache: kv_cache_fraction={params['kv_cache_fraction']} of the memory free when EACH instance loads "
            "(later instances see what earlier ones took)"
        )
    else:
        lines.append("KV cache: default budget (8 full-context sequences) per instance")
    return "\n".join(lines)


def reload_model(url: str, name: str) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    try:
        httpclient.InferenceServerClient(url).load_model(name)
    except InferenceServerException as e:
        raise CliError(f"--reload: the server at {url} did not reload {name}: {e.message() or e}") from None


def run(args: argparse.Namespace) -> int:
    model_dir = Path(args.model)
    if args.count is None:
        cfg = read_config(model_dir)
        print(f"{cfg.name or model_dir.name}: {describe(cfg)}")
        return 0
    gpus = None
    if args.gpus:
        try:
            gpus = [int(x) for x in args.gpus.split(",") if x.strip()]
        except ValueError:
            raise CliError(f"--gpus: {args.gpus!r} is not a comma-separated list of GPU ids") from None
    cfg = set_instances(model_dir, args.count, args.kind, gpus)
    name = cfg.name or model_dir.name
    print(f"wrote {model_dir / 'config.pbtxt'}\n{name}: {describe(cfg)}")
    if gpus and len(gpus) > 1:
        print("note: the engine takes its device from the `device` parameter; instances on other GPUs need the "
              "glue to map Triton's instance device onto it")
    if args.reload:
        reload_model(args.reload, name)
        print(f"reloaded {name} on {args.reload}")
    else:
        print("a running server picks this up when the model is reloaded (tritonlm instances ... --reload HOST:PORT)")
    return 0
