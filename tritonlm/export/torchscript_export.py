"""TorchScript decoder (torch.jit.trace of the flat-cache wrapper) for Triton's PyTorch backend.

Triton's libtorch backend names tensors by position: inputs INPUT__0.. in the order
input_ids, attention_mask, position_ids, past.0.key, past.0.value, ...; outputs
OUTPUT__0 = logits, OUTPUT__1.. = present.0.key, present.0.value, ...
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from tritonlm.export.onnx_export import _example_inputs, quiet_logs
from tritonlm.export.wrapper import FlatCacheDecoder, as_float32


def export_decoder_torchscript(model, path: str | Path) -> Path:
    """Trace with a NON-empty past: traced with an empty past the graph specializes the
    mask arithmetic to P=0 and left-padded batches come out wrong."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    wrapper = FlatCacheDecoder(as_float32(model)).eval()
    example = _example_inputs(wrapper.spec, batch=2, seq=3, past=4)
    with torch.no_grad(), warnings.catch_warnings(), quiet_logs():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(wrapper, example, check_trace=False, strict=False)
    traced.save(str(path))
    return path
