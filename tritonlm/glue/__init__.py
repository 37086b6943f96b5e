"""Triton-facing glue: turns Triton tensors into plain arguments and results back.

Only the Python backend stub imports this package (it needs
`triton_python_backend_utils`); the engine underneath is plain Python.
"""

from __future__ import annotations

import importlib
from typing import Any

# task name -> (module under tritonlm.glue, its handler class)
TASKS = {
    "echo": ("tritonlm.glue.echo", "EchoHandler"),
    "forward": ("tritonlm.glue.forward", "ForwardHandler"),
    "generate": ("tritonlm.glue.generate", "GenerateHandler"),
}


def model_parameters(config: dict[str, Any]) -> dict[str, str]:
    """config.pbtxt `parameters` as a plain str -> str dict."""
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def make_handler(config: dict[str, Any], args: dict[str, str]):
    from tritonlm.glue.logs import route_logging_to_triton

    route_logging_to_triton()
    params = model_parameters(config)
    task = params.get("task", "")
    if task not in TASKS:
        raise ValueError(
            f"model '{config.get('name')}': parameters.task is {task!r}; expected one of {sorted(TASKS)} "
            '(add parameters { key: "task" value: { string_value: "generate" } } to config.pbtxt)'
        )
    module_name, class_name = TASKS[task]
    return getattr(importlib.import_module(module_name), class_name)(config, params, args)
