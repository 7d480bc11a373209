"""Flip-Flop data: an independent register simulation over the decoded token strings."""

from __future__ import annotations

import numpy as np
import pytest

from copejax.data.base import EXAMPLE_KEYS, make_task

SPLITS = ("train", "test", "ood_sparse", "ood_dense")


def decode(task, ids: np.ndarray) -> list[str]:
    return [task.vocab[i] for i in ids]


def document(example: dict) -> list[int]:
    """inputs plus the last target: the whole 2n-token string."""
    return [*example["inputs"].tolist(), int(example["targets"][-1])]


def check_flipflop(tokens: list[str]) -> list[int]:
    """Re-simulates the register; returns the indices (into tokens) of read bits."""
    assert len(tokens) % 2 == 0
    assert tokens[0] == "w" and tokens[-2] == "r"
    memory = None
    reads = []
    for j in range(0, len(tokens), 2):
        op, bit = tokens[j], tokens[j + 1]
        assert op in ("w", "r", "i") and bit in ("0", "1")
        if op == "w":
            memory = bit
        elif op == "r":
            assert bit == memory
            reads.append(j + 1)
    return reads


def test_sequences_are_valid_and_masks_exact() -> None:
    task = make_task("flipflop", {"num_instructions": 64})
    for split in SPLITS:
        source = task.source(split, seed=3)
        for index in range(50):
            ex = source[index]
            assert set(ex) == set(EXAMPLE_KEYS)
            assert all(ex[k].shape == (task.seq_len,) for k in EXAMPLE_KEYS)
            assert ex["inputs"].dtype == np.int32 and ex["loss_mask"].dtype == np.float32
            tokens = decode(task, np.asarray(document(ex)))
            reads = check_flipflop(tokens)
            # targets are inputs shifted by one
            np.testing.assert_array_equal(ex["targets"][:-1], ex["inputs"][1:])
            # mask is 1 exactly at positions t whose target (token t + 1) is a read bit
            expected = np.zeros(task.seq_len, np.float32)
            expected[np.asarray(reads) - 1] = 1.0
            np.testing.assert_array_equal(ex["loss_mask"], expected)
            assert all(tokens[t] == "r" for t in np.flatnonzero(ex["loss_mask"]))
            np.testing.assert_array_equal(ex["positions"], np.arange(task.seq_len))
            np.testing.assert_array_equal(ex["segment_ids"], np.ones(task.seq_len))


@pytest.mark.parametrize(
    ("split", "p_i"), [("train", 0.8), ("ood_sparse", 0.98), ("ood_dense", 0.1)]
)
def test_instruction_proportions(split: str, p_i: float) -> None:
    task = make_task("flipflop", {"num_instructions": 128})
    source = task.source(split, seed=0)
    counts = {"w": 0, "r": 0, "i": 0}
    for index in range(80):
        tokens = decode(task, np.asarray(document(source[index])))
        for op in tokens[2:-2:2]:  # the i.i.d. instructions (first w and last r are fixed)
            counts[op] += 1
    total = sum(counts.values())
    # binomial standard error is at most 0.5 / sqrt(total) ~ 0.005; allow 5 of them
    tolerance = 5 * 0.5 / np.sqrt(total)
    assert abs(counts["i"] / total - p_i) < tolerance
    assert abs(counts["w"] / total - (1 - p_i) / 2) < tolerance
    assert abs(counts["r"] / total - (1 - p_i) / 2) < tolerance


def test_full_length_default() -> None:
    task = make_task("flipflop")
    assert task.seq_len == 511
    ex = task.source("test", seed=0)[0]
    assert len(document(ex)) == 512


def test_deterministic_per_seed_and_index() -> None:
    task = make_task("flipflop", {"num_instructions": 32})
    a = task.source("train", seed=1)
    b = task.source("train", seed=1)
    for index in (0, 7, 99):
        for key in EXAMPLE_KEYS:
            np.testing.assert_array_equal(a[index][key], b[index][key])
    assert not np.array_equal(a[0]["inputs"], a[1]["inputs"])
    assert not np.array_equal(a[0]["inputs"], task.source("train", seed=2)[0]["inputs"])
    assert not np.array_equal(a[0]["inputs"], task.source("test", seed=1)[0]["inputs"])
    assert repr(a) == repr(b) and repr(a) != repr(task.source("test", seed=1))
    assert len(a) == task.train_size


def test_metrics_perfect_and_corrupted() -> None:
    task = make_task("flipflop", {"num_instructions": 32})
    source = task.source("test", seed=0)
    batch = {k: np.stack([source[i][k] for i in range(8)]) for k in EXAMPLE_KEYS}
    perfect = batch["targets"].copy()
    summary = task.summarize(task.metrics(batch, perfect))
    assert summary == {"error": 0.0, "glitch_rate": 0.0}
    # flip one read bit in sequences 0 and 3, and two in sequence 5; corrupt unscored tokens too
    corrupted = perfect.copy()
    flips = []
    for row, count in ((0, 1), (3, 1), (5, 2)):
        reads = np.flatnonzero(batch["loss_mask"][row])[:count]
        flips.extend((row, t) for t in reads)
    for row, t in flips:
        corrupted[row, t] = 9 - corrupted[row, t]  # "0" (4) <-> "1" (5)
    corrupted[batch["loss_mask"] == 0] = 0
    totals = task.metrics(batch, corrupted)
    reads = batch["loss_mask"].sum()
    assert totals["errors"] == 4 and totals["scored"] == reads
    summary = task.summarize(totals)
    assert summary["error"] == pytest.approx(4 / reads)
    assert summary["glitch_rate"] == pytest.approx(3 / 8)


@pytest.mark.parametrize(
    "options",
    [
        {"p_i": 1.0},
        {"p_i": -0.1},
        {"p_i_sparse": 1.5},
        {"p_i_dense": -1.0},
        {"num_instructions": 0},
        {"num_instructions": 1},
        {"test_size": 0},
        {"train_size": -5},
    ],
)
def test_bad_options_raise(options: dict) -> None:
    name = next(iter(options))
    with pytest.raises(ValueError, match=name):
        make_task("flipflop", options)


def test_unknown_split_and_index() -> None:
    task = make_task("flipflop", {"num_instructions": 8, "test_size": 3})
    with pytest.raises(ValueError, match="valid"):
        task.source("valid", seed=0)
    with pytest.raises(IndexError):
        task.source("test", seed=0)[3]


def test_long_splits_are_longer_valid_sequences() -> None:
    task = make_task("flipflop", {"num_instructions": 16, "long_instructions": 48})
    assert set(task.splits()) == {*SPLITS, "long_test", "long_sparse"}
    for split, p_i in (("long_test", 0.8), ("long_sparse", 0.98)):
        assert task.p_ignore(split) == p_i
        assert task.split_length(split) == 95
        source = task.source(split, seed=2)
        ops = []
        for index in range(40):
            ex = source[index]
            assert all(ex[k].shape == (95,) for k in EXAMPLE_KEYS)
            tokens = decode(task, np.asarray(document(ex)))
            reads = check_flipflop(tokens)
            assert np.flatnonzero(ex["loss_mask"]).tolist() == [r - 1 for r in reads]
            ops += tokens[2:-2:2]
        assert abs(ops.count("i") / len(ops) - p_i) < 5 * 0.5 / np.sqrt(len(ops))
    assert task.split_length("test") == task.seq_len == 31
    assert "long_test" not in make_task("flipflop", {"num_instructions": 16}).splits()


@pytest.mark.parametrize("long", [8, 16, 2.5])
def test_long_instructions_must_exceed_training(long: float) -> None:
    with pytest.raises(ValueError, match=rf"long_instructions must be 0 .* got {long}"):
        make_task("flipflop", {"num_instructions": 16, "long_instructions": long})
