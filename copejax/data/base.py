"""The task interface: every task is a set of named splits of deterministic grain sources.

An example is a dict of NumPy arrays, all of length T (the task's sequence length):

- ``inputs``: int32 token ids fed to the model;
- ``targets``: int32 next-token ids (``targets[t]`` is predicted from ``inputs[: t + 1]``);
- ``loss_mask``: float32, 1 where the target is scored (loss and error), 0 elsewhere;
- ``positions``: int32 position of each token within its document;
- ``segment_ids``: int32 document id (0 for padding), for packed sequences.

Element ``index`` of a split is a pure function of ``(seed, split, index)``, so grain can
shard, shuffle and checkpoint it, and two runs see identical data.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

Example = dict[str, np.ndarray]
EXAMPLE_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


class TaskSource(abc.ABC):
    """A grain ``RandomAccessDataSource``: ``len`` and ``__getitem__`` returning an Example.

    ``__repr__`` must be stable (grain compares it when restoring an iterator).
    """

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __getitem__(self, index: int) -> Example: ...


@dataclasses.dataclass(frozen=True)
class Task(abc.ABC):
    """A task: its options (dataclass fields), vocabulary, splits and metrics."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""

    @abc.abstractmethod
    def validate(self) -> None:
        """Raises ValueError naming the bad option and what is allowed."""

    @property
    @abc.abstractmethod
    def vocab(self) -> tuple[str, ...]:
        """Token strings, index = token id."""

    @property
    @abc.abstractmethod
    def seq_len(self) -> int:
        """Length T of every example of the training split."""

    @abc.abstractmethod
    def splits(self) -> Mapping[str, int]:
        """Split name -> number of examples (``train`` plus the evaluation splits)."""

    @abc.abstractmethod
    def source(self, split: str, seed: int) -> TaskSource:
        """The deterministic source of ``split``."""

    def metrics(self, batch: Example, predictions_BT: np.ndarray) -> dict[str, float]:
        """Sums for the split's metrics from greedy predictions (argmax of the logits).

        Returns sums and counts (``{"errors": ..., "scored": ..., ...}``) so that they add up
        over batches; :meth:`summarize` turns the totals into rates. Default: token errors on
        scored positions and per-sequence glitches (any scored token wrong).
        """
        mask = batch["loss_mask"] > 0
        wrong = (predictions_BT != batch["targets"]) & mask
        seq_has = mask.any(axis=-1)
        return {
            "errors": float(wrong.sum()),
            "scored": float(mask.sum()),
            "glitches": float((wrong.any(axis=-1) & seq_has).sum()),
            "sequences": float(seq_has.sum()),
        }

    def summarize(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Rates from summed :meth:`metrics`: ``error`` (per scored token), ``glitch_rate``."""
        return {
            "error": totals["errors"] / max(totals["scored"], 1.0),
            "glitch_rate": totals["glitches"] / max(totals["sequences"], 1.0),
        }


_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: registers a task under ``cls.name``."""
    _TASKS[cls.name] = cls
    return cls


@functools.cache
def _load_all() -> None:
    import importlib
    import pkgutil

    import copejax.data as package

    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"copejax.data.{info.name}")


def task_names() -> list[str]:
    _load_all()
    return sorted(_TASKS)


def make_task(name: str, options: Mapping[str, Any] | None = None) -> Task:
    """Builds and validates task ``name``; unknown names or options list what is allowed."""
    _load_all()
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(task_names())}")
    cls = _TASKS[name]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options or {}) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for task {name!r}; allowed: {allowed}")
    task = cls(**dict(options or {}))
    task.validate()
    return task
