"""CharTokenizer (fixed ids, round trip, UNK), HFTokenizer from local files, the prompt template."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from isoexec.rl.data import Problem, synthetic_arithmetic
from isoexec.rl.tokenizer import (BASE_TEMPLATE, CHARSET, CharTokenizer, HFTokenizer, Tokenizer,
                                  TokenizerNotFound, chat_prompt)


def test_char_ids_are_pinned():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    # The mapping is part of every recorded run: changing it silently would change all token ids.
    assert tok.encode("\n") == [4] and tok.encode(" ") == [6] and tok.encode("~") == [100]
    assert tok.encode("Answer: 42") == [39, 84, 89, 93, 75, 88, 32, 6, 26, 24]   # ord(c) - 26
    assert len(CHARSET) == 97 and tok.vocab_size == 128
    assert isinstance(tok, Tokenizer)


@given(st.text(alphabet=CHARSET, max_size=200))
def test_char_round_trip(text):
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text) and all(4 <= i < 101 for i in ids)
    assert tok.decode(ids) == text


def test_synthetic_prompts_round_trip_without_unk():
    tok = CharTokenizer()
    for row in synthetic_arithmetic(20, seed=0):
        text = chat_prompt(row["prompt"][0]["content"]) + " 3*4=12\nAnswer: 12"
        ids = tok.encode(text)
        assert tok.unk_id not in ids and tok.decode(ids) == text


def test_unknown_chars_and_unused_ids_decode_to_replacement():
    tok = CharTokenizer(vocab_size=110)
    assert tok.encode("x\u00d7y") == [tok.encode("x")[0], tok.unk_id, tok.encode("y")[0]]
    assert tok.decode(tok.encode("x\u00d7y")) == "x\ufffdy"
    assert tok.decode([105, 109]) == "\ufffd\ufffd"                  # ids past the charset
    assert tok.decode([tok.bos_id, *tok.encode("ok"), tok.eos_id, tok.pad_id]) == "ok"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([110])


@pytest.mark.parametrize("size", [100, 513])
def test_vocab_bounds(size):
    with pytest.raises(ValueError, match="vocab_size"):
        CharTokenizer(vocab_size=size)


def _save_local_hf_tokenizer(folder):
    """A small character-level tokenizer saved as a checkpoint folder would hold it."""
    from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for ch in CHARSET:
        vocab[ch] = len(vocab)
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    raw.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>").save_pretrained(folder)


def test_hf_tokenizer_from_local_folder(tmp_path):
    _save_local_hf_tokenizer(tmp_path / "ckpt")
    tok = HFTokenizer(tmp_path / "ckpt")
    assert isinstance(tok, Tokenizer)
    assert tok.eos_id == 1 and tok.pad_id == 1 and tok.vocab_size == 2 + len(CHARSET)
    text = "Compute 3+4.\nAnswer: 7"
    ids = tok.encode(text)
    assert tok.eos_id not in ids                                      # no special tokens added
    assert tok.decode(ids + [tok.eos_id]) == text


def test_hf_tokenizer_missing_or_empty_folder(tmp_path):
    with pytest.raises(TokenizerNotFound, match="not found"):
        HFTokenizer(tmp_path / "missing")
    with pytest.raises(TokenizerNotFound, match="Qwen/Qwen3-0.6B"):
        HFTokenizer("Qwen/Qwen3-0.6B")                              # a hub id is not fetched
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerNotFound, match="empty"):
        HFTokenizer(tmp_path / "empty")


def test_chat_prompt_template():
    p = Problem("a", "Compute 1+1.", "2")
    assert chat_prompt(p) == "User: Compute 1+1.\n\nAssistant:" == BASE_TEMPLATE.format(prompt=p.prompt_text)
    assert chat_prompt(p, "Q: {prompt}\nA:") == "Q: Compute 1+1.\nA:"
    with pytest.raises(ValueError, match="exactly one field"):
        chat_prompt(p, "{prompt} {other}")


def test_chat_template_builds_the_prompt_where_the_tokenizer_has_one(chat_tokenizer_dir, plain_tokenizer_dir):
    from isoexec.rl.tokenizer import prompt_for

    tok = HFTokenizer(chat_tokenizer_dir)
    assert tok.chat_template
    text = prompt_for(tok, "3+4=")
    assert text == "<|user|>3+4=<|assistant|>"                      # add_generation_prompt=True
    ids = tok.encode(text)
    user, asst = (tok._tok.convert_tokens_to_ids(t) for t in ("<|user|>", "<|assistant|>"))
    assert ids[0] == user and ids[-1] == asst and len(ids) == 6     # the specials are one id each
    plain = HFTokenizer(plain_tokenizer_dir)
    assert not plain.chat_template and prompt_for(plain, "3+4=") == BASE_TEMPLATE.format(prompt="3+4=")
    assert prompt_for(CharTokenizer(), "3+4=") == "User: 3+4=\n\nAssistant:"
