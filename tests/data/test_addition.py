"""Addition data: recompute every sum from the decoded digit strings."""

from __future__ import annotations

import numpy as np
import pytest

from copejax.data.addition import accuracy_grid
from copejax.data.base import EXAMPLE_KEYS, make_task

SMALL = {"max_digits": 6, "extra_digits": 2, "samples_per_pair": 3}


def parse(task, example: dict) -> tuple[str, str, str, int]:
    """(a, b, c) as written (least significant digit first) and the index of '='."""
    real = example["segment_ids"] > 0
    ids = [*example["inputs"][real].tolist(), int(example["targets"][real][-1])]
    text = "".join(task.vocab[i] if task.vocab[i] != "<eos>" else "$" for i in ids)
    assert text.endswith("$") and text.count("$") == 1
    question, answer = text[:-1].split("=")
    a, b = question.split("+")
    return a, b, answer, text.index("=")


def check_sum(a: str, b: str, c: str) -> None:
    for number in (a, b, c):
        assert number.isdigit()
        assert len(number) == 1 or number[-1] != "0"  # no leading zero (written last)
    assert int(a[::-1]) + int(b[::-1]) == int(c[::-1])


@pytest.mark.parametrize("split", ["train", "test", "grid"])
def test_sums_are_right_and_masks_exact(split: str) -> None:
    task = make_task("addition", SMALL)
    source = task.source(split, seed=1)
    length = task.split_len(split)
    assert length == 3 * (8 if split == "grid" else 6) + 3
    for index in range(min(len(source), 150)):
        ex = source[index]
        assert all(ex[k].shape == (length,) for k in EXAMPLE_KEYS)
        a, b, c, equals = parse(task, ex)
        check_sum(a, b, c)
        limit = 8 if split == "grid" else 6
        assert 1 <= len(a) <= limit and 1 <= len(b) <= limit
        if split == "grid":
            assert (len(a), len(b)) == task.pair(index)
        # scored: the positions from '=' on, predicting the answer digits and <eos>
        expected = np.zeros(length, np.float32)
        expected[equals : equals + len(c) + 1] = 1.0
        np.testing.assert_array_equal(ex["loss_mask"], expected)
        real = ex["segment_ids"][1:] > 0
        np.testing.assert_array_equal(ex["targets"][:-1][real], ex["inputs"][1:][real])


def test_grid_covers_every_pair_evenly() -> None:
    task = make_task("addition", SMALL)
    assert task.splits()["grid"] == 64 * 3
    pairs = [task.pair(i) for i in range(task.splits()["grid"])]
    assert sorted(set(pairs)) == [(i, j) for i in range(1, 9) for j in range(1, 9)]
    assert all(pairs.count(p) == 3 for p in set(pairs))
    assert sorted(pairs[:64]) == sorted(set(pairs))  # any 64-prefix covers every pair


def test_train_lengths_uniform() -> None:
    task = make_task("addition", SMALL)
    source = task.source("train", seed=0)
    lengths = np.array([[len(x) for x in parse(task, source[i])[:2]] for i in range(600)])
    freq = np.bincount(lengths.ravel(), minlength=7)[1:] / lengths.size
    assert np.all(np.abs(freq - 1 / 6) < 5 * np.sqrt((1 / 6) * (5 / 6) / lengths.size))


def test_deterministic_and_varied() -> None:
    task = make_task("addition", SMALL)
    a, b = task.source("grid", seed=3), task.source("grid", seed=3)
    for key in EXAMPLE_KEYS:
        np.testing.assert_array_equal(a[10][key], b[10][key])
    assert not np.array_equal(a[10]["inputs"], a[10 + 64]["inputs"])  # same pair, new sample
    assert not np.array_equal(a[10]["inputs"], task.source("grid", seed=4)[10]["inputs"])


def test_metrics_exact_match_per_pair_and_grid() -> None:
    task = make_task("addition", SMALL)
    source = task.source("grid", seed=0)
    batch = {k: np.stack([source[i][k] for i in range(128)]) for k in EXAMPLE_KEYS}
    perfect = np.where(batch["loss_mask"] > 0, batch["targets"], 0)
    summary = task.summarize(task.metrics(batch, perfect))
    assert summary["accuracy"] == 1.0 and summary["error"] == 0.0
    grid = accuracy_grid(summary, 8)
    np.testing.assert_array_equal(grid, np.ones((8, 8)))
    # break one answer digit of every sum with len a = 2 and len b = 5 (rows 12 and 76)
    corrupted = perfect.copy()
    for row in (12, 76):
        assert task.pair(row) == (2, 5)
        t = np.flatnonzero(batch["loss_mask"][row])[-1]  # the <eos> prediction
        corrupted[row, t] = 1
    totals = task.metrics(batch, corrupted)
    assert totals["count/2x5"] == 2 and totals["correct/2x5"] == 0
    summary = task.summarize(totals)
    assert summary["accuracy/2x5"] == 0.0 and summary["accuracy/5x2"] == 1.0
    assert summary["accuracy"] == pytest.approx(126 / 128)
    expected = np.ones((8, 8))
    expected[1, 4] = 0.0
    np.testing.assert_array_equal(accuracy_grid(totals, 8), expected)
    np.testing.assert_array_equal(accuracy_grid(summary, 8), expected)
    assert np.isnan(accuracy_grid(task.metrics(batch, perfect), 9)[8, 8])


@pytest.mark.parametrize(
    "options",
    [{"max_digits": 0}, {"extra_digits": -1}, {"samples_per_pair": 0}, {"test_size": -2}],
)
def test_bad_options_raise(options: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        make_task("addition", options)


def test_unknown_split() -> None:
    with pytest.raises(ValueError, match="ood"):
        make_task("addition", SMALL).source("ood", seed=0)
