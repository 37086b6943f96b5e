"""A mixture-of-experts MLP block: a router picks top_k of E experts per token, each expert
a SwiGLU MLP; the block's output is the routing-weighted sum of the chosen experts' outputs
(Mixtral, Qwen3-MoE, OLMoE; gpt-oss with a router bias, the softmax over the top_k logits
and a clamped SwiGLU), plus a shared expert scaled by a sigmoid gate (Qwen2-MoE).

    route(logits, top_k, normalize)   softmax over the experts, top_k, renormalized or not
    clamped_swiglu(gate_up, a, l)     gpt-oss's activation
    MoE.from_hf(block, config, t)     the weights of transformers' *SparseMoeBlock / GptOssMLP
    MoE(x, glu)                       x [N, C] -> [N, C], each expert run once over its rows
    MoE.convert(fn)                   every expert projection re-packed (block_weights' formats,
                                      int8_weight_only's codes)
    refuse_precision(layers, what)    ValueError: int8 (x int8) does not cover the experts

Routing is transformers' own arithmetic, op for op (the router's F.linear on the [E, C]
weight, a float32 softmax, torch.topk), so ties between experts break as they do there.

Grouped compute: the N*top_k (token, expert) routes are sorted by expert, so each expert's
rows are one contiguous run of a gathered [N*top_k, C] input; each expert with any rows runs
one gate_up and one down matmul over its run, and the outputs are gathered back to their
tokens, weighted and summed. A step thus costs one matmul pair per expert hit, whatever the batch,
instead of one per (token, expert). Each expert's projections are the project's Linear
classes (runners.layers), so on the CPU they run in the same packed formats as a dense MLP's
(Transformer.block_weights). The per-expert row counts are read on the host, so a
step with MoE layers cannot be captured in a CUDA graph (families.fast_paths).

Shapes: N tokens (rows), C hidden, E experts, K top_k, F an expert's MLP width, Fs the shared
expert's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from tritonlm.engine.runners.layers import FloatLinear, Linear


def route(logits: torch.Tensor, top_k: int, normalize: bool,
          softmax_after_topk: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] -> (weights [N, K], experts [N, K] int64): the top_k experts of a float32
    softmax over all E (torch.topk's order, ties included), their probabilities divided by
    their sum when `normalize` (Mixtral always; Qwen-MoE / OLMoE: norm_topk_prob). With
    softmax_after_topk (gpt-oss): the top_k logits, then a softmax over those alone, in the
    logits' dtype."""
    if softmax_after_topk:
        top, experts = torch.topk(logits, top_k, dim=-1)  # [N, K] each
        return F.softmax(top, dim=-1, dtype=top.dtype), experts
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [N, E]
    weights, experts = torch.topk(probs, top_k, dim=-1)  # [N, K] each
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[M, 2F] gate | up -> [M, F]: gpt-oss's SwiGLU, gate clamped to <= limit and up to
    [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(eq=False)
class MoE:
    """One layer's router (transformers' [E, C] layout: F.linear, the op transformers runs, so
    the logits and their ties are its own) and experts, one Linear pair per expert in the
    project's formats (block_weights packs them as it packs the dense projections)."""

    router: torch.Tensor  # [E, C]
    gate_up: list[Linear]  # E x [C, 2F], gate | up side by side
    down: list[Linear]  # E x [F, C]
    top_k: int
    normalize: bool  # renormalize the top_k probabilities to sum to 1
    # Mixtral keeps the routing weights float32 when it scales an expert's output; the others
    # cast them to the router logits' dtype first: the same products in bfloat16 as theirs
    float_weights: bool = False
    shared_gate_up: Linear | None = None  # [C, 2Fs] Qwen2-MoE's shared expert, every token
    shared_down: Linear | None = None  # [Fs, C]
    shared_gate: Linear | None = None  # [C, 1] sigmoid(x @ it) scales the shared expert's output
    router_bias: torch.Tensor | None = None  # [E] gpt-oss's
    softmax_after_topk: bool = False  # gpt-oss: the softmax runs over the top_k logits only
    swiglu_clamp: tuple[float, float] | None = None  # gpt-oss's (alpha, limit): clamped_swiglu

    @property
    def num_experts(self) -> int:
        return int(self.router.shape[0])

    @staticmethod
    def from_hf(block, config, t: Callable[[torch.Tensor | None], torch.Tensor | None]) -> "MoE":
        """The weights of a transformers *SparseMoeBlock (gate: the router, experts: stacked
        gate_up_proj [E, 2F, C] / down_proj [E, C, F], shared_expert and shared_expert_gate where
        present); t moves a tensor to the model's device and dtype."""

        model_type = config.model_type
        if model_type == "gpt_oss":
            return MoE._from_gpt_oss(block, config, t)

        def lin(w: torch.Tensor) -> FloatLinear:  # nn.Linear's [out, in] -> [in, out], contiguous
            return FloatLinear(w.t().contiguous(), None)

        shared = {}
        if getattr(block, "shared_expert", None) is not None:
            se = block.shared_expert
            shared = dict(shared_gate_up=lin(torch.cat([t(se.gate_proj.weight), t(se.up_proj.weight)])),  # [C, 2Fs]
                          shared_down=lin(t(se.down_proj.weight)),  # [Fs, C]
                          shared_gate=lin(t(block.shared_expert_gate.weight)))  # [C, 1]
        gate_up, down = t(block.experts.gate_up_proj), t(block.experts.down_proj)  # [E, 2F, C], [E, C, F]
        normalize = True if model_type == "mixtral" else bool(getattr(config, "norm_topk_prob", False))
        return MoE(router=t(block.gate.weight), gate_up=[lin(w) for w in gate_up], down=[lin(w) for w in down],
                   top_k=int(config.num_experts_per_tok), normalize=normalize, float_weights=model_type == "mixtral",
                   **shared)

    @staticmethod
    def _from_gpt_oss(block, config, t: Callable[[torch.Tensor | None], torch.Tensor | None]) -> "MoE":
        """gpt-oss's GptOssMLP: router weight and bias; experts stored [in, out] with biases,
        gate and up interleaved in gate_up's columns (gate even, up odd), put side by side here
        (gate | up) so that the activation splits them as every other family's."""
        ex = block.experts
        if not isinstance(getattr(ex, "gate_up_proj", None), torch.Tensor):
            raise ValueError("gpt-oss: the experts were loaded MXFP4-packed (transformers' MXFP4 kernels); load the "
                             "checkpoint dequantized instead (quantization_config=Mxfp4Config(dequantize=True))")
        gate_up, gate_up_b = t(ex.gate_up_proj), t(ex.gate_up_proj_bias)  # [E, C, 2F], [E, 2F]
        down, down_b = t(ex.down_proj), t(ex.down_proj_bias)  # [E, F, C], [E, C]

        def side_by_side(w: torch.Tensor) -> torch.Tensor:  # [..., 2F] interleaved -> gate | up
            return torch.cat([w[..., 0::2], w[..., 1::2]], dim=-1).contiguous()

        return MoE(router=t(block.router.weight), router_bias=t(block.router.bias),
                   gate_up=[FloatLinear(side_by_side(w), side_by_side(b)) for w, b in zip(gate_up, gate_up_b)],
                   down=[FloatLinear(w.contiguous(), b.contiguous()) for w, b in zip(down, down_b)],
                   top_k=int(config.num_experts_per_tok), normalize=False, softmax_after_topk=True,
                   swiglu_clamp=(float(config.swiglu_alpha), float(config.swiglu_limit)))

    def projections(self) -> dict[str, Linear]:
        """Every projection by name: "experts.{e}.gate_up" / ".down", "shared.{gate_up|down|gate}"."""
        out: dict[str, Linear] = {}
        for e, (gate_up, down) in enumerate(zip(self.gate_up, self.down)):
            out[f"experts.{e}.gate_up"], out[f"experts.{e}.down"] = gate_up, down
        for name in ("gate_up", "down", "gate"):
            if getattr(self, f"shared_{name}") is not None:
                out[f"shared.{name}"] = getattr(self, f"shared_{name}")
        return out

    def convert(self, fn: Callable[[Linear], Linear]) -> None:
        """Each expert's (and the shared expert's) projections replaced by fn(projection), in place."""
        self.gate_up = [fn(p) for p in self.gate_up]
        self.down = [fn(p) for p in self.down]
        for name in ("shared_gate_up", "shared_down", "shared_gate"):
            if getattr(self, name) is not None:
                setattr(self, name, fn(getattr(self, name)))

    def __call__(self, x: torch.Tensor, glu: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [N, C] -> [N, C]. glu: [M, 2F] -> [M, F], the gated activation (act(gate) * up)."""
        if self.swiglu_clamp is not None:
            alpha, limit = self.swiglu_clamp
            glu = lambda gate_up: clamped_swiglu(gate_up, alpha, limit)  # noqa: E731
        logits = F.linear(x, self.router, self.router_bias)  # [N, E]
        weights, experts = route(logits, self.top_k, self.normalize, self.softmax_after_topk)  # [N, K]
        if not self.float_weights:
            weights = weights.to(logits.dtype)
        flat = experts.reshape(-1)  # [N*K] the expert of each route, token-major
        order = torch.argsort(flat, stable=True)  # routes grouped by expert, tokens ascending within one
        token = order // self.top_k  # [N*K] the token of each grouped route
        xs = x.index_select(0, token)  # [N*K, C]
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # rows per expert (one host read)
        parts, start = [], 0
        for e, n in enumerate(counts):
            if n:
                parts.append(self.down[e](glu(self.gate_up[e](xs[start:start + n]))))  # [n, C]
                start += n
        if not parts:  # no rows
            return torch.zeros_like(x)
        ys = torch.cat(parts) if len(parts) > 1 else parts[0]  # [N*K, C] grouped by expert
        # back to token-major order (a gather: CPU scatter-adds cost more), weighted, summed per token
        ys = ys.index_select(0, torch.argsort(order)).view(*experts.shape, -1)  # [N, K, C]
        out = (ys * weights.unsqueeze(-1)).to(x.dtype).sum(dim=1)  # [N, C]
        if self.shared_gate_up is not None:
            shared = self.shared_down(glu(self.shared_gate_up(x)))  # [N, C]
            out = out + torch.sigmoid(self.shared_gate(x)) * shared
        return out


def refuse_precision(layers: list, precision: str) -> None:
    """ValueError when a model with MoE layers is asked for int8 (x int8): its calibration,
    smoothing and residual rotation (runners.quant) read a Layer's own projections, not the
    experts' (int8_weight_only, which needs none of them, converts the experts too)."""
    if any(getattr(L, "moe", None) is not None for L in layers):
        raise ValueError(f"{precision} is not supported for mixture-of-experts models (its quantizer does not cover "
                         "the experts' weights); serve them as float32 or bfloat16")
