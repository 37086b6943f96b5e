"""tritonlm's own C++ kernels, prebuilt per x86-64 level and loaded on first use.

    kernels_available() -> (bool, why)   loads the best build for this CPU once per process;
    kernels_loaded() -> bool             whether that has happened and the ops can run
    loaded_build() -> LoadedBuild        which one (level, prebuilt or compiled, path); then
    torch.ops.tritonlm.paged_attention_qkv(qkv, k_cache, v_cache, write_slots, slot_table,
                                           positions, cos, sin, heads, scale)
        a decode step's attention: RoPE, the new K/V into the pool, attention read
        through the slot table (paged_attention.cpp)
    torch.ops.tritonlm.rms_norm(x, w, eps), .add_rms_norm(x, delta, w, eps), .silu_mul(gate_up)
        a layer's element-wise steps fused (decode_ops.cpp)
    torch.ops.tritonlm.int8_linear(x, smooth, bias, packed, buf, reduce_range)
        an int8 projection, rows quantized alone, in one op (decode_ops.cpp)
    torch.ops.tritonlm.w8_linear(x, panel, scale, offset, bias, in, out, isa), .w8_isas()
        a projection with int8 weights in 16-wide output panels of quads and float32
        activations rounded to 16-bit codes (`dtype: int8_weight_only`), AVX-512 / AVX2 /
        scalar, the same bits on each up to 64 rows: the best this CPU's build has, or the one
        named (weight_only_int8.cpp)
    torch.ops.tritonlm.panel_linear(x, panel, bias, out), .panel_supported()
        a float32 projection over weights in 16-wide output panels (runners/layers.py's
        PanelLinear; AVX-512 and AVX2 builds) (float_panel.cpp)
    torch.ops.tritonlm.i8_linear(x, panel, wscale, bias, out, isa), .i8_isas(), .i8_amx_refusal()
        int8 weights x int8 activations with all 8 bits on every level (no int16 saturation
        without VNNI; AMX tiles for calls of several rows where the CPU and Linux allow them),
        the same bits on every path; Int8Linear's kernel unless TRITONLM_INT8_KERNEL picks
        fbgemm's (int8_act8.cpp)
    torch.classes.tritonlm.DecoderStack, torch.ops.tritonlm.decoder_stack(stack, x, ...)
        a decode step's layers (Llama family, GPT-2), those ops in one call (decoder_stack.cpp)

The sources ship with the package and are compiled once per x86-64 level (isa.py:
portable, avx2, avx512, avx512_vnni) ahead of time, by `make setup` or an image build
(`python -m tritonlm.engine.kernels --prebuild`, build.py), into TRITONLM_KERNELS_DIR or the
package's `prebuilt/` folder. The first call picks the best prebuilt level this CPU's flags
run (TRITONLM_KERNEL_ISA forces one, refused by name where the CPU lacks it) and loads it:
no compiler at start, and no build runs on a CPU without its instructions. Only where no
level of these sources is prebuilt (a dev checkout whose sources changed, a plain
`pip install` not followed by --prebuild) does it compile, for this CPU (-march=native; a
forced level with its own flags), into torch's extension cache, and say so.

Only one build can be loaded per process: the ops of every level register under the one
`tritonlm` namespace. When nothing can load (no build and no compiler, a non-x86 CPU, a
failed build), the reason is returned and the caller runs its torch path instead.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from tritonlm.engine.kernels.build import build_directory, exclusive_build  # noqa: F401 - the package's API
from tritonlm.engine.kernels.isa import IsaError  # noqa: F401 - the package's API

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedBuild:
    level: str  # an isa.LEVELS name, or "native" (compiled for this CPU)
    origin: str  # "prebuilt" or "compiled"
    path: Path
    why: str  # why this level

    def describe(self) -> str:
        how = "prebuilt" if self.origin == "prebuilt" else "compiled at load"
        return f"{self.level}, {how} ({self.why}): {self.path}"


_lock = threading.Lock()
_state: tuple[bool, str] | None = None  # (available, why), once per process
_loaded: LoadedBuild | None = None


def _load() -> tuple[bool, str]:
    global _loaded
    from tritonlm.engine.kernels import build, isa

    forced = isa.forced_level()  # IsaError: a forced level is refused, never replaced
    present = build.prebuilt_levels()
    chosen, why = isa.choose(isa.cpu_flags(), present, forced)
    if chosen is not None and chosen.name in present:
        path, origin = present[chosen.name], "prebuilt"
    else:
        # nothing prebuilt fits: compile now (a forced level with its flags, else for this CPU)
        cannot = build.why_not_buildable()
        if cannot is not None:
            return False, f"no prebuilt kernels in {build.prebuilt_dir()} for these sources, and {cannot}"
        missing = f"no build of these sources in {build.prebuilt_dir()} ({why}; " \
                  "`python -m tritonlm.engine.kernels --prebuild` builds them)"
        log.warning("C++ kernels: compiling now: %s", missing)
        try:
            path = build.compile_now(chosen)
        except Exception as e:  # noqa: BLE001
            return False, f"building the C++ kernels failed ({build._last_line(e)})"
        origin, why = "compiled", missing
    try:
        torch.ops.load_library(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged build falls back to the torch path
        return False, f"loading the C++ kernels from {path} failed ({build._last_line(e)})"
    _loaded = LoadedBuild(chosen.name if chosen is not None else "native", origin, path, why)
    return True, _loaded.describe()


def kernels_available() -> tuple[bool, str]:
    """(can tritonlm's C++ ops run, which build and why); loaded on the first call only.
    TRITONLM_KERNEL_ISA naming an unknown level or one this CPU lacks raises IsaError."""
    global _state
    with _lock:
        if _state is None:
            _state = _load()
            (log.info if _state[0] else log.warning)("C++ kernels: %s", _state[1])
        return _state


def kernels_loaded() -> bool:
    """The C++ ops are loaded in this process already; never loads or builds them (a caller on
    a hot path uses them only where a runner has loaded them at model load)."""
    return _state is not None and _state[0]


def loaded_build() -> LoadedBuild | None:
    """The build kernels_available() loaded (its level, whether prebuilt, its path), or None."""
    kernels_available()
    return _loaded
