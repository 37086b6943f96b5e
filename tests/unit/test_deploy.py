"""deploy/: the Dockerfile, its entry point and the Kubernetes manifests, checked without
Docker or a cluster (neither runs here): every path the Dockerfile copies exists, every
command and option it and the entry point call exist in this package, the entry point's
export step really exports, and the manifests agree with `tritonlm serve`'s defaults, the
metrics tritonlm exports and the drain timeout. The entry point serving and draining on a
real tritonserver: tests/integration/test_deploy.py."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess

import pytest
import yaml

from tritonlm.commands.serve import KILL_GRACE_S, add_server_args
from tritonlm.paths import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "k8s"
TRITONLM = str(REPO_ROOT / ".venv" / "bin" / "tritonlm")


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def help_text(*args: str) -> str:
    return subprocess.run([TRITONLM, *args, "--help"], capture_output=True, text=True, timeout=60, check=True).stdout


def test_dockerfile_base_image_and_build_args():
    ins = dockerfile_instructions()
    args = dict(rest.partition("=")[::2] for word, rest in ins if word == "ARG")
    assert args["TRITON_TAG"] == "24.10-py3"
    assert "whl/cu" in args["TORCH_INDEX_URL"]  # the CPU-only variant overrides it (documented)
    assert ("FROM", "nvcr.io/nvidia/tritonserver:${TRITON_TAG}") in ins
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in (DEPLOY / "Dockerfile").read_text()
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in (DEPLOY / "README.md").read_text()


def test_dockerfile_copies_paths_that_exist():
    copies = [shlex.split(rest) for word, rest in dockerfile_instructions() if word == "COPY"]
    dests = {}
    for parts in copies:
        *sources, dest = parts
        for src in sources:
            assert (REPO_ROOT / src).exists(), src
            dests[src] = dest
    assert dests["backends/tritonlm"] == "/opt/tritonserver/backends/tritonlm"
    assert (REPO_ROOT / "backends/tritonlm/model.py").is_file()
    entry = dests["deploy/entrypoint.sh"]
    assert ("ENTRYPOINT", f'["{entry}"]') in dockerfile_instructions()
    assert os.access(DEPLOY / "entrypoint.sh", os.X_OK)


def test_every_run_step_is_documented_for_a_bare_machine():
    readme = (DEPLOY / "README.md").read_text()
    runs = [rest for word, rest in dockerfile_instructions() if word == "RUN"]
    assert runs
    for run in runs:
        for command in run.split("&&"):
            command = re.sub(r"\$\{?TORCH_INDEX_URL\}?", "https://download.pytorch.org/whl/cu124", command.strip())
            assert command in readme, f"deploy/README.md does not give the bare-machine form of: {command}"


def test_entrypoint_calls_commands_and_options_that_exist():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "tritonlm" in scripts
    entry = (DEPLOY / "entrypoint.sh").read_text()
    subprocess.run(["bash", "-n", str(DEPLOY / "entrypoint.sh")], check=True)
    top = help_text()
    joined = re.sub(r"\\\n\s*", " ", entry)  # continued lines as one
    calls = re.findall(r"^\s*(?:exec\s+)?tritonlm (\w[\w-]*)([^\n&]*)", joined, re.M)
    assert {c for c, _ in calls} == {"export", "serve"}
    for command, rest in calls:
        assert re.search(rf"^\s+{command}\b", top, re.M), command
        sub = help_text(command)
        for option in re.findall(r"(--[a-z][a-z-]+)", rest):
            assert option in sub, (command, option)
    # serve runs the image's own tritonserver, load/unload API off, and is exec'd (SIGTERM reaches it)
    assert re.search(r'^exec tritonlm serve .*--tritonserver "\$\(command -v tritonserver\)" --model-control none', entry, re.M)
    d = serve_defaults()
    defaults = dict(re.findall(r"^(\w+)=\$\{TRITONLM_\w+:-([^}]*)\}", entry, re.M))
    assert defaults["HOST"] == "0.0.0.0"  # a container publishes its ports; model control stays none
    assert [int(defaults[k]) for k in ("HTTP_PORT", "GRPC_PORT", "METRICS_PORT", "OPENAI_PORT", "HEALTH_PORT")] == [
        d.http_port, d.grpc_port, d.metrics_port, d.openai_port, d.health_port]
    assert (int(defaults["MAX_RESTARTS"]), float(defaults["RESTART_WINDOW"])) == (d.max_restarts, d.restart_window)


def test_entrypoint_export_step_exports_once(tmp_path):
    env = {**os.environ, "PATH": f"{REPO_ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "TRITONLM_REPO": str(tmp_path / "models"),
           "TRITONLM_MODEL": "tiny-gpt2", "TRITONLM_EXPORT_ARGS": "--device cpu"}
    run = lambda *a, **kw: subprocess.run(["bash", str(DEPLOY / "entrypoint.sh"), *a], env={**env, **kw},
                                          capture_output=True, text=True, timeout=180)
    first = run("export")
    assert first.returncode == 0, first.stdout + first.stderr
    assert (tmp_path / "models" / "tiny-gpt2" / "config.pbtxt").is_file()
    again = run("export")
    assert again.returncode == 0 and "already holds models" in again.stdout
    empty = run("serve", TRITONLM_REPO=str(tmp_path / "empty"), TRITONLM_MODEL="")
    assert empty.returncode == 2 and "TRITONLM_MODEL is not set" in empty.stderr


# ---- Kubernetes ----------------------------------------------------------------------------


def load_all() -> dict[str, list[dict]]:
    docs = {}
    for path in sorted(K8S.rglob("*.yaml")):
        docs[str(path.relative_to(K8S))] = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def kind(name: str) -> dict:
    found = [d for docs in load_all().values() for d in docs if d.get("kind") == name]
    assert len(found) == 1, name
    return found[0]


def serve_defaults() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_server_args(p)
    return p.parse_args([])


def test_every_manifest_parses_and_the_base_lists_them():
    docs = load_all()
    assert {"base/kustomization.yaml", "overlays/cpu/kustomization.yaml", "prometheus-adapter-values.yaml"} <= set(docs)
    base = docs["base/kustomization.yaml"][0]
    for resource in base["resources"]:
        assert (K8S / "base" / resource).is_file()
    assert {d["kind"] for f, ds in docs.items() if f.startswith("base/") for d in ds} >= {
        "Deployment", "Service", "PodMonitor", "HorizontalPodAutoscaler", "PodDisruptionBudget"}


def test_deployment_probes_ports_gpu_and_grace_period():
    dep = kind("Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (c,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    d = serve_defaults()
    assert ports == {"http": d.http_port, "grpc": d.grpc_port, "metrics": d.metrics_port, "openai": d.openai_port,
                     "health": d.health_port}
    # the probes ask serve's endpoint, which answers for the models (Triton's own says 200 over a dead one)
    assert c["startupProbe"]["httpGet"] == {"path": "/health/ready", "port": "health"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "health"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health/live", "port": "health"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    env = {e["name"]: e["value"] for e in c["env"]}
    drain = float(env["TRITONLM_DRAIN_TIMEOUT"])
    pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > pre_stop + drain + KILL_GRACE_S
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= grace  # a drain is not cut by liveness
    (init,) = pod["initContainers"]
    assert init["args"] == ["export"]
    mounts = lambda x: {m["name"]: m["mountPath"] for m in x["volumeMounts"]}
    assert mounts(init) == mounts(c) == {"models": env["TRITONLM_REPO"]}


def test_service_podmonitor_pdb_match_the_pods():
    dep = kind("Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    container_ports = {p["name"]: p["containerPort"] for p in dep["spec"]["template"]["spec"]["containers"][0]["ports"]}
    svc = kind("Service")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        n: (port, n) for n, port in container_ports.items()}
    pm = kind("PodMonitor")
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] in container_ports
    pdb = kind("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_hpa_scales_on_a_metric_tritonlm_exports_through_the_adapter_rule():
    hpa = kind("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"]["name"] == kind("Deployment")["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    assert f'"{name}"' in (REPO_ROOT / "tritonlm" / "glue" / "metrics.py").read_text()
    rules = load_all()["prometheus-adapter-values.yaml"][0]["rules"]["custom"]
    assert any(r["seriesQuery"].startswith(name + "{") and r["name"]["as"] == name for r in rules)


def _apply_json_patch(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].strip("/").split("/")]
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        key = int(last) if isinstance(node, list) else last
        assert key in node or (isinstance(node, list) and key < len(node)), op["path"]
        if op["op"] == "remove":
            del node[key]
        else:
            node[key] = op["value"]


def test_cpu_overlay_patches_apply_and_remove_every_gpu():
    overlay = load_all()["overlays/cpu/kustomization.yaml"][0]
    assert overlay["resources"] == ["../../base"]
    dep = kind("Deployment")
    for patch in overlay["patches"]:
        _apply_json_patch(dep, yaml.safe_load(patch["patch"]))
    assert "nvidia.com/gpu" not in yaml.safe_dump(dep)
    init_env = {e["name"]: e["value"] for e in dep["spec"]["template"]["spec"]["initContainers"][0]["env"]}
    assert init_env["TRITONLM_MODEL"] == "tiny-gpt2" and "cpu" in init_env["TRITONLM_EXPORT_ARGS"]


def test_readme_links_the_deploy_guide():
    assert "deploy/README.md" in (REPO_ROOT / "README.md").read_text()
