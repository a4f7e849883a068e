"""Text <-> token ids for the RL loop, and the prompt template.

Two tokenizers stand behind one small protocol:

* :class:`CharTokenizer` - one id per character, for the tiny random-weight models that run on
  CPU in tests and the embedded workflow. No files, no download, and the mapping is fixed in
  code, so the same text gives the same ids on every machine (a prerequisite for comparing
  native vs IsoExec runs token for token).
* :class:`HFTokenizer` - a real checkpoint's tokenizer read from local files only (no hub is
  reachable on our machines; failing fast with the path beats a network timeout).

:func:`prompt_for` turns a user message into the prompt string: through the tokenizer's chat
template where it has one (an instruct checkpoint was trained on that frame, and verl's RL data
set builds its prompts the same way), else through :data:`BASE_TEMPLATE` (:func:`chat_prompt`).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

from ..errors import IsoExecError


@runtime_checkable
class Tokenizer(Protocol):
    """What the loop needs: ids for the engine, text for the reward, the stop id, the id range."""

    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class TokenizerNotFound(IsoExecError, FileNotFoundError):
    """A tokenizer folder is missing or holds no tokenizer files."""


# --------------------------------------------------------------------------- characters

#: Characters with their own id, in id order after the four specials. Printable ASCII covers the
#: synthetic problems, the DAPO instruction and "Answer: <n>" lines; anything else is UNK.
CHARSET = "\n\t" + "".join(chr(c) for c in range(32, 127))
REPLACEMENT = "\ufffd"   # what UNK and unused ids decode to


class CharTokenizer:
    """Character-level tokenizer: ids 0..3 are PAD, BOS, EOS, UNK, then one id per character of
    :data:`CHARSET` (newline, tab, printable ASCII: 101 ids in all).

    ``vocab_size`` may be larger than that (default 128, at most 512) so a tiny model can have a
    round embedding size; ids that name no character - and UNK - decode to U+FFFD, because a
    sampled model can emit any id below ``vocab_size`` and the reward must still see text.
    ``encode`` never adds BOS/EOS (the caller decides); ``decode`` drops PAD/BOS/EOS.
    """

    PAD, BOS, EOS, UNK = 0, 1, 2, 3
    NUM_SPECIAL = 4
    MAX_VOCAB = 512

    def __init__(self, vocab_size: int = 128):
        needed = self.NUM_SPECIAL + len(CHARSET)
        if not needed <= vocab_size <= self.MAX_VOCAB:
            raise ValueError(f"CharTokenizer: vocab_size must be in [{needed}, {self.MAX_VOCAB}], got {vocab_size}")
        self.vocab_size = vocab_size
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = self.PAD, self.BOS, self.EOS, self.UNK
        self._stoi = {ch: self.NUM_SPECIAL + i for i, ch in enumerate(CHARSET)}
        self._itos = {i: ch for ch, i in self._stoi.items()}

    def encode(self, text: str) -> list[int]:
        unk = self.UNK
        return [self._stoi.get(ch, unk) for ch in text]

    def decode(self, ids: Sequence[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"CharTokenizer.decode: id {i} outside [0, {self.vocab_size})")
            if i in (self.PAD, self.BOS, self.EOS):
                continue
            out.append(self._itos.get(i, REPLACEMENT))
        return "".join(out)


# --------------------------------------------------------------------------- Hugging Face


class HFTokenizer:
    """A checkpoint's tokenizer loaded with ``transformers.AutoTokenizer`` from a local folder.

    ``local_files_only=True`` always: our hosts cannot reach a hub, and a model id typed where a
    path belongs should fail at once with that path in the message. ``vocab_size`` is
    ``len(tokenizer)`` (base vocabulary plus added tokens); a model's embedding may be larger
    (padded), which is fine - ids beyond the tokenizer decode to nothing.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_dir():
            raise TokenizerNotFound(f"tokenizer folder {str(path)!r} not found (a local checkpoint "
                                    f"folder with tokenizer.json / tokenizer_config.json is needed; "
                                    f"hub ids are not fetched)")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError) as e:
            raise TokenizerNotFound(f"{path}: no usable tokenizer files ({e})") from e
        if self._tok.eos_token_id is None:
            raise TokenizerNotFound(f"{path}: the tokenizer defines no EOS token; RL generation "
                                    f"needs one to stop")
        self.eos_id = int(self._tok.eos_token_id)
        self.bos_id = self._tok.bos_token_id
        self.pad_id = self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self._tok)
        # None for a base checkpoint without one: prompt_for then uses the plain frame
        self.chat_template = getattr(self._tok, "chat_template", None) or None

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The prompt text of ``messages`` in the checkpoint's chat template, ending where the
        assistant's reply starts (``add_generation_prompt=True``). Text, not ids, as verl does:
        :meth:`encode` then turns it into ids without adding special tokens twice."""
        return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        # No special tokens: the prompt template says exactly what the model sees.
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


# --------------------------------------------------------------------------- prompt


#: The base-model template: the stored user message (DAPO instruction + problem), a blank line,
#: then "Assistant:" for the model to continue. Base checkpoints and the tiny models have no chat
#: template, and a fixed plain-text frame keeps the prompt tokens identical for the engine and
#: the trainer. The response is everything the model writes after it.
BASE_TEMPLATE = "User: {prompt}\n\nAssistant:"


def prompt_for(tok, user_text: str, plain: str = BASE_TEMPLATE) -> str:
    """The prompt string for one user message: ``tok``'s chat template (with the generation
    prompt) when the tokenizer has one, otherwise ``plain`` (a template with one ``{prompt}``
    field; the character tokenizer has no chat template)."""
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": user_text}])
    return chat_prompt(user_text, plain)


def chat_prompt(problem, template: str = BASE_TEMPLATE) -> str:
    """The prompt string for ``problem`` (a :class:`~isoexec.rl.data.Problem` or its text)."""
    text = problem if isinstance(problem, str) else problem.prompt_text
    fields = {name for _, name, _, _ in string.Formatter().parse(template) if name}
    if fields != {"prompt"}:
        raise ValueError(f"chat_prompt: template must have exactly one field {{prompt}}, has {sorted(fields)}")
    return template.format(prompt=text)
