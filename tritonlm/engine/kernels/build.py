"""Compiling the C++ kernels: once per ISA level ahead of time, or for this CPU at load.

    prebuilt_dir() -> Path           where prebuilt levels live: TRITONLM_KERNELS_DIR, else the
                                     package's own `prebuilt/` folder (it persists with the
                                     install; not in git)
    prebuilt_path(level) -> Path     one level's library there, named by its digest
    prebuild(levels) -> [(name, ok, what)]
                                     compile those levels into prebuilt_dir() (`make setup`, an
                                     image build: `python -m tritonlm.engine.kernels --prebuild`)
    compile_now(level | None) -> Path
                                     compile at load into torch's extension cache: a level's
                                     flags, or None for -march=native (no prebuilt build fits)

A build is keyed by a digest of the sources, the torch version (the ops link against its
libraries) and the level's flags, never by the CPU it was built on: a level's build runs on
every CPU with the level's flags. Changed sources change the digest, so a stale build is
never loaded; the loader then compiles.

Compiling never loads what it built: a build for a level this CPU lacks may run
AVX-512 code in its static initializers. Torch's own build (torch.utils.cpp_extension's
ninja writer) is used without its loader.

Every compile of one folder holds an OS lock (flock) that the kernel drops when its holder
dies, so two processes never build into one folder at once and a process killed mid-build
stops no later one; torch's own lock file, if one was left, is removed under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from tritonlm.engine.kernels.isa import LEVELS, Level, cpu_flags, level

log = logging.getLogger(__name__)

ENV_DIR = "TRITONLM_KERNELS_DIR"
_HERE = Path(__file__).parent
SOURCES = [_HERE / "paged_attention.cpp", _HERE / "decode_ops.cpp", _HERE / "decoder_stack.cpp",
           _HERE / "weight_only_int8.cpp", _HERE / "float_panel.cpp", _HERE / "int8_act8.cpp", _HERE / "lora_ops.cpp"]
HEADERS = [_HERE / "simd_math.h", _HERE / "lora_ops.h", _HERE / "float_panel.h"]
# -fopenmp: at::parallel_for runs on torch's own OpenMP team (the process already has torch's
# libgomp loaded; the extension links to it by its soname)
_COMMON_CFLAGS = ("-O3", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_NATIVE_CFLAGS = ("-march=native", "-mprefer-vector-width=512")
_PREBUILT_NAME = re.compile(r"^tritonlm_kernels_(\w+?)_([0-9a-f]{12})\.so$")


def _digest(*parts: bytes) -> str:
    sources = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    return hashlib.sha256(sources + torch.__version__.encode() + b"\0".join(parts)).hexdigest()[:12]


def level_digest(lv: Level) -> str:
    return _digest(lv.name.encode(), " ".join(lv.cflags).encode())


def _cpu_fingerprint() -> str:
    """The CPU's model and flags: what -march=native compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return platform.processor()


def prebuilt_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or _HERE / "prebuilt")


def prebuilt_path(lv: Level) -> Path:
    return prebuilt_dir() / f"tritonlm_kernels_{lv.name}_{level_digest(lv)}.so"


def prebuilt_levels() -> dict[str, Path]:
    """The levels whose build of these sources is in prebuilt_dir(), by name."""
    return {lv.name: p for lv in LEVELS if (p := prebuilt_path(lv)).is_file()}


def build_directory(lv: Level | None = None) -> Path:
    """A load-time build's folder in torch's extension cache (TORCH_EXTENSIONS_DIR, else
    torch's default): a level's (digest of the sources, torch and its flags), or with None
    the -march=native build's, whose digest also covers the CPU's model and flags."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / "tritonlm"
    if lv is None:
        return root / f"tritonlm_kernels_native_{_digest(_cpu_fingerprint().encode())}"
    return root / f"tritonlm_kernels_{lv.name}_{level_digest(lv)}"


def put_ninja_on_path() -> None:
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


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Hold build_dir's OS lock (waiting for another process's build to finish), with any
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


def why_not_buildable() -> str | None:
    """Why nothing can be compiled here (not x86-64, no ninja or compiler), None if it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the kernels are built for x86-64 CPUs; this one is {platform.machine()}"
    try:
        from torch.utils.cpp_extension import get_cxx_compiler, verify_ninja_availability

        put_ninja_on_path()
        verify_ninja_availability()
        if shutil.which(get_cxx_compiler()) is None:
            return f"no C++ compiler ({get_cxx_compiler()}) on PATH"
    except Exception as e:  # noqa: BLE001 - any reason not to build is reported, not raised
        return f"cannot build C++ extensions here ({e})"
    return None


def _compile(name: str, build_dir: Path, cflags: tuple[str, ...]) -> Path:
    """Compile the sources into build_dir/name.so with ninja (a no-op when it is up to date);
    the caller holds build_dir's lock. Torch's writer adds its include paths, ABI flag and
    libraries; its loader is not used."""
    from torch.utils.cpp_extension import _write_ninja_file_and_build_library

    put_ninja_on_path()
    _write_ninja_file_and_build_library(
        name=name, sources=[str(p) for p in SOURCES], extra_cflags=[*_COMMON_CFLAGS, *cflags],
        extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=list(_LDFLAGS), extra_include_paths=[],
        build_directory=str(build_dir), verbose=False, with_cuda=False, with_sycl=False,
    )
    return build_dir / f"{name}.so"


def compile_now(lv: Level | None) -> Path:
    """Compile at load, into torch's extension cache: lv's flags, or -march=native for None."""
    build_dir = build_directory(lv)
    with exclusive_build(build_dir):
        return _compile(build_dir.name, build_dir, _NATIVE_CFLAGS if lv is None else lv.cflags)


def prebuild(names: list[str] | None = None) -> list[tuple[str, bool, str]]:
    """Compile each level (all by default) into prebuilt_dir(), skipping those already there,
    and remove builds of other digests (older sources or torch) from it. Returns (level, ok,
    the library's path or why it failed)."""
    out_dir = prebuilt_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    levels = [level(n) for n in names] if names else list(LEVELS)
    results = []
    for lv in levels:
        final = prebuilt_path(lv)
        if final.is_file():
            results.append((lv.name, True, f"{final} (already built)"))
            continue
        build_dir = out_dir / ".build" / final.stem
        try:
            with exclusive_build(build_dir):
                if not final.is_file():  # another process may have finished it meanwhile
                    built = _compile(final.stem, build_dir, lv.cflags)
                    os.replace(built, final)  # a loader sees the whole library or none
            shutil.rmtree(build_dir, ignore_errors=True)
            results.append((lv.name, True, str(final)))
        except Exception as e:  # noqa: BLE001 - reported per level; the others still build
            results.append((lv.name, False, _last_line(e)))
    current = {prebuilt_path(lv).name for lv in LEVELS}
    for stale in out_dir.iterdir():
        if _PREBUILT_NAME.match(stale.name) and stale.name not in current:
            stale.unlink(missing_ok=True)  # a process that loaded it keeps its mapping
    for folder in (out_dir / ".build").glob("tritonlm_kernels_*"):
        if f"{folder.name}.so" not in current:  # a build of older sources that was stopped
            shutil.rmtree(folder, ignore_errors=True)
    return results


def _last_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[-1] if text else repr(e)


def host_summary() -> str:
    """'runs avx512_vnni, avx512, avx2, portable': the levels this CPU's flags allow."""
    from tritonlm.engine.kernels.isa import supported

    return "runs " + ", ".join(lv.name for lv in supported(cpu_flags()))
