"""Passkey retrieval (Mohtashami and Jaggi 2023, arXiv 2305.16300; TAPE 4.3, arXiv 2501.00712).

A document, in word and punctuation tokens, is an introduction, filler sentences cycling
through "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back
again.", the line "The pass key is K. Remember it. K is the pass key." inserted after a
fraction ``depth`` of the filler sentences, and the question "What is the pass key? The pass
key is K." at the end. K is uniform in [1, ``max_key``] (50000) and written one digit per
token; the answer digits and the final "." are the scored tokens.

Splits: ``train`` (length ``train_len``, depth uniform) and ``len_<L>`` for every L in
``eval_lengths``, whose element ``i`` has depth ``depths[i % len(depths)]``. A split of length
L holds as many filler sentences as fit in L + 1 tokens with a five-digit key (so the context
is the same for every key), padded on the right for shorter keys.

Metric: the accuracy of the generated key. With teacher forcing, the greedy prediction at
every scored position conditions on the true prefix; a generated answer conditions on its own
earlier outputs, which are the true prefix as long as they are right. So greedy generation
produces exactly the key and its "." iff every scored teacher-forced prediction is right:
``correct`` counts those sequences, per depth (``correct/depth_<d>``; the depth is read back
from where the key line sits). :func:`accuracy_table` gives the [length, depth] array.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from copejax.data import _sequence as seq
from copejax.data.base import Example, Task, TaskSource, register_task

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text . "
    "Find it and memorize it . I will quiz you about the important information there ."
).split()
FILLER = tuple(
    s.split()
    for s in (
        "The grass is green .",
        "The sky is blue .",
        "The sun is yellow .",
        "Here we go .",
        "There and back again .",
    )
)
KEY_LINE = "The pass key is {K} . Remember it . {K} is the pass key .".split()
QUESTION = "What is the pass key ? The pass key is".split()
_WORDS = sorted({*INTRO, *(w for s in FILLER for w in s), *KEY_LINE, *QUESTION} - {"{K}"})
VOCAB = ("<pad>", *"0123456789", *_WORDS)
_ID = {w: i for i, w in enumerate(VOCAB)}
MAX_KEY_DIGITS = 5


def _ids(words: Sequence[str], key: int) -> list[int]:
    out: list[int] = []
    for word in words:
        out += [_ID[d] for d in str(key)] if word == "{K}" else [_ID[word]]
    return out


def depth_key(depth: float) -> str:
    """The metric suffix of ``depth``: ``depth_0``, ``depth_0.25``, ..."""
    return f"depth_{depth:g}"


@register_task
@dataclasses.dataclass(frozen=True)
class Passkey(Task):
    """Find the pass key hidden at some depth of a filler text."""

    name: ClassVar[str] = "passkey"
    paper: ClassVar[str] = "Mohtashami and Jaggi 2023, Landmark Attention, arXiv 2305.16300"

    train_len: int = 256
    eval_lengths: tuple[int, ...] = (256, 512, 1024)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    max_key: int = 50_000
    train_size: int = 1_000_000
    eval_size: int = 100

    def __post_init__(self) -> None:  # lists from a ConfigDict become hashable tuples
        object.__setattr__(self, "eval_lengths", tuple(self.eval_lengths))
        object.__setattr__(self, "depths", tuple(self.depths))

    def validate(self) -> None:
        seq.check_positive(
            max_key=self.max_key, train_size=self.train_size, eval_size=self.eval_size
        )
        if self.max_key >= 10**MAX_KEY_DIGITS:
            raise ValueError(f"max_key must be < {10**MAX_KEY_DIGITS}, got {self.max_key}")
        shortest = self.fixed_tokens() - 1
        for name, lengths in (
            ("train_len", (self.train_len,)),
            ("eval_lengths", self.eval_lengths),
        ):
            for length in lengths:
                if int(length) != length or length < shortest:
                    raise ValueError(
                        f"{name} entries must be integers >= {shortest} (a document with no "
                        f"filler), got {length!r}"
                    )
        if not self.eval_lengths or len(set(self.eval_lengths)) != len(self.eval_lengths):
            raise ValueError(f"eval_lengths must be distinct and not empty: {self.eval_lengths}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths must be a non-empty tuple in [0, 1], got {self.depths}")

    @property
    def vocab(self) -> tuple[str, ...]:
        return VOCAB

    @property
    def seq_len(self) -> int:
        return self.train_len

    def split_len(self, split: str) -> int:
        """Length T of the examples of ``split``."""
        seq.check_split(split, tuple(self.splits()))
        return self.train_len if split == "train" else int(split.removeprefix("len_"))

    def splits(self) -> Mapping[str, int]:
        return {"train": self.train_size, **{f"len_{n}": self.eval_size for n in self.eval_lengths}}

    @staticmethod
    def fixed_tokens() -> int:
        """Tokens of a document with no filler and a five-digit key."""
        return len(_ids([*INTRO, *KEY_LINE, *QUESTION, "{K}", "."], 10**MAX_KEY_DIGITS - 1))

    @staticmethod
    def num_filler(length: int) -> int:
        """Filler sentences in a split of length T = ``length`` (documents of T + 1 tokens)."""
        budget, count = length + 1 - Passkey.fixed_tokens(), 0
        while budget >= len(FILLER[count % len(FILLER)]):
            budget -= len(FILLER[count % len(FILLER)])
            count += 1
        return count

    def source(self, split: str, seed: int) -> TaskSource:
        length = self.split_len(split)
        num_filler = self.num_filler(length)
        if split == "train":
            make = lambda rng, index: self.example(rng, int(rng.integers(num_filler + 1)), length)
        else:
            make = lambda rng, index: self.example(
                rng, round(self.depths[index % len(self.depths)] * num_filler), length
            )
        return seq.SequenceSource(self, split, seed, self.splits()[split], make)

    def example(self, rng: np.random.Generator, before: int, length: int) -> Example:
        """A document with the key line after ``before`` filler sentences, as an Example."""
        key = int(rng.integers(1, self.max_key + 1))
        filler = [FILLER[j % len(FILLER)] for j in range(self.num_filler(length))]
        words = [*INTRO, *(w for s in filler[:before] for w in s), *KEY_LINE]
        words += [*(w for s in filler[before:] for w in s), *QUESTION]
        question = _ids(words, key)
        answer = _ids(["{K}", "."], key)
        scored = [False] * len(question) + [True] * len(answer)
        return seq.to_example(question + answer, scored, length)

    def depth_of(self, inputs_T: np.ndarray) -> float:
        """The configured depth nearest to where the key line sits in ``inputs_T``."""
        start = int(np.argmax(inputs_T == _ID["pass"]))
        periods = int((inputs_T[:start] == _ID["."]).sum()) - INTRO.count(".")
        fraction = periods / max(self.num_filler(len(inputs_T)), 1)
        return self.depths[int(np.argmin([abs(d - fraction) for d in self.depths]))]

    def metrics(self, batch: Example, predictions_BT: np.ndarray) -> dict[str, float]:
        """Sums: ``correct``/``count`` (key exactly generated) and the same per depth."""
        mask_BT = batch["loss_mask"] > 0
        exact_B = ~((predictions_BT != batch["targets"]) & mask_BT).any(axis=-1)
        totals: dict[str, float] = {}
        for row in range(mask_BT.shape[0]):
            if not mask_BT[row].any():
                continue
            depth = depth_key(self.depth_of(batch["inputs"][row]))
            for suffix in ("", "/" + depth):
                totals["correct" + suffix] = totals.get("correct" + suffix, 0.0) + float(
                    exact_B[row]
                )
                totals["count" + suffix] = totals.get("count" + suffix, 0.0) + 1.0
        return totals

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """``accuracy``, ``error`` = 1 - accuracy and ``accuracy/depth_<d>``."""
        accuracy = totals.get("correct", 0.0) / max(totals.get("count", 0.0), 1.0)
        out = {"accuracy": accuracy, "error": 1.0 - accuracy}
        for key, value in totals.items():
            if key.startswith("count/") and value > 0:
                depth = key.removeprefix("count/")
                out[f"accuracy/{depth}"] = float(totals.get(f"correct/{depth}", 0.0)) / value
        return out


def accuracy_table(
    results: Mapping[str, float], lengths: Sequence[int], depths: Sequence[float]
) -> np.ndarray:
    """The [length, depth] accuracy array from the trainer's flat eval results.

    Args:
      results: keys ``eval/len_<L>/accuracy/depth_<d>`` as written by the eval loop.
      lengths: the context lengths L (rows).
      depths: the depths d (columns).

    Returns:
      float [len(lengths), len(depths)], NaN where a cell is missing.
    """
    table = np.full((len(lengths), len(depths)), np.nan)
    for i, length in enumerate(lengths):
        for j, depth in enumerate(depths):
            key = f"eval/len_{length}/accuracy/{depth_key(depth)}"
            if key in results:
                table[i, j] = results[key]
    return table
