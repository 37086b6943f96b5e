"""vLLM's /tokenize and /detokenize: a model's own tokenizer, from the frontend's process.

POST /tokenize   {"model", "prompt"} or {"model", "messages"[, "add_generation_prompt"]}
                 [, "add_special_tokens" (default true)]
                 -> {"count", "max_model_len", "tokens"}; with messages, the chat template's
                 prompt, counted as the model counts it (usage.prompt_tokens of the same request)
POST /detokenize {"model", "tokens"} -> {"prompt"}
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tritonlm.openai.errors import OpenAIError, bad_field

MAX_TOKENS_IN = 1 << 20  # token ids one /detokenize takes


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_field("prompt", "send exactly one of prompt (a string) and messages (a chat)")

    def chat_messages(self) -> list[dict]:
        from tritonlm.openai.schemas import ChatCompletionRequest

        return ChatCompletionRequest.model_validate({"model": self.model, "messages": self.messages}).chat_messages()


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    tokens: list[int] = Field(max_length=MAX_TOKENS_IN)

    def check_supported(self) -> None:
        pass


async def tokenize(templates, info, req: TokenizeRequest) -> dict:
    tok = await templates.tokenizer(info.base, info.parameters, param="prompt" if req.prompt is not None else "messages")
    if req.messages is not None:
        text = await templates.render(info.base, info.parameters, req.chat_messages(),
                                      add_generation_prompt=req.add_generation_prompt)
    else:
        text = req.prompt
    ids = await asyncio.to_thread(lambda: list(tok(text, add_special_tokens=req.add_special_tokens).input_ids))
    max_len = info.parameters.get("max_context", "")
    return {"count": len(ids), "max_model_len": int(max_len) if max_len.isdigit() else None, "tokens": ids}


async def detokenize(templates, info, req: DetokenizeRequest) -> dict:
    tok = await templates.tokenizer(info.base, info.parameters, param="tokens")
    vocab = len(tok)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(400, f"tokens: token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens",
                          code="invalid_value")
    return {"prompt": await asyncio.to_thread(tok.decode, req.tokens)}
