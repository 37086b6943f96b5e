"""torch -> ONNX decoder with KV cache (dynamo exporter), plus int8 and fp16 variants.

`export_decoder_onnx(model, path)` is the one entry point the engine's tests use to
build an artifact; the I/O names are those of `tritonlm.export.wrapper`.
"""

from __future__ import annotations

import contextlib
import logging
import os
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


# Weight blocks of 32 input channels, one fp32 scale each: per-tensor (and even
# per-output-channel) scales lose too much top-1 agreement in the check (verify.py;
# docs/performance-notes.md).
INT8_BLOCK = 32
# A MatMul whose input has max|x| >= this many times its RMS on the calibration batch stays
# float32: Llama MLP down-projections carry "massive activations" (max/RMS far above the
# rest's), and int8 error on the weights they multiply moves the residual stream of every
# later layer. The threshold sits between ordinary activations' ratios and those outliers'
# (docs/performance-notes.md).
OUTLIER_RATIO = 50.0


def weight_matmuls(model_proto) -> list:
    """MatMul nodes whose B input is a stored weight (what weight quantization can touch)."""
    inits = {t.name for t in model_proto.graph.initializer}
    return [n for n in model_proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]


def activation_outlier_ratios(model_proto, seed: int = 0, batch: int = 2, seq: int = 16) -> dict[str, float]:
    """max|x| / RMS(x) of the activation input of each weight MatMul, from one fp32 forward
    pass over seeded random tokens (prefill from an empty past). Node name -> ratio."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    probe = onnx.ModelProto()
    probe.CopyFrom(model_proto)
    nodes = weight_matmuls(probe)
    acts = list(dict.fromkeys(n.input[0] for n in nodes))
    for name in acts:  # expose the activations as extra outputs
        probe.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    del probe
    vocab = None
    for t in model_proto.graph.initializer:  # the embedding table: [vocab, hidden], read by Gather
        if any(n.op_type == "Gather" and n.input[0] == t.name for n in model_proto.graph.node):
            vocab = int(t.dims[0])
            break
    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray] = {
        "input_ids": rng.integers(0, vocab or 2, size=(batch, seq), dtype=np.int64),
        "attention_mask": np.ones((batch, seq), dtype=np.int64),
        "position_ids": np.tile(np.arange(seq, dtype=np.int64), (batch, 1)),
    }
    for inp in sess.get_inputs():
        if inp.name.startswith("past_key_values."):
            heads, head_dim = inp.shape[1], inp.shape[3]
            feed[inp.name] = np.zeros((batch, heads, 0, head_dim), dtype=np.float32)
    values = dict(zip(acts, sess.run(acts, feed)))
    ratios = {}
    for n in nodes:
        x = np.abs(values[n.input[0]].astype(np.float64))
        ratios[n.name] = float(x.max() / max(np.sqrt((x * x).mean()), 1e-12))
    return ratios


def gemm_to_matmul(model_proto) -> int:
    """Rewrite Gemm(x, W, b) with a stored W as MatMul + Add: GPT-2's Conv1D exports as Gemm,
    and ONNX Runtime's blockwise weight quantizer handles MatMul only. Returns how many."""
    import numpy as np
    from onnx import helper, numpy_helper

    graph = model_proto.graph
    inits = {t.name: t for t in graph.initializer}
    done = 0
    nodes = []
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        plain = attrs.get("alpha", 1.0) == 1.0 and attrs.get("beta", 1.0) == 1.0 and not attrs.get("transA", 0)
        if node.op_type != "Gemm" or node.input[1] not in inits or not plain:
            nodes.append(node)
            continue
        weight = node.input[1]
        if attrs.get("transB", 0):
            w = numpy_helper.to_array(inits[weight]).T
            weight = node.name + "_weight_t"
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), name=weight))
        has_bias = len(node.input) > 2 and node.input[2]
        mm_out = node.output[0] + "_matmul" if has_bias else node.output[0]
        nodes.append(helper.make_node("MatMul", [node.input[0], weight], [mm_out], name=node.name + "_matmul"))
        if has_bias:
            nodes.append(helper.make_node("Add", [mm_out, node.input[2]], [node.output[0]], name=node.name + "_bias"))
        done += 1
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
        used = {i for n in graph.node for i in n.input}
        for t in [t for t in graph.initializer if t.name not in used]:
            graph.initializer.remove(t)
    return done


def quantize_int8(src: Path, dst: Path) -> Path:
    """int8 weights, blockwise (ONNX Runtime's MatMulNBits with 8 bits, blocks of INT8_BLOCK),
    for every weight MatMul except those fed by outlier activations (OUTLIER_RATIO).
    Activations, attention, norms and the embedding Gather stay float32. Compute runs in
    fp32 on dequantized weights (accuracy_level 1): ONNX Runtime's int8-activation path
    (level 4) quantizes activations per block and cost SmolLM2 6 points of top-1."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    proto = onnx.load(str(src))
    n = fold_constant_transposes(proto)  # so a tied LM head is quantized too
    g = gemm_to_matmul(proto)
    log.debug("folded %d constant transposes, rewrote %d Gemm before quantization", n, g)
    ratios = activation_outlier_ratios(proto)
    keep_float = sorted(name for name, r in ratios.items() if r >= OUTLIER_RATIO)
    log.info("int8: %d of %d weight MatMuls stay float32 (activation max/RMS >= %g)",
             len(keep_float), len(ratios), OUTLIER_RATIO)
    config = DefaultWeightOnlyQuantConfig(
        block_size=INT8_BLOCK, is_symmetric=True, accuracy_level=1, bits=8, op_types_to_quantize=("MatMul",),
    )
    with quiet_logs():
        quantizer = MatMulNBitsQuantizer(
            proto, block_size=INT8_BLOCK, is_symmetric=True, accuracy_level=1,
            nodes_to_exclude=keep_float, algo_config=config,
        )
        quantizer.process()
    _save_onnx(quantizer.model.model, dst)
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
