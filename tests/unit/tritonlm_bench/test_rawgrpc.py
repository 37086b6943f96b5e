"""perf/tritonlm_bench/rawgrpc.py: requests built by hand are the requests tritonclient builds
from numpy arrays; responses read by hand read as tritonclient's InferResult reads them."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import InferInput, InferResult, service_pb2
from tritonclient.grpc._utils import _get_inference_request

from tritonlm_bench.rawgrpc import infer_request, is_final, output_int, raw_tensor


def tritonclient_request(model: str, request_id: str, arrays: dict[str, tuple[str, np.ndarray]]):
    inputs = []
    for name, (datatype, array) in arrays.items():
        tensor = InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return _get_inference_request(model, inputs, "", request_id, None, 0, False, False, 0, None, None)


def test_a_request_is_the_one_tritonclient_builds_from_the_same_values():
    prompts = [b"The capital of France is", b"", "caf\u00e9 \u2603".encode()]
    ours = infer_request("gpt2", "r-7", [
        raw_tensor("text_input", "BYTES", prompts),
        raw_tensor("max_tokens", "INT32", [16, 1, 2**31 - 1]),
        raw_tensor("temperature", "FP32", [0.5, 1.0, 1e-3]),
        raw_tensor("stream", "BOOL", [True, False, True]),
        raw_tensor("seed", "UINT64", [2**64 - 1, 0, 42]),
    ])
    reference = tritonclient_request("gpt2", "r-7", {
        "text_input": ("BYTES", np.array(prompts, dtype=np.object_)),
        "max_tokens": ("INT32", np.array([16, 1, 2**31 - 1], np.int32)),
        "temperature": ("FP32", np.array([0.5, 1.0, 1e-3], np.float32)),
        "stream": ("BOOL", np.array([True, False, True])),
        "seed": ("UINT64", np.array([2**64 - 1, 0, 42], np.uint64)),
    })
    assert ours.model_name == reference.model_name and ours.id == reference.id
    assert [(t.name, t.datatype, list(t.shape)) for t in ours.inputs] == [
        (t.name, t.datatype, list(t.shape)) for t in reference.inputs]
    assert list(ours.raw_input_contents) == list(reference.raw_input_contents)


def test_a_given_shape_is_kept_and_an_unknown_datatype_is_refused():
    t = raw_tensor("input_ids", "INT32", [1, 2, 3, 4, 5, 6], shape=[2, 3])
    assert t.shape == [2, 3] and np.frombuffer(t.data, np.int32).tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(KeyError):
        raw_tensor("x", "FP64", [1.0])


def stream_response(outputs: dict[str, np.ndarray], final: bool | None):
    """A ModelStreamInferResponse as the server sends it: typed outputs, raw contents, and
    triton_final_response when given."""
    result = service_pb2.ModelInferResponse(model_name="gpt2", id="r-7")
    for name, array in outputs.items():
        result.outputs.add(name=name, datatype="INT32", shape=list(array.shape))
        result.raw_output_contents.append(array.tobytes())
    if final is not None:
        result.parameters["triton_final_response"].bool_param = final
    return service_pb2.ModelStreamInferResponse(infer_response=result)


def test_responses_read_as_tritonclient_reads_them():
    outputs = {"num_input_tokens": np.array([5], np.int32), "num_output_tokens": np.array([16], np.int32)}
    response = stream_response(outputs, final=True)
    reference = InferResult(response.infer_response)
    for name in outputs:
        assert output_int(response, name) == int(reference.as_numpy(name)[0])
    assert output_int(response, "text_output") is None and reference.as_numpy("text_output") is None
    assert is_final(response) is True


@pytest.mark.parametrize("final", [False, None])
def test_a_response_not_flagged_final_is_not_final(final):
    assert is_final(stream_response({"num_output_tokens": np.array([3], np.int32)}, final=final)) is False
