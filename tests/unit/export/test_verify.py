"""tritonlm/export/verify.py: the check every artifact passes before it is written catches an
artifact that ignores the attention mask, and its onnx-int8 threshold stays where the
Llama family needs it."""

from __future__ import annotations

import torch

from tests.helpers.exports import artifact
from tritonlm.export.verify import TOLERANCES, DecoderInputs, onnx_decoder_fn, verify_decoder


def test_verifier_rejects_an_artifact_that_ignores_the_mask(exported, model):
    run = onnx_decoder_fn(artifact(exported[0], "onnx"))

    def broken(inp: DecoderInputs):
        return run(DecoderInputs(inp.input_ids, torch.ones_like(inp.attention_mask), inp.position_ids, inp.past))

    report = verify_decoder(broken, model, "onnx", seed=5)
    failure = report.failure()
    assert failure is not None and "logit diff" in failure
    by_case = {c.name: c for c in report.cases}
    assert by_case["decode"].max_abs_diff < 1e-4  # no padding: unaffected
    assert by_case["mid_padded"].max_abs_diff > 1e-2


def test_llama_threshold_is_not_lowered():
    assert TOLERANCES["onnx-int8"].min_top1 >= 0.95
