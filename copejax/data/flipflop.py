"""Flip-Flop language modelling (Liu et al. 2023, arXiv 2306.00946; CoPE 5.1, arXiv 2405.18719).

A sequence is ``num_instructions`` pairs (instruction, bit) with instructions w (write),
r (read), i (ignore); the first is w, the last is r, the others are drawn i.i.d. with
P(i) = p_i and P(w) = P(r) = (1 - p_i) / 2. Bits after w and i are uniform; the bit after r
equals the most recently written bit. 256 instructions make 512 tokens, so T = 511 next-token
predictions. Only the bits after r are scored: ``loss_mask[t] = 1`` exactly where
``inputs[t] == "r"`` (its target is the read bit).

Splits, keyed by p_i: ``train`` and ``test`` (in distribution, p_i = 0.8), ``ood_sparse``
(p_i = 0.98, reads far from their write) and ``ood_dense`` (p_i = 0.1). The authors' sizes are
1.6M train and 16K / 160K / 4K evaluation sequences; the evaluation defaults here are small.

Length generalisation (not in either paper; copejax's study 1 adds it): with
``long_instructions`` > 0, the splits ``long_test`` (p_i = 0.8) and ``long_sparse`` (p_i =
0.98) hold sequences of ``long_instructions`` pairs, longer than training, so that reads sit
at distances and positions never trained on.

Metrics are the base ones, which here are exactly the paper's: ``error`` is the per-read error
rate (scored tokens are the reads) and ``glitch_rate`` the fraction of sequences with any read
wrong.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from copejax.data import _sequence as seq
from copejax.data.base import Example, Task, TaskSource, register_task

VOCAB = ("<pad>", "w", "r", "i", "0", "1")
WRITE = 1
READ = 2
IGNORE = 3
BIT0 = 4


@register_task
@dataclasses.dataclass(frozen=True)
class FlipFlop(Task):
    """FFL(p_i) with a split per p_i; options are the p_i values, length and split sizes."""

    name: ClassVar[str] = "flipflop"
    paper: ClassVar[str] = "Liu et al. 2023, Exposing attention glitches, arXiv 2306.00946"

    num_instructions: int = 256
    p_i: float = 0.8
    p_i_sparse: float = 0.98
    p_i_dense: float = 0.1
    train_size: int = 1_600_000
    test_size: int = 1_000
    ood_sparse_size: int = 1_000
    ood_dense_size: int = 1_000
    long_instructions: int = 0
    long_size: int = 1_000

    def validate(self) -> None:
        seq.check_probability(p_i=self.p_i, p_i_sparse=self.p_i_sparse, p_i_dense=self.p_i_dense)
        seq.check_positive(
            train_size=self.train_size,
            test_size=self.test_size,
            ood_sparse_size=self.ood_sparse_size,
            ood_dense_size=self.ood_dense_size,
            long_size=self.long_size,
        )
        if int(self.num_instructions) != self.num_instructions or self.num_instructions < 2:
            raise ValueError(
                f"num_instructions must be an integer >= 2 (first w, last r), "
                f"got {self.num_instructions!r}"
            )
        long = self.long_instructions
        if int(long) != long or (long != 0 and long <= self.num_instructions):
            raise ValueError(
                f"long_instructions must be 0 (no long splits) or an integer above "
                f"num_instructions={self.num_instructions}, got {long!r}"
            )

    @property
    def vocab(self) -> tuple[str, ...]:
        return VOCAB

    @property
    def seq_len(self) -> int:
        return 2 * self.num_instructions - 1

    def p_ignore(self, split: str) -> float:
        """p_i of ``split``."""
        seq.check_split(split, tuple(self.splits()))
        by_split = {
            "ood_sparse": self.p_i_sparse,
            "long_sparse": self.p_i_sparse,
            "ood_dense": self.p_i_dense,
        }
        return by_split.get(split, self.p_i)

    def split_instructions(self, split: str) -> int:
        """Instructions per sequence of ``split``."""
        seq.check_split(split, tuple(self.splits()))
        return self.long_instructions if split.startswith("long_") else self.num_instructions

    def split_length(self, split: str) -> int:
        """Length T of the examples of ``split``."""
        return 2 * self.split_instructions(split) - 1

    def splits(self) -> Mapping[str, int]:
        splits = {
            "train": self.train_size,
            "test": self.test_size,
            "ood_sparse": self.ood_sparse_size,
            "ood_dense": self.ood_dense_size,
        }
        if self.long_instructions:
            splits.update(long_test=self.long_size, long_sparse=self.long_size)
        return splits

    def source(self, split: str, seed: int) -> TaskSource:
        p_i, n = self.p_ignore(split), self.split_instructions(split)
        make = lambda rng, index: self.example(rng, p_i, n)
        return seq.SequenceSource(self, split, seed, self.splits()[split], make)

    def example(self, rng: np.random.Generator, p_i: float, n: int | None = None) -> Example:
        """One FFL(p_i) sequence of ``2 * n`` tokens (default n: ``num_instructions``)."""
        n = self.num_instructions if n is None else n
        p_wr = (1.0 - p_i) / 2.0
        ops = rng.choice(np.array([WRITE, READ, IGNORE]), size=n, p=[p_wr, p_wr, p_i])
        ops[0], ops[-1] = WRITE, READ
        bits = rng.integers(0, 2, size=n)
        memory = 0
        for j in range(n):
            if ops[j] == WRITE:
                memory = bits[j]
            elif ops[j] == READ:
                bits[j] = memory
        doc = np.stack([ops, BIT0 + bits], axis=1).reshape(-1)
        scored = np.zeros(2 * n, bool)
        scored[1::2] = ops == READ
        return seq.to_example(doc, scored, 2 * n - 1)
