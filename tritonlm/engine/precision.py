"""The `dtype` setting resolved for a device: compute dtype, and whether weights are int8.

    float32 | bfloat16 | float16   compute, KV cache and weights in that dtype
    int8                           weights int8 per output channel (PyTorch's dynamic
                                   quantized linear: fbgemm, VNNI where the CPU has it);
                                   activations quantized per call; compute and KV float32.
                                   CPU only.
    auto                           bfloat16 where it is faster than float32: a GPU of
                                   compute capability 8.0+, a CPU with AMX (bf16 tiles);
                                   else float32. A CPU with AVX512-BF16 but no AMX runs
                                   bf16 dot products natively, but the float32 step with
                                   oneDNN-blocked weights is as fast from batch 8 on (see
                                   bf16_pays). Opt-in: the default, float32, keeps greedy
                                   output equal to transformers in float32.

Resolved once at load (Precision.reason goes to the log), never per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = (*COMPUTE_DTYPES, "int8", "auto")


class PrecisionError(ValueError):
    """The dtype cannot run on this device; the message says why and what can."""


@dataclass(frozen=True)
class Precision:
    name: str  # the resolved setting: float32 | bfloat16 | float16 | int8
    compute: torch.dtype  # activations and the KV cache
    int8_weights: bool
    reason: str  # why this precision, for the log


def native_bf16(device: str | torch.device) -> tuple[bool, str]:
    """(does the device multiply bf16 natively, what was found). Without it, bf16 matmuls
    are emulated and run slower than float32 (2.3x slower on one AVX-512 CPU without BF16)."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return major >= 8, f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"
    found = [name for name, probe in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
             if getattr(torch.cpu, probe, lambda: False)()]
    return bool(found), f"CPU with {' and '.join(found)}" if found else "CPU without AVX512-BF16 or AMX"


def bf16_pays(device: str | torch.device) -> tuple[bool, str]:
    """(is a bfloat16 step faster than float32 on this device, what was found).

    GPU: native bf16 (compute capability 8.0+). CPU: AMX only. Measured on an AMD EPYC with
    AVX512-BF16 and no AMX (perf/bench_precision.py, SmolLM2, context 192): bf16 1.35x
    faster than float32 at batch 1 but 0.75x at batch 32, float32 being oneDNN-blocked."""
    device = torch.device(device)
    native, found = native_bf16(device)
    if device.type == "cuda":
        return native, found
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if amx:
        return True, found
    if native:
        return False, f"{found}, no AMX: blocked float32 is as fast from batch 8 on"
    return False, found


def int8_unsupported(device: str | torch.device) -> str | None:
    """Why int8 weights cannot run on this device, or None when they can."""
    device = torch.device(device)
    if device.type != "cpu":
        return f"int8 weights run on the CPU only (PyTorch's dynamic quantized linear); device is {device}"
    if "fbgemm" not in torch.backends.quantized.supported_engines and "x86" not in torch.backends.quantized.supported_engines:
        return "this PyTorch build has no x86/fbgemm quantized engine"
    return None


def resolve_precision(name: str, device: str | torch.device) -> Precision:
    """The precision `dtype: name` means on `device`; PrecisionError when it cannot run there."""
    if name in COMPUTE_DTYPES:
        return Precision(name, COMPUTE_DTYPES[name], False, "set in the config")
    if name == "int8":
        why = int8_unsupported(device)
        if why:
            raise PrecisionError(f"{why}; use float32, bfloat16 or auto there")
        return Precision("int8", torch.float32, True, "set in the config")
    if name == "auto":
        faster, found = bf16_pays(device)
        if faster:
            return Precision("bfloat16", torch.bfloat16, False, f"auto: bf16 is faster here ({found})")
        return Precision("float32", torch.float32, False, f"auto: bf16 would not be faster ({found})")
    raise PrecisionError(f"{name!r} is not a dtype; use one of {', '.join(DTYPE_NAMES)}")
