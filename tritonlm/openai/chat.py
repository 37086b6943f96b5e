"""Chat messages -> one prompt, with the model's own chat template.

The template is the `chat_template` of the model's tokenizer, loaded by this process from
the model's folder: `<repo>/<model>/<hf_dir>` (hf_dir: the model config's parameter, default
1/hf; it must stay inside the repository), or a folder given with --tokenizer. A model whose
tokenizer has no chat template gets a 400 (no default template is made up); without access
to any tokenizer, chat requests get a 400 saying to pass --repo or --tokenizer.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from tritonlm.openai.errors import OpenAIError


class ChatTemplates:
    def __init__(self, repo: Path | None = None, tokenizers: dict[str, Path] | None = None):
        """repo: the model repository Triton serves (as this process sees it); tokenizers:
        model name -> tokenizer folder, "*" for every model (wins over repo)."""
        self.repo = Path(repo) if repo else None
        self.tokenizers = {k: Path(v) for k, v in (tokenizers or {}).items()}
        self._loaded: dict[tuple[str, str], object] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def folder(self, model: str, parameters: dict[str, str]) -> Path | None:
        if model in self.tokenizers:
            return self.tokenizers[model]
        if "*" in self.tokenizers:
            return self.tokenizers["*"]
        if self.repo is None:
            return None
        model_dir = Path(os.path.abspath(self.repo / model))
        path = Path(os.path.normpath(model_dir / parameters.get("hf_dir", "1/hf")))
        repository = Path(os.path.abspath(self.repo))
        if not path.is_relative_to(repository) or path == repository:
            return None  # a path leaving the repository is not followed
        return path

    async def tokenizer(self, model: str, parameters: dict[str, str], param: str = "messages"):
        """The model's tokenizer, loaded once; param: the request field that needs it."""
        folder = self.folder(model, parameters)
        if folder is None:
            raise OpenAIError(
                400,
                f"{param}: this needs model '{model}''s tokenizer, and this frontend has none: "
                "start it with --repo (the model repository) or --tokenizer (a tokenizer folder)",
                param=param, code="no_tokenizer",
            )
        key = (model, str(folder))
        if key not in self._loaded:
            lock = self._locks.setdefault(model, asyncio.Lock())
            async with lock:
                if key not in self._loaded:
                    self._loaded[key] = await asyncio.to_thread(_load, folder, model)
        return self._loaded[key]

    async def render(self, model: str, parameters: dict[str, str], messages: list[dict],
                     add_generation_prompt: bool = True, tools: list[dict] | None = None,
                     need_tools: bool = False) -> str:
        """The prompt. tools: rendered by the template, in its own format; need_tools: a
        template that leaves them out (no tool support) is a 400 naming `tools`."""
        tok = await self.tokenizer(model, parameters)
        if not getattr(tok, "chat_template", None):
            raise OpenAIError(
                400,
                f"messages: model '{model}' has no chat template (its tokenizer has no chat_template); "
                "use /v1/completions with a prompt, or add a chat_template to the model's tokenizer_config.json",
                param="messages", code="no_chat_template",
            )
        def apply(msgs: list[dict], with_tools: bool = True) -> str:
            return tok.apply_chat_template(msgs, tools=(tools or None) if with_tools else None, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

        try:
            text = apply(messages)
            if need_tools and text == apply(messages, with_tools=False):
                raise OpenAIError(
                    400, f"tools: the chat template of '{model}' does not render tools, so the model cannot be offered "
                    "them with tool_choice \"auto\"; send tool_choice \"required\" or a named function (the answer is "
                    "then constrained to a valid call), or give the model a template with tool support",
                    param="tools", code="no_tool_support")
        except OpenAIError:
            raise
        except Exception as e:  # a template may raise on purpose (e.g. roles must alternate)
            _check_tool_history(model, messages, apply)  # a template that cannot take tool calls says so
            raise OpenAIError(400, f"messages: the chat template of '{model}' refused them: {e}", param="messages",
                              code="invalid_value") from None
        _check_tool_history(model, messages, apply, text)
        # the model's tokenizer adds its BOS itself when it encodes: do not send a second one
        bos = getattr(tok, "bos_token", None)
        if bos and text.startswith(bos) and _adds_bos(tok):
            text = text[len(bos):]
        return text


def _check_tool_history(model: str, messages: list[dict], apply, text: str | None = None) -> None:
    """A 400 naming the first assistant message's tool_calls when the template cannot express
    them: it renders the conversation the same without them (they would vanish from the
    prompt), or refuses it only while they are there (e.g. it adds the content, null beside
    calls, to a string). text: the rendering with them, None when that raised."""
    first = next((i for i, m in enumerate(messages) if m.get("tool_calls")), None)
    if first is None:
        return
    without = [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages]
    if text is None:  # it raised: does it take the same conversation without the calls (and their null content)?
        without = [m | {"content": m["content"] or ""} if m["role"] == "assistant" else m for m in without]
    try:
        plain = apply(without)
    except Exception:  # noqa: BLE001 - refused without the calls too: not about the calls
        return
    if text is None or text == plain:
        raise OpenAIError(
            400, f"messages[{first}].tool_calls: the chat template of '{model}' does not render tool calls, so the "
            "model would not see this call; send the call and its result as text (assistant and user content), or "
            "give the model a template with tool support", param=f"messages[{first}].tool_calls", code="no_tool_support")


def _adds_bos(tok) -> bool:
    try:
        ids = tok("a").input_ids
    except Exception:
        return False
    return bool(ids) and tok.bos_token_id is not None and ids[0] == tok.bos_token_id


def _load(folder: Path, model: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise OpenAIError(
            500, f"cannot load the tokenizer of model '{model}' from {folder}: {first}", code="tokenizer_error"
        ) from None
