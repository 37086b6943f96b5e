"""LoRA adapters applied per row of a step: each row of a batch under its own adapter, or none.

    attach_lora(model) -> LoraState     wraps the model's projections and LM head, once
    LoraStep.plan(adapters, plan)       which rows of a step run under which adapter
    with state.running(step): ...       the step's forward pass, the adapters applied
    decode_batch(adapters, model)       a decode step's adapters for the C++ decode step

Every projection of the layers becomes a LoraLinear: the base projection (any weight format:
float, blocked, panels, int8, int8 weight-only) computes every row, then each adapter of the
step adds (x_i @ a_i) @ b_i, float32, to its own rows. Adapters of different ranks share the
step, each at its own rank (no padding to the largest); rows without an adapter get nothing
added. With no step running (or a step of base rows only) a wrapper is one attribute test over
the base projection.

Where tritonlm's C++ ops run (float32 on the CPU, Transformer.cpp_ops) the update is one call
per projection, grouped by adapter (kernels/lora_ops.cpp, torch.ops.tritonlm.lora_apply), and
the C++ decoder stack runs the same kernel right after each base projection: a decode step
with adapter rows is still one C++ call (Transformer.decode_step with a LoraBatch, or the stack
inside run_layers), with the same bits as the Python layer loop. Only a decode step whose
adapters replace the embedding or the LM head (modules_to_save) takes the Python path around
the stack, which applies those for their rows. On CUDA, where Triton runs, the update is two
Triton launches per projection whatever the number of adapters (kernels/lora_triton.py), over
the step's adapters packed once per projection (LoraStep.triton_pack). Elsewhere (no Triton,
CPU without the C++ ops, bfloat16 on the CPU) each adapter's rows are gathered, multiplied
with torch ops and index-added.

The rows a projection sees are the step's tokens in one of two layouts (runners.model): packed
(ForwardBatch.packed, the N valid tokens) or the whole padded [B, T]; the step holds both, and
a projection's row count says which it got (N < B*T whenever the batch is packed). The LM head
sees B rows (each row's last token) or B*T (all_logits). modules_to_save's replacement
embedding and LM head are looked up / applied for their adapter's rows only.

CUDA decode graphs hold the base projections only: a GPU step with adapter rows runs eagerly
(runners.torch_runner).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from tritonlm.engine.kernels import lora_triton
from tritonlm.engine.lora.adapter import LoraAdapter, projection_widths
from tritonlm.engine.runners.layers import PROJECTION_NAMES, Linear

# Tests set this to run the Triton kernels on CPU tensors (under TRITON_INTERPRET=1), which
# otherwise serve CUDA tensors only.
TRITON_ON_CPU = False

# a Layer's projection -> its place in the C++ decoder stack's layer (DecoderStack's order)
STACK_INDEX = {"qkv": 0, "o": 1, "gate_up": 2, "fc": 2, "down": 3}


def cpp_weights(adapter: LoraAdapter, num_layers: int) -> object:
    """The adapter's updates as torch.classes.tritonlm.LoraWeights (kept on the adapter): its
    a [in, R] referenced, its b packed to each row's non-zero columns."""
    if adapter.cpp is None:
        weights = torch.classes.tritonlm.LoraWeights(num_layers)
        for (layer, name), delta in adapter.deltas.items():
            weights.set(layer, STACK_INDEX[name], delta.a, delta.b)
        adapter.cpp = weights
    return adapter.cpp


def cpp_batch(adapters: list[LoraAdapter], groups: list[torch.Tensor], num_layers: int) -> object:
    """A torch.classes.tritonlm.LoraBatch: adapters[i] on rows groups[i] (int64 [n_i])."""
    batch = torch.classes.tritonlm.LoraBatch()
    for adapter, rows in zip(adapters, groups):
        if rows.numel():
            batch.add(cpp_weights(adapter, num_layers), rows)
    return batch


def decode_batch(adapters: list[LoraAdapter | None], num_layers: int) -> object | None:
    """A decode step's rows (one token each) per adapter, as the C++ decode step takes them;
    None when no row has an adapter."""
    rows: dict[int, list[int]] = {}
    order: list[LoraAdapter] = []
    for b, a in enumerate(adapters):
        if a is None:
            continue
        if id(a) not in rows:
            rows[id(a)] = []
            order.append(a)
        rows[id(a)].append(b)
    if not order:
        return None
    return cpp_batch(order, [torch.tensor(rows[id(a)], dtype=torch.int64) for a in order], num_layers)


@dataclass(eq=False)
class LoraStep:
    """One step's adapters and, per adapter, the rows that run under it, in each layout:
    packed tokens [n_i] (into the N valid tokens), whole-batch tokens [n_i] (into B*T) and
    rows [m_i] (into B)."""

    adapters: list[LoraAdapter]  # each distinct adapter of the step once
    packed: list[torch.Tensor]  # per adapter: its tokens among the packed N
    tokens: list[torch.Tensor]  # per adapter: its tokens among B*T
    rows: list[torch.Tensor]  # per adapter: its rows among B
    num_packed: int  # N
    batch: int  # B
    width: int  # T
    # the model's layers, where the C++ kernels apply the updates (lora_ops.cpp); 0: torch ops
    cpp_layers: int = 0
    _cpp: dict[int, object] = field(default_factory=dict, repr=False)  # rows of a projection -> LoraBatch
    _slots: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # rows of a projection -> [rows] int32
    # (layer, projection) -> its updates of the step's adapters, packed for the Triton kernels
    _packs: dict[tuple[int, str], lora_triton.LoraPack] = field(default_factory=dict, repr=False)

    @staticmethod
    def plan(adapters: list[LoraAdapter | None], valid: torch.Tensor, device: torch.device,
             cpp_layers: int = 0) -> "LoraStep | None":
        """adapters[b]: row b's adapter (None: the base); valid [B, T] bool (ForwardBatch.valid);
        cpp_layers: the model's layer count where its C++ ops run (CPU, float32), else 0.
        None when no row has an adapter."""
        distinct: dict[int, int] = {}
        order: list[LoraAdapter] = []
        slot = []
        for a in adapters:
            if a is None:
                slot.append(-1)
                continue
            if id(a) not in distinct:
                distinct[id(a)] = len(order)
                order.append(a)
            slot.append(distinct[id(a)])
        if not order:
            return None
        valid = valid.cpu()
        bsz, width = valid.shape
        if len(slot) != bsz:
            raise ValueError(f"StepBatch.adapters has {len(slot)} entries for a batch of {bsz} rows")
        row_slot = torch.tensor(slot, dtype=torch.int64)  # [B]
        token_slot = row_slot.repeat_interleave(width)  # [B*T]
        packed_slot = token_slot[valid.reshape(-1)]  # [N]

        def where(s: torch.Tensor, k: int) -> torch.Tensor:
            return (s == k).nonzero().squeeze(1).to(device)

        ks = range(len(order))
        return LoraStep(order, [where(packed_slot, k) for k in ks], [where(token_slot, k) for k in ks],
                        [where(row_slot, k) for k in ks], int(packed_slot.shape[0]), bsz, width, cpp_layers)

    def cpp_batch(self, rows: int) -> object:
        """The adapters' rows among a projection's `rows` rows as a C++ LoraBatch (made once per layout)."""
        batch = self._cpp.get(rows)
        if batch is None:
            batch = self._cpp[rows] = cpp_batch(self.adapters, self.token_groups(rows), self.cpp_layers)
        return batch

    def triton_slots(self, rows: int, device: torch.device) -> torch.Tensor:
        """[rows] int32: each of a projection's rows' adapter (its index in `adapters`), -1
        for base rows, as the Triton kernels take them (made once per layout)."""
        slots = self._slots.get(rows)
        if slots is None:
            slots = torch.full((rows,), -1, dtype=torch.int32, device=device)
            for k, idx in enumerate(self.token_groups(rows)):
                slots[idx.to(device)] = k
            self._slots[rows] = slots
        return slots

    def triton_pack(self, key: tuple[int, str], in_features: int, out_features: int,
                    device: torch.device) -> lora_triton.LoraPack:
        """The adapters' updates of projection `key`, packed for the Triton kernels (once per
        step: the step's adapters differ from step to step)."""
        pack = self._packs.get(key)
        if pack is None:
            deltas = [adapter.deltas.get(key) for adapter in self.adapters]
            pack = self._packs[key] = lora_triton.pack_deltas(
                [None if d is None else (d.a, d.b) for d in deltas], in_features, out_features, device)
        return pack

    def token_groups(self, rows: int) -> list[torch.Tensor]:
        """Per adapter, its rows among a projection's `rows` rows (N packed, or B*T)."""
        if rows == self.num_packed:
            return self.packed
        if rows == self.batch * self.width:
            return self.tokens
        raise ValueError(f"a projection saw {rows} rows; the step has {self.num_packed} tokens of "
                         f"{self.batch} x {self.width}")

    def head_groups(self, rows: int) -> list[torch.Tensor]:
        """Per adapter, its rows among the LM head's `rows` (B last tokens, or B*T)."""
        if rows == self.batch:
            return self.rows
        if rows == self.batch * self.width:
            return self.tokens
        raise ValueError(f"the LM head saw {rows} rows; the step has {self.batch} x {self.width}")


@dataclass(eq=False)
class LoraState:
    """The adapters' side of one Transformer: the step running now (None between steps and
    for base-only steps), read by the wrapped projections (one runner, one thread)."""

    step: LoraStep | None = None
    stack_steps: int = 0  # steps whose adapter rows ran inside the C++ decoder stack (tests read it)
    wrapped: dict[tuple[int, str], "LoraLinear"] = field(default_factory=dict)
    # {(layer, projection): (inputs, outputs)} (adapter.projection_widths), taken at attach
    widths: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)

    @contextmanager
    def running(self, step: LoraStep | None) -> Iterator[None]:
        self.step = step
        try:
            yield
        finally:
            self.step = None

    def embed(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [B, T, C] looked up in the base table -> the same with each adapter's replacement
        embedding (modules_to_save) at its rows' tokens."""
        step = self.step
        if step is None or not any(a.embed is not None for a in step.adapters):
            return x
        flat, ids = x.reshape(-1, x.shape[-1]), input_ids.reshape(-1)  # [B*T, C], [B*T]
        for adapter, idx in zip(step.adapters, step.tokens):
            if adapter.embed is not None and idx.numel():
                flat.index_copy_(0, idx, F.embedding(ids.index_select(0, idx), adapter.embed).to(flat.dtype))
        return flat.view(x.shape)


class LoraLinear(Linear):
    """A base projection plus the running step's adapters' updates of it, per row."""

    def __init__(self, base: Linear, state: LoraState, key: tuple[int, str]) -> None:
        self.base = base
        self.state = state
        self.key = key  # (layer, projection name): LoraAdapter.deltas' key

    @property
    def b(self) -> torch.Tensor | None:  # [out]: the base's bias (row_parallel adds it)
        return self.base.b

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., in] -> [..., out]
        y = self.base.apply(x, bias)
        step = self.state.step
        if step is None:
            return y
        y = y.contiguous()
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # [M, in], [M, out]
        if (flat_x.is_cuda or TRITON_ON_CPU) and lora_triton.available(flat_x.device)[0]:
            rows, width_in, width_out = flat_x.shape[0], flat_x.shape[1], flat_y.shape[1]
            lora_triton.lora_apply(flat_y, flat_x.contiguous(), step.triton_slots(rows, flat_x.device),
                                   step.triton_pack(self.key, width_in, width_out, flat_x.device))
            return y
        if step.cpp_layers and flat_x.dtype == torch.float32 and flat_y.dtype == torch.float32:
            torch.ops.tritonlm.lora_apply(flat_y, flat_x.contiguous(), step.cpp_batch(flat_x.shape[0]), self.key[0],
                                          STACK_INDEX[self.key[1]])
            return y
        for adapter, idx in zip(step.adapters, step.token_groups(flat_x.shape[0])):
            delta = adapter.deltas.get(self.key)
            if delta is None or not idx.numel():
                continue
            h = flat_x.index_select(0, idx).to(delta.a.dtype) @ delta.a  # [n, R]
            flat_y.index_add_(0, idx, (h @ delta.b).to(y.dtype))  # [n, out]
        return y

    def plain(self):
        raise ValueError("a projection with LoRA adapters attached cannot be sliced or quantized: "
                         "quantize or pack the base model first, then attach adapters")

    def opaque_weight(self) -> tuple[object, int] | None:
        return self.base.opaque_weight()


class LoraHead(Linear):
    """The base LM head, or a modules_to_save replacement for its adapter's rows."""

    def __init__(self, base: Linear, state: LoraState) -> None:
        self.base = base
        self.state = state

    @property
    def b(self) -> torch.Tensor | None:
        return self.base.b

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # [..., C] -> [..., V]
        y = self.base.apply(x, bias)
        step = self.state.step
        if step is None or not any(a.head is not None for a in step.adapters):
            return y
        y = y.contiguous()
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # [M, C], [M, V]
        for adapter, idx in zip(step.adapters, step.head_groups(flat_x.shape[0])):
            if adapter.head is not None and idx.numel():
                flat_y.index_copy_(0, idx, adapter.head(flat_x.index_select(0, idx)).to(y.dtype))
        return y

    def plain(self):
        raise ValueError("an LM head with LoRA adapters attached cannot be sliced or quantized")

    def opaque_weight(self) -> tuple[object, int] | None:
        return self.base.opaque_weight()


def attach_lora(model) -> LoraState:
    """Wrap the layers' projections and the LM head of the runners.model.Transformer `model` so
    steps can run adapters (once: attaching again returns the same state). After any
    quantization and packing, which read the plain weights. The decoder stack already built
    keeps the base projections; a step's adapters reach it as a LoraBatch (cpp_batch)."""
    state = getattr(model, "lora", None)
    if isinstance(state, LoraState):
        return state
    state = LoraState(widths=projection_widths(model))
    for li, layer in enumerate(model.layers):
        for name in PROJECTION_NAMES:
            proj = getattr(layer, name)
            if proj is not None:
                wrapped = LoraLinear(proj, state, (li, name))
                setattr(layer, name, wrapped)
                state.wrapped[li, name] = wrapped
    if model.lm_head is not None:
        model.lm_head = LoraHead(model.lm_head, state)
    model.lora = state
    return state
