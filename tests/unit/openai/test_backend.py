"""tritonlm/openai/backend.py: the interface between the OpenAI app and the server behind it
names everything the app asks of it, and both the Triton bridge and the tests' fake have it
with the same signatures (so the fake cannot drift from what the app really gets)."""

from __future__ import annotations

import ast
import inspect

import tritonlm.openai.app as app_module
from tests.unit.openai.fake_backend import FakeBackend, FakeGeneration
from tritonlm.openai.backend import Backend, GenerationStream
from tritonlm.openai.triton import Generation, TritonBackend


def members(protocol) -> set[str]:
    own = {n for n in vars(protocol) if not n.startswith("_") or n in ("__aiter__", "__anext__")}
    return own | set(getattr(protocol, "__annotations__", {}))


def test_the_bridge_and_the_fake_have_the_interface_with_its_signatures():
    bridge = TritonBackend("localhost:1")  # its gRPC client is made on first use: nothing connects
    assert isinstance(bridge, Backend) and isinstance(FakeBackend(), Backend)
    for protocol, implementations in ((Backend, (TritonBackend, FakeBackend)),
                                      (GenerationStream, (Generation, FakeGeneration))):
        for name in members(protocol) - {"url"}:
            want = list(inspect.signature(getattr(protocol, name)).parameters)
            for cls in implementations:
                got = list(inspect.signature(getattr(cls, name)).parameters)
                assert got == want, f"{cls.__name__}.{name}{got} differs from {protocol.__name__}.{name}{want}"
                assert inspect.iscoroutinefunction(getattr(cls, name)) == \
                    inspect.iscoroutinefunction(getattr(protocol, name)), f"{cls.__name__}.{name}: async or not"


def test_the_app_asks_the_backend_only_what_the_interface_names():
    """Every attribute the app reads off a backend (app.state.backend.X, backend.X) or off a
    generation (c.gen.X) is one the interface declares."""
    tree = ast.parse(inspect.getsource(app_module))
    used_backend, used_gen = set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = ast.unparse(node.value)
        if owner in ("app.state.backend", "backend"):
            used_backend.add(node.attr)
        elif owner.endswith(".gen") or owner == "gen":
            used_gen.add(node.attr)
    assert used_backend and used_backend <= members(Backend), used_backend - members(Backend)
    assert used_gen and used_gen <= members(GenerationStream), used_gen - members(GenerationStream)
