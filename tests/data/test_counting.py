"""Counting data: an independent interpreter of the whitespace-separated program text."""

from __future__ import annotations

import numpy as np
import pytest

from copejax.data.base import EXAMPLE_KEYS, make_task


def text_of(task, example: dict) -> str:
    ids = [*example["inputs"][example["segment_ids"] > 0].tolist()]
    ids.append(int(example["targets"][example["segment_ids"] > 0][-1]))
    vocab = task.vocab
    return " ".join(vocab[i] for i in ids)


def interpret(text: str, max_value: int) -> tuple[int, int, dict[str, int]]:
    """Runs 'v = 0 ;', 'v ++ ;', 'pass ;' and the final 'print v'; returns
    (the printed value the program states, the value it should be, op counts)."""
    words = text.split()
    assert words[-3] == "print"
    stated = int(words[-1])
    memory: dict[str, int] = {}
    counts = {"set": 0, "incr": 0, "pass": 0}
    statements = " ".join(words[:-3]).split(";")
    assert statements[-1] == ""
    for statement in statements[:-1]:
        parts = statement.split()
        if parts == ["pass"]:
            counts["pass"] += 1
        elif len(parts) == 3 and parts[1:] == ["=", "0"]:
            memory[parts[0]] = 0
            counts["set"] += 1
        elif len(parts) == 2 and parts[1] == "++":
            memory[parts[0]] += 1  # KeyError if used before being set
            assert memory[parts[0]] <= max_value
            counts["incr"] += 1
        else:
            raise AssertionError(f"bad statement {statement!r}")
    return stated, memory[words[-2]], counts


@pytest.mark.parametrize("num_vars", [1, 3, 5])
def test_programs_interpret_to_their_answer(num_vars: int) -> None:
    task = make_task("counting", {"num_vars": num_vars, "max_ops": 60})
    for split in ("train", "test", "ood_long", "ood_short"):
        source = task.source(split, seed=2)
        for index in range(30):
            ex = source[index]
            assert all(ex[k].shape == (task.seq_len,) for k in EXAMPLE_KEYS)
            stated, value, counts = interpret(text_of(task, ex), task.max_value)
            assert stated == value
            assert counts["set"] >= num_vars  # the prelude sets every variable
            assert 1 <= counts["set"] + counts["incr"] + counts["pass"] - num_vars <= 60
            # exactly one scored position: the one after "print v", whose target is the value
            (t,) = np.flatnonzero(ex["loss_mask"])
            assert task.vocab[ex["inputs"][t - 1]] == "print"
            assert task.vocab[ex["targets"][t]] == str(value)
            real = ex["segment_ids"][1:] > 0
            np.testing.assert_array_equal(ex["targets"][:-1][real], ex["inputs"][1:][real])


def test_values_stay_within_max_value() -> None:
    task = make_task("counting", {"max_ops": 200, "max_value": 3, "w_pass": 1.0})
    source = task.source("train", seed=0)
    seen = set()
    for index in range(30):
        stated, value, _ = interpret(text_of(task, source[index]), 3)
        assert stated == value
        seen.add(value)
    assert max(seen) == 3  # the cap is reached, never passed (checked in interpret)


@pytest.mark.parametrize(
    ("split", "w_pass"), [("test", 50.0), ("ood_long", 100.0), ("ood_short", 10.0)]
)
def test_operation_proportions(split: str, w_pass: float) -> None:
    # a huge max_value makes redraws impossible, so frequencies are the weights
    task = make_task("counting", {"max_ops": 200, "min_ops": 200, "max_value": 1000})
    source = task.source(split, seed=1)
    totals = {"set": 0, "incr": 0, "pass": 0}
    for index in range(40):
        _, _, counts = interpret(text_of(task, source[index]), 1000)
        counts["set"] -= 1  # the prelude
        for key in totals:
            totals[key] += counts[key]
    n = sum(totals.values())
    assert n == 40 * 200
    weights = np.array([1.0, 7.0, w_pass]) / (8.0 + w_pass)
    for key, p in zip(("set", "incr", "pass"), weights, strict=True):
        assert abs(totals[key] / n - p) < 5 * np.sqrt(p * (1 - p) / n)


def test_left_truncation_keeps_the_end() -> None:
    full = make_task("counting", {"num_vars": 3, "max_ops": 100})
    cut = make_task("counting", {"num_vars": 3, "max_ops": 100, "max_len": 64})
    assert cut.seq_len == 64
    n_cut = 0
    for index in range(20):
        a, b = full.source("test", seed=9)[index], cut.source("test", seed=9)[index]
        used = int(a["segment_ids"].sum())
        if used > 64:
            n_cut += 1
            for key in ("inputs", "targets", "loss_mask"):
                np.testing.assert_array_equal(b[key], a[key][used - 64 : used])
            np.testing.assert_array_equal(b["positions"], np.arange(64))
        else:
            for key in EXAMPLE_KEYS:
                np.testing.assert_array_equal(b[key], a[key][:64])
        assert b["loss_mask"].sum() == 1
        assert cut.vocab[b["inputs"][np.flatnonzero(b["loss_mask"])[0] - 1]] == "print"
    assert n_cut > 10


def test_deterministic_and_varied() -> None:
    task = make_task("counting", {"max_ops": 50})
    a, b = task.source("train", seed=0), task.source("train", seed=0)
    for key in EXAMPLE_KEYS:
        np.testing.assert_array_equal(a[11][key], b[11][key])
    assert not np.array_equal(a[11]["inputs"], a[12]["inputs"])
    assert not np.array_equal(a[11]["inputs"], task.source("train", seed=1)[11]["inputs"])
    assert len(a) == 10_000


def test_metrics_answer_only() -> None:
    task = make_task("counting", {"max_ops": 40})
    source = task.source("test", seed=0)
    batch = {k: np.stack([source[i][k] for i in range(10)]) for k in EXAMPLE_KEYS}
    predictions = np.where(batch["loss_mask"] > 0, batch["targets"], 0)  # all else wrong
    assert task.summarize(task.metrics(batch, predictions)) == {"error": 0.0}
    rows, cols = np.nonzero(batch["loss_mask"])
    predictions[rows[:3], cols[:3]] = task.vocab.index(";")  # never an answer
    assert task.summarize(task.metrics(batch, predictions)) == {"error": 3 / 10}


@pytest.mark.parametrize(
    "options",
    [
        {"num_vars": 0},
        {"num_vars": 27},
        {"max_ops": 0},
        {"min_ops": 0},
        {"max_len": 2},
        {"max_len": -1},
        {"w_pass_short": -1.0},
        {"train_size": 0},
    ],
)
def test_bad_options_raise(options: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        make_task("counting", options)


def test_unknown_split() -> None:
    with pytest.raises(ValueError, match="ood"):
        make_task("counting").source("ood", seed=0)
