"""Passkey data: find the key in the decoded text and check the question's answer."""

from __future__ import annotations

import re

import numpy as np
import pytest

from copejax.data.base import EXAMPLE_KEYS, make_task
from copejax.data.passkey import accuracy_table

SMALL = {"train_len": 96, "eval_lengths": (96, 160), "depths": (0.0, 0.5, 1.0), "eval_size": 12}
FILLER = {
    "The grass is green .",
    "The sky is blue .",
    "The sun is yellow .",
    "Here we go .",
    "There and back again .",
}


def text_of(task, example: dict) -> str:
    real = example["segment_ids"] > 0
    ids = [*example["inputs"][real].tolist(), int(example["targets"][real][-1])]
    words = [task.vocab[i] for i in ids]
    # glue digit tokens back into numbers
    return re.sub(r"(?<=\d) (?=\d)", "", " ".join(words))


def find_key(text: str) -> tuple[int, float, int]:
    """(the key, depth of the key line among filler sentences, the answer the text ends with)."""
    line = re.search(r"The pass key is (\d+) \. Remember it \. (\d+) is the pass key \.", text)
    assert line and line.group(1) == line.group(2)
    before, after = text[: line.start()], text[line.end() :]
    assert after.endswith(" . ") or after.endswith(" .")
    question = re.search(r"What is the pass key \? The pass key is (\d+) \.$", after)
    assert question
    intro_end = before.index("information there .") + len("information there .")
    sentences_before = [s.strip() + " ." for s in before[intro_end:].split(" .") if s.strip()]
    sentences_after = [s.strip() + " ." for s in after[: question.start()].split(" .") if s.strip()]
    assert set(sentences_before) <= FILLER and set(sentences_after) <= FILLER
    total = len(sentences_before) + len(sentences_after)
    return int(line.group(1)), len(sentences_before) / total, int(question.group(1))


def test_documents_hold_the_key_at_the_split_depths() -> None:
    task = make_task("passkey", SMALL)
    for split, length in (("train", 96), ("len_96", 96), ("len_160", 160)):
        assert task.split_len(split) == length
        source = task.source(split, seed=0)
        for index in range(12):
            ex = source[index]
            assert all(ex[k].shape == (length,) for k in EXAMPLE_KEYS)
            key, depth, answer = find_key(text_of(task, ex))
            assert answer == key and 1 <= key <= 50_000
            if split != "train":
                target = SMALL["depths"][index % 3]
                assert abs(depth - target) <= 0.5 / task.num_filler(length) + 1e-9
                assert task.depth_of(ex["inputs"]) == target
            # scored: the answer digits and the final "."
            scored = np.flatnonzero(ex["loss_mask"])
            assert len(scored) == len(str(key)) + 1
            assert "".join(task.vocab[i] for i in ex["targets"][scored]) == f"{key}."
            assert task.vocab[ex["inputs"][scored[0]]] == "is"
            assert np.all(np.diff(scored) == 1) and ex["segment_ids"][scored[-1]] == 1
            real = ex["segment_ids"][1:] > 0
            np.testing.assert_array_equal(ex["targets"][:-1][real], ex["inputs"][1:][real])
            # a five-digit key fills the length up to the filler's granularity
            assert ex["segment_ids"].sum() > length - 6 - 5


def test_keys_uniform_and_depths_spread() -> None:
    task = make_task("passkey", {**SMALL, "max_key": 4})
    source = task.source("train", seed=0)
    keys, depths = [], []
    for index in range(400):
        key, depth, _ = find_key(text_of(task, source[index]))
        keys.append(key)
        depths.append(depth)
    freq = np.bincount(keys, minlength=5)[1:] / 400
    assert np.all(np.abs(freq - 0.25) < 5 * np.sqrt(0.25 * 0.75 / 400))
    assert abs(np.mean(depths) - 0.5) < 0.05 and min(depths) == 0.0 and max(depths) == 1.0


def test_deterministic_and_varied() -> None:
    task = make_task("passkey", SMALL)
    a, b = task.source("len_160", seed=2), task.source("len_160", seed=2)
    for key in EXAMPLE_KEYS:
        np.testing.assert_array_equal(a[5][key], b[5][key])
    assert not np.array_equal(a[5]["inputs"], a[8]["inputs"])  # same depth, new key
    assert not np.array_equal(a[5]["inputs"], task.source("len_160", seed=3)[5]["inputs"])
    assert repr(a) == repr(b)


def test_metrics_accuracy_by_depth() -> None:
    task = make_task("passkey", SMALL)
    source = task.source("len_160", seed=0)
    batch = {k: np.stack([source[i][k] for i in range(12)]) for k in EXAMPLE_KEYS}
    perfect = np.where(batch["loss_mask"] > 0, batch["targets"], 0)
    summary = task.summarize(task.metrics(batch, perfect))
    assert summary["accuracy"] == 1.0 and summary["error"] == 0.0
    assert {k for k in summary if k.startswith("accuracy/")} == {
        "accuracy/depth_0",
        "accuracy/depth_0.5",
        "accuracy/depth_1",
    }
    # one wrong digit in sequences 1 and 4 (depth 0.5), the final "." wrong in sequence 2
    corrupted = perfect.copy()
    for row, which in ((1, 0), (4, 1), (2, -1)):
        t = np.flatnonzero(batch["loss_mask"][row])[which]
        corrupted[row, t] = task.vocab.index("The")
    totals = task.metrics(batch, corrupted)
    summary = task.summarize(totals)
    assert summary["accuracy"] == pytest.approx(9 / 12)
    assert summary["accuracy/depth_0.5"] == pytest.approx(2 / 4)
    assert summary["accuracy/depth_1"] == pytest.approx(3 / 4)
    assert summary["accuracy/depth_0"] == 1.0
    results = {f"eval/len_160/{k}": v for k, v in summary.items()}
    table = accuracy_table(results, [96, 160], [0.0, 0.5, 1.0])
    np.testing.assert_array_equal(table[1], [1.0, 0.5, 0.75])
    assert np.isnan(table[0]).all()


@pytest.mark.parametrize(
    "options",
    [
        {"train_len": 10},
        {"eval_lengths": (96, 0)},
        {"eval_lengths": ()},
        {"depths": (0.5, 1.5)},
        {"max_key": 0},
        {"max_key": 100_000},
        {"eval_size": 0},
    ],
)
def test_bad_options_raise(options: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        make_task("passkey", options)


def test_unknown_split() -> None:
    with pytest.raises(ValueError, match="len_100"):
        make_task("passkey", SMALL).source("len_100", seed=0)
