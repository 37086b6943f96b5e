"""Small Python-backend models with known timing, for checking the harnesses end to end.

`write_streaming_model`: a decoupled model with the LLM tensor names (text_input
BYTES [1], max_tokens INT32 [1], optional stream and exclude_input_in_output
BOOL [1] -> text_output) that
answers each request with `max_tokens` streamed pieces: the first after
`prefill_ms`, then one every `token_ms`, then a final empty response flagged
complete. Time to first token and inter-token latency are therefore known.

`write_token_model`: a batched model with a dynamic INT64 `input_ids` [-1]
(and `attention_mask`) and `logits` [-1, vocab]; it rejects ids outside the
vocabulary, so a harness that feeds it proves it derived valid token ids.

Each writes `<repo>/<name>/config.pbtxt` and `<repo>/<name>/1/model.py`.
"""

from __future__ import annotations

from pathlib import Path

_STREAM_CONFIG = """\
# Test model written by tests.helpers.timed_models: streams max_tokens pieces with known timing.
name: "{name}"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }},
  {{ name: "exclude_input_in_output" data_type: TYPE_BOOL dims: [ 1 ] optional: true }}
]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "prefill_ms" value: {{ string_value: "{prefill_ms}" }} }}
parameters {{ key: "token_ms" value: {{ string_value: "{token_ms}" }} }}
"""

_STREAM_MODEL = '''\
"""Streams max_tokens pieces per request: first after prefill_ms, then one per token_ms."""
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class StreamingTestModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.prefill_s = float(params["prefill_ms"]["string_value"]) / 1000.0
        self.token_s = float(params["token_ms"]["string_value"]) / 1000.0
        self.threads = []
        self.lock = threading.Lock()

    def execute(self, requests):
        # One thread per request: requests stream concurrently, like an engine's batch.
        with self.lock:
            self.threads = [t for t in self.threads if t.is_alive()]
            for request in requests:
                t = threading.Thread(target=self.stream, args=(request,), daemon=True)
                t.start()
                self.threads.append(t)
        return None

    def stream(self, request):
        sender = request.get_response_sender()
        try:
            n = int(pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1)[0])
            start = time.monotonic()
            for i in range(n):
                # absolute deadlines: sleep overshoot does not accumulate
                delay = start + self.prefill_s + i * self.token_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                piece = np.array([(" t%d" % i).encode()], dtype=object)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", piece)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # a stream always ends with its final flag
            sender.send(
                pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
            )

    def finalize(self):
        for t in list(self.threads):
            t.join(timeout=10)


TritonPythonModel = StreamingTestModel  # the name the Python backend looks up
'''

_TOKEN_CONFIG = """\
# Test model written by tests.helpers.timed_models: token ids in, logits out; rejects ids >= vocab.
name: "{name}"
backend: "python"
max_batch_size: 8
dynamic_batching {{ max_queue_delay_microseconds: 1000 }}
input [
  {{ name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] }},
  {{ name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] }}
]
output [ {{ name: "logits" data_type: TYPE_FP32 dims: [ -1, {vocab} ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

_TOKEN_MODEL = '''\
"""Checks ids are inside the vocabulary and the mask is ones; returns one-hot logits."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TokenTestModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.vocab = int(config["output"][0]["dims"][-1])

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy()
            mask = pb_utils.get_input_tensor_by_name(request, "attention_mask").as_numpy()
            if ids.min() < 0 or ids.max() >= self.vocab or mask.shape != ids.shape or not (mask == 1).all():
                err = "input_ids outside [0, %d) or attention_mask not ones of the same shape" % self.vocab
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(err)))
                continue
            logits = np.zeros(ids.shape + (self.vocab,), dtype=np.float32)
            np.put_along_axis(logits, ids[..., None], 1.0, axis=-1)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("logits", logits)]))
        return responses


TritonPythonModel = TokenTestModel  # the name the Python backend looks up
'''


def write_streaming_model(repo: Path, name: str = "stream_test", *, prefill_ms: float = 40.0, token_ms: float = 10.0) -> Path:
    folder = Path(repo) / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(_STREAM_CONFIG.format(name=name, prefill_ms=prefill_ms, token_ms=token_ms))
    (folder / "1" / "model.py").write_text(_STREAM_MODEL)
    return folder


def write_token_model(repo: Path, name: str = "token_test", *, vocab: int = 100) -> Path:
    folder = Path(repo) / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(_TOKEN_CONFIG.format(name=name, vocab=vocab))
    (folder / "1" / "model.py").write_text(_TOKEN_MODEL)
    return folder
