"""Triton glue of the forward-pass models (task=forward): an exported decoder run by
ONNX Runtime or TorchScript inside the `tritonlm` backend.

Triton's dynamic batcher hands execute() several requests at once; they go to
ForwardBatcher, which stacks the compatible ones and runs one forward pass per
group, so batching is real. Parameters (config.pbtxt):
    task      "forward"
    format    "onnx" | "torchscript"
    artifact  file in the version folder (default model.onnx / model.pt)
    device    "cpu" (default) | "cuda[:i]"
    threads   intra-op threads (default: the runtime's own choice)
    spin      "true": let ONNX Runtime's idle threads busy-wait (lower latency, burns CPU)
    max_positions  the model's context length (position_ids beyond it are refused)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonlm.engine.cpu_cores import instances_in_config, usable_cores
from tritonlm.export.forward_runtime import ForwardBatcher, Layout, onnx_run_fn, torchscript_run_fn
from tritonlm.glue.heartbeat import Heartbeat


class ForwardHandler:
    def __init__(self, config, params, args):
        self.name = config["name"]
        fmt = params.get("format", "onnx") or "onnx"
        if fmt not in ("onnx", "torchscript"):
            raise ValueError(f"model '{self.name}': parameters.format is {fmt!r}; use 'onnx' or 'torchscript'")
        artifact = params.get("artifact") or ("model.onnx" if fmt == "onnx" else "model.pt")
        version_dir = Path(args["model_repository"]) / str(args.get("model_version", "1"))
        path = version_dir / artifact
        if not path.is_file():
            raise ValueError(f"model '{self.name}': {path} not found; re-export with `tritonlm export`")
        device = params.get("device", "cpu") or "cpu"
        # 0: one per core this process may use, the cores split over the model's instances
        threads = int(params.get("threads", "0") or 0) or usable_cores().threads(instances_in_config(config))
        max_positions = int(params.get("max_positions", "0") or 0) or None
        self.layout = Layout.from_model_config(config)
        if fmt == "onnx":
            spin = (params.get("spin", "") or "").lower() in ("1", "true", "yes")
            run = onnx_run_fn(path, device=device, threads=threads, spin=spin)
        else:
            run = torchscript_run_fn(path, self.layout, device=device, threads=threads)
        self.batcher = ForwardBatcher(run, self.layout, max_positions=max_positions)
        # a forward model has no loop of its own to fail: only a stopped or wedged process is a fault
        self.heartbeat = Heartbeat(self.name, args.get("model_instance_name", ""), lambda: None).start()

    def execute(self, requests):
        feeds = []
        for request in requests:
            feed = {}
            for name in self.layout.inputs:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    feed[name] = tensor.as_numpy()
            feeds.append(feed)
        responses = []
        for result in self.batcher.run(feeds):
            if isinstance(result, Exception):
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{self.name}: {result}")))
            else:
                responses.append(pb_utils.InferenceResponse(
                    [pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in result.items()]
                ))
        return responses

    def finalize(self):
        self.heartbeat.stop()
        self.batcher = None
