"""grain pipelines from a task's sources: deterministic per (seed, index), sharded per process.

Training: ``source -> shuffle(seed) -> repeat -> [process::processes] -> batch``. Global batch
``k`` holds examples ``k*B .. (k+1)*B - 1`` of the shuffled stream whatever the number of
processes (process ``p`` takes every ``P``-th one from offset ``p``), so runs on one process and
on several see the same data. The iterator's state (``{"next_index": k}``) is checkpointed with
the model; every epoch is shuffled differently (grain reseeds per epoch). A run resumed with
another number of data workers (or processes) cannot use that state; :func:`seek` moves a
fresh iterator to the batch the restored step reads next.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from copejax.data.base import EXAMPLE_KEYS, Example, Task

# grain's shuffle takes a 32-bit seed; data seeds are derived from the run's seed.
_SEED_MASK = 2**32 - 1


def local_batch_size(global_batch: int, process_count: int) -> int:
    """Rows of the global batch held by each process."""
    if global_batch % process_count:
        raise ValueError(
            f"batch size {global_batch} must be divisible by the number of processes "
            f"{process_count}"
        )
    return global_batch // process_count


def train_dataset(
    task: Task,
    seed: int,
    global_batch: int,
    *,
    shuffle: bool = True,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """The infinite training stream of this process's batches (dicts of (b, T) arrays)."""
    source = task.source("train", seed)
    ds = grain.MapDataset.source(source)
    if shuffle:
        ds = ds.shuffle(seed=seed & _SEED_MASK)
    ds = ds.repeat()[process_index::process_count]
    return ds.batch(local_batch_size(global_batch, process_count), drop_remainder=True)


def train_iterator(
    task: Task,
    seed: int,
    global_batch: int,
    *,
    shuffle: bool = True,
    worker_count: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.DatasetIterator:
    """A checkpointable iterator over :func:`train_dataset` (``get_state``/``set_state``)."""
    ds = train_dataset(
        task,
        seed,
        global_batch,
        shuffle=shuffle,
        process_index=process_index,
        process_count=process_count,
    )
    iter_ds = ds.to_iter_dataset()
    if worker_count > 0:
        iter_ds = iter_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    return iter(iter_ds)


def _prefetch_state(batches: int, worker_count: int) -> dict[str, Any]:
    """The state of :func:`train_iterator` with ``worker_count`` > 0 workers after ``batches``
    batches: grain 0.2's ``mp_prefetch`` interleaves the workers' slices ``i::worker_count``
    round-robin, so worker ``i`` has read ceil((batches - i) / worker_count) of them.
    (grain's own iterator gives the same state: tests/train/test_input_pipeline.py.)"""
    return {
        "next_index_in_cycle": batches % worker_count,
        "next_index_in_datasets": worker_count,
        "iterators_in_use_indices": list(range(worker_count)),
        "iterators_in_use_states": [
            {"next_index": -(-(batches - i) // worker_count)} for i in range(worker_count)
        ],
        "exhausted": [0] * worker_count,
        "future_states": {},
    }


def seek(iterator: grain.DatasetIterator, batches: int, worker_count: int) -> None:
    """Moves a :func:`train_iterator` of ``worker_count`` workers to where it is after reading
    ``batches`` batches (a resumed run's step: every step reads one batch)."""
    if batches < 0:
        raise ValueError(f"batches must be >= 0, got {batches}")
    if worker_count > 0:
        iterator.set_state(_prefetch_state(batches, worker_count))
    else:
        grain.experimental.set_next_index(iterator, batches)


def eval_batches(
    task: Task,
    split: str,
    seed: int,
    global_batch: int,
    *,
    max_examples: int = 0,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[tuple[Example, int]]:
    """Batches of ``split`` in order, each padded to the local batch size.

    Yields ``(batch, real_rows)``: the first ``real_rows`` rows are examples, the rest copies of
    an example with ``loss_mask`` zero, so every batch has one shape and every process yields
    the same number of batches.
    """
    sizes = task.splits()
    if split not in sizes:
        raise ValueError(f"unknown split {split!r} of task {task.name!r}; known: {sorted(sizes)}")
    count = sizes[split] if max_examples <= 0 else min(sizes[split], max_examples)
    source = task.source(split, seed)
    local = local_batch_size(global_batch, process_count)
    mine = list(range(process_index, count, process_count))
    for k in range(math.ceil(count / global_batch)):
        indices = mine[k * local : (k + 1) * local]
        examples = [source[i] for i in indices]
        real = len(examples)
        pad = dict(source[0])
        pad["loss_mask"] = np.zeros_like(pad["loss_mask"])
        examples += [pad] * (local - real)
        yield {key: np.stack([e[key] for e in examples]) for key in EXAMPLE_KEYS}, real
