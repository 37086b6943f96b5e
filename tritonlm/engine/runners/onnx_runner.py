"""OnnxRunner: an exported decoder ONNX artifact driven over the paged KV pool.

The artifact follows tritonlm.export.wrapper's I/O contract:
    inputs   input_ids [B, T] int64, attention_mask [B, P+T] int64, position_ids [B, T] int64,
             past_key_values.{i}.key / .value [B, Hkv, P, D]
    outputs  logits [B, T, V], present.{i}.key / .value [B, Hkv, P+T, D]

Each step:
  1. gather every row's past (positions < past_len[b]) from the pool into right-padded dense
     tensors [B, Hkv, Pmax, D] (Pmax = max past_len): ONE copy of the live cache per step;
  2. attention_mask = 1 for valid past, 0 for the gap up to Pmax, then 1 for valid new tokens
     (0 for padded ones); explicit position_ids (so the gap does not shift positions);
  3. run; the graph returns present = past + new (a second full copy, made by the graph:
     the copy arithmetic in docs/architecture.md; perf/bench_runner.py measures it);
  4. write present[:, :, Pmax + t] for valid t into the pool (padding -> scratch slot 0).

Host/device paths:
  * CPU (default): `session.run` with numpy views of torch tensors (zero copy both ways).
  * io_binding=True: inputs and preallocated outputs bound by pointer to torch tensors.
    This is the CUDA path (tensors never leave the GPU); it is also exercised on CPU by
    the tests, so only the device strings and stream syncs of the CUDA case are untested.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch

from tritonlm.engine.batch import StepBatch
from tritonlm.engine.kv_cache import KVPool
from tritonlm.engine.runners.base import ForwardBatch, Workspace, check_pool, gather_kv, kv_rows, plan_step
from tritonlm.engine.model_shape import ModelShape

_ORT_TYPES: dict[str, tuple[np.dtype, torch.dtype]] = {
    "tensor(float)": (np.dtype(np.float32), torch.float32),
    "tensor(float16)": (np.dtype(np.float16), torch.float16),
    "tensor(double)": (np.dtype(np.float64), torch.float64),
    "tensor(int64)": (np.dtype(np.int64), torch.int64),
    "tensor(int32)": (np.dtype(np.int32), torch.int32),
}


def _types(ort_type: str, name: str) -> tuple[np.dtype, torch.dtype]:
    if ort_type not in _ORT_TYPES:
        raise ValueError(f"ONNX input/output {name!r} has type {ort_type}; supported: {sorted(_ORT_TYPES)}")
    return _ORT_TYPES[ort_type]


def _config_of(src):
    """A HF config from a loaded model, a config object, or a Hugging Face folder."""
    if isinstance(src, (str, Path)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(src))
    if hasattr(src, "model_type") and not hasattr(src, "forward"):
        return src  # already a config
    if hasattr(src, "config"):
        return src.config
    raise ValueError(f"cannot read a model config from {type(src).__name__}: pass a HF model, config or folder")


def past_names(num_layers: int) -> list[str]:
    return [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


def present_names(num_layers: int) -> list[str]:
    return [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]


class OnnxRunner:
    """forward(batch, pool) -> float32 logits; see runners.base for the contract."""

    def __init__(
        self,
        hf_dir_or_model,
        onnx_path: str | Path,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        io_binding: bool | None = None,
        session_options=None,
    ):
        import onnxruntime as ort

        config = _config_of(hf_dir_or_model)
        self.device = torch.device(device)
        self.onnx_path = Path(onnx_path)
        if not self.onnx_path.is_file():
            raise ValueError(f"onnx_path {str(onnx_path)!r} is not a file")
        providers = ["CPUExecutionProvider"]
        if self.device.type == "cuda":
            # --- CUDA path (untested here: no GPU on the build machines) ---
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise ValueError(
                    "device is cuda but onnxruntime has no CUDAExecutionProvider "
                    f"(available: {ort.get_available_providers()}); install onnxruntime-gpu"
                )
            providers = [("CUDAExecutionProvider", {"device_id": self.device.index or 0}), "CPUExecutionProvider"]
        elif self.device.type != "cpu":
            raise ValueError(f"device {str(device)!r} is not supported by OnnxRunner (cpu or cuda)")
        self.session = ort.InferenceSession(str(self.onnx_path), sess_options=session_options, providers=providers)
        self.io_binding = self.device.type == "cuda" if io_binding is None else bool(io_binding)
        if self.device.type == "cuda" and not self.io_binding:
            raise ValueError("io_binding=False needs device='cpu' (numpy feeds); on cuda the tensors stay bound")
        self.workspace = Workspace()  # past feeds (and bound presents) reused step to step

        probe = ModelShape.from_hf_config(config)
        n = probe.num_layers
        inputs = {i.name: i for i in self.session.get_inputs()}
        outputs = {o.name: o for o in self.session.get_outputs()}
        need_in = ["input_ids", "attention_mask", "position_ids", *past_names(n)]
        need_out = ["logits", *present_names(n)]
        missing = [x for x in need_in if x not in inputs] + [x for x in need_out if x not in outputs]
        if missing:
            raise ValueError(
                f"{self.onnx_path.name} does not follow the decoder I/O contract for {n} layers: "
                f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}"
            )
        self._in_types = {name: _types(inputs[name].type, name) for name in need_in}
        self._out_types = {name: _types(outputs[name].type, name) for name in need_out}
        self._past_names = past_names(n)
        self._present_names = present_names(n)
        past_torch = self._in_types["past_key_values.0.key"][1]
        self.dtype = dtype or past_torch
        self.spec = ModelShape.from_hf_config(config, dtype=self.dtype)
        self.max_positions = self.spec.max_positions if self.spec.architecture == "gpt2" else None

    def allocate_kv(self, num_slots: int) -> KVPool:
        return KVPool.for_shape(self.spec, num_slots, self.device)

    def close(self) -> None:
        pass

    # ---- step inputs ----------------------------------------------------------------
    def _inputs(self, plan: ForwardBatch, pool: KVPool) -> dict[str, torch.Tensor]:
        """Contiguous torch tensors on self.device, in the artifact's declared dtypes."""
        s = self.spec
        p = plan.max_past
        past_pos = torch.arange(p, device=self.device)  # [P]
        mask = torch.cat([past_pos.unsqueeze(0) < plan.past_len.unsqueeze(1), plan.valid], dim=1)  # [B, P+T]
        feed = {
            "input_ids": plan.input_ids,
            "attention_mask": mask,
            "position_ids": plan.positions,
        }
        # past: positions < Pmax of every row, straight into [B, Hkv, P, D] (entries >= past_len[b] are masked)
        rows = kv_rows(plan.slot_table[:, :p], s.num_kv_heads)  # [B*Hkv*P]
        shape = (plan.batch_size, s.num_kv_heads, p, s.head_dim)
        for li in range(s.num_layers):
            for name, cache in zip(self._past_names[2 * li : 2 * li + 2], (pool.k[li], pool.v[li])):
                want = self._in_types[name][1]
                out = self.workspace.take(name, shape, want, self.device) if cache.dtype == want else None
                feed[name] = gather_kv(cache, rows, plan.batch_size, out=out)  # [B, Hkv, P, D]
        return {name: t.to(self._in_types[name][1]).contiguous() for name, t in feed.items()}

    # ---- run: numpy (CPU) ------------------------------------------------------------
    def _run_numpy(self, feed: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        arrays = {name: t.numpy() for name, t in feed.items()}  # views, no copy
        names = ["logits", *self._present_names]
        return [torch.from_numpy(a) for a in self.session.run(names, arrays)]

    # ---- run: IOBinding (CUDA path; also runs on CPU) -----------------------------
    def _run_bound(self, feed: dict[str, torch.Tensor], plan: ForwardBatch) -> list[torch.Tensor]:
        dev_type = self.device.type
        dev_id = self.device.index or 0
        s = self.spec
        bsz, width, p = plan.batch_size, plan.width, plan.max_past
        out_shapes = {"logits": (bsz, width, s.vocab_size)}
        for name in self._present_names:
            out_shapes[name] = (bsz, s.num_kv_heads, p + width, s.head_dim)
        outs = {  # presents in reused buffers (read within this step only); logits fresh (returned)
            name: (torch.empty if name == "logits" else partial(self.workspace.take, name))(
                shape, dtype=self._out_types[name][1], device=self.device
            )
            for name, shape in out_shapes.items()
        }
        binding = self.session.io_binding()
        keep = []  # keeps placeholder buffers alive until the run ends
        for name, t in list(feed.items()) + list(outs.items()):
            if t.numel() == 0:  # empty past: ORT wants a real pointer; bind a 1-element buffer
                holder = torch.empty(1, dtype=t.dtype, device=self.device)
                keep.append(holder)
                ptr = holder.data_ptr()
            else:
                ptr = t.data_ptr()
            bind = binding.bind_input if name in feed else binding.bind_output
            np_type = (self._in_types if name in feed else self._out_types)[name][0]
            bind(name, dev_type, dev_id, np_type, tuple(t.shape), ptr)
        if dev_type == "cuda":  # --- CUDA (untested here) ---
            torch.cuda.synchronize(self.device)  # our gathers must land before ORT reads
        binding.synchronize_inputs()
        self.session.run_with_iobinding(binding)
        binding.synchronize_outputs()
        return [outs["logits"], *(outs[name] for name in self._present_names)]

    # ---- forward ------------------------------------------------------------------
    def forward(self, batch: StepBatch, pool: KVPool) -> torch.Tensor:
        check_pool(self.spec, self.device, pool)
        plan = plan_step(batch, self.device, self.max_positions)
        with torch.inference_mode():
            feed = self._inputs(plan, pool)
            if self.io_binding:
                logits, *present = self._run_bound(feed, plan)
            else:
                logits, *present = self._run_numpy(feed)
            logits = logits.to(self.device)  # [B, T, V] (no-op on CPU)
            p, width = plan.max_past, plan.width
            slots = plan.write_slots.reshape(-1)  # [B*T], padding -> scratch slot 0
            for li in range(self.spec.num_layers):
                for cache, new in zip((pool.k[li], pool.v[li]), present[2 * li : 2 * li + 2]):
                    new = new[:, :, p : p + width].to(self.device).permute(0, 2, 1, 3)  # [B, T, Hkv, D]
                    cache.index_copy_(0, slots, new.reshape(-1, *new.shape[2:]).to(cache.dtype))
            if not batch.all_logits:
                rows = torch.arange(plan.batch_size, device=self.device)
                logits = logits[rows, plan.num_new - 1]  # [B, V]
            return logits.float()

    __call__ = forward
