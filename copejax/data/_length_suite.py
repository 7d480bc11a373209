"""The shared framing of the length-generalisation suite (Ruoss et al. 2023, arXiv 2305.16843).

Ruoss et al. train on input lengths 1 to 40 and test on longer ones, scoring the output
tokens. Their model is an encoder that reads the input plus one empty query per output token
and emits every output token at once; copejax's model is a causal decoder, so here a task's
document is the input, a separator, then the output::

    x_1 ... x_n <sep> y_1 ... y_m

and the model predicts ``y_1`` from ``<sep>`` and each later ``y_j`` from the true ``y_{j-1}``
(teacher forcing, greedy argmax at evaluation). Only the output tokens are scored; the input
and separator never are. The input length n is the length the protocol talks about.

Splits (each example a pure function of (seed, split, index)):
- ``train``: n uniform in [``min_train_length``, ``max_train_length``], drawn per example
  (their ``UniformCurriculum`` draws one n per batch: the same marginal over n);
- ``test``: in distribution, the same lengths, ``samples_per_length`` each;
- ``long``: n in ``range(test_min_length, test_max_length + 1, test_length_step)``
  (``test_min_length`` 0: ``max_train_length + 1``), ``samples_per_length`` each.
The evaluation splits cycle through their lengths (element i has the (i mod L)-th length), so
any prefix of a split (``eval.max_examples``) covers its lengths evenly. Every example of a
split is padded to the split's longest document, T = max over n of n + (outputs for n).

Metrics: per input length n, sums ``correct/<n>`` and ``count/<n>`` of scored tokens and
``exact/<n>``, ``sequences/<n>`` of whole outputs; :meth:`LengthTask.summarize` gives
``accuracy`` = the per-output-token accuracy of each length averaged over the split's lengths,
``error`` = 1 - accuracy, ``exact_match`` (whole outputs, pooled) and ``accuracy/<n>`` per
length. Their score is the same mean of per-length accuracies (each pooled over the tokens of
a 64-sequence sub-batch, then averaged over sub-batches; here pooled over all sequences of the
length), but ``experiments/example.py`` takes ``accuracies[41:]`` of a list that starts at
length 1, i.e. lengths 42 and up; the ``long`` split starts at 41.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import numpy as np

from copejax.data import _sequence as seq
from copejax.data.base import EXAMPLE_KEYS, Example, Task, TaskSource

SEP_ID = 1  # vocabulary: "<pad>", "<sep>", then the task's symbols
FIRST_SYMBOL_ID = 2
SPLITS = ("train", "test", "long")
# The suite's tasks, one module each in copejax/data (Ruoss et al. 2023's names).
TASKS = (
    "reverse_string",
    "duplicate_string",
    "odds_first",
    "bucket_sort",
    "missing_duplicate",
    "binary_addition",
    "parity_check",
)
_SUMS = ("correct", "count", "exact", "sequences")


@dataclasses.dataclass(frozen=True)
class LengthTask(Task):
    """A task of the suite: subclasses give ``symbols``, :meth:`sample` and
    :meth:`output_length`; this class builds the documents, splits and metrics."""

    symbols: ClassVar[tuple[str, ...]] = ()
    paper: ClassVar[str] = "Ruoss et al. 2023, Randomized positional encodings, arXiv 2305.16843"

    min_train_length: int = 1
    max_train_length: int = 40
    test_min_length: int = 0  # 0: max_train_length + 1
    test_max_length: int = 500
    test_length_step: int = 1
    samples_per_length: int = 64  # theirs: 512 per length
    train_size: int = 100_000_000

    @abc.abstractmethod
    def sample(self, rng: np.random.Generator, length: int) -> tuple[list[int], list[int]]:
        """(input, output) symbol indices (into ``symbols``) of one instance of input length n.

        The input has exactly ``length`` symbols; the output at most ``output_length(length)``.
        """

    @abc.abstractmethod
    def output_length(self, length: int) -> int:
        """The most output symbols an input of ``length`` symbols can have."""

    def validate(self) -> None:
        seq.check_positive(
            min_train_length=self.min_train_length,
            max_train_length=self.max_train_length,
            test_max_length=self.test_max_length,
            test_length_step=self.test_length_step,
            samples_per_length=self.samples_per_length,
            train_size=self.train_size,
        )
        if self.max_train_length < self.min_train_length:
            raise ValueError(
                f"max_train_length={self.max_train_length} must be >= "
                f"min_train_length={self.min_train_length}"
            )
        start = self.test_min_length
        if int(start) != start or start < 0:
            raise ValueError(f"test_min_length must be an integer >= 0, got {start!r}")
        if self.test_max_length < self.first_test_length:
            raise ValueError(
                f"test_max_length={self.test_max_length} must be >= the first test length "
                f"{self.first_test_length} (test_min_length, or max_train_length + 1 for 0)"
            )

    @property
    def vocab(self) -> tuple[str, ...]:
        return ("<pad>", "<sep>", *self.symbols)

    @property
    def first_test_length(self) -> int:
        return self.test_min_length or self.max_train_length + 1

    def lengths(self, split: str) -> tuple[int, ...]:
        """The input lengths n of ``split``, in the order its elements cycle through them."""
        seq.check_split(split, SPLITS)
        if split == "long":
            step = self.test_length_step
            return tuple(range(self.first_test_length, self.test_max_length + 1, step))
        return tuple(range(self.min_train_length, self.max_train_length + 1))

    def split_length(self, split: str) -> int:
        """T of ``split``: its longest document (n + 1 + outputs) minus one."""
        return max(n + self.output_length(n) for n in self.lengths(split))

    @property
    def seq_len(self) -> int:
        return self.split_length("train")

    def splits(self) -> Mapping[str, int]:
        return {
            "train": self.train_size,
            "test": len(self.lengths("test")) * self.samples_per_length,
            "long": len(self.lengths("long")) * self.samples_per_length,
        }

    def source(self, split: str, seed: int) -> TaskSource:
        lengths, size = self.lengths(split), self.split_length(split)
        if split == "train":
            low, high = self.min_train_length, self.max_train_length
            make = lambda rng, index: self.example(rng, int(rng.integers(low, high + 1)), size)
        else:
            make = lambda rng, index: self.example(rng, lengths[index % len(lengths)], size)
        return seq.SequenceSource(self, split, seed, self.splits()[split], make)

    def document(self, rng: np.random.Generator, length: int) -> tuple[list[int], list[bool]]:
        """Token ids of ``input <sep> output`` and which of them are scored (the output)."""
        inputs, outputs = self.sample(rng, length)
        if len(inputs) != length or not 1 <= len(outputs) <= self.output_length(length):
            raise AssertionError(
                f"{self.name}: sample gave {len(inputs)} inputs, {len(outputs)} outputs for "
                f"n={length} (want n inputs, 1..{self.output_length(length)} outputs)"
            )
        doc = [FIRST_SYMBOL_ID + s for s in inputs] + [SEP_ID]
        doc += [FIRST_SYMBOL_ID + s for s in outputs]
        return doc, [False] * (length + 1) + [True] * len(outputs)

    def example(self, rng: np.random.Generator, length: int, size: int) -> Example:
        """One instance of input length ``length`` as an Example of length ``size``."""
        return seq.to_example(*self.document(rng, length), size)

    def decode_example(self, example: Example) -> tuple[list[str], list[str]]:
        """(input symbols, output symbols) of an Example, for tests and inspection."""
        inputs_T = np.asarray(example["inputs"])
        n = int(np.argmax(inputs_T == SEP_ID))
        scored_T = np.asarray(example["loss_mask"]) > 0
        names = self.vocab
        return [names[i] for i in inputs_T[:n]], [
            names[i] for i in np.asarray(example["targets"])[scored_T]
        ]

    def metrics(self, batch: Example, predictions_BT: np.ndarray) -> dict[str, float]:
        """Per input length n: scored-token sums ``correct/<n>``, ``count/<n>`` and
        whole-output sums ``exact/<n>``, ``sequences/<n>``."""
        mask_BT = batch["loss_mask"] > 0
        right_BT = (predictions_BT == batch["targets"]) & mask_BT
        n_B = np.argmax(batch["inputs"] == SEP_ID, axis=-1)
        totals: dict[str, float] = {}
        for row in np.flatnonzero(mask_BT.any(axis=-1)):
            n = int(n_B[row])
            scored, right = int(mask_BT[row].sum()), int(right_BT[row].sum())
            for key, value in zip(_SUMS, (right, scored, float(right == scored), 1.0), strict=True):
                totals[f"{key}/{n}"] = totals.get(f"{key}/{n}", 0.0) + value
        return totals

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """``accuracy`` (per-token, averaged over lengths), ``error``, ``exact_match`` and
        ``accuracy/<n>`` per length."""
        per_length = {
            int(key.removeprefix("count/")): totals.get(f"correct/{key[6:]}", 0.0) / value
            for key, value in totals.items()
            if key.startswith("count/") and value > 0
        }
        accuracy = float(np.mean(list(per_length.values()))) if per_length else 0.0
        exact = sum(v for k, v in totals.items() if k.startswith("exact/"))
        sequences = sum(v for k, v in totals.items() if k.startswith("sequences/"))
        out = {
            "accuracy": accuracy,
            "error": 1.0 - accuracy,
            "exact_match": exact / max(sequences, 1.0),
        }
        out.update({f"accuracy/{n}": per_length[n] for n in sorted(per_length)})
        return out


def repeat_rule_accuracy(task: LengthTask, split: str, seed: int) -> dict[str, float]:
    """:meth:`LengthTask.summarize` of the rule that needs no model: predict each output token
    as the previous true one, which teacher forcing hands to the decoder, and the first output
    token as the split's most frequent first output token.

    Where the output repeats its previous token (``bucket_sort``: right except at the at most
    ``len(symbols) - 1`` places the sorted symbol changes) this scores far above chance, so
    it is the floor a causal decoder's accuracy should be read against.
    """
    source = task.source(split, seed)
    examples = [source[i] for i in range(len(source))]  # each one generated once
    batch = {key: np.stack([e[key] for e in examples]) for key in EXAMPLE_KEYS}
    inputs_BT, targets_BT = batch["inputs"], batch["targets"]
    first_BT = (batch["loss_mask"] > 0) & (inputs_BT == SEP_ID)
    firsts, counts = np.unique(targets_BT[first_BT], return_counts=True)
    predictions_BT = np.where(first_BT, firsts[np.argmax(counts)], inputs_BT)
    return task.summarize(task.metrics(batch, predictions_BT))


def random_symbols(rng: np.random.Generator, length: int, alphabet: int) -> list[int]:
    """``length`` symbols drawn uniformly from ``range(alphabet)``."""
    return [int(s) for s in rng.integers(0, alphabet, size=length)]
