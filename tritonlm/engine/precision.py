"""The `dtype` setting resolved for a device: compute dtype, and whether weights are int8.

    float32 | bfloat16 | float16   compute, KV cache and weights in that dtype
    int8                           weights int8 per output channel, activations quantized
                                   per token to 8 bits (tritonlm's i8_linear, or PyTorch's
                                   fbgemm without the C++ kernels: TRITONLM_INT8_KERNEL);
                                   compute and KV float32. CPU only.
    int8_weight_only               8-bit weights per group of 32 inputs, activations float32,
                                   rounded to 16-bit codes per block inside tritonlm's own
                                   matmul kernel (kernels/weight_only_int8.cpp). Closer to
                                   float32's output than int8; CPU only.
    auto                           bfloat16 where the device multiplies bf16 natively (a
                                   GPU of compute capability 8.0+, a CPU with AVX512-BF16
                                   or AMX), else float32. Opt-in: the default, float32,
                                   keeps greedy output equal to transformers in float32.

Resolved once at load (Precision.reason goes to the log), never per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = (*COMPUTE_DTYPES, "int8", "int8_weight_only", "auto")


class PrecisionError(ValueError):
    """The dtype cannot run on this device; the message says why and what can."""


@dataclass(frozen=True)
class Precision:
    name: str  # the resolved setting: float32 | bfloat16 | float16 | int8 | int8_weight_only
    compute: torch.dtype  # activations and the KV cache
    int8_weights: bool  # int8 x int8: int8 weights, activations quantized per token
    reason: str  # why this precision, for the log
    int8_weight_only: bool = False  # int8 weights, float32 activations rounded to 16-bit codes


def native_bf16(device: str | torch.device) -> tuple[bool, str]:
    """(does the device multiply bf16 natively, what was found). Without it, bf16 matmuls
    are emulated and run slower than float32; with it, a bf16 step runs faster than blocked
    float32 (docs/performance-notes.md)."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return major >= 8, f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"
    found = [name for name, probe in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
             if getattr(torch.cpu, probe, lambda: False)()]
    return bool(found), f"CPU with {' and '.join(found)}" if found else "CPU without AVX512-BF16 or AMX"


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
    if name == "int8_weight_only":
        device = torch.device(device)
        if device.type != "cpu":
            raise PrecisionError(f"int8_weight_only runs on the CPU only (tritonlm's C++ kernel); device is {device}; "
                                 "use float32, bfloat16 or auto there")
        return Precision("int8_weight_only", torch.float32, False, "set in the config", int8_weight_only=True)
    if name == "auto":
        native, found = native_bf16(device)
        if native:
            return Precision("bfloat16", torch.bfloat16, False, f"auto: bf16 matmuls are native ({found})")
        return Precision("float32", torch.float32, False, f"auto: bf16 would be emulated ({found})")
    raise PrecisionError(f"{name!r} is not a dtype; use one of {', '.join(DTYPE_NAMES)}")
