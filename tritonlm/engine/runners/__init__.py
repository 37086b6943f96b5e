"""Runners: one forward pass for a batch of sequences with a paged KV cache.

    load_runner("torch", model_or_hf_dir, device="cpu")                       -> TorchRunner
    load_runner("onnx", model_or_config_or_hf_dir, onnx_path=PATH, device="cpu") -> OnnxRunner

Both follow runners.base.Runner: `spec`, `device`, `allocate_kv(num_slots) -> KVPool`,
`forward(batch, pool) -> logits`, `close()`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tritonlm.engine.runners.base import SCRATCH_SLOT, Runner, ForwardBatch, plan_step

RUNNER_KINDS = ("torch", "onnx")

__all__ = ["RUNNER_KINDS", "SCRATCH_SLOT", "Runner", "ForwardBatch", "load_runner", "plan_step"]


def onnx_session_options(threads: int = 0, spin: bool = False):
    """ONNX Runtime options for `threads` intra-op threads (0: its default). Idle threads sleep unless `spin`: a spinning thread keeps a core from the other threads
    of this server (or PyTorch, a reference run beside it) and from any neighbour, and a
    step stalls when one of its team is off its core."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return opts


def load_runner(
    kind: str,
    hf_dir_or_model,
    *,
    onnx_path: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    int8: bool = False,
    attention: str = "auto",
    threads: int = 0,
    **torch_options,
) -> Runner:
    """Build a runner.

    kind             "torch" | "onnx"
    hf_dir_or_model  a loaded HF causal LM, or a Hugging Face folder; for "onnx" also a bare
                     config object (only the shape facts are read: the weights are in the artifact)
    onnx_path        the exported decoder (.onnx); required for kind "onnx"
    device           "cpu" or "cuda[:i]"
    dtype            torch: compute dtype (default: the model's); onnx: KV dtype (default: the
                     artifact's declared past dtype)
    int8             torch only: int8 weights (CPU, float32 compute; see runners.quant.quantize_int8)
    attention        torch only: "auto" | "paged" | "gather", how decode steps read the KV
                     pool (TorchRunner; the runner's `attention` says what it uses)
    threads          onnx only: ONNX Runtime's intra-op threads (0: its default); torch's are
                     the calling thread's (torch.set_num_threads)
    torch_options    torch only: TorchRunner's cuda_graphs, max_batch, max_context, int8_weight_only
    """
    if kind == "torch":
        from tritonlm.engine.runners.torch_runner import TorchRunner

        if isinstance(hf_dir_or_model, (str, Path)):
            return TorchRunner.from_pretrained(
                hf_dir_or_model, device=device, dtype=dtype, int8=int8, attention=attention, **torch_options)
        return TorchRunner(hf_dir_or_model, device=device, dtype=dtype, int8=int8, attention=attention, **torch_options)
    if torch_options:
        raise ValueError(f"{sorted(torch_options)}: torch runtime options, not for {kind!r}")
    if kind == "onnx":
        if int8:
            raise ValueError("int8 weights are a torch runtime option; for ONNX export the onnx-int8 artifact")
        from tritonlm.engine.runners.onnx_runner import OnnxRunner

        if onnx_path is None:
            raise ValueError("runner kind 'onnx' needs onnx_path (the exported decoder .onnx file)")
        return OnnxRunner(hf_dir_or_model, onnx_path, device=device, dtype=dtype, session_options=onnx_session_options(threads))
    raise ValueError(f"unknown runner kind {kind!r} for field 'runner': expected one of {list(RUNNER_KINDS)}")
