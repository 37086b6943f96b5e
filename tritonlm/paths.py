"""Where the pieces of the serving stack live on this machine.

The Triton server, its Python backend and the backend stubs come from the
`nvidia-pytriton` wheel; perf_analyzer comes from the `tritonclient` wheel. Nothing
is imported from those packages here (importing pytriton is slow and has side
effects): their folders are found through importlib metadata.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BACKEND_SOURCE = REPO_ROOT / "backends" / "tritonlm"
BUILD_DIR = REPO_ROOT / "build"
BACKEND_DIR = BUILD_DIR / "backends"  # what --backend-directory points at


class StackError(RuntimeError):
    """A piece of the serving stack is missing; the message says how to fix it."""


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@dataclass(frozen=True)
class TritonInstall:
    root: Path  # .../site-packages/pytriton/tritonserver

    @property
    def server_binary(self) -> Path:
        return self.root / "bin" / "tritonserver"

    @property
    def python_backend(self) -> Path:
        return self.root / "backends" / "python"

    def stub_for_running_python(self) -> Path:
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        return self.root / "python_backend_stubs" / ver / "triton_python_backend_stub"

    @property
    def bundled_libs(self) -> Path:
        # The wheel's auditwheel-vendored libraries (libcudart etc.) that the
        # backend and the stub are linked against.
        return self.root.parent.parent / "nvidia_pytriton.libs"


def triton_install() -> TritonInstall:
    pkg = _package_dir("pytriton")
    if pkg is None or not (pkg / "tritonserver" / "bin" / "tritonserver").exists():
        raise StackError(
            "tritonserver not found: the nvidia-pytriton==0.7.0 wheel is not installed "
            "in this environment (run `make setup`)"
        )
    return TritonInstall(pkg / "tritonserver")


def server_env(install: TritonInstall | None = None) -> dict[str, str]:
    """Environment for tritonserver: the wheel's bundled libs on the library path and
    this interpreter's folder first on PATH (the stub runs the first python found)."""
    install = install or triton_install()
    env = dict(os.environ)
    libs = [str(install.bundled_libs), str(install.root / "lib")]
    # The stub links libpython3.X.so dynamically; it must be THIS interpreter's, or
    # compiled modules (ssl, ...) of the venv's Python fail with undefined symbols
    # when a system libpython of another patch release is found first.
    libdir = sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir:
        libs.insert(0, libdir)
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libs)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    # Engine threads inside the stub should not oversubscribe a small machine.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def perf_analyzer_binary() -> Path:
    pkg = _package_dir("tritonclient")
    if pkg is None:
        raise StackError("tritonclient is not installed (run `make setup`)")
    binary = Path(sys.executable).parent / "perf_analyzer"
    if binary.exists():
        return binary
    for candidate in (pkg / "bin" / "perf_analyzer",):
        if candidate.exists():
            return candidate
    raise StackError(
        "perf_analyzer not found: tritonclient==2.51.0 ships it as bin/perf_analyzer (run `make setup`)"
    )


def cuda_runtime_lib_dir() -> Path | None:
    """nvidia-cuda-runtime-cu12 ships libcudart.so.12, which perf_analyzer links against
    even on a machine without a GPU."""
    nvidia = _package_dir("nvidia")
    if nvidia is None:
        return None
    lib = nvidia / "cuda_runtime" / "lib"
    return lib if lib.exists() else None


def perf_analyzer_env() -> dict[str, str]:
    env = dict(os.environ)
    libs = []
    cudart = cuda_runtime_lib_dir()
    if cudart is not None:
        libs.append(str(cudart))
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libs)
    return env
