"""The GPU decode step's pool access as torch custom ops, so torch.compile can take the step.

Inductor fuses the element-wise work of a decode step (norms, RoPE, residual adds, SwiGLU)
into far fewer kernels than eager torch launches, but it must not trace into the Triton
paged kernel's host-side wrapper, nor functionalize an in-place write into the KV pool
(that would copy the whole pool every step). Registered as custom ops, the two are opaque
calls with a declared effect: `write_kv` mutates its cache (inductor keeps it in place),
`paged_decode` returns a new tensor whose shape the fake implementation gives.

    torch.ops.tritonlm_gpu.write_kv(cache [S, Hkv, D], slots [B, T], new [B, T, Hkv, D]) -> None
    torch.ops.tritonlm_gpu.paged_decode(q [B, H, D], k_cache, v_cache, block_table [B, M],
                                        seq_lens [B], block_size, scale, window=0, softcap=0.0,
                                        sinks=None [H]) -> [B, H, D]
"""

from __future__ import annotations

import torch

from tritonlm.engine.kernels.paged_decode import paged_decode_attention


@torch.library.custom_op("tritonlm_gpu::write_kv", mutates_args=("cache",))
def write_kv(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """cache [S, Hkv, D] <- new [B, T, Hkv, D] at slots [B, T] (padding slots are scratch 0)."""
    cache.index_copy_(0, slots.reshape(-1), new.reshape(-1, *new.shape[2:]).to(cache.dtype))


@write_kv.register_fake
def _(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    return None


@torch.library.custom_op("tritonlm_gpu::paged_decode", mutates_args=())
def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, block_size: int, scale: float, window: int = 0, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, block_size, scale,
                                  window=window, softcap=softcap, sinks=sinks)


@paged_decode.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, block_size, scale, window=0, softcap=0.0, sinks=None):
    return torch.empty_like(q)
