"""Selective copy (Gu and Dao 2023, arXiv 2312.00752; as set up in CoPE 5.2, arXiv 2405.18719).

A document is ``num_tokens`` data tokens with ``num_blanks`` blanks ("_") scattered among them
at uniformly random places, then the separator "=", then the data tokens again in order
without the blanks: ``a _ _ c f _ f _ e = a c f f e``. The model must output the copy; only
the copy is scored (token error rate on the output, and per-sequence glitch rate, which are
the base metrics). The vocabulary has ``vocab_size`` = 16 entries in all: pad, blank,
separator and 13 data tokens.

Splits: ``train`` and ``test`` with 256 blanks, ``ood_dense`` with 128 and ``ood_sparse`` with
512, each around 256 data tokens, so the split lengths T are 768, 768, 640 and 1024
(:meth:`SelectiveCopy.split_len`); :attr:`seq_len` is the training length.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from copejax.data import _sequence as seq
from copejax.data.base import Example, Task, TaskSource, register_task

BLANK = 1
SEPARATOR = 2
FIRST_DATA = 3


@register_task
@dataclasses.dataclass(frozen=True)
class SelectiveCopy(Task):
    """Copy the non-blank tokens; the number of blanks sets the split."""

    name: ClassVar[str] = "selective_copy"
    paper: ClassVar[str] = "Gu and Dao 2023, Mamba, arXiv 2312.00752 (CoPE 5.2)"

    vocab_size: int = 16
    num_tokens: int = 256
    num_blanks: int = 256
    num_blanks_dense: int = 128
    num_blanks_sparse: int = 512
    train_size: int = 1_000_000
    test_size: int = 1_000
    ood_dense_size: int = 1_000
    ood_sparse_size: int = 1_000

    def validate(self) -> None:
        seq.check_positive(
            num_tokens=self.num_tokens,
            train_size=self.train_size,
            test_size=self.test_size,
            ood_dense_size=self.ood_dense_size,
            ood_sparse_size=self.ood_sparse_size,
        )
        for name in ("num_blanks", "num_blanks_dense", "num_blanks_sparse"):
            value = getattr(self, name)
            if int(value) != value or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if int(self.vocab_size) != self.vocab_size or self.vocab_size < FIRST_DATA + 2:
            raise ValueError(
                f"vocab_size must be an integer >= {FIRST_DATA + 2} (pad, blank, separator and "
                f"at least 2 data tokens), got {self.vocab_size!r}"
            )

    @property
    def vocab(self) -> tuple[str, ...]:
        num_data = self.vocab_size - FIRST_DATA
        letters = string.ascii_letters
        data = (
            letters[:num_data] if num_data <= len(letters) else [f"t{j}" for j in range(num_data)]
        )
        return ("<pad>", "_", "=", *data)

    def blanks(self, split: str) -> int:
        """Number of blanks in ``split``."""
        seq.check_split(split, tuple(self.splits()))
        return {"ood_dense": self.num_blanks_dense, "ood_sparse": self.num_blanks_sparse}.get(
            split, self.num_blanks
        )

    def split_len(self, split: str) -> int:
        """Length T of the examples of ``split``."""
        return 2 * self.num_tokens + self.blanks(split)

    @property
    def seq_len(self) -> int:
        return self.split_len("train")

    def splits(self) -> Mapping[str, int]:
        return {
            "train": self.train_size,
            "test": self.test_size,
            "ood_dense": self.ood_dense_size,
            "ood_sparse": self.ood_sparse_size,
        }

    def source(self, split: str, seed: int) -> TaskSource:
        num_blanks = self.blanks(split)
        make = lambda rng, index: self.example(rng, num_blanks)
        return seq.SequenceSource(self, split, seed, self.splits()[split], make)

    def example(self, rng: np.random.Generator, num_blanks: int) -> Example:
        """One document: data with ``num_blanks`` blanks, the separator, the copy."""
        n = self.num_tokens
        data = rng.integers(FIRST_DATA, self.vocab_size, size=n)
        is_blank = np.zeros(n + num_blanks, bool)
        is_blank[rng.choice(n + num_blanks, size=num_blanks, replace=False)] = True
        noisy = np.full(n + num_blanks, BLANK)
        noisy[~is_blank] = data
        doc = np.concatenate([noisy, [SEPARATOR], data])
        scored = np.arange(len(doc)) > n + num_blanks
        return seq.to_example(doc, scored, 2 * n + num_blanks)
