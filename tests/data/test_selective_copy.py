"""Selective copy data: an independent checker that strips the blanks from the decoded text."""

from __future__ import annotations

import numpy as np
import pytest

from copejax.data.base import EXAMPLE_KEYS, make_task

SMALL = {"num_tokens": 16, "num_blanks": 16, "num_blanks_dense": 8, "num_blanks_sparse": 32}


def document(example: dict) -> list[int]:
    return [*example["inputs"].tolist(), int(example["targets"][-1])]


def check_copy(words: list[str]) -> tuple[int, int]:
    """Checks 'noisy = copy'; returns (number of blanks, index of the separator)."""
    sep = words.index("=")
    assert words.count("=") == 1
    noisy, copy = words[:sep], words[sep + 1 :]
    assert [w for w in noisy if w != "_"] == copy
    assert "_" not in copy
    return noisy.count("_"), sep


@pytest.mark.parametrize(
    ("split", "blanks"), [("train", 16), ("test", 16), ("ood_dense", 8), ("ood_sparse", 32)]
)
def test_documents_and_masks(split: str, blanks: int) -> None:
    task = make_task("selective_copy", SMALL)
    source = task.source(split, seed=5)
    length = 2 * 16 + blanks
    assert task.split_len(split) == length
    for index in range(40):
        ex = source[index]
        assert all(ex[k].shape == (length,) for k in EXAMPLE_KEYS)
        words = [task.vocab[i] for i in document(ex)]
        assert len(words) == length + 1
        counted, sep = check_copy(words)
        assert counted == blanks and len(words) - sep - 1 == 16
        np.testing.assert_array_equal(ex["targets"][:-1], ex["inputs"][1:])
        # scored: positions whose next token belongs to the copy, i.e. t >= sep
        expected = (np.arange(length) >= sep).astype(np.float32)
        np.testing.assert_array_equal(ex["loss_mask"], expected)
        assert ex["loss_mask"].sum() == 16


def test_paper_lengths_and_vocab() -> None:
    task = make_task("selective_copy")
    assert len(task.vocab) == 16 and len(set(task.vocab)) == 16
    assert task.seq_len == 768
    assert [task.split_len(s) for s in ("test", "ood_dense", "ood_sparse")] == [768, 640, 1024]


def test_token_and_blank_placement_are_uniform() -> None:
    task = make_task("selective_copy", {"num_tokens": 8, "num_blanks": 8, "vocab_size": 6})
    source = task.source("train", seed=0)
    docs = np.stack([np.asarray(document(source[i])) for i in range(600)])
    noisy = docs[:, :16]
    blank_rate = (noisy == 1).mean(axis=0)  # each place is blank with probability 1/2
    assert np.all(np.abs(blank_rate - 0.5) < 5 * 0.5 / np.sqrt(600))
    copy = docs[:, 17:]
    freq = np.bincount(copy.ravel(), minlength=6)[3:] / copy.size  # 3 data tokens, 1/3 each
    assert np.all(np.abs(freq - 1 / 3) < 5 * 0.5 / np.sqrt(copy.size))


def test_deterministic_per_seed_and_index() -> None:
    task = make_task("selective_copy", SMALL)
    a, b = task.source("test", seed=4), task.source("test", seed=4)
    for key in EXAMPLE_KEYS:
        np.testing.assert_array_equal(a[3][key], b[3][key])
    assert not np.array_equal(a[3]["inputs"], a[4]["inputs"])
    assert not np.array_equal(a[3]["inputs"], task.source("test", seed=5)[3]["inputs"])
    assert repr(a) == repr(b)


def test_metrics_token_error_on_output() -> None:
    task = make_task("selective_copy", SMALL)
    source = task.source("ood_sparse", seed=0)
    batch = {k: np.stack([source[i][k] for i in range(4)]) for k in EXAMPLE_KEYS}
    predictions = batch["targets"].copy()
    predictions[batch["loss_mask"] == 0] = 1  # errors outside the copy do not count
    assert task.summarize(task.metrics(batch, predictions)) == {"error": 0.0, "glitch_rate": 0.0}
    scored = np.argwhere(batch["loss_mask"] > 0)
    for row, t in scored[[0, 1, 2, 20]]:  # 3 errors in sequence 0, one in sequence 1
        predictions[row, t] = 1
    summary = task.summarize(task.metrics(batch, predictions))
    assert summary["error"] == pytest.approx(4 / (4 * 16))
    assert summary["glitch_rate"] == pytest.approx(2 / 4)


@pytest.mark.parametrize(
    "options",
    [
        {"num_tokens": 0},
        {"num_blanks": -1},
        {"num_blanks_sparse": 2.5},
        {"vocab_size": 4},
        {"test_size": 0},
    ],
)
def test_bad_options_raise(options: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        make_task("selective_copy", options)


def test_unknown_split() -> None:
    with pytest.raises(ValueError, match="sparse"):
        make_task("selective_copy", SMALL).source("sparse", seed=0)
