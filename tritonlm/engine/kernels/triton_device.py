"""Where tritonlm's Triton kernels (paged_decode.py, lora_triton.py) can run.

    interpreting() -> bool                 TRITON_INTERPRET is on: kernels run on CPU tensors
    available(device) -> (bool, why)       triton imports and the device is CUDA, or interpreting
    built(cache, build) -> kernels         build() once per interpreter setting
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch


def interpreting() -> bool:
    # The values triton's own env_bool accepts for TRITON_INTERPRET.
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


def available(device: str | torch.device) -> tuple[bool, str]:
    """(True, what runs) when the kernels can run for tensors on `device`: triton imports and
    the device is CUDA, or TRITON_INTERPRET=1 is set (the interpreter, on CPU tensors, for
    tests); otherwise (False, why)."""
    try:
        import triton
    except ImportError as e:
        return False, f"triton is not installed ({e})"
    if interpreting():
        return True, f"triton {triton.__version__} interpreter (TRITON_INTERPRET=1)"
    dev = torch.device(device)
    if dev.type != "cuda":
        return False, f"device {dev} is not CUDA (set TRITON_INTERPRET=1 to run the interpreter)"
    if not torch.cuda.is_available():
        return False, "torch has no usable CUDA device"
    return True, f"triton {triton.__version__} on {dev}"


def built(cache: dict[bool, Any], build: Callable[[], Any]) -> Any:
    """The kernels build() makes, made once for each interpreter setting: triton.jit reads
    TRITON_INTERPRET when it decorates, so building them at import would fix that choice for
    the whole process (and would need triton to import the kernel's module at all)."""
    interpret = interpreting()
    if interpret not in cache:
        cache[interpret] = build()
    return cache[interpret]
