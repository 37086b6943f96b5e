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

import logging
from pathlib import Path
from typing import Callable

import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVPool
from tritonlm.engine.runners.base import check_pool, plan_step
from tritonlm.engine.runners.model import Transformer
from tritonlm.engine.runners.moe import refuse_precision
from tritonlm.engine.runners.quant import calibrate, quantize_int8, rotate_residual
from tritonlm.engine.runners.rope import recompute_at, rope_key
from tritonlm.engine.runners.weight_only import quantize_weight_only

log = logging.getLogger(__name__)

# the most prompt tokens a CPU step runs as one-token rows beside its decoding rows (chunk_rows)
FUSED_CHUNK_TOKENS = 128


class TorchRunner:
    """forward(batch, pool) -> float32 logits; see runners.base for the contract."""

    feeds_device_tokens = True  # StepBatch.fed: written in on the device (plan_step, DecodeGraphs)

    def __init__(
        self, model, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None, int8: bool = False,
        attention: str = "auto", int8_keep_float: Callable[[str], bool] | None = None,
        cuda_graphs: str = "auto", max_batch: int = 256, max_context: int | None = None, compile_decode: bool = False,
        int8_weight_only: bool = False,
    ):
        """int8: weights of every projection and the LM head in int8 (CPU, float32 compute);
        int8_keep_float(name) -> True leaves that projection float (quant.quantize_int8).
        int8_weight_only: int8 weights with float32 activations rounded to 16-bit codes
            instead (runners.weight_only).
        attention: "auto" / "paged" use the paged-attention kernel where it can run (see
        `self.attention` and `self.attention_why`; "paged" does not raise, the loader
        refuses it); "gather" never does.
        cuda_graphs: "auto" replays decode steps as CUDA graphs where the Triton decode
        kernel runs (runners.decode_graphs), "off" runs them eagerly; max_batch and
        max_context bound the graphs' buffers (the engine's max_num_seqs and max_context);
        compile_decode: those decode steps through torch.compile first."""
        if int8_keep_float is not None and not int8:
            raise ValueError("int8_keep_float: only with int8=True (it chooses what int8 leaves float)")
        if int8 and int8_weight_only:
            raise ValueError("int8 and int8_weight_only: one or the other (int8 x int8, or int8 weights only)")
        if attention not in ("auto", "paged", "gather"):
            raise ValueError(f"attention: {attention!r}; use 'auto', 'paged' or 'gather'")
        self.device = torch.device(device)
        self.transformer = Transformer.from_hf(model, self.device, dtype)  # ValueError for other architectures
        self.spec = self.transformer.spec
        self.dtype = self.spec.dtype
        self.config = model.config
        self.max_positions = self.transformer.max_positions  # GPT-2: a hard limit; RoPE: none (None)
        if int8:
            refuse_precision(self.transformer.layers, "int8")  # before calibration runs the model
            rotate_residual(self.transformer)  # Llama family: outliers spread before calibration sees them
            calibrate(self.transformer)
            quantize_int8(self.transformer, keep_float=int8_keep_float)
        self.int8_weight_only = int8_weight_only
        if int8_weight_only:
            quantize_weight_only(self.transformer)  # nearest rounding: GPTQ's gain did not pay for its load time
        self.transformer.block_weights()  # CPU float: oneDNN's blocked layout (after calibration, which reads w)
        from tritonlm.engine.runners.decode_graphs import CUDA_GRAPH_MODES

        if cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs: {cuda_graphs!r}; use one of {', '.join(CUDA_GRAPH_MODES)}")
        self.attention, self.attention_why = "gather", "asked for"
        if attention != "gather":
            on, self.attention_why = self.transformer.use_paged_kernel()
            self.attention = "paged" if on else "gather"
            if not on and self.device.type == "cuda":
                on, why = self.transformer.use_decode_kernel()
                self.attention, self.attention_why = ("paged", "Triton decode kernel") if on else ("gather", why)
        self.cuda_graphs = cuda_graphs
        self.compile_decode = compile_decode
        self.max_batch = max_batch
        self.max_context = max_context or self.max_positions or 4096
        self.decode_graphs = None  # runners.decode_graphs.DecodeGraphs, made by the first decode step
        # decode steps from block tables in one C++ call where the whole model is in the
        # decoder stack (Transformer.decode_step); False: the Python path (tests compare the two)
        self.lean_decode = True

    @classmethod
    def from_pretrained(
        cls, hf_dir: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
        int8: bool = False, attention: str = "auto", cuda_graphs: str = "auto", max_batch: int = 256,
        max_context: int | None = None, compile_decode: bool = False, int8_weight_only: bool = False, **kwargs
    ) -> "TorchRunner":
        from transformers import AutoModelForCausalLM

        if dtype is not None:
            kwargs["dtype"] = dtype
        model = AutoModelForCausalLM.from_pretrained(str(hf_dir), **kwargs)
        model.eval()
        return cls(model, device=device, dtype=dtype, int8=int8, attention=attention, cuda_graphs=cuda_graphs,
                   max_batch=max_batch, max_context=max_context, compile_decode=compile_decode,
                   int8_weight_only=int8_weight_only)

    @property
    def chunk_rows(self) -> int:
        """Prompt tokens a step may run as one-token rows in its decoding rows' pass
        (ModelExecutor._run_beside_decodes). On a CPU every pass streams all the weights, so
        a chunk's pass of its own costs about what a decode step does; run beside the
        decodes, its tokens add only their share of the projections. A wide chunk gains
        less (its own pass runs it as one wide product, and every one of its rows here also
        pays the LM head), so only chunks up to FUSED_CHUNK_TOKENS join. Only where the
        rows read the pool in place (float32, the C++ paged kernel): the gathered path would
        copy each row's whole history once per prompt token. Not with int8 weights only,
        whose kernel changes its way (and a row's bits) past a few dozen rows. 0 on a GPU:
        its decode steps replay graphs captured for fixed batch sizes."""
        if self.device.type != "cpu" or self.attention != "paged" or self.dtype != torch.float32:
            return 0
        return 0 if self.int8_weight_only else FUSED_CHUNK_TOKENS

    @property
    def rope_recompute_at(self) -> int | None:
        """Phi-3 with longrope: the length past which a sequence runs again whole (Scheduler.rotate_again)."""
        return recompute_at(self.transformer.length_rope)

    def rope_key(self, prompt_tokens: int) -> bytes | None:
        """Which tables of a length-dependent RoPE rotate a sequence of that prompt (None: no
        such RoPE, or a short prompt's): keys its prefix-cache chain (Scheduler._chain_root)."""
        return rope_key(self.transformer.length_rope, prompt_tokens)

    def allocate_kv(self, num_slots: int) -> KVPool:
        return KVPool.for_shape(self.spec, num_slots, self.device)

    def forward(self, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        check_pool(self.spec, self.device, pool)
        lean = (self.lean_decode and batch.width == 1 and not batch.all_logits and batch.block_table is not None
                and batch.window_block_table is None and self.transformer.decode_step_ready)
        if lean and batch.fed is not None:  # the C++ decode step (a CPU's) reads input_ids itself
            batch.apply_fed(batch.input_ids)
            batch.fed = None
        if batch.adapters is not None and any(a is not None for a in batch.adapters):
            if lean and not any(a is not None and (a.embed is not None or a.head is not None) for a in batch.adapters):
                from tritonlm.engine.lora.apply import decode_batch

                self._lora_state()  # the adapters were attached
                return self.transformer.decode_step(batch, pool, decode_batch(batch.adapters, len(self.transformer.layers)))
            return self._forward_lora(batch, pool)
        graphs = self._decode_graphs(batch, pool)
        if graphs is not None:
            if self.max_positions is not None and int((batch.past_len + batch.num_new).max()) > self.max_positions:
                raise ValueError(f"sequence length exceeds the model's max_positions={self.max_positions}")
            return graphs.forward(batch)
        if lean:
            return self.transformer.decode_step(batch, pool)
        plan = plan_step(batch, self.device, self.max_positions)
        return self.transformer.forward(plan, batch.all_logits, pool)

    __call__ = forward

    def _lora_state(self):
        state = self.transformer.lora
        if state is None:
            raise ValueError("StepBatch.adapters names LoRA adapters, but none are attached to this runner "
                             "(lora.apply.attach_lora)")
        return state

    def _forward_lora(self, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        """A step with LoRA adapter rows (lora.apply) that is not a plain decode step (a prefill,
        or adapters that replace the embedding or LM head): Transformer.forward with each row's
        adapter applied; its layers still run in the C++ decoder stack where it can take the
        step (CUDA decode graphs hold the base projections only)."""
        from tritonlm.engine.lora.apply import LoraStep

        state = self._lora_state()
        plan = plan_step(batch, self.device, self.max_positions)
        cpp_layers = len(self.transformer.layers) if self.transformer.cpp_ops else 0
        with state.running(LoraStep.plan(batch.adapters, plan.valid, self.device, cpp_layers)):
            return self.transformer.forward(plan, batch.all_logits, pool)

    def prepare_decode(self, pool: KVPool, block_size: int) -> str:
        """Capture the decode graphs of every bucket now (compiling first with compile_decode),
        so the first requests do not wait for it. A compilation that fails falls back to the
        uncompiled step, logged. Returns what the decode steps will run."""
        if not self.transformer.decode_kernel:
            return f"no decode graphs: {self.attention_why}"
        if self.transformer.window_groups:
            return f"no decode graphs: {self.transformer.fast_paths().why}"
        self.decode_graphs = self._new_decode_graphs(pool, block_size)
        try:
            self.decode_graphs.capture_all()
        except Exception as e:  # noqa: BLE001 - the uncompiled step serves instead
            if not self.compile_decode:
                raise
            log.warning("compile_decode: torch.compile failed (%s: %s); decode steps run uncompiled",
                        type(e).__name__, e)
            self.compile_decode = False
            self.decode_graphs = self._new_decode_graphs(pool, block_size)
            self.decode_graphs.capture_all()
        what = "CUDA graphs" if self.decode_graphs.use_graphs else "eager padded steps"
        return f"{what} for batch buckets {self.decode_graphs.buckets}" + (", compiled" if self.compile_decode else "")

    def _decode_graphs(self, batch: StepBatch, pool: KVPool):
        """The DecodeGraphs that runs this batch, or None for the general path (always for a
        length-dependent RoPE: its padded steps know no prompt lengths)."""
        if (not self.transformer.decode_kernel or batch.block_table is None or self.transformer.length_rope is not None
                or batch.window_block_table is not None):  # two groups' tables: the general path
            return None
        graphs = self.decode_graphs
        if graphs is None or graphs.pool is not pool:
            graphs = self.decode_graphs = self._new_decode_graphs(pool, batch.block_size)
        return graphs if graphs.accepts(batch) else None

    def _new_decode_graphs(self, pool: KVPool, block_size: int):
        from tritonlm.engine.runners.decode_graphs import DecodeGraphs

        blocks = -(-self.max_context // block_size)  # the block-table width of a full-context sequence
        return DecodeGraphs(self.transformer, pool, self.max_batch, blocks, block_size,
                            graphs=self.cuda_graphs == "auto" and self.transformer.fast_paths().cuda_graphs,
                            compile=self.compile_decode)

    def close(self) -> None:
        pass
