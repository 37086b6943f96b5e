"""`dtype: int8_weight_only` (runners/weight_only.py, layers.WeightOnlyInt8Linear): int8
weights, float32 activations.

The served model is exactly the float model with every projection's weights rounded to
the nearest level of a grid per group of inputs, so transformers running on weights rounded the same way (here,
independently) is a reference for the forward pass: greedy tokens (teacher-forced) must
agree with it, up to float summation order. Against float32 transformers it is checked on
the tiny seeded models here, on SmolLM2's real weights under the `slow` mark (32 prompts x
128 tokens, the int8 test's measure). GPTQ's rounding (weight_only.gptq_round, measured by
perf/bench_precision.py, not served) is checked by what it minimizes."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.models import Collector, drain, hf_greedy_ids, stack_and_loop_logits, tiny, tiny_llama
from tests.helpers.servers import add_generation_model
from tests.unit.engine.runners.test_quant import PROMPTS, logits_of, tiny_model
from tritonlm.engine.loader import build_engine
from tritonlm.engine.parallel.shard import tensor_slice
from tritonlm.engine.runners.layers import WeightOnlyInt8Linear
from tritonlm.engine.runners.weight_only import GROUP, gptq_round, rtn_round
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.settings import EngineSettings, SettingsError
from tritonlm_bench.agreement import reference_continuations, teacher_forced_agreement


def rounded_weights(model):
    """A copy of an HF model whose every projection (nn.Linear, GPT-2's Conv1D [in, out]) and
    LM head holds its weights rounded per GROUP inputs of an output channel (the channel's
    inputs where they do not split so) to the nearest level, with the grid's float16 step
    and start, of the best by squared error of: 256 or 241 even levels from the group's
    minimum to its maximum, 255 over [-max|w|, max|w|]; back in float32: what
    int8_weight_only computes with, written independently of the engine. A tied head gets
    its own rounded copy; the embedding stays float, as in the engine."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        conv1d = type(module).__name__ == "Conv1D"
        if not (isinstance(module, torch.nn.Linear) or conv1d):
            continue
        w = module.weight.detach().float()
        w = w.t() if conv1d else w  # [out, in]
        out, width = w.shape
        group = GROUP if width % GROUP == 0 else width
        w = w.reshape(out, width // group, group)
        low, high = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
        half = (w.abs().amax(dim=2, keepdim=True) / 127).clamp(min=2.0 ** -24).half().float()
        best, best_err = None, None
        for start, step in ((low.half().float(), ((high - low) / 255).clamp(min=2.0 ** -24).half().float()),
                            (low.half().float(), ((high - low) / 240).clamp(min=2.0 ** -24).half().float()),
                            (-128 * half, half)):
            levels = start + torch.round((w - start) / step).clamp(0, 255) * step
            err = (levels - w).square().sum(2, keepdim=True)
            best = levels if best is None else torch.where(err < best_err, levels, best)
            best_err = err if best_err is None else torch.minimum(err, best_err)
        rounded = best.reshape(out, width)
        module.weight = torch.nn.Parameter(rounded.t().contiguous() if conv1d else rounded)
    return model


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_weight_only_greedy_equals_transformers_on_the_rounded_weights(arch):
    """Every projection and the LM head are int8 through the C++ kernel, the layers run as
    one DecoderStack, and the greedy tokens after every reference prefix are transformers'
    own on the same rounded weights (a wrong scale, layout or rounding would disagree on
    most). Against float32 transformers they agree about as often as int8 does on these
    random weights (tiny models have small logit margins). The weights take fewer bytes."""
    model, prompts = tiny_model(arch)
    prompts = prompts[:6]
    runner = TorchRunner(model, int8_weight_only=True)
    t = runner.transformer
    assert all(isinstance(p, WeightOnlyInt8Linear) and p.panel.dtype == torch.uint8 for p in t.projections())
    if runner.attention == "paged":
        assert all(p.cpp_op for p in t.projections()) and t.decoder_stack is not None
    assert t.weight_bytes() < TorchRunner(model).transformer.weight_bytes()
    same = teacher_forced_agreement(runner, prompts, reference_continuations(rounded_weights(model), prompts, 24))
    fp32 = teacher_forced_agreement(runner, prompts, reference_continuations(model, prompts, 24))
    print(f"{arch}: int8_weight_only vs transformers on the same rounded weights {same.fraction:.4f}, "
          f"vs float32 {fp32.fraction:.4f} ({fp32.agreed}/{fp32.total})")
    assert same.fraction >= 0.99
    assert fp32.fraction >= (0.96 if arch == "gpt2" else 0.92)  # measured 0.993 and 0.944


def test_gptq_rounding_lowers_the_output_error_on_its_calibration_inputs():
    """gptq_round against nearest rounding to the same symmetric grid (a scale per group of
    64 inputs, every value within [-127, 127] x scale) on a weight whose inputs are
    correlated (as activations are): a smaller error of x @ w^T on those inputs, a larger
    one on the weights themselves (GPTQ trades weight error for output error)."""
    g = torch.Generator().manual_seed(7)
    out, width = 48, 128
    w = torch.randn(out, width, generator=g)
    mix = torch.randn(width, width, generator=g) / width ** 0.5
    x = torch.randn(512, width, generator=g) @ (torch.eye(width) + 2 * mix)  # [N, in], correlated inputs
    results = {}
    scale = (w.reshape(out, -1, 64).abs().amax(dim=2) / 127.0).clamp(min=1e-12)  # [out, G]
    nearest = (torch.round(w / scale.repeat_interleave(64, dim=1)).clamp(-127, 127).to(torch.int8), scale)
    for name, (q, scale) in {"rtn": nearest, "gptq": gptq_round(w, x.t() @ x, 64)}.items():
        assert q.dtype == torch.int8 and q.shape == (out, width) and scale.shape == (out, width // 64)
        assert q.abs().max() <= 127  # symmetric codes
        dq = q.float() * scale.repeat_interleave(64, dim=1)
        results[name] = ((x @ (w - dq).t()).norm().item(), (w - dq).norm().item())
    print(f"output error rtn {results['rtn'][0]:.4f}, gptq {results['gptq'][0]:.4f}; "
          f"weight error rtn {results['rtn'][1]:.4f}, gptq {results['gptq'][1]:.4f}")
    assert results["gptq"][0] < 0.8 * results["rtn"][0]
    assert results["gptq"][1] > results["rtn"][1]


def test_weight_only_decoder_stack_gives_the_python_loops_bits():
    """The DecoderStack's weight-only projections against run_layers' Python loop of the same
    ops: equal logits, bit for bit, over decode and mixed-width steps (a prefill over 8 wide
    runs the loop, whose widest projections widen their weights to float)."""
    runner = TorchRunner(tiny_llama(attention_bias=True), int8_weight_only=True)
    if runner.attention != "paged":
        pytest.skip(f"no C++ kernels here: {runner.attention_why}")
    assert runner.transformer.decoder_stack is not None
    logits = stack_and_loop_logits(runner, [3, 1, 8, 1], first_past=40, blocks=80)
    for a, b in zip(*logits):
        assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item():.3g}"


def test_weight_only_engine_generates_through_the_settings(tmp_path):
    """`dtype: int8_weight_only` in config.pbtxt: the engine loads int8 weights with float
    activations and, batching 4 streams with its KV cache, generates exactly the greedy
    tokens of the same weights recomputing each sequence alone, with no cache, and
    transformers' own greedy tokens on the same rounded weights."""
    folder = add_generation_model(tmp_path, "tinyw8", dtype="int8_weight_only")
    engine = build_engine(EngineSettings.from_params(
        {"task": "generate", "max_context": "256", "dtype": "int8_weight_only"}, folder))
    assert all(isinstance(p, WeightOnlyInt8Linear) for p in engine.runner.transformer.projections())
    model, tok = tiny()
    prompts = PROMPTS[24:28]
    col = Collector()
    rids = [col.request(engine, p, max_tokens=12, end_id=-1) for p in prompts]
    drain(engine)
    alone = TorchRunner(model, int8_weight_only=True)
    reference = rounded_weights(model)
    for p, rid in zip(prompts, rids):
        seq = tok(p).input_ids
        for _ in range(12):
            seq.append(int(logits_of(alone, [seq])[0, -1].argmax()))
        assert col.ids(rid) == seq[-12:], p
        assert col.ids(rid) == hf_greedy_ids(reference, tok(p).input_ids, 12), p
    assert engine.cache.used_bytes == 0


def test_weight_only_refuses_what_it_cannot_serve(tmp_path):
    folder = add_generation_model(tmp_path, "tinyw8", dtype="int8_weight_only")
    cuda = EngineSettings.from_params({"task": "generate", "dtype": "int8_weight_only", "device": "cuda"}, folder)
    with pytest.raises(SettingsError, match=r"^dtype: int8_weight_only runs on the CPU only"):
        build_engine(cuda)
    with pytest.raises(SettingsError, match=r"^dtype: int8_weight_only needs runtime 'torch'"):
        EngineSettings.from_params({"dtype": "int8_weight_only", "runtime": "onnx", "onnx_model": "1/hf/config.json"},
                                   folder)
    with pytest.raises(SettingsError, match=r"^dtype: int8_weight_only needs runtime 'torch' without model parallelism"):
        EngineSettings.from_params({"dtype": "int8_weight_only", "pipeline_parallel_size": "2"}, folder)
    with pytest.raises(ValueError, match="int8 and int8_weight_only: one or the other"):
        TorchRunner(tiny()[0], int8=True, int8_weight_only=True)
    with pytest.raises(ValueError, match="int8_weight_only needs float32 compute on the CPU"):
        TorchRunner(tiny()[0], dtype=torch.bfloat16, int8_weight_only=True)
    with pytest.raises(ValueError, match="int8 weights cannot be sliced"):
        tensor_slice(TorchRunner(tiny()[0], int8_weight_only=True).transformer, 0, 2)


def test_weight_only_without_the_kernels_computes_the_same_function():
    """The torch fallback (no C++ kernels: widen to a float copy, then F.linear) gives the
    kernel's logits to float rounding."""
    model, prompts = tiny_model("llama")
    runner = TorchRunner(model, int8_weight_only=True)
    native = logits_of(runner, prompts[:3])
    fallback = TorchRunner(model, int8_weight_only=True, attention="gather")
    assert not any(p.cpp_op for p in fallback.transformer.projections())
    diff = (logits_of(fallback, prompts[:3]) - native).abs().max().item()
    assert diff < 1e-4 * max(1.0, native.abs().max().item()), diff


@pytest.mark.slow
def test_smollm2_weight_only_greedy_agreement_with_float32():
    """SmolLM2's packaged weights, 32 prompts x 128 tokens, teacher-forced against float32
    transformers (prompts the weight-only scheme was not tuned on): issue 37 asks >= 0.99.
    The package is a GGUF file whose projections are Q4_1 blocks of 32 and whose LM head
    (the tied embedding) is Q8_0: rtn_round keeps both exactly (docs/configuration.md,
    "Precision"), so what is left is float summation order, and in decode-sized passes (8
    sequences x 8 tokens, 64 rows: the kernel's direct path) the activations' 16-bit codes."""
    from tritonlm.models.loading import load_model

    model, tok, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)
    prompts = [tok(p).input_ids for p in PROMPTS]  # 32 prompts
    reference = reference_continuations(model, prompts, 128)
    runner = TorchRunner(model, int8_weight_only=True)
    for chunk in (None, 8):
        got = teacher_forced_agreement(runner, prompts, reference, chunk=chunk)
        print(f"SmolLM2-135M int8_weight_only, {chunk or 'whole'} tokens a pass: {got.agreed}/{got.total} = "
              f"{got.fraction:.4f} of 32 x 128 greedy tokens agree")
        assert got.total == 32 * 128
        assert got.fraction >= 0.99


@pytest.mark.parametrize("grid", ["q4_1", "q4_0-full", "q8_0", "256-steps"])
def test_rtn_round_keeps_weights_already_on_its_grids_exactly(grid):
    """Weights that a GGUF file stored in blocks of 32 with float16 d and min (Q4_1: min + k d,
    k < 16, d >= 2^-10; Q8_0: d k, |k| <= 127, d = max|w| / 127; a Q4_0 block, (k - 8) d, that
    spans all 16 levels) or on 256 even steps of their group's range come back from rtn_round
    exactly; random weights come back within half a step of the grid their group took (and
    the float16 start's rounding)."""
    g = torch.Generator().manual_seed(len(grid))
    out, width = 24, 4 * GROUP
    d = (torch.rand(out, width // GROUP, 1, generator=g) * 0.01 + 1e-3).half().float()
    levels = {"q4_1": 16, "q4_0-full": 16, "q8_0": 255, "256-steps": 256}[grid]
    k = torch.randint(0, levels, (out, width // GROUP, GROUP), generator=g).float()
    k[..., 0], k[..., 1] = 0, levels - 1  # every block spans its whole grid (a Q4_1 or Q8_0 file's do)
    if grid == "q4_0-full":
        w = (k - 8) * d
    elif grid == "q8_0":
        w = (k - 127) * d
    else:
        w = (torch.randn(out, width // GROUP, 1, generator=g) * 0.02).half().float() + k * d
    w = w.reshape(out, width)
    q, scale, offset = rtn_round(w, GROUP)
    assert q.dtype == torch.uint8 and scale.dtype == offset.dtype == torch.float16
    assert scale.shape == offset.shape == (out, width // GROUP)
    back = WeightOnlyInt8Linear.from_rows(q, scale, offset, None).dequantized()
    assert torch.equal(back, w)
    noise = torch.randn(out, width, generator=g)
    q, scale, offset = rtn_round(noise, GROUP)
    err = WeightOnlyInt8Linear.from_rows(q, scale, offset, None).dequantized() - noise
    step = scale.float().repeat_interleave(GROUP, dim=1)
    start = offset.float().abs().repeat_interleave(GROUP, dim=1)
    assert (err.abs() <= step * 0.5 + start * 2.0 ** -11 + 1e-6).all()
    assert (offset.float() != -128 * scale.float()).float().mean() > 0.5  # most groups took a min-to-max grid


@pytest.mark.parametrize("bad, why", [(float("nan"), "not finite"), (-1e6, "beyond float16's range")])
def test_weight_only_refuses_weights_it_cannot_express_naming_the_projection(bad, why):
    from tritonlm.engine.runners.model import Transformer
    from tritonlm.engine.runners.weight_only import quantize_weight_only

    t = Transformer.from_hf(copy.deepcopy(tiny()[0]))  # its weights are the HF model's tensors: not the shared one
    t.layers[1].down.w[3, 5] = bad  # [in, out]
    with pytest.raises(ValueError, match=f"int8_weight_only: layers.1.down holds weights .*{why}"):
        quantize_weight_only(t)
