"""The flat-cache decoder: the forward pass every exported artifact implements.

I/O contract (shared with the engine's ONNX runner; keep the names):
    inputs   input_ids       [B, T]      int64
             attention_mask  [B, P+T]    int64   1 = attend, 0 = skip (zeros anywhere, also mid-row)
             position_ids    [B, T]      int64
             past_key_values.{i}.key / .value   [B, kv_heads, P, head_dim]   (P may be 0)
    outputs  logits          [B, T, V]
             present.{i}.key / .value          [B, kv_heads, P+T, head_dim]

transformers 5.x takes the cache as a `DynamicCache` object; the wrapper builds one
from the flat past tensors and flattens the returned cache again, so exporters see
plain tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tritonlm.engine.model_shape import ModelShape


def past_names(num_layers: int) -> list[str]:
    names = []
    for i in range(num_layers):
        names += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
    return names


def present_names(num_layers: int) -> list[str]:
    names = []
    for i in range(num_layers):
        names += [f"present.{i}.key", f"present.{i}.value"]
    return names


def input_names(num_layers: int) -> list[str]:
    return ["input_ids", "attention_mask", "position_ids", *past_names(num_layers)]


def output_names(num_layers: int) -> list[str]:
    return ["logits", *present_names(num_layers)]


def as_float32(model):
    """The model in float32, eval mode (exports are traced in float32; fp16 is derived later)."""
    model = model.eval()
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = model.float()
    return model


def model_shape(model) -> ModelShape:
    """Shape facts of a loaded HF causal LM (raises ValueError for other architectures)."""
    return ModelShape.from_hf_config(model.config)


class FlatCacheDecoder(torch.nn.Module):
    """forward(input_ids, attention_mask, position_ids, *flat_past) -> (logits, *flat_present)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.spec = model_shape(model)

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        n = self.spec.num_layers
        if len(past) != 2 * n:
            raise ValueError(f"expected {2 * n} past tensors (key and value for {n} layers), got {len(past)}")
        cache = DynamicCache(config=self.model.config)
        for i in range(n):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=True,
        )
        flat: list[torch.Tensor] = []
        for i in range(n):
            layer = out.cache.layers[i]
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


@dataclass(frozen=True)
class DecoderInputs:
    """One call's inputs as numpy-free torch tensors, in contract order."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    past: tuple[torch.Tensor, ...]

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.attention_mask, self.position_ids, *self.past)

    def as_feed(self, num_layers: int) -> dict:
        feed = {
            "input_ids": self.input_ids.numpy(),
            "attention_mask": self.attention_mask.numpy(),
            "position_ids": self.position_ids.numpy(),
        }
        for name, t in zip(past_names(num_layers), self.past):
            feed[name] = t.numpy()
        return feed

