"""What the OpenAI app (tritonlm/openai/app.py) asks of the server behind it: the interface
that the Triton bridge (tritonlm/openai/triton.py, TritonBackend) implements, and that a
test's fake implements to drive the app without a tritonserver.

The data that crosses it, `ServedModel` and `Piece`, is defined in triton.py beside the code
that reads it from Triton's answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tritonlm.openai.triton import Piece, ServedModel


@runtime_checkable
class GenerationStream(Protocol):
    """One generation request. `async for piece in stream` yields its responses in order,
    the last one with `final` set (an error response raises OpenAIError: its status is the
    HTTP status of the answer, 503 while the model restarts). cancel() ends it at once,
    from any point, also from a `finally` of a cancelled task; after the final response it
    does nothing."""

    def __aiter__(self) -> "GenerationStream": ...

    async def __anext__(self) -> "Piece": ...

    def cancel(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """The generation models of one server, and their generations."""

    url: str  # where it is, as error messages name it

    async def models(self, refresh: bool = False) -> dict[str, "ServedModel"]:
        """The generation models that serve now, by name (refresh: ask, not from a cache)."""
        ...

    async def model(self, name: str) -> "ServedModel":
        """One of them; an unknown name raises OpenAIError 404 (errors.model_not_found)."""
        ...

    def generate(self, model: str, prompt: str, sampling: dict, stream: bool, chat: bool = False) -> GenerationStream:
        """Start one generation: prompt is the whole text the model continues, sampling the
        `sampling_parameters` JSON object (tritonlm/protocol.py); stream: one response per
        token (else one for the whole answer); chat: an error about the prompt names
        `messages`. A server out of reach raises OpenAIError 503 here or on the first piece."""
        ...

    async def live(self) -> bool:
        """Whether the server answers (GET /health)."""
        ...

    async def close(self) -> None: ...
