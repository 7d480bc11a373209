"""A tiny copy task for the training tests: recall the first half of a random sequence.

Registered as ``tiny_copy`` when imported. Training sequences have T = 12; the ``long`` split
has T = 18 (an evaluation split longer than training, as OOD splits are).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import ml_collections
import numpy as np

from copejax.config.base import base_config
from copejax.data.base import Example, Task, TaskSource, register_task

SPLITS = ("train", "test", "long")


class CopySource(TaskSource):
    def __init__(
        self, size: int, half: int, vocab: int, seed: int, split: str, *, poison: int = -1,
        poison_all: bool = False,
    ) -> None:  # fmt: skip
        self.size, self.half, self.vocab, self.seed, self.split = size, half, vocab, seed, split
        self.poison, self.poison_all = poison, poison_all

    def __repr__(self) -> str:
        return f"CopySource(size={self.size}, half={self.half}, seed={self.seed}, {self.split})"

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Example:
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), index])
        first = rng.integers(1, self.vocab, self.half)
        doc = np.concatenate([first, first])
        length = 2 * self.half - 1
        mask = np.zeros(length, np.float32)
        mask[self.half - 1 :] = 1.0
        if index == self.poison or self.poison_all:
            mask[-1] = np.nan  # a non-finite loss for the batch holding this example
        return {
            "inputs": doc[:-1].astype(np.int32),
            "targets": doc[1:].astype(np.int32),
            "loss_mask": mask,
            "positions": np.arange(length, dtype=np.int32),
            "segment_ids": np.ones(length, np.int32),
        }


@register_task
@dataclasses.dataclass(frozen=True)
class TinyCopy(Task):
    name: ClassVar[str] = "tiny_copy"
    paper: ClassVar[str] = "test task"

    half: int = 6
    vocab_size: int = 8
    train_size: int = 10_000
    poison_index: int = -1  # train example whose loss is NaN (tests of non-finite handling)
    poison_all: bool = False  # every train example's loss is NaN

    def validate(self) -> None:
        if self.half < 2:
            raise ValueError(f"half must be >= 2, got {self.half}")

    @property
    def vocab(self) -> tuple[str, ...]:
        return tuple(str(i) for i in range(self.vocab_size))

    @property
    def seq_len(self) -> int:
        return 2 * self.half - 1

    def splits(self) -> Mapping[str, int]:
        return {"train": self.train_size, "test": 24, "long": 24}

    def source(self, split: str, seed: int) -> TaskSource:
        half = self.half + 3 if split == "long" else self.half
        poison = self.poison_index if split == "train" else -1
        return CopySource(
            self.splits()[split], half, self.vocab_size, seed, split, poison=poison,
            poison_all=self.poison_all and split == "train",
        )  # fmt: skip


def tiny_config(position: str = "rope", **train: object) -> ml_collections.ConfigDict:
    """A seconds-long run of tiny_copy: D=16, 2 heads, 1 layer, batch 8."""
    c = base_config()
    c.task.name = "tiny_copy"
    c.model.update(d_model=16, num_heads=2, num_layers=1, position=position)
    c.train.update(
        steps=6, batch_size=8, learning_rate=1e-2, warmup_steps=2, log_every=1, eval_every=3,
        checkpoint_every=3, keep_checkpoints=5,
    )  # fmt: skip
    c.train.update(train)
    c.eval.update(batch_size=8, max_examples=12)
    return c
