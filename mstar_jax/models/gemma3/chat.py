"""Gemma 3's text and chat as the server speaks them: the GGUF file's SentencePiece vocabulary
(`Gemma3Tokenizer`); a file without one (the tests' tiny random model names its pieces only) falls
back to greedy longest-match over its pieces. Chat messages become Gemma's template:

    <bos><start_of_turn>user\\n{system}\\n\\n{content}<end_of_turn>\\n<start_of_turn>model\\n

with `assistant` turns as `model` ones; generation stops at `<end_of_turn>` or EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["IncrementalDecoder", "TextTokenizer"]


class TextTokenizer:
    """A Gemma 3 file's text <-> token ids, and its chat template (module doc).

    Args:
      pieces: the vocabulary's pieces, by id.
      bos_id, eos_id: its BOS and EOS.
      sentencepiece: a `Gemma3Tokenizer` over the same vocabulary, or None (longest-match over `pieces`).
    """

    def __init__(self, pieces: Sequence[str], *, bos_id: int, eos_id: int, sentencepiece: Any = None):
        self.pieces = list(pieces)
        self.bos_id, self.eos_id, self._sp = bos_id, eos_id, sentencepiece
        ids = {piece: i for i, piece in enumerate(self.pieces)}
        self.start_of_turn = ids.get("<start_of_turn>")
        self.end_of_turn = ids.get("<end_of_turn>")
        self._control = {i for i, p in enumerate(self.pieces) if p.startswith("<") and p.endswith(">")}
        self._by_text = {p: i for p, i in ids.items() if i not in self._control and p}
        self._longest = max((len(p) for p in self._by_text), default=1)

    @classmethod
    def from_gguf(cls, path: Any) -> TextTokenizer:
        """The tokenizer of the GGUF file at `path` (SentencePiece when the file has its model)."""
        from mstar_jax.models.gemma3.gguf import GGUFError, _field, open_gguf
        from mstar_jax.models.gemma3.tokenizer import Gemma3Tokenizer

        reader = open_gguf(path)
        pieces = [str(p) for p in _field(reader, "tokenizer.ggml.tokens")]
        bos = int(_field(reader, "tokenizer.ggml.bos_token_id"))
        eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
        try:
            sentencepiece = Gemma3Tokenizer.from_gguf(reader)
        except (GGUFError, ValueError):  # a file naming its pieces only: longest match over them
            sentencepiece = None
        return cls(pieces, bos_id=bos, eos_id=eos, sentencepiece=sentencepiece)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """Tokens generation ends at: EOS, and `<end_of_turn>` where the vocabulary has it."""
        return (self.eos_id,) + (() if self.end_of_turn is None else (self.end_of_turn,))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS).

        Raises:
          ValueError: for text the vocabulary cannot spell (only without SentencePiece, which falls back
            to bytes).
        """
        if self._sp is not None:
            return self._sp.encode(text, add_bos=False)
        ids, at = [], 0
        while at < len(text):
            for length in range(min(self._longest, len(text) - at), 0, -1):
                token = self._by_text.get(text[at : at + length])
                if token is not None:
                    ids.append(token)
                    at += length
                    break
            else:
                raise ValueError(f"{text[at]!r} at offset {at} is not in the model's vocabulary")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; control tokens (`<bos>`, `<end_of_turn>`, ...) decode to nothing."""
        if self._sp is not None:
            return self._sp.decode(ids)
        return "".join(self.pieces[i] for i in ids if i not in self._control)

    def chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The prompt of `(role, content)` messages in Gemma's chat template, ending at the model's turn.

        As Gemma 3's own template: a system message may come first only, and opens the first user turn
        (Gemma has no system turn); then turns alternate user, assistant, user, ..., each content
        trimmed, an assistant's as the `model` turn.

        Raises:
          ValueError: for a vocabulary without `<start_of_turn>` and `<end_of_turn>`, a system message
            after the first, or turns that do not alternate starting with the user's.
        """
        if self.start_of_turn is None or self.end_of_turn is None:
            raise ValueError("this model's vocabulary has no <start_of_turn>/<end_of_turn>: no chat template")
        prefix = ""
        if messages and messages[0][0] == "system":
            prefix, messages = f"{messages[0][1]}\n\n", messages[1:]
        ids = [self.bos_id]
        for i, (role, content) in enumerate(messages):
            if (role == "user") != (i % 2 == 0) or role not in ("user", "assistant"):
                raise ValueError(
                    f"message {i + (prefix != '')} has role {role!r}: after an optional first system "
                    "message, roles must alternate user, assistant, user, ..."
                )
            turn = "model" if role == "assistant" else role
            text = f"{turn}\n{prefix if i == 0 else ''}{content.strip()}"
            ids += [self.start_of_turn, *self.encode(text), self.end_of_turn, *self.encode("\n")]
        return [*ids, self.start_of_turn, *self.encode("model\n")]


class IncrementalDecoder:
    """Text of a growing token list, handed out as it becomes final: `push(token)` returns what the new
    token adds (nothing while a multi-byte character is incomplete)."""

    def __init__(self, tokenizer: TextTokenizer):
        self.tokenizer, self.tokens, self.text = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):  # a byte-fallback character still incomplete
            return ""
        new, self.text = text[len(self.text) :], text
        return new
