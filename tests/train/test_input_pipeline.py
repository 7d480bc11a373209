"""grain pipelines: determinism, per-process sharding, iterator state, padded eval batches."""

from __future__ import annotations

import numpy as np

from copejax.training import input_pipeline
from tests.train.tiny_task import TinyCopy


def _rows(batch: dict[str, np.ndarray]) -> set[bytes]:
    return {row.tobytes() for row in batch["inputs"]}


def test_processes_share_the_single_process_batches() -> None:
    task = TinyCopy()
    single = input_pipeline.train_iterator(task, 3, 8)
    parts = [
        input_pipeline.train_iterator(task, 3, 8, process_index=p, process_count=2)
        for p in range(2)
    ]
    for _ in range(3):
        whole = next(single)
        halves = [next(it) for it in parts]
        assert all(h["inputs"].shape == (4, task.seq_len) for h in halves)
        assert _rows(whole) == _rows(halves[0]) | _rows(halves[1])
        assert len(_rows(whole)) == 8


def test_shuffle_seed_and_iterator_state() -> None:
    task = TinyCopy(train_size=20)
    a = input_pipeline.train_iterator(task, 0, 4)
    b = input_pipeline.train_iterator(task, 1, 4)
    assert not np.array_equal(next(a)["inputs"], next(b)["inputs"])
    for _ in range(3):
        next(a)
    state = a.get_state()
    expected = [next(a)["inputs"] for _ in range(3)]
    restored = input_pipeline.train_iterator(task, 0, 4)
    restored.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(restored)["inputs"], want)
    # every epoch is a permutation of the 20 examples, shuffled differently each epoch
    epoch = input_pipeline.train_iterator(task, 0, 4)
    seen = [next(epoch)["inputs"] for _ in range(10)]
    assert len(_rows({"inputs": np.concatenate(seen[:5])})) == 20
    assert not np.array_equal(np.concatenate(seen[:5]), np.concatenate(seen[5:]))


def test_eval_batches_are_padded_and_complete() -> None:
    task = TinyCopy()
    source = task.source("long", 0)
    got = list(input_pipeline.eval_batches(task, "long", 0, 8, max_examples=11))
    assert [real for _, real in got] == [8, 3]
    assert all(b["inputs"].shape == (8, 17) for b, _ in got)
    last, real = got[-1]
    assert last["loss_mask"][real:].sum() == 0
    for i in range(11):
        np.testing.assert_array_equal(got[i // 8][0]["inputs"][i % 8], source[i]["inputs"])
