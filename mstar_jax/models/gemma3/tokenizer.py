"""Gemma 3's tokenizer: the GGUF file's vocabulary loaded into SentencePiece as a BPE model.

The file (`tokenizer.ggml.model = "llama"`) holds a SentencePiece vocabulary: pieces, scores and types,
the types numbered as SentencePiece numbers them. Two edits by llama.cpp's converter are undone so
that SentencePiece accepts and applies the model as Gemma's own `tokenizer.model` does:

- user-defined pieces (runs of spaces, tabs or newlines, HTML tags) had `▁` written as a plain space,
  because llama.cpp matches them against raw text; SentencePiece matches them after its normalizer has
  turned spaces into `▁`, so the `▁` is put back;
- tokens flagged special in Hugging Face's config were all typed CONTROL, `<unk>` included;
  SentencePiece needs the piece at `tokenizer.ggml.unknown_token_id` typed UNKNOWN.

Control pieces (`<bos>`, `<start_of_turn>`, ...) are never produced from text: `encode("<bos>")`
spells the characters out, as llama.cpp does when it tokenizes without parsing special tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mstar_jax.models.gemma3.gguf import GGUFError, _field, _number, open_gguf, require

__all__ = ["Gemma3Tokenizer"]

_SPACE = "▁"  # U+2581, SentencePiece's escaped space


class Gemma3Tokenizer:
    """Text <-> Gemma 3 token ids through SentencePiece (BPE, byte fallback, no normalization).

    Build it with `from_gguf`. Encoding applies no NFKC normalization and adds no dummy prefix: a
    leading space is kept as its own `▁`, whitespace runs and newlines map to their own pieces, and
    characters outside the vocabulary fall back to byte pieces, so `decode(encode(text)) == text`.
    """

    __slots__ = ("_bos_id", "_eos_id", "_processor")

    def __init__(self, processor: Any, *, bos_id: int, eos_id: int):
        """Wrap a loaded `sentencepiece.SentencePieceProcessor` whose BOS and EOS are these ids."""
        self._processor = processor
        self._bos_id = bos_id
        self._eos_id = eos_id

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | Any) -> Gemma3Tokenizer:
        """Build the tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

        Args:
          path: the `.gguf` file, or a `gguf.GGUFReader` already open on it (`open_gguf`).

        Raises:
          ValueError: when the file's tokenizer is not a SentencePiece (`llama`) one, or lacks a key.
          ModuleNotFoundError: when `gguf` or `sentencepiece` is not installed.
        """
        sentencepiece = require("sentencepiece", "the Gemma 3 tokenizer")
        model_pb2 = require("sentencepiece.sentencepiece_model_pb2", "the Gemma 3 tokenizer", "sentencepiece")
        reader = open_gguf(path)
        kind = _field(reader, "tokenizer.ggml.model")
        if kind != "llama":
            raise ValueError(f"tokenizer.ggml.model={kind!r} must be 'llama' (a SentencePiece vocabulary)")
        pieces = _field(reader, "tokenizer.ggml.tokens")
        scores = _field(reader, "tokenizer.ggml.scores")
        types = _field(reader, "tokenizer.ggml.token_type")
        if not len(pieces) == len(scores) == len(types):
            raise ValueError(
                f"tokenizer.ggml.tokens ({len(pieces)}), .scores ({len(scores)}) and .token_type "
                f"({len(types)}) must have one entry per token"
            )
        special = {
            name: _number(reader, f"tokenizer.ggml.{name}_token_id", int)
            for name in ("unknown", "bos", "eos", "padding")
        }
        for name, token_id in special.items():
            if not 0 <= token_id < len(pieces):
                raise ValueError(f"tokenizer.ggml.{name}_token_id={token_id} must be in [0, {len(pieces)})")
        add_space_prefix = _field(reader, "tokenizer.ggml.add_space_prefix", default=False)

        Piece = model_pb2.ModelProto.SentencePiece
        model = model_pb2.ModelProto()
        for token_id, (piece, score, kind_id) in enumerate(zip(pieces, scores, types, strict=True)):
            if kind_id == Piece.USER_DEFINED:
                piece = piece.replace(" ", _SPACE)
            if token_id == special["unknown"]:
                kind_id = Piece.UNKNOWN
            model.pieces.add(piece=piece, score=float(score), type=int(kind_id))
        trainer = model.trainer_spec
        trainer.model_type = model_pb2.TrainerSpec.BPE
        trainer.vocab_size = len(pieces)
        trainer.byte_fallback = True
        for role, name in (("unk", "unknown"), ("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
            setattr(trainer, f"{role}_id", special[name])
            setattr(trainer, f"{role}_piece", pieces[special[name]])
        normalizer = model.normalizer_spec
        normalizer.name = "identity"  # Gemma's model: no NFKC, text is only space-escaped
        normalizer.add_dummy_prefix = bool(add_space_prefix)
        normalizer.remove_extra_whitespaces = False
        normalizer.escape_whitespaces = True
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(model.SerializeToString())
        except RuntimeError as error:  # SentencePiece's own check: a byte piece missing, a piece twice
            raise GGUFError(
                f"GGUF file {reader.data.filename!r}: its vocabulary is not a SentencePiece model ({error})"
            ) from None
        return cls(processor, bos_id=special["bos"], eos_id=special["eos"])

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence token (2 for Gemma 3)."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """End-of-sequence token (1 for Gemma 3)."""
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary; every id is in `[0, vocab_size)`."""
        return self._processor.GetPieceSize()

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, preceded by `bos_id` when `add_bos`.

        Raises:
          TypeError: when `text` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._processor.EncodeAsIds(text)
        return [self._bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; control tokens (BOS, EOS, ...) decode to nothing.

        Raises:
          ValueError: for an id outside `[0, vocab_size)`.
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:8]} must be in [0, vocab_size={self.vocab_size})")
        return self._processor.DecodeIds(ids)
