"""tritonlm's own C++ kernels, compiled for this host on first use.

    kernels_available() -> (bool, why)   builds and loads once per process; then
    torch.ops.tritonlm.paged_attention_qkv(qkv, k_cache, v_cache, write_slots, slot_table,
                                           positions, cos, sin, heads, scale)
        a decode step's attention: RoPE, the new K/V into the pool, attention read
        through the slot table (paged_attention.cpp)
    torch.ops.tritonlm.rms_norm(x, w, eps), .add_rms_norm(x, delta, w, eps), .silu_mul(gate_up)
        a layer's element-wise steps fused (decode_ops.cpp)
    torch.ops.tritonlm.int8_linear(x, smooth, bias, packed, buf, reduce_range)
        an int8 projection, rows quantized alone, in one op (decode_ops.cpp)
    torch.ops.tritonlm.w8_linear(x, panel, scale, offset, bias, out, isa), .w8_isas()
        a projection with int8 weights in 16-wide output panels and float32 activations
        (`dtype: int8_weight_only`), AVX-512 / AVX2 / scalar: the best this CPU's build has,
        or the one named (weight_only_int8.cpp)
    torch.ops.tritonlm.panel_linear(x, panel, bias, out), .panel_supported()
        a float32 projection over weights in 16-wide output panels (runners/layers.py's
        PanelLinear; AVX-512 builds only) (float_panel.cpp)
    torch.classes.tritonlm.DecoderStack, torch.ops.tritonlm.decoder_stack(stack, x, ...)
        a decode step's layers (Llama family, GPT-2), those ops in one call (decoder_stack.cpp)

The sources ship with the package; torch.utils.cpp_extension compiles them with the
host's compiler (g++ and ninja) into one extension in torch's extension cache
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions; ours under tritonlm/),
under a name that hashes the sources, the torch version and the CPU's model and flags:
it is compiled for this CPU (-march=native), so a cache shared with a different CPU
builds its own copy, and a later load reuses the build.

Every load (a no-op ninja run once built) takes torch's build lock, a plain file that
torch waits on without limit; a process killed while holding it (a model instance
stopped during startup) would make every later load hang. So loads of one build
directory are serialized by an OS lock (flock) that the kernel drops when its holder
dies, and whoever holds it removes torch's lock file first: it can only be a dead
process's.
When anything is missing (no compiler, a non-x86 CPU, a failed build), the reason is
returned and the caller runs its torch path instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [_HERE / "paged_attention.cpp", _HERE / "decode_ops.cpp", _HERE / "decoder_stack.cpp",
            _HERE / "weight_only_int8.cpp", _HERE / "float_panel.cpp"]
_HEADERS = [_HERE / "simd_math.h"]
_lock = threading.Lock()
_state: tuple[bool, str] | None = None  # (available, why), once per process


def _cpu_fingerprint() -> str:
    """The CPU's model and flags: what -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH. Every process must find the same one: ninja records a
    hash of each command in the build folder's log, and another ninja version reads that log
    as changed commands and rebuilds everything (a server whose PATH holds the venv's bin,
    a shell whose PATH holds only /usr/bin). The `ninja` package (a dependency) comes first."""
    try:
        import ninja
    except ImportError:
        return
    entries = os.environ.get("PATH", "").split(os.pathsep)
    if entries[:1] != [ninja.BIN_DIR]:
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, *[e for e in entries if e and e != ninja.BIN_DIR]])


def build_directory() -> Path:
    """This build's folder in torch's extension cache (TORCH_EXTENSIONS_DIR, else torch's
    default), named by a hash of the sources, the torch version and the CPU."""
    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha256(
        b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + torch.__version__.encode() + _cpu_fingerprint().encode()
    ).hexdigest()[:12]
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    return root / "tritonlm" / f"tritonlm_paged_attention_{digest}"


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold build_dir's OS lock (waiting for another process's load to finish), with any
    torch lock file a dead process left there removed."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "tritonlm.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            torch_lock = build_dir / "lock"
            if torch_lock.exists():
                log.warning("removing a kernel build lock left by a process that died: %s", torch_lock)
                torch_lock.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _build() -> tuple[bool, str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False, f"the kernel is built for x86-64 CPUs; this one is {platform.machine()}"
    try:
        from torch.utils.cpp_extension import load, verify_ninja_availability

        _put_ninja_on_path()
        verify_ninja_availability()
    except Exception as e:  # noqa: BLE001 - any reason not to build is reported, not raised
        return False, f"cannot build C++ extensions here ({e})"
    try:
        build_dir = build_directory()
        with exclusive_build(build_dir):
            # -fopenmp: at::parallel_for runs on torch's own OpenMP team (the process already
            # has torch's libgomp loaded; the extension links to it by its soname)
            load(
                name=build_dir.name,
                build_directory=str(build_dir),
                sources=[str(p) for p in _SOURCES],
                extra_cflags=["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # noqa: BLE001
        return False, f"building the C++ kernels failed ({str(e).strip().splitlines()[-1] if str(e).strip() else e!r})"
    return True, "built for this CPU"


def kernels_available() -> tuple[bool, str]:
    """(can tritonlm's C++ ops run, why); built on the first call only."""
    global _state
    with _lock:
        if _state is None:
            _state = _build()
            (log.info if _state[0] else log.warning)("C++ kernels: %s", _state[1])
        return _state

