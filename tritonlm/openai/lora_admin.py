"""vLLM's run-time LoRA endpoints, off unless asked for (--allow-runtime-lora or
TRITONLM_ALLOW_RUNTIME_LORA, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), behind the API key
like every other route:

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"[, "base_model_name"]}
    POST /v1/unload_lora_adapter  {"lora_name"}

The engine runs in Triton's Python backend, possibly as several instances (processes) per
model, which this process cannot call. What they all read is the model's multi_lora.json: a
load checks the adapter folder here (its config and its weights' shapes against the base
model's config.json, adapter.check_adapter: a refused adapter is a 400 before anything
changes), then rewrites the file whole (a temporary file renamed over it); every instance
notices the change at its next request naming an adapter (lora.multi_lora) and loads the
adapter at its first use, on its loader thread. An unload drops the name from the file;
requests running under it finish (they hold the adapter). So the frontend must see the model
repository (`tritonlm serve`, or `tritonlm openai --repo`), and one frontend writes it.

vLLM's answers: 200 with a plain-text "Success: ..." line; 400 for a missing field, a name
already served, or a refused adapter; 404 for an unload of a name it does not know (naming
those it does); the routes themselves answer 404 while turned off.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from tritonlm.openai.backend import Backend
from tritonlm.openai.errors import OpenAIError
from tritonlm.openai.triton import ServedModel

ALLOW_ENV = "TRITONLM_ALLOW_RUNTIME_LORA"
TRUE_WORDS = ("1", "true", "yes", "on")


def allow_runtime_lora_from(flag: bool) -> bool:
    """--allow-runtime-lora, else the environment's TRITONLM_ALLOW_RUNTIME_LORA (1 / true / yes / on)."""
    return flag or os.environ.get(ALLOW_ENV, "").strip().lower() in TRUE_WORDS


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="invalid_value")


def takes_lora(model: ServedModel, repo: Path) -> bool:
    """The model was loaded to run adapters: it names some, sets enable_lora, or has a
    multi_lora.json (settings.EngineSettings.takes_lora: the same rule, so the engine has the
    registry this frontend writes for; an empty {} left by unloading every adapter counts)."""
    from tritonlm.engine.settings import MULTI_LORA_FILE

    params = model.parameters
    return (bool(params.get("lora_adapters", "").strip()) or params.get("enable_lora", "").strip().lower() in TRUE_WORDS
            or (repo / model.name / MULTI_LORA_FILE).is_file())


def read_entries(model_dir: Path) -> dict[str, str]:
    """The model's multi_lora.json ({name: folder}), {} without one."""
    from tritonlm.engine.settings import MULTI_LORA_FILE

    path = model_dir / MULTI_LORA_FILE
    if not path.is_file():
        return {}
    try:
        entries = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise OpenAIError(500, f"{path} cannot be read ({e}); fix or remove it", code="internal_error") from None
    if not isinstance(entries, dict):
        raise OpenAIError(500, f"{path} is not a JSON object {{\"name\": \"folder\"}}; fix or remove it",
                          code="internal_error")
    return entries


def write_entries(model_dir: Path, entries: dict[str, str]) -> None:
    """multi_lora.json rewritten whole: a reader (each model instance) sees the old file or the
    new one, never half of one."""
    from tritonlm.engine.settings import MULTI_LORA_FILE

    fd, tmp = tempfile.mkstemp(dir=model_dir, prefix="." + MULTI_LORA_FILE, suffix=".tmp")
    try:
        # mkstemp makes it 0600: the model's instances may run as another user, so keep the old
        # file's mode, or a plain file's
        try:
            mode = os.stat(model_dir / MULTI_LORA_FILE).st_mode & 0o777
        except OSError:
            mode = 0o644
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, model_dir / MULTI_LORA_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_folder(repo: Path, model: ServedModel, name: str, raw_path: str) -> None:
    """The adapter folder as the model's instances will load it, checked against the base
    model's config.json (lora.adapter.check_adapter): a 400 naming what is wrong."""
    from transformers import AutoConfig

    from tritonlm.engine.lora.adapter import BaseShape, check_adapter
    from tritonlm.engine.settings import SettingsError, adapter_pairs, inside_repository

    model_dir = repo / model.name
    try:
        adapter_pairs(json.dumps({name: raw_path}), "lora_name")  # the name's characters, as the model checks them
    except SettingsError as e:
        raise _bad("lora_name", str(e)) from None
    try:
        folder = inside_repository("lora_path", raw_path, model_dir)
    except SettingsError as e:
        raise _bad("lora_path", str(e)) from None
    if not folder.is_dir():
        raise _bad("lora_path", f"lora_path: no folder {raw_path!r} in model '{model.name}' (looked at {folder}); "
                                "paths are relative to the model folder, inside the model repository")
    params = model.parameters
    try:
        hf_dir = inside_repository("hf_dir", params.get("hf_dir", "") or "1/hf", model_dir)
        base = BaseShape.of_hf_config(AutoConfig.from_pretrained(str(hf_dir)))
    except (SettingsError, OSError, ValueError) as e:
        raise OpenAIError(500, f"model '{model.name}': its config.json cannot be read to check the adapter ({e})",
                          code="internal_error") from None
    try:
        max_rank = int(params.get("max_lora_rank", "") or 64)
        check_adapter(folder, base, name, max_rank)
    except ValueError as e:
        raise _bad("lora_path", f"lora_path: {e}") from None


def _base_model(models: dict[str, ServedModel], repo: Path, asked: Any) -> ServedModel:
    """The generation model a new adapter goes on: base_model_name, or the only one that takes adapters."""
    bases = sorted(n for n, m in models.items() if m.parent is None)
    taking = [n for n in bases if takes_lora(models[n], repo)]
    if asked is not None:
        if not isinstance(asked, str) or asked not in bases:
            raise _bad("base_model_name", f"base_model_name: {asked!r} is not a served generation model; served: "
                                          f"{', '.join(bases) or 'none'}")
        if asked not in taking:
            raise _bad("base_model_name", f"base_model_name: model '{asked}' was not loaded to take LoRA adapters; "
                                          "set the parameter enable_lora: true in its config.pbtxt (and reload it)")
        return models[asked]
    if len(taking) == 1:
        return models[taking[0]]
    if not taking:
        raise _bad("base_model_name", "no served model takes LoRA adapters; set the parameter enable_lora: true in "
                                      f"a generation model's config.pbtxt (served: {', '.join(bases) or 'none'})")
    raise _bad("base_model_name", f"base_model_name: several models take LoRA adapters ({', '.join(taking)}); name "
                                  "the one this adapter is for")


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise OpenAIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def add_lora_routes(app: FastAPI, repo: Path, backend: Callable[[], Backend]) -> None:
    """The two routes on `app`, for the models of the repository at `repo`; backend() gives the
    app's Backend (made in its lifespan)."""
    writing = asyncio.Lock()  # one read-modify-write of a multi_lora.json at a time

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await _json_body(request)
        name, raw_path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(raw_path, str) or not raw_path:
            raise _bad("lora_name" if not name else "lora_path", "Both 'lora_name' and 'lora_path' must be provided.")
        async with writing:
            models = await backend().models(refresh=True)
            if name in models:
                what = "has already been loaded" if models[name].parent is not None else "is the name of a served model"
                raise _bad("lora_name", f"The lora adapter '{name}' {what}.")
            model = _base_model(models, repo, body.get("base_model_name"))
            await asyncio.to_thread(check_folder, repo, model, name, raw_path)
            entries = read_entries(repo / model.name)
            entries[name] = raw_path
            await asyncio.to_thread(write_entries, repo / model.name, entries)
            await backend().models(refresh=True)  # the model list's cache: the adapter is a model from now on
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await _json_body(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise _bad("lora_name", "'lora_name' must be provided.")
        async with writing:
            models = await backend().models(refresh=True)
            adapters = sorted(n for n, m in models.items() if m.parent is not None)
            model = models.get(name)
            if model is None or model.parent is None:
                raise OpenAIError(404, f"The lora adapter '{name}' cannot be found (adapters served: "
                                       f"{', '.join(adapters) or 'none'}).", param="lora_name", code="not_found")
            entries = read_entries(repo / model.parent)
            if name not in entries:
                raise _bad("lora_name", f"The lora adapter '{name}' is named by model '{model.parent}''s lora_adapters "
                                        "parameter (config.pbtxt), which unloading at run time does not change; only "
                                        "adapters in its multi_lora.json can be unloaded")
            del entries[name]
            await asyncio.to_thread(write_entries, repo / model.parent, entries)
            await backend().models(refresh=True)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
