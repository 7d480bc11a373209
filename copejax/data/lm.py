"""Language modelling on real text, with length-extrapolation splits (CoPE 5.4-5.5, arXiv
2405.18719; Press et al. 2021, ALiBi, arXiv 2108.12409, for evaluating past the training length).

Documents come from a corpus (``corpus`` option; see ``copejax/data/_corpora.py`` for the
corpora, their sizes, licences and the document-level split), are tokenized (bytes by default,
or a BPE trained locally on the training documents and saved in ``tokenizer_dir``) and packed
into rows of T = ``length`` predictions with per-document positions and segment ids (see
``copejax/data/_packing.py``).

Splits: ``train``, ``valid`` and ``test`` at length T, and ``valid_x2``, ``valid_x4``,
``valid_x8`` (the factors of ``extrapolation``): the validation documents packed at 2T, 4T, 8T
for perplexity past the training length (CoPE Figure 3). Every split is fixed (no random
draw): ``seed`` does not change it, and the trainer shuffles the training rows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from copejax.data import _corpora, _packing
from copejax.data import _tokenizers as tok
from copejax.data.base import Example, Task, TaskSource, register_task


class LMSource(TaskSource):
    """Rows of one packed split; element ``index`` is row ``index``."""

    def __init__(self, owner: object, split: str, packing: _packing.Packing) -> None:
        self._owner, self._split, self._packing = owner, split, packing

    def __len__(self) -> int:
        return self._packing.num_rows

    def __getitem__(self, index: int) -> Example:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for split {self._split!r} of {len(self)}")
        return self._packing.example(index)

    def __repr__(self) -> str:
        return f"LMSource({self._owner!r}, split={self._split!r})"


@register_task
@dataclasses.dataclass(frozen=True)
class LanguageModel(Task):
    """Next-token prediction on a text corpus; see the module docstring."""

    name: ClassVar[str] = "lm"
    paper: ClassVar[str] = "Golovneva et al. 2024, Contextual Position Encoding, arXiv 2405.18719"

    corpus: str = "shakespeare"
    length: int = 256
    tokenizer: str = "byte"
    tokenizer_dir: str = ""
    bpe_vocab_size: int = 1024
    data_dir: str = ""
    tfds_split: str = "train"
    text_feature: str = "text"
    valid_fraction: float = 0.05
    test_fraction: float = 0.05
    max_documents: int = 0
    extrapolation: tuple[int, ...] = (2, 4, 8)

    def __post_init__(self) -> None:
        object.__setattr__(self, "extrapolation", tuple(int(f) for f in self.extrapolation))

    def validate(self) -> None:
        if int(self.length) != self.length or self.length < 1:
            raise ValueError(f"length must be a positive integer, got {self.length!r}")
        if self.tokenizer not in ("byte", "bpe"):
            raise ValueError(f"tokenizer must be 'byte' or 'bpe', got {self.tokenizer!r}")
        if self.tokenizer == "bpe" and not self.tokenizer_dir:
            raise ValueError("tokenizer='bpe' needs tokenizer_dir (where bpe.model is saved)")
        if self.tokenizer == "bpe" and self.bpe_vocab_size < 260:
            raise ValueError(
                f"bpe_vocab_size must be >= 260 (specials + 256 byte pieces), "
                f"got {self.bpe_vocab_size!r}"
            )
        for key in ("valid_fraction", "test_fraction"):
            if not 0.0 <= getattr(self, key) < 0.5:
                raise ValueError(f"{key} must be in [0, 0.5), got {getattr(self, key)!r}")
        if self.max_documents < 0:
            raise ValueError(f"max_documents must be >= 0 (0 = all), got {self.max_documents!r}")
        if any(f < 2 for f in self.extrapolation):
            raise ValueError(
                f"extrapolation factors must be integers >= 2, got {self.extrapolation}"
            )
        kind = self.corpus.partition(":")[0]
        if self.corpus not in ("shakespeare", "stdlib") and kind not in ("tfds", "files"):
            raise ValueError(
                f"unknown corpus {self.corpus!r}; allowed: 'shakespeare', 'stdlib', "
                "'tfds:<name>', 'files:<glob>'"
            )

    def documents(self) -> dict[str, list[_corpora.Document]]:
        """The corpus's (name, text) documents of each of ``train``, ``valid``, ``test``."""
        return _split_documents(self)

    def text_tokenizer(self) -> tok.Tokenizer:
        """The tokenizer (a BPE is trained on the training documents the first time)."""
        return _tokenizer(self)

    @property
    def vocab(self) -> tuple[str, ...]:
        return self.text_tokenizer().vocab

    @property
    def seq_len(self) -> int:
        return self.length

    def split_length(self, split: str) -> int:
        """Row length of ``split``: T, or factor * T for ``valid_x<factor>``."""
        if split in ("train", "valid", "test"):
            return self.length
        factor = split.removeprefix("valid_x")
        if split.startswith("valid_x") and factor.isdigit() and int(factor) in self.extrapolation:
            return int(factor) * self.length
        raise ValueError(f"unknown split {split!r}; allowed splits: {list(self.split_names())}")

    def split_names(self) -> tuple[str, ...]:
        return ("train", "valid", "test", *(f"valid_x{f}" for f in self.extrapolation))

    def splits(self) -> Mapping[str, int]:
        return {split: self.packing(split).num_rows for split in self.split_names()}

    def packing(self, split: str) -> _packing.Packing:
        """The packed rows of ``split``."""
        return _packing_of(self, split)

    def source(self, split: str, seed: int) -> TaskSource:
        return LMSource(self, split, self.packing(split))

    def metrics(self, batch: Example, predictions_BT: np.ndarray) -> dict[str, float]:
        """Next-token errors on scored tokens (a glitch rate means nothing for free text)."""
        mask = batch["loss_mask"] > 0
        wrong = (predictions_BT != batch["targets"]) & mask
        return {"errors": float(wrong.sum()), "scored": float(mask.sum())}

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """``error``: the fraction of scored next tokens the argmax gets wrong."""
        return {"error": totals["errors"] / max(totals["scored"], 1.0)}


@functools.cache
def _split_documents(task: LanguageModel) -> dict[str, list[_corpora.Document]]:
    docs = _corpora.load_documents(task.corpus, task.data_dir, task.tfds_split, task.text_feature)
    if task.max_documents:
        docs = docs[: task.max_documents]
    return _corpora.split_documents(docs, task.valid_fraction, task.test_fraction)


@functools.cache
def _tokenizer(task: LanguageModel) -> tok.Tokenizer:
    texts = ()
    if task.tokenizer == "bpe":
        texts = (text for _, text in _split_documents(task)["train"])
    return tok.make_tokenizer(task.tokenizer, task.tokenizer_dir, texts, task.bpe_vocab_size)


@functools.cache
def _tokenized(task: LanguageModel, split: str) -> tuple[np.ndarray, ...]:
    tokenizer = _tokenizer(task)
    return tuple(tokenizer.encode_document(text) for _, text in _split_documents(task)[split])


@functools.cache
def _packing_of(task: LanguageModel, split: str) -> _packing.Packing:
    length = task.split_length(split)
    docs_split = split if split in ("train", "test") else "valid"
    return _packing.pack(list(_tokenized(task, docs_split)), length)
