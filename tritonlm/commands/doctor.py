"""`tritonlm doctor`: what is installed and working, and what to do about the rest."""

from __future__ import annotations

import importlib.metadata as md
import subprocess

from tritonlm.paths import StackError, perf_analyzer_binary, perf_analyzer_env, triton_install


def add_parser(sub) -> None:
    sub.add_parser("doctor", help="check the serving stack on this machine").set_defaults(func=run)


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def checks() -> list[tuple[str, bool, str]]:
    """(what, ok, detail or fix) for each piece of the stack."""
    rows: list[tuple[str, bool, str]] = []
    try:
        install = triton_install()
        rows.append(("tritonserver binary", True, str(install.server_binary)))
        stub = install.stub_for_running_python()
        rows.append(("Python backend stub", stub.exists(), str(stub) if stub.exists() else "missing: run `make setup`"))
        from tritonlm.paths import BACKEND_DIR

        prepared = (BACKEND_DIR / "python" / "triton_python_backend_stub").exists()
        rows.append(("backend directory", prepared, str(BACKEND_DIR) if prepared else "run `tritonlm setup-backend`"))
    except StackError as e:
        rows.append(("tritonserver binary", False, str(e)))
    try:
        pa = perf_analyzer_binary()
        proc = subprocess.run([str(pa), "--version"], env=perf_analyzer_env(), capture_output=True, text=True, timeout=30)
        out = (proc.stdout + proc.stderr).strip()
        if proc.returncode == 0 and "Version" in out:
            rows.append(("perf_analyzer", True, out.splitlines()[-1]))
        else:
            fix = "apt-get install libb64-0d" if "libb64" in out else "pip install nvidia-cuda-runtime-cu12" if "cudart" in out else "run `make setup`"
            rows.append(("perf_analyzer", False, f"{out.splitlines()[-1] if out else 'fails to start'}: {fix}"))
    except StackError as e:
        rows.append(("perf_analyzer", False, str(e)))
    for pkg in ("tritonclient", "torch", "onnxruntime", "onnxruntime-gpu", "onnx", "transformers", "numpy"):
        v = _version(pkg)
        if v is not None or pkg != "onnxruntime-gpu":
            rows.append((pkg, v is not None, v or f"missing: pip install {pkg} (or `make setup`)"))
    try:
        import torch

        cuda = torch.cuda.is_available()
        rows.append(("CUDA (torch)", True, f"yes: {torch.cuda.get_device_name(0)}" if cuda else "no (CPU only)"))
    except ImportError:
        pass
    try:
        from tritonlm.engine.kernels import IsaError, kernels_available

        fix = ("`make setup` (or `python -m tritonlm.engine.kernels --prebuild` with g++ installed); "
               "decode falls back to the slower gather path")
        try:
            ok, why = kernels_available()  # names the ISA level loaded and where from
        except IsaError as e:  # a TRITONLM_KERNEL_ISA this CPU cannot run: a model would not load
            ok, why, fix = False, str(e), "unset TRITONLM_KERNEL_ISA or name a level this CPU runs"
        rows.append(("C++ kernels (paged attention, fused ops)", ok, why if ok else f"{why}: {fix}"))
        rows.append(int8_kernel_row(ok))
    except ImportError:
        pass
    from tritonlm.engine.cpu_cores import usable_cores

    budget = usable_cores()
    rows.append(("compute threads (num_threads: auto)", True,
                 f"{budget.threads()} per model instance ({budget.why}); split over instances and model-parallel "
                 "ranks, lowered while other processes take these cores"))
    rows.append(memory_bandwidth_row(budget.threads()))
    try:
        import onnxruntime as ort

        rows.append(("ONNX Runtime providers", True, ", ".join(ort.get_available_providers())))
    except ImportError:
        pass
    return rows


def memory_bandwidth_row(threads: int) -> tuple[str, bool, str]:
    """The host's memory read bandwidth on one and on `threads` threads, and what it bounds:
    one stream's decode reads every weight once per token (tritonlm/perf/roofline.py)."""
    from tritonlm.perf.roofline import read_bandwidth

    one, many = read_bandwidth(1, repeats=3), read_bandwidth(max(1, threads), repeats=3)
    return ("memory read bandwidth", True,
            f"{one / 1e9:.1f} GB/s on 1 thread, {many / 1e9:.1f} GB/s on {threads}: one stream decodes at most "
            f"{many / 1e9:.1f} / (GB of weights per token) tokens/s")


def run(args) -> int:
    rows = checks()
    width = max(len(r[0]) for r in rows)
    for what, ok, detail in rows:
        print(f"{'ok ' if ok else 'BAD'}  {what:<{width}}  {detail}")
    bad = [r for r in rows if not r[1]]
    print(f"\n{len(bad)} problem(s)" if bad else "\nall good")
    return 1 if bad else 0


def int8_kernel_row(kernels_ok: bool) -> tuple[str, bool, str]:
    """Which kernel `dtype: int8` runs here (TRITONLM_INT8_KERNEL) and with how many activation bits."""
    from tritonlm.engine.runners.layers import INT8_KERNEL_ENV, INT8_VNNI, i8_path, int8_kernel, int8_reduce_range

    name = "int8 kernel (dtype: int8)"
    try:
        kernel = int8_kernel() if kernels_ok else "fbgemm"
        if kernel == "tritonlm":
            return name, True, (f"tritonlm's i8_linear, {i8_path()} path: 8-bit activations, "
                                "the same bits on every x86 CPU (fbgemm's with attention_backend: gather)")
        bits = 7 if int8_reduce_range() else 8
        why = "" if kernels_ok else " (no C++ kernels)"
        return name, True, f"fbgemm{why}: {bits}-bit activations{' (without VNNI)' if bits == 7 and not INT8_VNNI else ''}"
    except ValueError as e:  # a wrong TRITONLM_INT8_KERNEL or TRITONLM_INT8_REDUCE_RANGE: an int8 model would not load
        return name, False, f"{e} (unset {INT8_KERNEL_ENV} for the default)"
