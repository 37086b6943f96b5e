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

Two parts of transformers' forward do not fit the contract, and the wrapper replaces them:
  sliding windows  transformers' mask measures the window in cache columns, which the holes
                   of a mid-padded pool stretch, and its windowed cache layers drop keys, so
                   present would be shorter than P+T. Where a layer has a window the wrapper
                   passes masks of its own (attention_bias) and a cache of full layers.
  experts          transformers' mixture-of-experts loops over the experts a batch routes to,
                   a count known only at run time, which tracing cannot keep. The wrapper
                   runs every expert on every row and weights each by its routing weight
                   (zero where unrouted): dense_experts_forward.
"""

from __future__ import annotations

import contextlib
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
        self.windows = layer_windows(model.config)
        self.moe = has_experts(model)

    def forward(self, input_ids, attention_mask, position_ids, *past):
        from transformers import DynamicCache

        n = self.spec.num_layers
        if len(past) != 2 * n:
            raise ValueError(f"expected {2 * n} past tensors (key and value for {n} layers), got {len(past)}")
        # no config: one full layer per model layer (a config would give windowed layers, which drop keys)
        cache = DynamicCache()
        for i in range(n):
            cache.update(past[2 * i], past[2 * i + 1], i)
        mask = attention_mask
        if any(w is not None for w in self.windows):
            mask = window_masks(attention_mask, input_ids.shape[1], self.windows)
        with dense_experts(self.model) if self.moe else contextlib.nullcontext():
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
        flat: list[torch.Tensor] = []
        for i in range(n):
            layer = out.cache.layers[i]
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def layer_windows(config) -> list[int | None]:
    """Per layer, its sliding window (None: full attention), as the engine reads the config."""
    if config.model_type == "gpt2":
        return [None] * config.n_layer
    from tritonlm.engine.runners.families import block_specs

    return [b.sliding_window for b in block_specs(config)]


def attention_bias(attention_mask: torch.Tensor, seq: int, window: int | None) -> torch.Tensor:
    """Additive attention mask [B, 1, T, P+T]: 0 where a query may attend, the float32 minimum
    elsewhere. attention_mask [B, P+T] int64; the queries are its last T columns.

    A query sees the unmasked columns up to its own; with a window, only those fewer than
    `window` positions back, as transformers' sliding_window_overlay (keys p - window < j <= p).
    Positions are counted over unmasked columns (a row's cumulative sum), so the holes of a
    mid-padded pool do not count. Every query also sees its own column: a padding query would
    otherwise see nothing, its softmax would be NaN, and the NaN would reach real rows through
    the next layer's keys (masked scores still multiply their values)."""
    # indices, not slices, pick the queries' columns: the exporter cannot bound a slice that
    # starts at P+T - T, as the mask's length is a dimension of its own
    total = attention_mask.shape[1]
    cols = torch.arange(total, device=attention_mask.device)  # [P+T]
    rows = torch.arange(seq, device=attention_mask.device) + (total - seq)  # [T]: the queries' columns
    visible = attention_mask.bool()[:, None, :] & (cols[None, None, :] <= rows[None, :, None])  # [B, T, P+T]
    if window is not None:
        count = attention_mask.long().cumsum(-1)  # [B, P+T]: unmasked columns up to each column
        back = count.index_select(1, rows)[:, :, None] - count[:, None, :]  # [B, T, P+T]: positions key to query
        visible = visible & (back < window)
    visible = visible | (cols[None, None, :] == rows[None, :, None])
    zero = torch.zeros((), dtype=torch.float32, device=attention_mask.device)
    low = torch.full((), torch.finfo(torch.float32).min, dtype=torch.float32, device=attention_mask.device)
    return torch.where(visible, zero, low)[:, None]


def window_masks(attention_mask: torch.Tensor, seq: int, windows: list[int | None]):
    """What the model's forward takes as attention_mask when a layer has a window: one 4-D mask
    where every layer has the same window, else transformers' per-layer-type mapping (the
    families that mix full and sliding layers index their masks by config.layer_types)."""
    kinds = sorted({w for w in windows if w is not None})
    if len(kinds) > 1:
        raise ValueError(f"layers with different sliding windows {kinds} are not supported (one window per model)")
    local = attention_bias(attention_mask, seq, kinds[0])
    if all(w is not None for w in windows):
        return local
    return {"full_attention": attention_bias(attention_mask, seq, None), "sliding_attention": local}


def has_experts(model) -> bool:
    """Whether `model` has transformers' experts modules (3-D expert weights in one module)."""
    return any(hasattr(m, "gate_up_proj") and hasattr(m, "num_experts") for m in model.modules())


DENSE_EXPERTS = "tritonlm_dense"


def dense_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (hidden [N, H], top_k_index / top_k_weights [N, k]) with
    every expert run on every row, weighted by its routing weight: E / k times the MLP work of
    routing, in shapes that do not depend on the routing. The experts' own _apply_gate splits
    gate and up (concatenated or interleaved, gpt-oss's clamp); weights are [E, out, in], or
    [E, in, out] where the class says is_transposed; biases where it has_bias."""
    if not getattr(self, "has_gate", True):
        raise ValueError(f"{type(self).__name__}: experts without a gate do not export")
    transposed = getattr(self, "is_transposed", False)
    bias = getattr(self, "has_bias", False)
    experts = torch.arange(self.num_experts, device=hidden_states.device)  # [E]
    # [N, k, E] one-hot of each choice, times its weight, summed over the k choices: [N, E]
    routing = ((top_k_index[..., None] == experts).to(top_k_weights.dtype) * top_k_weights[..., None]).sum(1)
    gate_up = torch.einsum("nh,eho->eno" if transposed else "nh,eoh->eno", hidden_states, self.gate_up_proj)  # [E, N, 2I]
    if bias:
        gate_up = gate_up + self.gate_up_proj_bias[:, None, :]
    act = self._apply_gate(gate_up)  # [E, N, I]
    out = torch.einsum("eni,eih->enh" if transposed else "eni,ehi->enh", act, self.down_proj)  # [E, N, H]
    if bias:
        out = out + self.down_proj_bias[:, None, :]
    return torch.einsum("enh,ne->nh", out, routing.to(out.dtype)).to(hidden_states.dtype)


@contextlib.contextmanager
def dense_experts(model):
    """Run `model`'s experts with dense_experts_forward for the duration (its own choice after)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(DENSE_EXPERTS, dense_experts_forward)
    previous = model.get_experts_implementation()
    model.set_experts_implementation(DENSE_EXPERTS)
    try:
        yield
    finally:
        model.set_experts_implementation(previous)


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

