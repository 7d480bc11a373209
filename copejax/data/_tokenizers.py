"""Tokenizers for language modelling: bytes (default) and a BPE trained locally.

Both share the specials ``<pad>`` = 0 (padding), ``<bos>`` = 1 and ``<eos>`` = 2, which open
and close every document. The byte tokenizer maps byte b of the UTF-8 text to id b + 3
(vocabulary 259). The BPE tokenizer is a SentencePiece model (Kudo & Richardson 2018,
arXiv 1808.06226) of type BPE with byte fallback and no normalisation, so decoding inverts
encoding; it is trained on the training documents and saved in a directory.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")
BPE_FILE = "bpe.model"


class Tokenizer(abc.ABC):
    """Text <-> int32 ids; ``vocab`` lists a display string per id."""

    @property
    @abc.abstractmethod
    def vocab(self) -> tuple[str, ...]: ...

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """The ids of ``text`` (no specials), int32 of shape [L]."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of ``ids``; specials are dropped."""

    def encode_document(self, text: str) -> np.ndarray:
        """``<bos>`` + ids + ``<eos>``."""
        return np.concatenate([[BOS_ID], self.encode(text), [EOS_ID]]).astype(np.int32)

    def token_strings(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        """Display string of each id (for plot axes)."""
        return [self.vocab[int(i)] for i in ids]


def _byte_label(b: int) -> str:
    char = chr(b)
    if char == " ":
        return "␣"
    if char == "\n":
        return "⏎"
    return char if 32 < b < 127 else f"<0x{b:02X}>"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: id = byte + 3."""

    @property
    def vocab(self) -> tuple[str, ...]:
        return SPECIALS + tuple(_byte_label(b) for b in range(256))

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + len(SPECIALS)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids_L = np.asarray(ids, np.int64)
        data = (ids_L[ids_L >= len(SPECIALS)] - len(SPECIALS)).astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")


class BpeTokenizer(Tokenizer):
    """A SentencePiece BPE model with byte fallback; ids 0-2 are our specials."""

    def __init__(self, model_file: str | os.PathLike) -> None:
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(model_file))
        self._vocab = tuple(
            SPECIALS[i] if i < len(SPECIALS) else self._sp.id_to_piece(i)
            for i in range(self._sp.get_piece_size())
        )

    @property
    def vocab(self) -> tuple[str, ...]:
        return self._vocab

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._sp.encode(text), np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._sp.decode([int(i) for i in ids if int(i) >= len(SPECIALS)])


def train_bpe(texts: Iterable[str], vocab_size: int, directory: str | os.PathLike) -> Path:
    """Trains a BPE model on ``texts`` and writes ``<directory>/bpe.model``; returns its path.

    Deterministic for the same texts and vocab size (single-threaded training).
    """
    import sentencepiece as spm

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    # One "sentence" per line: SentencePiece cannot hold a newline inside a piece, and lines
    # keep its sentence length limit out of the way. Newlines are learnt by byte fallback.
    lines = (line for text in texts for line in text.splitlines() if line.strip())
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines,
            model_prefix=str(path / BPE_FILE.removesuffix(".model")),
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            split_digits=True,
            character_coverage=1.0,
            pad_id=PAD_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            unk_id=3,
            num_threads=1,
            minloglevel=2,
        )
    except RuntimeError as error:
        # The vocabulary holds 4 specials, 256 byte pieces and every distinct character of the
        # texts, and at most as many merges as the texts offer: both bounds depend on the texts.
        if "ocabulary size" in str(error):
            raise ValueError(
                f"bpe vocab_size {vocab_size} does not fit these training texts: {error}"
            ) from error
        raise
    return path / BPE_FILE


def make_tokenizer(
    kind: str, directory: str = "", texts: Iterable[str] = (), vocab_size: int = 0
) -> Tokenizer:
    """``"byte"``, or ``"bpe"``: loads ``<directory>/bpe.model``, training it first if absent.

    A saved model whose vocabulary is not ``vocab_size`` (when given) is refused, so that the
    model's embedding table always matches the tokenizer.
    """
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        if not directory:
            raise ValueError("tokenizer 'bpe' needs tokenizer_dir (where bpe.model is saved)")
        model = Path(directory) / BPE_FILE
        if not model.exists():
            train_bpe(texts, vocab_size, directory)
        tokenizer = BpeTokenizer(model)
        if vocab_size and len(tokenizer.vocab) != vocab_size:
            raise ValueError(
                f"{model} has a vocabulary of {len(tokenizer.vocab)}, not bpe_vocab_size "
                f"{vocab_size}: use another tokenizer_dir or bpe_vocab_size={len(tokenizer.vocab)}"
            )
        return tokenizer
    raise ValueError(f"unknown tokenizer {kind!r}; allowed: 'byte', 'bpe'")
