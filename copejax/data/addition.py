"""Multi-digit addition (McLeish et al. 2024, arXiv 2405.17399; as used in TAPE 4.1, 2501.00712).

A document is ``a + b = c <eos>`` in character tokens, every number written least significant
digit first (``123 + 45 = 168`` is ``3 2 1 + 5 4 = 8 6 1 <eos>``). Operands of length L > 1
have a nonzero leading digit. Only the answer digits and the end token are scored (the loss
starts after "="), so a sum is exactly right iff every scored token is.

Splits:
- ``train`` and ``test``: the lengths of a and b are independent and uniform in
  [1, ``max_digits``] (N = 40 in the paper); T = 3 N + 3.
- ``grid``: every pair (len a, len b) in [1, N + ``extra_digits``]^2 with
  ``samples_per_pair`` sums each (paper: 100), ordered so that any prefix of the split covers
  the pairs evenly (element ``i`` has pair ``i % pairs``); T = 3 (N + extra) + 3.

Metrics: ``correct/<la>x<lb>`` and ``count/<la>x<lb>`` sums per length pair (exact match of
the whole answer); :meth:`Addition.summarize` gives ``accuracy`` and ``accuracy/<la>x<lb>``,
and :func:`accuracy_grid` turns the totals into the [la, lb] array a heatmap draws.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from copejax.data import _sequence as seq
from copejax.data.base import Example, Task, TaskSource, register_task

VOCAB = ("<pad>", *"0123456789", "+", "=", "<eos>")
DIGIT0 = 1
PLUS = 11
EQUALS = 12
EOS = 13
_PAIR = re.compile(r"^(correct|count)/(\d+)x(\d+)$")


def digits_lsd_first(value: int) -> list[int]:
    """Token ids of ``value``'s decimal digits, least significant first."""
    return [DIGIT0 + int(ch) for ch in reversed(str(value))]


@register_task
@dataclasses.dataclass(frozen=True)
class Addition(Task):
    """a + b = c, reversed digits, exact-match accuracy per operand-length pair."""

    name: ClassVar[str] = "addition"
    paper: ClassVar[str] = "McLeish et al. 2024, Abacus embeddings, arXiv 2405.17399"

    max_digits: int = 40
    extra_digits: int = 10
    samples_per_pair: int = 10  # the paper: 100
    train_size: int = 20_000_000
    test_size: int = 1_000

    def validate(self) -> None:
        seq.check_positive(
            max_digits=self.max_digits,
            samples_per_pair=self.samples_per_pair,
            train_size=self.train_size,
            test_size=self.test_size,
        )
        if int(self.extra_digits) != self.extra_digits or self.extra_digits < 0:
            raise ValueError(f"extra_digits must be an integer >= 0, got {self.extra_digits!r}")

    @property
    def vocab(self) -> tuple[str, ...]:
        return VOCAB

    @property
    def grid_digits(self) -> int:
        """The longest operand of the ``grid`` split, N + extra."""
        return self.max_digits + self.extra_digits

    def split_len(self, split: str) -> int:
        """Length T of the examples of ``split``: 3 M + 3 for operands of up to M digits."""
        seq.check_split(split, tuple(self.splits()))
        return 3 * (self.grid_digits if split == "grid" else self.max_digits) + 3

    @property
    def seq_len(self) -> int:
        return self.split_len("train")

    def splits(self) -> Mapping[str, int]:
        return {
            "train": self.train_size,
            "test": self.test_size,
            "grid": self.grid_digits**2 * self.samples_per_pair,
        }

    def pair(self, index: int) -> tuple[int, int]:
        """(len a, len b) of element ``index`` of the ``grid`` split."""
        la, lb = divmod(index % self.grid_digits**2, self.grid_digits)
        return la + 1, lb + 1

    def source(self, split: str, seed: int) -> TaskSource:
        length = self.split_len(split)
        if split == "grid":
            make = lambda rng, index: self.example(rng, *self.pair(index), length)
        else:
            make = lambda rng, index: self.example(
                rng, *(int(n) for n in rng.integers(1, self.max_digits + 1, size=2)), length
            )
        return seq.SequenceSource(self, split, seed, self.splits()[split], make)

    @staticmethod
    def operand(rng: np.random.Generator, num_digits: int) -> int:
        """A uniform number with exactly ``num_digits`` digits (0-9 for one digit)."""
        digits = rng.integers(0, 10, size=num_digits)
        if num_digits > 1:
            digits[0] = rng.integers(1, 10)
        return int("".join(map(str, digits)))

    def example(self, rng: np.random.Generator, len_a: int, len_b: int, length: int) -> Example:
        """``a + b = c <eos>`` with operands of ``len_a`` and ``len_b`` digits."""
        a, b = self.operand(rng, len_a), self.operand(rng, len_b)
        question = [*digits_lsd_first(a), PLUS, *digits_lsd_first(b), EQUALS]
        answer = [*digits_lsd_first(a + b), EOS]
        scored = [False] * len(question) + [True] * len(answer)
        return seq.to_example(question + answer, scored, length)

    def metrics(self, batch: Example, predictions_BT: np.ndarray) -> dict[str, float]:
        """Exact-match sums per (len a, len b): ``correct/<la>x<lb>``, ``count/<la>x<lb>``."""
        inputs_BT, mask_BT = batch["inputs"], batch["loss_mask"] > 0
        exact_B = ~((predictions_BT != batch["targets"]) & mask_BT).any(axis=-1)
        totals: dict[str, float] = {}
        for row in range(inputs_BT.shape[0]):
            if not mask_BT[row].any():
                continue
            plus = int(np.argmax(inputs_BT[row] == PLUS))
            equals = int(np.argmax(inputs_BT[row] == EQUALS))
            key = f"{plus}x{equals - plus - 1}"
            totals[f"correct/{key}"] = totals.get(f"correct/{key}", 0.0) + float(exact_B[row])
            totals[f"count/{key}"] = totals.get(f"count/{key}", 0.0) + 1.0
        return totals

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """``accuracy`` over all sums, ``accuracy/<la>x<lb>`` per pair, ``error`` = 1 - accuracy."""
        correct = sum(v for k, v in totals.items() if k.startswith("correct/"))
        count = sum(v for k, v in totals.items() if k.startswith("count/"))
        out = {"accuracy": correct / max(count, 1.0), "error": 1.0 - correct / max(count, 1.0)}
        for key, value in totals.items():
            if key.startswith("count/") and value > 0:
                pair = key.removeprefix("count/")
                out[f"accuracy/{pair}"] = totals.get(f"correct/{pair}", 0.0) / value
        return out


def accuracy_grid(totals: Mapping[str, float], max_digits: int) -> np.ndarray:
    """The heatmap numbers: exact-match accuracy per (len a, len b).

    Args:
      totals: summed :meth:`Addition.metrics` (``correct/<la>x<lb>``, ``count/<la>x<lb>``), or
        the ``accuracy/<la>x<lb>`` entries of :meth:`Addition.summarize`.
      max_digits: M, the grid's longest operand.

    Returns:
      float [M, M] array, entry [la - 1, lb - 1]; NaN where no sum of that pair was seen.
    """
    grid = np.full((max_digits, max_digits), np.nan)
    for key, value in totals.items():
        if key.startswith("accuracy/"):
            la, lb = (int(n) for n in key.removeprefix("accuracy/").split("x"))
            if la <= max_digits and lb <= max_digits:
                grid[la - 1, lb - 1] = value
        match = _PAIR.match(key)
        if match and match.group(1) == "count" and value > 0:
            la, lb = int(match.group(2)), int(match.group(3))
            if la <= max_digits and lb <= max_digits:
                grid[la - 1, lb - 1] = totals.get(f"correct/{la}x{lb}", 0.0) / value
    return grid
