"""The x86-64 instruction-set levels the C++ kernels are built for, and which one a CPU runs.

One set of sources (their `#if defined(__AVX512F__)` / `__AVX2__` branches) is compiled once
per level with that level's flags; at load the best level this CPU's flags allow is picked
among the builds present, so one install serves every node of a mixed fleet and a build
never runs on a CPU that lacks its instructions (SIGILL).

    LEVELS                       the levels, best first
    cpu_flags() -> set[str]      this CPU's flags, as /proc/cpuinfo names them
    supported(flags) -> levels   the levels those flags run, best first
    choose(flags, present, forced) -> (Level, why)
                                 the level to load; forced (TRITONLM_KERNEL_ISA) is refused by
                                 name where the flags lack it
    forced_level() -> str | None TRITONLM_KERNEL_ISA, checked against the level names

No level is built for AMX: the avx512_vnni build (and a -march=native one on such a CPU)
carries int8's AMX path (int8_act8.cpp), compiled by a function attribute and taken at run
time only where CPUID shows amx_int8 and Linux grants the tile state, so an AMX CPU runs the
avx512_vnni build and its tiles.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

ENV_FORCE = "TRITONLM_KERNEL_ISA"

# x86-64 psABI levels, in /proc/cpuinfo's names: what -march=x86-64-vN lets the compiler emit
# anywhere in the build (lzcnt is `abm`), so a CPU must have all of them, not just the vector ones
_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_V3 = _V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Level:
    name: str
    needs: frozenset[str]  # CPU flags (/proc/cpuinfo) the build's code may use
    cflags: tuple[str, ...]  # the compiler flags that select the sources' branches
    what: str  # one line for people


LEVELS: tuple[Level, ...] = (
    Level("avx512_vnni", _V4 | {"avx512_vnni", "avx512_bf16"},
          ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mprefer-vector-width=512"),
          "AVX-512 with VNNI and BF16 (Intel Cooper Lake and later, AMD Zen 4 and later)"),
    Level("avx512", _V4, ("-march=x86-64-v4", "-mprefer-vector-width=512"),
          "x86-64-v4: AVX-512 F/BW/CD/DQ/VL (Intel Skylake-SP and later)"),
    Level("avx2", _V3, ("-march=x86-64-v3",), "x86-64-v3: AVX2, FMA, F16C (Intel Haswell, AMD Zen and later)"),
    Level("portable", frozenset(), ("-march=x86-64", "-mtune=generic"), "any x86-64 CPU: the scalar C++ paths"),
)
NAMES = tuple(level.name for level in LEVELS)
_BY_NAME = {level.name: level for level in LEVELS}


class IsaError(ValueError):
    """A forced level that is not a level, or that this CPU cannot run."""


def level(name: str) -> Level:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise IsaError(f"kernel ISA level {name!r} is not one of {', '.join(NAMES)}") from None


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The first processor's flags (the kernel lists only what it also enabled, such as the
    AVX-512 register state); empty where there is no /proc/cpuinfo, which leaves portable."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        pass
    return set()


def supported(flags: Iterable[str]) -> list[Level]:
    have = set(flags)
    return [lv for lv in LEVELS if lv.needs <= have]


def forced_level() -> str | None:
    """TRITONLM_KERNEL_ISA's level, None when unset or empty; an unknown name is an IsaError."""
    value = os.environ.get(ENV_FORCE, "").strip()
    if not value:
        return None
    if value not in _BY_NAME:
        raise IsaError(f"{ENV_FORCE}={value!r} is not a kernel ISA level; use one of {', '.join(NAMES)} "
                       "(or leave it unset: the best this CPU runs)")
    return value


def choose(flags: Iterable[str], present: Iterable[str], forced: str | None = None) -> tuple[Level | None, str]:
    """The level to load: forced if given (an IsaError naming the missing flags when this CPU
    lacks it), else the best level these flags run among `present` (the prebuilt ones);
    (None, why) when none is present, and the caller compiles."""
    runs = supported(flags)
    if forced is not None:
        want = level(forced)
        if want not in runs:
            missing = " ".join(sorted(want.needs - set(flags)))
            raise IsaError(f"{ENV_FORCE}={forced}: this CPU lacks {missing}; it runs "
                           f"{', '.join(lv.name for lv in runs)}")
        return want, f"forced by {ENV_FORCE}"
    prebuilt = set(present)
    for lv in runs:
        if lv.name in prebuilt:
            best = runs[0]
            return lv, "the best level this CPU runs" if lv is best else \
                f"the best prebuilt level this CPU runs ({best.name} is not prebuilt)"
    return None, f"no prebuilt level this CPU runs (it runs {', '.join(lv.name for lv in runs)})"
