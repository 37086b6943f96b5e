"""Build the --backend-directory tritonserver is started with.

Layout (what NVIDIA's containers have under /opt/tritonserver/backends):
    build/backends/python/   libtriton_python.so + the stub for this Python
    build/backends/tritonlm  -> backends/tritonlm (the Python-based backend: model.py)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tritonlm.paths import BACKEND_DIR, BACKEND_SOURCE, StackError, TritonInstall, triton_install


def _copy_if_changed(src: Path, dst: Path) -> bool:
    if dst.exists() and dst.stat().st_size == src.stat().st_size and dst.stat().st_mtime >= src.stat().st_mtime:
        return False
    shutil.copy2(src, dst)
    return True


def prepare_backend_dir(install: TritonInstall | None = None, backend_dir: Path = BACKEND_DIR) -> Path:
    """Idempotent: copies only what changed. Returns the backend directory."""
    install = install or triton_install()
    stub = install.stub_for_running_python()
    if not stub.exists():
        raise StackError(f"no Python backend stub for this Python in the Triton wheel ({stub})")
    python_dir = backend_dir / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in (install.python_backend / "libtriton_python.so", install.python_backend / "triton_python_backend_utils.py", stub):
        _copy_if_changed(src, python_dir / src.name)
    (python_dir / "triton_python_backend_stub").chmod(0o755)
    link = backend_dir / "tritonlm"
    if not (link.is_symlink() and link.resolve() == BACKEND_SOURCE.resolve()):
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)
        link.symlink_to(BACKEND_SOURCE.resolve(), target_is_directory=True)
    return backend_dir
