"""tritonlm/engine/tokenizer.py: a model folder's tokenizer loads as transformers saved it or
refuses naming the field, and a draft must map every token to the target's id."""

from __future__ import annotations

import logging
import shutil

import pytest

from tests.helpers.models import tiny
from tritonlm.engine.settings import SettingsError
from tritonlm.engine.tokenizer import TokenizerMismatch, check_same_tokenizer, error_summary, load_tokenizer

TEXT = "Café naïve — 你好，世界 🙂 <|endoftext|> done"


def test_a_saved_tokenizer_loads_and_encodes_and_decodes_as_the_original(tmp_path, caplog):
    _, tok = tiny()
    tok.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tritonlm.engine.tokenizer"):
        loaded = load_tokenizer(tmp_path)
    assert not caplog.records  # it has an EOS: nothing to warn about
    ids = tok(TEXT).input_ids
    assert loaded(TEXT).input_ids == ids
    assert loaded.decode(ids) == tok.decode(ids) == TEXT
    assert loaded.eos_token_id == tok.eos_token_id and loaded.get_vocab() == tok.get_vocab()


def test_a_folder_without_a_tokenizer_refuses_naming_the_field_and_the_folder(tmp_path):
    (tmp_path / "hf").mkdir()
    with pytest.raises(SettingsError, match=r"^draft_model: no usable tokenizer in .*hf \(\w+: ") as refused:
        load_tokenizer(tmp_path / "hf", field="draft_model")
    assert str(tmp_path / "hf") in str(refused.value)
    assert refused.value.__cause__ is None  # the message says it all: no chained traceback
    _, tok = tiny()
    tok.save_pretrained(tmp_path / "broken")
    (tmp_path / "broken" / "tokenizer.json").write_text("{ not json")
    with pytest.raises(SettingsError, match=r"^hf_dir: no usable tokenizer in "):
        load_tokenizer(tmp_path / "broken")


def test_a_tokenizer_without_eos_loads_with_a_warning(tmp_path, caplog):
    from transformers import PreTrainedTokenizerFast

    _, tok = tiny()
    tok.save_pretrained(tmp_path / "with")
    bare = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "with" / "tokenizer.json"))
    bare.save_pretrained(tmp_path / "without")
    with caplog.at_level(logging.WARNING, logger="tritonlm.engine.tokenizer"):
        loaded = load_tokenizer(tmp_path / "without")
    assert loaded.eos_token_id is None
    assert any("no EOS token" in r.getMessage() for r in caplog.records)


def test_error_summary_is_the_type_and_the_first_line():
    assert error_summary(OSError("can't load\nsecond line\nthird")) == "OSError: can't load"
    assert error_summary(ValueError("")) == "ValueError: "
    assert error_summary(KeyError("model")) == "KeyError: 'model'"


def test_the_same_vocabulary_passes_and_a_different_one_is_refused_with_the_counts(tmp_path):
    _, tok = tiny()
    tok.save_pretrained(tmp_path / "target")
    shutil.copytree(tmp_path / "target", tmp_path / "same")
    check_same_tokenizer(tok, load_tokenizer(tmp_path / "same"), tmp_path / "same")

    draft = load_tokenizer(tmp_path / "target")
    draft.add_tokens(["<extra-a>", "<extra-b>"])
    target_vocab, draft_vocab = tok.get_vocab(), draft.get_vocab()
    differ = sorted(t for t in set(target_vocab) | set(draft_vocab) if target_vocab.get(t) != draft_vocab.get(t))
    assert differ == ["<extra-a>", "<extra-b>"]
    with pytest.raises(TokenizerMismatch) as refused:
        check_same_tokenizer(tok, draft, "models/draft")
    e = refused.value
    assert isinstance(e, SettingsError)
    assert (e.differ, e.total, e.example) == (2, len(target_vocab) + 2, "<extra-a>")
    assert (e.target_id, e.draft_id) == (None, draft_vocab["<extra-a>"])
    assert (e.target_size, e.draft_size) == (len(target_vocab), len(target_vocab) + 2)
    assert str(e).startswith("draft_model: the draft's tokenizer (models/draft) differs from the target's: 2 of ")


def test_the_same_tokens_under_other_ids_are_refused():
    """Same token set, two ids swapped: every token exists on both sides, yet a draft's id
    would mean another text to the target."""
    _, tok = tiny()

    class Swapped:
        def get_vocab(self):
            vocab = dict(tok.get_vocab())
            a, b = sorted(vocab)[:2]
            vocab[a], vocab[b] = vocab[b], vocab[a]
            return vocab

    with pytest.raises(TokenizerMismatch) as refused:
        check_same_tokenizer(tok, Swapped(), "d")
    a = sorted(tok.get_vocab())[0]
    assert refused.value.differ == 2 and refused.value.total == len(tok.get_vocab())
    assert (refused.value.example, refused.value.target_id) == (a, tok.get_vocab()[a])
