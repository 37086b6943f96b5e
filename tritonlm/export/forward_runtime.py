"""Run an exported decoder (ONNX or TorchScript) for a list of requests: plain NumPy,
no Triton imports, so unit tests reach it without a server.

`ForwardBatcher.run(list of {name: array})` checks each request, stacks the
compatible ones (same number of new tokens T) along the batch dimension, runs ONE
forward pass per group and splits the outputs back. A request that is malformed
gets its own error; the others still run.

Requests with different past lengths P still share a pass: their pasts are
right-padded to the longest and the padding is masked out (attention_mask
[past 1..1 | 0..0 | new 1..1], the mid-row zeros every exported artifact is
verified with); each request gets back only its own P+T cache positions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tritonlm.export.wrapper import input_names, output_names

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """One request's inputs are wrong; the message says which and how."""


@dataclass(frozen=True)
class Layout:
    """Shapes the artifact expects (from its config.pbtxt)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def inputs(self) -> list[str]:
        return input_names(self.num_layers)

    @property
    def outputs(self) -> list[str]:
        return output_names(self.num_layers)

    @staticmethod
    def from_model_config(config: dict) -> "Layout":
        """From the JSON model config Triton hands the backend."""
        ins = {t["name"]: [int(d) for d in t["dims"]] for t in config.get("input", [])}
        outs = {t["name"]: [int(d) for d in t["dims"]] for t in config.get("output", [])}
        n = sum(1 for k in ins if k.startswith("past_key_values.")) // 2
        if n == 0 or "past_key_values.0.key" not in ins or "logits" not in outs:
            raise ValueError(
                "config.pbtxt does not declare the decoder I/O (input_ids, attention_mask, position_ids, "
                "past_key_values.{i}.key/value; logits, present.{i}.key/value): re-export the model"
            )
        kv = ins["past_key_values.0.key"]
        return Layout(num_layers=n, num_kv_heads=kv[-3], head_dim=kv[-1], vocab_size=outs["logits"][-1])


Feed = dict[str, np.ndarray]
RunFn = Callable[[Feed], list[np.ndarray]]  # contract-ordered outputs


def check_request(inputs: Feed, layout: Layout) -> tuple[int, int, int]:
    """Validate one request's tensors; returns (batch, T, P). Raises RequestError."""
    missing = [n for n in layout.inputs if n not in inputs]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise RequestError(f"missing input(s) {missing[:3]}{more}: send all of {layout.inputs[:4]}... (P may be 0)")
    ids = inputs["input_ids"]
    if ids.ndim != 2 or ids.shape[1] < 1:
        raise RequestError(f"input_ids must be [batch, T] with T >= 1, got shape {list(ids.shape)}")
    b, t = ids.shape
    if inputs["position_ids"].shape != ids.shape:
        raise RequestError(
            f"position_ids shape {list(inputs['position_ids'].shape)} must equal input_ids shape {list(ids.shape)}"
        )
    past = inputs["past_key_values.0.key"]
    if past.ndim != 4 or past.shape[0] != b or past.shape[1] != layout.num_kv_heads or past.shape[3] != layout.head_dim:
        raise RequestError(
            f"past_key_values.0.key must be [{b}, {layout.num_kv_heads}, P, {layout.head_dim}], got {list(past.shape)}"
        )
    p = past.shape[2]
    for name in layout.inputs[3:]:
        if inputs[name].shape != past.shape:
            raise RequestError(f"{name} shape {list(inputs[name].shape)} differs from past_key_values.0.key {list(past.shape)}")
    mask = inputs["attention_mask"]
    if mask.shape != (b, p + t):
        raise RequestError(f"attention_mask must be [batch, P+T] = [{b}, {p + t}], got {list(mask.shape)}")
    if ids.size and (ids.min() < 0 or ids.max() >= layout.vocab_size):
        raise RequestError(f"input_ids must be in [0, {layout.vocab_size}), got values {int(ids.min())}..{int(ids.max())}")
    if inputs["position_ids"].size and inputs["position_ids"].min() < 0:
        raise RequestError("position_ids must be >= 0")
    if mask.size and not np.isin(mask, (0, 1)).all():
        raise RequestError("attention_mask must hold only 0 and 1")
    return b, t, p


class ForwardBatcher:
    def __init__(self, run: RunFn, layout: Layout, max_positions: int | None = None):
        self._run = run
        self.layout = layout
        self.max_positions = max_positions
        self.last_group_sizes: list[int] = []  # requests per forward pass of the last run (for tests/logs)

    def run(self, requests: Sequence[Feed]) -> list[dict[str, np.ndarray] | Exception]:
        results: list[dict[str, np.ndarray] | Exception] = [RequestError("not run")] * len(requests)
        groups: dict[int, list[tuple[int, int, int]]] = {}  # T -> [(request index, batch, P)]
        for i, inputs in enumerate(requests):
            try:
                b, t, p = check_request(inputs, self.layout)
                if self.max_positions is not None and int(inputs["position_ids"].max()) >= self.max_positions:
                    raise RequestError(f"position_ids must be < {self.max_positions} (the model's context length)")
            except RequestError as e:
                results[i] = e
                continue
            groups.setdefault(t, []).append((i, b, p))
        self.last_group_sizes = []
        for t, members in groups.items():
            self.last_group_sizes.append(len(members))
            feed = self._stack([requests[i] for i, _, _ in members], [p for _, _, p in members], t)
            try:
                outs = self._run(feed)
            except Exception as e:  # noqa: BLE001 - the runtime's own error, passed on per request
                log.exception("forward pass failed")
                for i, _, _ in members:
                    results[i] = RuntimeError(f"forward pass failed: {e}")
                continue
            p_max = max(p for _, _, p in members)
            start = 0
            for i, b, p in members:
                rows = slice(start, start + b)
                result = {}
                for name, out in zip(self.layout.outputs, outs):
                    if name == "logits" or p == p_max:
                        result[name] = np.ascontiguousarray(out[rows])
                    else:  # drop the padding between this request's past and its new tokens
                        result[name] = np.concatenate([out[rows, :, :p], out[rows, :, p_max:]], axis=2)
                results[i] = result
                start += b
        return results

    def _stack(self, feeds: list[Feed], pasts: list[int], t: int) -> Feed:
        """One feed for a group with the same T: concatenated along the batch; pasts shorter
        than the longest are right-padded with zeros and masked out."""
        if len(feeds) == 1:
            return feeds[0]
        p_max = max(pasts)
        out: Feed = {}
        for name in ("input_ids", "position_ids"):
            out[name] = np.concatenate([f[name] for f in feeds], axis=0)
        masks = []
        for f, p in zip(feeds, pasts):
            m = f["attention_mask"]
            if p < p_max:
                gap = np.zeros((m.shape[0], p_max - p), dtype=m.dtype)
                m = np.concatenate([m[:, :p], gap, m[:, p:]], axis=1)
            masks.append(m)
        out["attention_mask"] = np.concatenate(masks, axis=0)
        for name in self.layout.inputs[3:]:
            parts = []
            for f, p in zip(feeds, pasts):
                x = f[name]
                if p < p_max:
                    pad = np.zeros((x.shape[0], x.shape[1], p_max - p, x.shape[3]), dtype=x.dtype)
                    x = np.concatenate([x, pad], axis=2)
                parts.append(x)
            out[name] = np.ascontiguousarray(np.concatenate(parts, axis=0))
        return out


# ---- runtimes -----------------------------------------------------------------------------

def onnx_run_fn(path: Path, device: str = "cpu", threads: int = 0, spin: bool = False) -> RunFn:
    import onnxruntime as ort

    from tritonlm.engine.runners import onnx_session_options

    opts = onnx_session_options(threads, spin)
    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise ValueError(f"device {device} but onnxruntime has no CUDAExecutionProvider: install onnxruntime-gpu")
        idx = int(device.split(":", 1)[1]) if ":" in device else 0
        providers = [("CUDAExecutionProvider", {"device_id": idx}), "CPUExecutionProvider"]
    sess = ort.InferenceSession(str(path), opts, providers=providers)
    types = {i.name: i.type for i in sess.get_inputs()}
    out_names = [o.name for o in sess.get_outputs()]

    def run(feed: Feed) -> list[np.ndarray]:
        cast = {}
        for k, v in feed.items():
            want = types.get(k)
            if want == "tensor(float16)":
                v = v.astype(np.float16)
            elif want == "tensor(float)":
                v = v.astype(np.float32, copy=False)
            elif want == "tensor(int64)":
                v = v.astype(np.int64, copy=False)
            cast[k] = v
        return [np.asarray(o, dtype=np.float32) for o in sess.run(out_names, cast)]

    return run


def torchscript_run_fn(path: Path, layout: Layout, device: str = "cpu", threads: int = 0) -> RunFn:
    import torch

    if threads:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.load(str(path), map_location=dev).eval()
    names = layout.inputs

    def run(feed: Feed) -> list[np.ndarray]:
        args = [torch.from_numpy(np.ascontiguousarray(feed[n])).to(dev) for n in names]
        args[:3] = [a.long() for a in args[:3]]
        args[3:] = [a.float() for a in args[3:]]
        with torch.no_grad(), torch.jit.optimized_execution(False):
            outs = module(*args)
        return [o.float().cpu().numpy() for o in outs]

    return run
