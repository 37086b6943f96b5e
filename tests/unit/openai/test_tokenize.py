"""tritonlm/openai/tokenize.py: vLLM's /tokenize and /detokenize on the app (fake backend,
the tiny tokenizer), against the tokenizer's own encode, decode and chat template."""

from __future__ import annotations

from tests.helpers.chat_templates import CHATML
from tritonlm.models.builtin import tiny_tokenizer

TEXT = "Café naïve — 你好 🙂"


def test_tokenize_and_detokenize_equal_the_tokenizers_own(served):
    tok = tiny_tokenizer()
    r = served.http.post("/tokenize", json={"model": "tiny", "prompt": TEXT}).json()
    assert r["tokens"] == tok(TEXT).input_ids and r["count"] == len(r["tokens"]) and r["max_model_len"] is None
    assert served.http.post("/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json() == {"prompt": TEXT}
    messages = [{"role": "user", "content": TEXT}]
    chat = served.http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
    want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=CHATML)
    assert chat["tokens"] == tok(want).input_ids


def test_tokenize_refusals_name_the_field(served):
    both = served.http.post("/tokenize", json={"model": "tiny", "prompt": "x", "messages": []})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    vocab = len(tiny_tokenizer())
    bad = served.http.post("/detokenize", json={"model": "tiny", "tokens": [1, vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert f"[0, {vocab})" in bad.json()["error"]["message"]
    unknown = served.http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
