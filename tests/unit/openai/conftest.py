"""The OpenAI app in process, in front of a FakeBackend (fake_backend.py): no tritonserver.

Chat models get the built-in tiny tokenizer (tritonlm/models/builtin.py) saved with a chat
template: "tiny" a ChatML one, "tools" a Hermes-style one that renders tools, "plain" none.
The app is driven over starlette's TestClient (an httpx2 client bound to the ASGI app), by
itself or as the official `openai` client's http_client.
"""

from __future__ import annotations

import openai
import pytest
from starlette.testclient import TestClient

from tests.helpers.chat_templates import CHATML, TOOLS_TEMPLATE
from tests.unit.openai.fake_backend import HANG_GUARD_S, FakeBackend
from tritonlm.models.builtin import tiny_tokenizer
from tritonlm.openai.app import create_app
from tritonlm.openai.chat import ChatTemplates

MODELS = ("tiny", "tools", "plain")


@pytest.fixture(scope="session")
def tokenizers(tmp_path_factory) -> dict[str, str]:
    """model name -> its tokenizer folder."""
    root = tmp_path_factory.mktemp("tokenizers")
    folders = {}
    for name, template in (("tiny", CHATML), ("tools", TOOLS_TEMPLATE), ("plain", None)):
        tok = tiny_tokenizer()
        tok.chat_template = template
        tok.save_pretrained(root / name)
        folders[name] = str(root / name)
    return folders


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(models=MODELS)


class Served:
    """The app, its fake backend, an HTTP client bound to it and an `openai` client over that."""

    def __init__(self, backend: FakeBackend, tokenizers: dict[str, str], **options):
        self.backend = backend
        self.app = create_app(backend=backend, templates=ChatTemplates(tokenizers=tokenizers), **options)
        self.http = TestClient(self.app, raise_server_exceptions=False)
        self.http.__enter__()
        key = options.get("api_key") or "unused"
        self.openai = openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=self.http,
                                    max_retries=0, timeout=HANG_GUARD_S)

    def close(self) -> None:
        self.http.__exit__(None, None, None)


@pytest.fixture
def serve(backend, tokenizers):
    """serve(**create_app options) -> Served, closed after the test; `backend` is its backend."""
    made = []

    def make(**options) -> Served:
        made.append(Served(backend, tokenizers, **options))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def served(serve) -> Served:
    return serve()
