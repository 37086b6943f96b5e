"""Compiling a Triton kernel launch for a GPU on a machine without one: what the JIT would
build on an sm_90 card (H100 / H200) for the same arguments, so the tests that run the
kernels under the interpreter also see the GPU compiler accept them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

_TT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}


def skip_unless_compilable() -> None:
    """Skips the test where triton has no NVIDIA backend, or was imported under the interpreter
    (its library then cannot compile in this process)."""
    import triton
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("triton has no NVIDIA backend")
    if not isinstance(triton.language.standard.sum, triton.runtime.JITFunction):
        pytest.skip("triton was imported under TRITON_INTERPRET=1: its library cannot compile in this process")


def compile_for_hopper(kernel: Any, values: list[Any], consts: dict[str, Any]) -> str:
    """The PTX of `kernel` (a compiled-mode triton.jit function) for sm_90 with positional
    `values` and keyword constexprs `consts` (num_warps among them), as the JIT specializes:
    tensors and integers divisible by 16 marked so."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list] = {}
    for i, (name, value) in enumerate(zip(names, values)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TT[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    constexprs = {}
    for i, name in enumerate(names[len(values) :], start=len(values)):
        signature[name] = "constexpr"
        constexprs[(i,)] = consts[name]
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": consts["num_warps"]})
    return compiled.asm["ptx"]
