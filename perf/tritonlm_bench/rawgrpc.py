"""Inference requests and responses at the level of Triton's gRPC protocol buffers.

For clients that need what tritonclient hides: every response of a stream as it arrives
(to time each one), cancelling a stream mid-way, many requests on one stream, or inputs
that are malformed on purpose.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

NUMPY_TYPES = {"INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_, "UINT64": np.uint64}


class RawTensor(NamedTuple):
    name: str
    datatype: str  # Triton's: BYTES, INT32, FP32, BOOL, UINT64
    shape: list[int]
    data: bytes  # raw_input_contents: little-endian values, BYTES as 4-byte length + bytes each


def raw_tensor(name: str, datatype: str, values: list, shape: list[int] | None = None) -> RawTensor:
    """A tensor of `values` (bytes for BYTES); shape defaults to [len(values)]."""
    if datatype == "BYTES":
        data = b"".join(struct.pack("<I", len(v)) + v for v in values)
    else:
        data = np.array(values, dtype=NUMPY_TYPES[datatype]).tobytes()
    return RawTensor(name, datatype, list(shape if shape is not None else [len(values)]), data)


def infer_request(model: str, request_id: str, tensors: list[RawTensor]):
    """A ModelInferRequest carrying the tensors, for GRPCInferenceServiceStub.ModelStreamInfer."""
    from tritonclient.grpc import service_pb2

    inputs = [service_pb2.ModelInferRequest.InferInputTensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in tensors]
    return service_pb2.ModelInferRequest(model_name=model, id=request_id, inputs=inputs,
                                         raw_input_contents=[t.data for t in tensors])


def is_final(response) -> bool:
    """A ModelStreamInferResponse flagged as its request's last (triton_final_response)."""
    param = response.infer_response.parameters.get("triton_final_response")
    return param is not None and param.bool_param


def output_int(response, name: str) -> int | None:
    """The first INT32 value of output `name` of a ModelStreamInferResponse (None when absent):
    the final response's num_output_tokens."""
    result = response.infer_response
    for out, raw in zip(result.outputs, result.raw_output_contents):
        if out.name == name:
            return int(np.frombuffer(raw, np.int32)[0])
    return None
