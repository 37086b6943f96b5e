"""torch -> ONNX decoder with KV cache (dynamo exporter), plus int8 and fp16 variants.

`export_decoder_onnx(model, path)` is the one entry point the engine's tests use to
build an artifact; the I/O names are those of `tritonlm.export.wrapper`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import warnings
from pathlib import Path

import torch

from tritonlm.export.wrapper import (
    FlatCacheDecoder,
    as_float32,
    input_names,
    output_names,
)

log = logging.getLogger(__name__)

OPSET = 18


@contextlib.contextmanager
def quiet_logs(level: int = logging.WARNING):
    """The exporter, onnxscript's optimizer and the quantizer log hundreds of INFO lines
    (some on the root logger): silence records up to `level` while they run."""
    previous = logging.root.manager.disable
    logging.disable(level)
    try:
        yield
    finally:
        logging.disable(previous)


def _example_inputs(spec, batch: int = 2, seq: int = 3, past: int = 0):
    """Example call for tracing: left padding in row 0 so no mask shortcut can be baked in."""
    gen = torch.Generator().manual_seed(0)  # leave the caller's global RNG alone
    ids = torch.randint(0, spec.vocab_size, (batch, seq), dtype=torch.long, generator=gen)
    mask = torch.ones(batch, past + seq, dtype=torch.long)
    mask[0, 0] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -seq:]
    kv = (batch, spec.num_kv_heads, past, spec.head_dim)
    pasts = tuple(torch.randn(kv, generator=gen) for _ in range(2 * spec.num_layers))
    return (ids, mask, pos, *pasts)


def export_decoder_onnx(model, path: str | os.PathLike) -> Path:
    """Export `model` (HF GPT-2 or Llama causal LM, float32, eval) to an ONNX decoder with KV cache.

    Inputs  input_ids [B,T], attention_mask [B,P+T], position_ids [B,T] (int64),
            past_key_values.{i}.key/.value [B,kv_heads,P,head_dim] (P = 0 allowed)
    Outputs logits [B,T,V], present.{i}.key/.value [B,kv_heads,P+T,head_dim]
    B, T and P are dynamic. Weights go into one file (external data only past 2 GB).
    Returns the path written. Does not verify: see tritonlm.export.verify.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = as_float32(model)
    wrapper = FlatCacheDecoder(model).eval()
    spec = wrapper.spec
    n = spec.num_layers
    batch = torch.export.Dim("batch", min=1, max=1024)
    seq = torch.export.Dim("seq", min=1, max=spec.max_positions)
    past = torch.export.Dim("past", min=0, max=spec.max_positions)
    # attention_mask's length is past + seq; the exporter works out that relation itself.
    total = torch.export.Dim.DYNAMIC
    kv = {0: batch, 2: past}
    dynamic_shapes = (
        {0: batch, 1: seq},
        {0: batch, 1: total},
        {0: batch, 1: seq},
        tuple(kv for _ in range(2 * n)),
    )
    example = _example_inputs(spec)
    with torch.no_grad(), warnings.catch_warnings(), quiet_logs():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            _Positional(wrapper, n),
            (example[0], example[1], example[2], tuple(example[3:])),
            input_names=input_names(n),
            output_names=output_names(n),
            dynamic_shapes=dynamic_shapes,
            opset_version=OPSET,
            dynamo=True,
            external_data=False,
            optimize=True,
            verbose=False,
        )
    proto = program.model_proto
    _name_mask_dim(proto)
    _save_onnx(proto, path)
    return path


def _name_mask_dim(proto) -> None:
    """The exporter names attention_mask's length after an internal symbol: say what it is."""
    for value in proto.graph.input:
        if value.name == "attention_mask":
            dim = value.type.tensor_type.shape.dim[1]
            if dim.dim_param:
                dim.dim_param = "past + seq"


class _Positional(torch.nn.Module):
    """Takes the past as one tuple argument: the dynamo exporter's dynamic_shapes must
    nest the per-layer tensors as one entry."""

    def __init__(self, decoder: FlatCacheDecoder, num_layers: int):
        super().__init__()
        self.decoder = decoder
        self.num_layers = num_layers

    def forward(self, input_ids, attention_mask, position_ids, past):
        return self.decoder(input_ids, attention_mask, position_ids, *past)


TWO_GB = 2 * 1024**3 - 1


def _save_onnx(model_proto, path: Path) -> None:
    import onnx

    if model_proto.ByteSize() < TWO_GB:
        onnx.save_model(model_proto, str(path))
    else:
        onnx.save_model(
            model_proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
            location=path.name + ".data",
        )


# ---- int8 ---------------------------------------------------------------------------

def fold_constant_transposes(model_proto) -> int:
    """Replace Transpose(initializer) by a stored, already transposed initializer.

    With tied embeddings the dynamo graph computes the LM head as MatMul(h, Transpose(wte)):
    the quantizer only quantizes MatMuls whose weight is an initializer, so unfolded the
    largest matrix of the model stays float32 and int8 gives no speed-up.
    Returns how many were folded."""
    import numpy as np
    from onnx import numpy_helper

    graph = model_proto.graph
    inits = {t.name: t for t in graph.initializer}
    folded = 0
    keep = []
    for node in graph.node:
        if node.op_type == "Transpose" and len(node.input) == 1 and node.input[0] in inits:
            perm = None
            for attr in node.attribute:
                if attr.name == "perm":
                    perm = list(attr.ints)
            arr = numpy_helper.to_array(inits[node.input[0]])
            new = numpy_helper.from_array(np.ascontiguousarray(np.transpose(arr, perm)), name=node.output[0])
            graph.initializer.append(new)
            folded += 1
            continue
        keep.append(node)
    if folded:
        del graph.node[:]
        graph.node.extend(keep)
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        unused = [t for t in graph.initializer if t.name not in used]
        for t in unused:
            graph.initializer.remove(t)
    return folded


def quantize_int8(src: Path, dst: Path) -> Path:
    """Dynamic int8 (QInt8 weights, activations quantized at run time) of the fp32 decoder."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    proto = onnx.load(str(src))
    n = fold_constant_transposes(proto)
    log.debug("folded %d constant transposes before quantization", n)
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        folded = Path(tmp) / "folded.onnx"
        _save_onnx(proto, folded)
        del proto
        with quiet_logs():
            quantize_dynamic(
                folded,
                dst,
                op_types_to_quantize=["MatMul", "Gemm", "Gather"],  # Gather: the embedding tables too (size)
                weight_type=QuantType.QInt8,
                per_channel=False,
                use_external_data_format=folded.with_name(folded.name + ".data").exists(),
            )
    return dst


# ---- fp16 ---------------------------------------------------------------------------

def convert_fp16(src: Path, dst: Path) -> Path:
    """float16 weights and compute, float32 inputs/outputs (so the engine feeds the same
    tensors to every variant). Meant for GPUs; ONNX Runtime's CPU provider runs it too
    (slower than fp32) which is how it is verified here."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    proto = onnx.load(str(src))
    with quiet_logs():
        proto16 = convert_float_to_float16(proto, keep_io_types=True, disable_shape_infer=False)
    _save_onnx(proto16, dst)
    return dst
