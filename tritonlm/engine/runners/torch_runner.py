"""TorchRunner: our own forward pass over a Hugging Face model's weights, paged KV cache.

A thin wrapper: the weights and the forward pass are runners.model.Transformer (the same
code the tensor/pipeline-parallel ranks run on their shares), int8 is runners.quant. Per
layer, attention writes the new keys/values into the pool in place, then either reads them
in place through the slot table (tritonlm's C++ paged-attention kernel: decode-width
steps, CPU, float32) or gathers each sequence's keys into [B, Hkv, L, D] and runs
scaled_dot_product_attention with a boolean mask (key exists AND causal); see
runners/layers.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVPool
from tritonlm.engine.runners.base import check_pool, plan_step
from tritonlm.engine.runners.model import Transformer
from tritonlm.engine.runners.quant import calibrate, quantize_int8, rotate_residual


class TorchRunner:
    """forward(batch, pool) -> float32 logits; see runners.base for the contract."""

    def __init__(
        self, model, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, int8: bool = False,
        attention: str = "auto", int8_keep_float: Callable[[str], bool] | None = None,
    ):
        """int8: weights of every projection and the LM head in int8 (CPU, float32 compute);
        int8_keep_float(name) -> True leaves that projection float (quant.quantize_int8).
        attention: "auto" / "paged" use the paged-attention kernel where it can run (see
        `self.attention` and `self.attention_why`; "paged" does not raise, the loader
        refuses it); "gather" never does."""
        if int8_keep_float is not None and not int8:
            raise ValueError("int8_keep_float: only with int8=True (it chooses what int8 leaves float)")
        if attention not in ("auto", "paged", "gather"):
            raise ValueError(f"attention: {attention!r}; use 'auto', 'paged' or 'gather'")
        self.device = torch.device(device)
        self.transformer = Transformer.from_hf(model, self.device, dtype)  # ValueError for other architectures
        self.spec = self.transformer.spec
        self.dtype = self.spec.dtype
        self.config = model.config
        self.max_positions = self.transformer.max_positions  # GPT-2: a hard limit; RoPE: none (None)
        if int8:
            rotate_residual(self.transformer)  # Llama family: outliers spread before calibration sees them
            calibrate(self.transformer)
            quantize_int8(self.transformer, keep_float=int8_keep_float)
        self.transformer.block_weights()  # CPU float: oneDNN's blocked layout (after calibration, which reads w)
        self.attention, self.attention_why = "gather", "asked for"
        if attention != "gather":
            on, self.attention_why = self.transformer.use_paged_kernel()
            self.attention = "paged" if on else "gather"

    @classmethod
    def from_pretrained(
        cls, hf_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
        int8: bool = False, attention: str = "auto", **kwargs
    ) -> "TorchRunner":
        from transformers import AutoModelForCausalLM

        if dtype is not None:
            kwargs["dtype"] = dtype
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), **kwargs)
        model.eval()
        return cls(model, device=device, dtype=dtype, int8=int8, attention=attention)

    def allocate_kv(self, num_slots: int) -> KVPool:
        return KVPool.for_shape(self.spec, num_slots, self.device)

    def forward(self, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        check_pool(self.spec, self.device, pool)
        plan = plan_step(batch, self.device, self.max_positions)
        return self.transformer.forward(plan, batch.all_logits, pool)

    __call__ = forward

    def close(self) -> None:
        pass
