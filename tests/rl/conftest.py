"""Shared RL test fixtures: a real Hugging Face tokenizer built offline from a tiny in-memory
`tokenizers` model (no hub, no download), with and without a chat template."""

from __future__ import annotations

import pytest

CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["<unk>", "<eos>", "<|user|>", "<|assistant|>"]


def save_tiny_hf_tokenizer(path, chat_template=None):
    """A character-level BPE (no merges) over the synthetic task's characters, saved with
    save_pretrained so HFTokenizer loads it the way it loads a checkpoint's tokenizer."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("0123456789+-*=: \nAnswerUsistCompute."))
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>",
                                  additional_special_tokens=["<|user|>", "<|assistant|>"])
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(path))
    return path


@pytest.fixture
def chat_tokenizer_dir(tmp_path):
    return save_tiny_hf_tokenizer(tmp_path / "chat_tok", CHAT_TEMPLATE)


@pytest.fixture
def plain_tokenizer_dir(tmp_path):
    return save_tiny_hf_tokenizer(tmp_path / "plain_tok")
