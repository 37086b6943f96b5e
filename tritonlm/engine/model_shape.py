"""Model shape facts the engine needs, read once from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    architecture: str  # "gpt2" | "llama" (every Llama-shaped family: runners.families.ROTARY_FAMILIES)
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (< num_heads with grouped-query attention)
    head_dim: int
    vocab_size: int
    max_positions: int  # context length the model supports
    dtype: torch.dtype = torch.float32
    family: str = ""  # the config's model_type ("qwen3", "mistral", ...): runners.families.FAMILIES

    def kv_bytes_per_token(self, num_layers: int | None = None, num_kv_heads: int | None = None) -> int:
        """KV cache bytes one token costs: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes.

        The one place this formula lives. Defaults: the whole model; a tensor-parallel rank
        passes its kv heads, a pipeline stage its layer count."""
        layers = self.num_layers if num_layers is None else num_layers
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * layers * heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV cache bytes one token of the whole model costs."""
        return self.kv_bytes_per_token()

    @staticmethod
    def from_hf_config(config, dtype: torch.dtype = torch.float32) -> "ModelShape":
        model_type = getattr(config, "model_type", "")
        if model_type == "gpt2":
            return ModelShape(
                architecture="gpt2",
                num_layers=config.n_layer,
                num_heads=config.n_head,
                num_kv_heads=config.n_head,
                head_dim=config.n_embd // config.n_head,
                vocab_size=config.vocab_size,
                max_positions=config.n_positions,
                dtype=dtype,
                family="gpt2",
            )
        from tritonlm.engine.runners.families import ROTARY_FAMILIES, refusal

        if model_type in ROTARY_FAMILIES:
            heads = config.num_attention_heads
            return ModelShape(
                architecture="llama",
                num_layers=config.num_hidden_layers,
                num_heads=heads,
                num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                vocab_size=config.vocab_size,
                max_positions=config.max_position_embeddings,
                dtype=dtype,
                family=model_type,
            )
        raise ValueError(refusal(model_type))
