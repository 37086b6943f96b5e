"""The one-stream limit's parts: weight bytes per decode step against independent counts, and
a bandwidth figure that is a real one."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from tritonlm.perf.roofline import WEIGHT_FORMATS, decode_weight_bytes, one_stream_limit, read_bandwidth

# SmolLM2-135M's shape, smaller vocabulary and fewer layers: grouped-query attention, a tied head
LLAMA = dict(hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, vocab_size=500, max_position_embeddings=64)


def parameter_bytes(config) -> tuple[int, int]:
    """(bytes of every parameter of the real float32 model, bytes of its embedding tables that
    are only gathered from: those the LM head does not share)."""
    model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied table once
    gathered = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
                   if isinstance(m, torch.nn.Embedding) and m.weight is not head)
    return total, gathered


@pytest.mark.parametrize("config", [LlamaConfig(**LLAMA, tie_word_embeddings=True),
                                    LlamaConfig(**LLAMA, tie_word_embeddings=False),
                                    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=32)],
                         ids=["llama-tied", "llama-untied", "gpt2"])
def test_float32_bytes_are_every_parameter_but_the_gathered_tables(config):
    total, gathered = parameter_bytes(config)
    assert decode_weight_bytes(config, "float32") == total - gathered
    assert decode_weight_bytes(config, "bfloat16") < decode_weight_bytes(config, "float32")


def llama_counts(h: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int) -> tuple[int, int, int]:
    """(matrix weights, their output channels, norm weights) of a Llama, tied head, by its formula."""
    d = h // heads
    q, kv = heads * d, kv_heads * d
    matrices = layers * (h * q + 2 * h * kv + q * h + 3 * h * inter) + vocab * h
    outputs = layers * (q + 2 * kv + h + 2 * inter + h) + vocab
    norms = layers * 2 * h + h
    return matrices, outputs, norms


@pytest.mark.parametrize("fmt, per_weight, per_output", [("int8", 1, 4), ("int8_weight_only", 1.125, 0),
                                                         ("Q8_0", 34 / 32, 0), ("F32", 4, 0)])
def test_quantized_bytes_follow_the_formats_layout(fmt, per_weight, per_output):
    config = LlamaConfig(**LLAMA, tie_word_embeddings=True)
    matrices, outputs, norms = llama_counts(96, 256, 3, 6, 2, 500)
    want = matrices * per_weight + outputs * per_output + norms * 4
    assert decode_weight_bytes(config, fmt) == round(want)


def test_an_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match="'Q4_K'.*float32"):
        decode_weight_bytes(LlamaConfig(**LLAMA), "Q4_K")
    assert set(WEIGHT_FORMATS) >= {"float32", "int8", "int8_weight_only", "F32", "Q8_0"}


def test_read_bandwidth_is_a_positive_finite_figure_and_keeps_the_thread_setting():
    threads = torch.get_num_threads()
    for n in (1, threads):
        bw = read_bandwidth(n, mib=64, repeats=2)
        assert math.isfinite(bw) and bw > 0
    assert torch.get_num_threads() == threads
    with pytest.raises(ValueError, match="threads"):
        read_bandwidth(0)


def test_one_stream_limit_is_bandwidth_over_bytes():
    assert one_stream_limit(30e9, 538_000_000) == pytest.approx(55.76, rel=1e-3)
    with pytest.raises(ValueError, match="weight_bytes"):
        one_stream_limit(30e9, 0)
