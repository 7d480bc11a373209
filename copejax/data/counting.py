"""The counting task of CoPE section 5.3 (Golovneva et al. 2024, arXiv 2405.18719).

A program over ``num_vars`` variables (a, b, c, ...) in whitespace-separated tokens::

    a = 0 ; b = 0 ; pass ; a ++ ; pass ; b = 0 ; a ++ ; pass ; print a 2

It starts by setting every variable to 0, then runs a number of operations drawn uniformly in
[``min_ops``, ``max_ops``] (paper: up to 512), each "v = 0", "v ++" or "pass" with weights
``w_set`` : ``w_incr`` : ``w_pass`` = 1 : 7 : 50 and the variable uniform. Values never exceed
``max_value`` (10): an increment past it is redrawn. The program ends with ``print v`` for a
uniform variable, followed by its value, the one scored token (error on the answer only).

Splits: ``train`` (the paper's 10K sequences) and ``test`` with ``w_pass``; out of
distribution ``ood_long`` (``w_pass_long`` = 100: longer relevant context) and ``ood_short``
(``w_pass_short`` = 10).

Context: a program takes up to 4 tokens per operation, so 512 operations can exceed a model's
context. With ``max_len`` = T > 0, examples have length T and a longer program is truncated from
the left, as in the paper's setup: its first tokens are dropped, positions restart at 0, and the
final print and answer are always kept (the last set of the printed variable may then be cut
off). With ``max_len`` = 0, T is the longest possible program and nothing is cut.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from copejax.data import _sequence as seq
from copejax.data.base import Example, Task, TaskSource, register_task

KEYWORDS = ("<pad>", ";", "pass", "=", "++", "print")
SEMI = 1
PASS = 2
ASSIGN = 3
INCR = 4
PRINT = 5
# Operation kinds, in the order of the weights
SET = 0
INCREMENT = 1
NOTHING = 2


@register_task
@dataclasses.dataclass(frozen=True)
class Counting(Task):
    """Count increments since the last set of the printed variable."""

    name: ClassVar[str] = "counting"
    paper: ClassVar[str] = "Golovneva et al. 2024, Contextual Position Encoding, arXiv 2405.18719"

    num_vars: int = 1
    min_ops: int = 1
    max_ops: int = 512
    max_value: int = 10
    w_set: float = 1.0
    w_incr: float = 7.0
    w_pass: float = 50.0
    w_pass_long: float = 100.0
    w_pass_short: float = 10.0
    max_len: int = 0
    train_size: int = 10_000
    test_size: int = 1_000
    ood_long_size: int = 1_000
    ood_short_size: int = 1_000

    def validate(self) -> None:
        seq.check_positive(
            num_vars=self.num_vars,
            min_ops=self.min_ops,
            max_ops=self.max_ops,
            max_value=self.max_value,
            train_size=self.train_size,
            test_size=self.test_size,
            ood_long_size=self.ood_long_size,
            ood_short_size=self.ood_short_size,
        )
        if self.num_vars > len(string.ascii_lowercase):
            raise ValueError(f"num_vars must be in [1, 26], got {self.num_vars!r}")
        if self.min_ops > self.max_ops:
            raise ValueError(f"min_ops ({self.min_ops}) must be <= max_ops ({self.max_ops})")
        if self.w_set < 0 or self.w_incr <= 0:
            raise ValueError(f"need w_set >= 0 and w_incr > 0, got {self.w_set}, {self.w_incr}")
        for name in ("w_pass", "w_pass_long", "w_pass_short"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if int(self.max_len) != self.max_len or self.max_len < 0 or 0 < self.max_len < 3:
            raise ValueError(
                f"max_len must be 0 (no truncation) or an integer >= 3, got {self.max_len!r}"
            )

    @property
    def variables(self) -> tuple[str, ...]:
        return tuple(string.ascii_lowercase[: self.num_vars])

    @property
    def vocab(self) -> tuple[str, ...]:
        return (*KEYWORDS, *self.variables, *(str(v) for v in range(self.max_value + 1)))

    def var_id(self, j: int) -> int:
        return len(KEYWORDS) + j

    def value_id(self, value: int) -> int:
        return len(KEYWORDS) + self.num_vars + value

    @property
    def seq_len(self) -> int:
        if self.max_len:
            return self.max_len
        return 4 * (self.num_vars + self.max_ops) + 3 - 1  # longest program, minus one

    def pass_weight(self, split: str) -> float:
        """The weight of "pass" in ``split``."""
        seq.check_split(split, tuple(self.splits()))
        return {"ood_long": self.w_pass_long, "ood_short": self.w_pass_short}.get(
            split, self.w_pass
        )

    def splits(self) -> Mapping[str, int]:
        return {
            "train": self.train_size,
            "test": self.test_size,
            "ood_long": self.ood_long_size,
            "ood_short": self.ood_short_size,
        }

    def source(self, split: str, seed: int) -> TaskSource:
        w_pass = self.pass_weight(split)
        make = lambda rng, index: self.example(rng, w_pass)
        return seq.SequenceSource(self, split, seed, self.splits()[split], make)

    def program(self, rng: np.random.Generator, w_pass: float) -> tuple[list[int], int]:
        """Token ids of one program including the answer, and the answer's value."""
        weights = np.array([self.w_set, self.w_incr, w_pass], np.float64)
        weights /= weights.sum()
        values = [0] * self.num_vars
        doc: list[int] = []
        for j in range(self.num_vars):
            doc += [self.var_id(j), ASSIGN, self.value_id(0), SEMI]
        num_ops = int(rng.integers(self.min_ops, self.max_ops + 1))
        candidates: list[tuple[int, int]] = []  # (kind, variable), drawn in bulk for speed
        for _ in range(num_ops):
            while True:
                if not candidates:
                    kinds = rng.choice(3, size=num_ops + 16, p=weights)
                    variables = rng.integers(self.num_vars, size=num_ops + 16)
                    candidates = list(zip(kinds.tolist(), variables.tolist(), strict=True))[::-1]
                kind, j = candidates.pop()
                if kind != INCREMENT or values[j] < self.max_value:
                    break
            if kind == SET:
                values[j] = 0
                doc += [self.var_id(j), ASSIGN, self.value_id(0), SEMI]
            elif kind == INCREMENT:
                values[j] += 1
                doc += [self.var_id(j), INCR, SEMI]
            else:
                doc += [PASS, SEMI]
        j = int(rng.integers(self.num_vars))
        doc += [PRINT, self.var_id(j), self.value_id(values[j])]
        return doc, values[j]

    def example(self, rng: np.random.Generator, w_pass: float) -> Example:
        """One program as an Example; only the printed value is scored."""
        doc, _ = self.program(rng, w_pass)
        scored = np.zeros(len(doc), bool)
        scored[-1] = True
        return seq.to_example(doc, scored, self.seq_len, truncate_left=True)

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """``error``: the fraction of wrong answers (one scored token per program)."""
        return {"error": totals["errors"] / max(totals["scored"], 1.0)}
