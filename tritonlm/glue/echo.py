"""The wiring model: proves the backend, the stub and the package import work.

text_input (BYTES [1]) -> text_output (the same text), num_chars (INT32 [1]).
"""

from __future__ import annotations

import numpy as np
import triton_python_backend_utils as pb_utils


class EchoHandler:
    def __init__(self, config, params, args):
        self.name = config["name"]

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                raw = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
                # [batch, 1] with max_batch_size > 0
                texts = [decode_utf8(v, "text_input") for v in raw.reshape(-1)]
                out = np.array([t.encode() for t in texts], dtype=object).reshape(raw.shape)
                lengths = np.array([len(t) for t in texts], dtype=np.int32).reshape(raw.shape)
                responses.append(
                    pb_utils.InferenceResponse(
                        [pb_utils.Tensor("text_output", out), pb_utils.Tensor("num_chars", lengths)]
                    )
                )
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
        return responses

    def finalize(self):
        pass


def decode_utf8(value, input_name: str) -> str:
    data = value if isinstance(value, bytes) else str(value).encode()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{input_name}: not valid UTF-8 ({e.reason} at byte {e.start}); send UTF-8 text") from None
