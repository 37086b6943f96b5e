"""A torch dispatch mode that fails on any read of a tensor value to the host, for the Triton
kernels' launch planning, which a CUDA graph replays and so must not depend on values."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class NoValueReads(TorchDispatchMode):
    """Inside it, .item(), int(), bool() or max() over a tensor raises AssertionError."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func is not torch.ops.aten._local_scalar_dense.default, "a tensor value was read on the host"
        return func(*args, **(kwargs or {}))
