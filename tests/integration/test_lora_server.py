"""Multi-LoRA through a real tritonserver and the OpenAI frontend (docs/lora.md): a tiny Llama
serving two PEFT adapters, one named by the `lora_adapters` parameter and one by a
multi_lora.json beside it. Greedy text under each adapter (the `lora_name` input, the
`sampling_parameters` key, the OpenAI `model` field) equals PEFT's merge_and_unload() model's
own generate(); the base stays the base; an unknown adapter is a clear error naming the known
ones and the server keeps serving. With --allow-runtime-lora (behind the API key), vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter add and drop adapters while it serves: a
loaded one is listed and equals PEFT, an unloaded one is a 404, a reloaded one the new weights,
a bad one a 400 naming why, with nothing changed."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass

import openai
import pytest
import torch

from tests.helpers.lora import make_adapter, write_config
from tests.helpers.servers import HANG_GUARD_S, metric
from tritonlm.client.generate import GenerateError, generate_grpc
from tritonlm.export.repository import write_generation_model
from tritonlm.openai.server import OpenAIServer
from tritonlm.server import free_ports

PROMPTS = ["Hello world", "The cat sat on the"]
MAX_TOKENS = 12
ADAPTERS = {  # name -> how PEFT makes it: different ranks and targets, so each changes the text its own way
    "sql": dict(seed=1, r=8, lora_alpha=16, target_modules="all-linear"),
    "chat": dict(seed=2, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
}


@pytest.fixture(scope="module")
def served_models(tmp_path_factory):
    """(repository, tokenizer, {None: base, adapter name: PEFT's merged model})."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tritonlm.models.builtin import tiny_tokenizer

    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,  # varied greedy continuations
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(11)
    base = LlamaForCausalLM(config).eval()
    repo = tmp_path_factory.mktemp("lorarepo")
    folder = write_generation_model(repo, "tiny", base, tok, lora_adapters="sql=adapters/sql", max_cpu_loras=1)
    models = {None: base}
    for name, kw in ADAPTERS.items():
        kw = dict(kw)
        models[name] = make_adapter(base, folder / "adapters" / name, kw.pop("seed"), **kw)
    (folder / "multi_lora.json").write_text(json.dumps({"chat": "adapters/chat"}))  # vLLM backend's file
    return repo, tok, models


@pytest.fixture(scope="module")
def triton_repo(served_models):
    return served_models[0]


@pytest.fixture(scope="module")
def frontend(triton_server, triton_repo):
    (port,) = free_ports(1)
    with OpenAIServer(triton_server.grpc_url, port=port, repo=triton_repo) as server:
        yield server


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD_S)


@torch.no_grad()
def peft_text(served_models, adapter: str | None, prompt: str) -> str:
    """transformers' greedy generate() on the merged model: the text after the prompt, to EOS."""
    _, tok, models = served_models
    ids = tok(prompt, return_tensors="pt")
    out = models[adapter].generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tok.eos_token_id)
    new = out[0, ids.input_ids.shape[1]:].tolist()
    if tok.eos_token_id in new:
        new = new[: new.index(tok.eos_token_id)]
    return tok.decode(new)


def grpc(server, prompt: str, **params):
    return generate_grpc(server.grpc_url, "tiny", prompt, exclude_input_in_output=True, max_tokens=MAX_TOKENS, **params)


def test_each_adapter_and_the_base_equal_peft_through_triton(triton_server, served_models):
    texts = {}
    for prompt in PROMPTS:
        for adapter in (None, "sql", "chat"):
            want = peft_text(served_models, adapter, prompt)
            got = grpc(triton_server, prompt, lora_name=adapter).text
            assert got == want, (prompt, adapter)
            texts[prompt, adapter] = got
            if adapter is not None:  # vLLM backend's form: the name inside sampling_parameters
                sp = json.dumps({"lora_name": adapter, "max_tokens": MAX_TOKENS})
                assert generate_grpc(triton_server.grpc_url, "tiny", prompt, exclude_input_in_output=True,
                                     sampling_parameters=sp).text == want
    # the adapters change the text (else equality with PEFT would not show they ran)
    assert any(texts[p, "sql"] != texts[p, None] for p in PROMPTS)
    assert any(texts[p, "chat"] != texts[p, None] for p in PROMPTS)


def test_openai_model_field_names_an_adapter_and_models_lists_it(client, served_models):
    """Both adapters, the `lora_adapters` one and the multi_lora.json one (the frontend reads
    the repository), are models of their own with `tiny` as parent."""
    cards = {m.id: m for m in client.models.list().data}
    assert "tiny" in cards and "sql" in cards and "chat" in cards
    assert cards["sql"].model_extra.get("parent") == "tiny" and cards["chat"].model_extra.get("parent") == "tiny"
    for adapter in ("sql", "chat"):
        for prompt in PROMPTS:
            r = client.completions.create(model=adapter, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert r.model == adapter and r.choices[0].text == peft_text(served_models, adapter, prompt)


def test_an_unknown_adapter_is_a_clear_error_and_the_server_keeps_serving(triton_server, client, served_models):
    with pytest.raises(GenerateError, match=r"lora_name: unknown LoRA adapter 'nope'; this model serves: 'chat', 'sql'"):
        grpc(triton_server, PROMPTS[0], lora_name="nope")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPTS[0], max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "sql" in e.value.body["message"]
    assert grpc(triton_server, PROMPTS[0], lora_name="chat").text == peft_text(served_models, "chat", PROMPTS[0])


def test_adapter_metrics_count_requests_loads_and_evictions(triton_server, served_models):
    """Requests per adapter, cold loads, evictions (max_cpu_loras=1: every switch of adapter
    loads one and drops the other) and residency, counted by the time each answer is back."""
    def read():
        return ({a: metric(triton_server, "tritonlm_lora_requests_total", "tiny", default=0, adapter=a) for a in ADAPTERS},
                metric(triton_server, "tritonlm_lora_loads_total", "tiny"),
                metric(triton_server, "tritonlm_lora_evictions_total", "tiny"))

    grpc(triton_server, PROMPTS[0], lora_name="sql")  # sql resident, whatever ran before
    requests, loads, evictions = read()
    for adapter in ("chat", "sql", "sql"):
        grpc(triton_server, PROMPTS[0], lora_name=adapter)
    after, loads_after, evictions_after = read()
    assert after["chat"] - requests["chat"] == 1 and after["sql"] - requests["sql"] == 2
    assert loads_after - loads == 2 and evictions_after - evictions == 2  # chat in, then sql back in
    assert metric(triton_server, "tritonlm_lora_adapters_resident", "tiny") == 1
    assert metric(triton_server, "tritonlm_lora_load_seconds_count", "tiny") == loads_after


# --- adapters loaded and unloaded at run time ------------------------------------------------
API_KEY = "lora-admin-key"


@pytest.fixture(scope="module")
def new_adapters(served_models, tmp_path_factory):
    """Adapter folders in the model folder that no config names: `fresh` (its merged model joins
    served_models' as "fresh"), a DoRA one, and one made for another base model's shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    repo, tok, models = served_models
    folder = repo / "tiny" / "adapters"
    models["fresh"] = make_adapter(models[None], folder / "fresh", 3, r=4, lora_alpha=8, target_modules="all-linear")
    make_adapter(models[None], folder / "dora", 4, r=4, lora_alpha=8, target_modules=["q_proj"])
    write_config(folder / "dora", use_dora=True)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    make_adapter(LlamaForCausalLM(config).eval(), folder / "wide", 5, r=4, lora_alpha=8, target_modules=["q_proj"])
    return folder


@pytest.fixture(scope="module")
def admin(triton_server, triton_repo, new_adapters):
    """An OpenAI frontend with the run-time LoRA endpoints on, behind an API key."""
    (port,) = free_ports(1)
    with OpenAIServer(triton_server.grpc_url, port=port, repo=triton_repo, api_key=API_KEY,
                      allow_runtime_lora=True) as server:
        yield server


@dataclass
class Answer:
    status_code: int
    text: str

    def json(self) -> dict:
        return json.loads(self.text)


def post(server, path: str, body: dict, key: str | None = API_KEY) -> Answer:
    """A JSON POST (the openai client has no method for these routes)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=HANG_GUARD_S) as r:
            return Answer(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Answer(e.code, e.read().decode())


def test_runtime_lora_endpoints_are_off_by_default(frontend):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert post(frontend, path, {"lora_name": "fresh", "lora_path": "adapters/fresh"}).status_code == 404


def test_an_adapter_loaded_at_run_time_serves_then_unloads(triton_server, admin, served_models, new_adapters):
    """Load -> listed with parent `tiny` -> completions equal PEFT's merged model (OpenAI and
    Triton's lora_name) -> a second load of the name is a 400 -> unload -> 404 everywhere;
    loaded again with other weights in the same folder, it answers as the new weights do."""
    client = openai.OpenAI(base_url=admin.url + "/v1", api_key=API_KEY, max_retries=0, timeout=HANG_GUARD_S)
    load = {"lora_name": "fresh", "lora_path": "adapters/fresh"}
    assert post(admin, "/v1/load_lora_adapter", load, key=None).status_code == 401
    assert post(admin, "/v1/load_lora_adapter", load, key="wrong").status_code == 401
    r = post(admin, "/v1/load_lora_adapter", load)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fresh' added successfully."
    cards = {m.id: m for m in client.models.list().data}
    assert cards["fresh"].model_extra.get("parent") == "tiny"
    for prompt in PROMPTS:
        want = peft_text(served_models, "fresh", prompt)
        got = client.completions.create(model="fresh", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.model == "fresh" and got.choices[0].text == want
        assert grpc(triton_server, prompt, lora_name="fresh").text == want
    assert any(peft_text(served_models, "fresh", p) != peft_text(served_models, None, p) for p in PROMPTS)
    again = post(admin, "/v1/load_lora_adapter", load)
    assert again.status_code == 400 and "The lora adapter 'fresh' has already been loaded" in again.text

    r = post(admin, "/v1/unload_lora_adapter", {"lora_name": "fresh"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'fresh' removed successfully."
    assert "fresh" not in {m.id for m in client.models.list().data}
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="fresh", prompt=PROMPTS[0], max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(GenerateError, match=r"lora_name: unknown LoRA adapter 'fresh'; this model serves: 'chat', 'sql'"):
        grpc(triton_server, PROMPTS[0], lora_name="fresh")
    gone = post(admin, "/v1/unload_lora_adapter", {"lora_name": "fresh"})
    assert gone.status_code == 404 and "'fresh' cannot be found (adapters served: chat, sql)" in gone.text

    # reloaded in place: new weights, the same name and folder (the prefix cache must not serve the old ones)
    _, _, models = served_models
    shutil.rmtree(new_adapters / "fresh")
    models["fresh"] = make_adapter(models[None], new_adapters / "fresh", 13, r=8, lora_alpha=16,
                                   target_modules=["q_proj", "v_proj", "up_proj"])
    assert post(admin, "/v1/load_lora_adapter", load).status_code == 200
    for prompt in PROMPTS:
        got = client.completions.create(model="fresh", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert got.choices[0].text == peft_text(served_models, "fresh", prompt)
    assert post(admin, "/v1/unload_lora_adapter", {"lora_name": "fresh"}).status_code == 200


@pytest.mark.parametrize("body, status, message", [
    ({"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ({"lora_name": "x", "lora_path": "adapters/missing"}, 400, "lora_path: no folder 'adapters/missing' in model 'tiny'"),
    ({"lora_name": "x", "lora_path": "../../elsewhere"}, 400, "lora_path: '../../elsewhere' leaves the model repository"),
    ({"lora_name": "x", "lora_path": "adapters/dora"}, 400, "LoRA adapter 'x': use_dora=True: DoRA"),
    ({"lora_name": "x", "lora_path": "adapters/wide"}, 400, "do not fit the base model's q_proj, which maps 64 inputs"),
    ({"lora_name": "sql", "lora_path": "adapters/chat"}, 400, "The lora adapter 'sql' has already been loaded."),
    ({"lora_name": "tiny", "lora_path": "adapters/chat"}, 400, "The lora adapter 'tiny' is the name of a served model."),
    ({"lora_name": "x", "lora_path": "adapters/chat", "base_model_name": "nope"}, 400,
     "base_model_name: 'nope' is not a served generation model; served: tiny"),
])
def test_a_bad_load_is_a_400_naming_why_and_changes_nothing(admin, client, served_models, body, status, message):
    r = post(admin, "/v1/load_lora_adapter", body)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert {m.id for m in client.models.list().data} == {"tiny", "sql", "chat"}
    got = client.completions.create(model="chat", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert got.choices[0].text == peft_text(served_models, "chat", PROMPTS[1])


def test_an_adapter_named_by_the_config_is_not_unloaded(admin):
    r = post(admin, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert r.status_code == 400 and "named by model 'tiny''s lora_adapters parameter" in r.text
