"""The length-generalisation suite (Ruoss et al. 2023): each task's output recomputed from its
decoded input by an independent reference, the framing (shapes, masks, next-token targets),
determinism, the splits' length ranges and the per-length accuracy metric."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from copejax.data._length_suite import repeat_rule_accuracy
from copejax.data.base import EXAMPLE_KEYS, make_task

SMALL = {"max_train_length": 9, "test_max_length": 21, "test_length_step": 4}
LONG_LENGTHS = (10, 14, 18)


def reference_binary_addition(symbols: list[str]) -> list[str]:
    """The little-endian sum then "$"; a lone number (n <= 2, no "+") is its own answer."""
    text = "".join(symbols)
    if "+" not in text:
        assert len(text) <= 2 and set(text) <= {"0", "1"}
        assert int(text[::-1], 2) <= 2 ** len(text) - 2  # their randint(0, 2^n - 1) range
        total = int(text[::-1], 2)
    else:
        a, b = text.split("+")
        assert a and b and int(a[::-1], 2) > 0 and int(b[::-1], 2) > 0
        total = int(a[::-1], 2) + int(b[::-1], 2)
    return [*bin(total)[2:][::-1], "$"]


def reference_missing_duplicate(symbols: list[str]) -> list[str]:
    """The symbol at the placeholder, read from the other copy of the doubled string."""
    if len(symbols) == 1:
        return ["1"]  # their arbitrary n = 1 instance
    body = symbols[:-1] if len(symbols) % 2 else symbols
    if len(symbols) % 2:
        assert symbols[-1] == "#"
    half = len(body) // 2
    assert body.count("_") == 1
    hole = body.index("_")
    other = hole + half if hole < half else hole - half
    first, second = body[:half], body[half:]
    assert [x for i, x in enumerate(first) if i != hole % half] == [
        x for i, x in enumerate(second) if i != hole % half
    ]
    return [body[other]]


def reference_odds_first(symbols: list[str]) -> list[str]:
    """0-based odd indices first, then the even ones (their generator's order)."""
    odd = [s for i, s in enumerate(symbols) if i % 2 == 1]
    even = [s for i, s in enumerate(symbols) if i % 2 == 0]
    return odd + even


REFERENCES: dict[str, tuple[set[str], Callable[[list[str]], list[str]]]] = {
    "reverse_string": ({"0", "1"}, lambda s: list(reversed(s))),
    "duplicate_string": ({"0", "1"}, lambda s: s + s),
    "odds_first": ({"0", "1"}, reference_odds_first),
    "bucket_sort": ({"0", "1", "2", "3", "4"}, lambda s: sorted(s, key=int)),
    "parity_check": ({"0", "1"}, lambda s: [str(s.count("1") % 2)]),
    "missing_duplicate": ({"0", "1", "_", "#"}, reference_missing_duplicate),
    "binary_addition": ({"0", "1", "+"}, reference_binary_addition),
}
TASKS = tuple(REFERENCES)


def read(vocab: tuple[str, ...], example: dict) -> tuple[list[str], list[str], int]:
    """(input symbols, output symbols, index of <sep>) from the raw arrays."""
    real = example["segment_ids"] > 0
    ids = [*example["inputs"][real].tolist(), int(example["targets"][real][-1])]
    text = [vocab[i] for i in ids]
    assert text.count("<sep>") == 1
    sep = text.index("<sep>")
    return text[:sep], text[sep + 1 :], sep


@pytest.mark.parametrize("split", ["train", "test", "long"])
@pytest.mark.parametrize("name", TASKS)
def test_outputs_match_the_reference_and_masks_are_exact(name: str, split: str) -> None:
    task = make_task(name, SMALL)
    alphabet, reference = REFERENCES[name]
    source = task.source(split, seed=3)
    length = task.split_length(split)
    for index in range(min(len(source), 60)):
        ex = source[index]
        assert all(ex[k].shape == (length,) for k in EXAMPLE_KEYS)
        inputs, outputs, sep = read(task.vocab, ex)
        assert set(inputs) <= alphabet and len(inputs) == sep
        assert outputs == reference(inputs)
        if split != "train":
            assert sep == task.lengths(split)[index % len(task.lengths(split))]
        # scored: exactly the positions predicting the outputs (from <sep> on)
        expected = np.zeros(length, np.float32)
        expected[sep : sep + len(outputs)] = 1.0
        np.testing.assert_array_equal(ex["loss_mask"], expected)
        used = sep + len(outputs)
        np.testing.assert_array_equal(ex["targets"][: used - 1], ex["inputs"][1:used])
        np.testing.assert_array_equal(ex["positions"][:used], np.arange(used))
        assert not ex["segment_ids"][used:].any() and not ex["inputs"][used:].any()
        assert ex["inputs"].dtype == np.int32 and ex["loss_mask"].dtype == np.float32


@pytest.mark.parametrize("name", TASKS)
def test_split_lengths(name: str) -> None:
    task = make_task(name, SMALL)
    assert task.lengths("train") == task.lengths("test") == tuple(range(1, 10))
    assert task.lengths("long") == LONG_LENGTHS
    assert task.splits()["long"] == 3 * 64 and task.splits()["test"] == 9 * 64
    train = task.source("train", seed=0)
    seen = {read(task.vocab, train[i])[2] for i in range(300)}
    assert seen == set(range(1, 10))  # every training length drawn, none outside
    default = make_task(name)
    assert default.lengths("train") == tuple(range(1, 41))  # the protocol: train on 1 to 40
    assert default.lengths("long")[0] == 41 and default.lengths("long")[-1] == 500
    # T is the longest document: n + 1 + outputs, minus one
    longest = max(n + default.output_length(n) for n in default.lengths("long"))
    assert default.split_length("long") == longest


@pytest.mark.parametrize("name", TASKS)
def test_deterministic_under_a_seed(name: str) -> None:
    task = make_task(name, SMALL)
    a, b, c = (task.source("long", seed=s) for s in (5, 5, 6))
    for index in range(6):
        for key in EXAMPLE_KEYS:
            np.testing.assert_array_equal(a[index][key], b[index][key])
    assert any(not np.array_equal(a[i]["inputs"], c[i]["inputs"]) for i in range(6))
    assert repr(a) == repr(b) and repr(a) != repr(c)


def test_binary_addition_operand_lengths_follow_their_generator() -> None:
    """len(a) uniform in [1, n - 2], len(b) = n - 1 - len(a), both written at full width."""
    task = make_task("binary_addition", SMALL)
    source = task.source("long", seed=0)
    lengths_a = set()
    for index in range(120):
        inputs, _, sep = read(task.vocab, source[index])
        a, b = "".join(inputs).split("+")
        assert len(a) + len(b) == sep - 1 and len(a) >= 1 and len(b) >= 1
        if sep == 10:
            lengths_a.add(len(a))
    assert lengths_a == set(range(1, 9))


def test_metric_averages_per_length_accuracies() -> None:
    """Two lengths with different output counts: the mean of the per-length accuracies, not
    the pooled token accuracy."""
    task = make_task("duplicate_string", {"max_train_length": 4, "test_max_length": 8})
    source = task.source("long", seed=0)  # lengths 5, 6, 7, 8
    batch = {k: np.stack([source[i][k] for i in range(2)]) for k in EXAMPLE_KEYS}
    predictions = batch["targets"].copy()
    wrong = np.flatnonzero(batch["loss_mask"][0])[:3]  # 3 of the 10 outputs of n = 5
    predictions[0, wrong] = batch["targets"][0, wrong] + 1
    totals = task.metrics(batch, predictions)
    assert totals == {
        "correct/5": 7.0,
        "count/5": 10.0,
        "exact/5": 0.0,
        "sequences/5": 1.0,
        "correct/6": 12.0,
        "count/6": 12.0,
        "exact/6": 1.0,
        "sequences/6": 1.0,
    }
    summary = task.summarize(totals)
    assert summary["accuracy"] == pytest.approx((0.7 + 1.0) / 2)
    assert summary["error"] == pytest.approx(1 - 0.85)
    assert summary["exact_match"] == 0.5
    assert summary["accuracy/5"] == pytest.approx(0.7) and summary["accuracy/6"] == 1.0
    padding = {k: np.zeros_like(v) for k, v in batch.items()}
    assert task.metrics(padding, predictions) == {}  # unscored rows count nowhere


@pytest.mark.parametrize(
    "options, match",
    [
        ({"max_train_length": 0}, "max_train_length"),
        ({"min_train_length": 5, "max_train_length": 4}, "max_train_length=4"),
        ({"test_max_length": 40}, "first test length 41"),
        ({"test_min_length": -1}, "test_min_length"),
        ({"test_length_step": 0}, "test_length_step"),
        ({"samples_per_length": 0}, "samples_per_length"),
    ],
)
def test_bad_options_are_refused(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_task("reverse_string", options)
    with pytest.raises(ValueError, match="allowed splits"):
        make_task("parity_check").source("valid", seed=0)


@pytest.mark.parametrize("name", ["binary_addition", "missing_duplicate"])
def test_decode_example_reads_input_and_output(name: str) -> None:
    task = make_task(name, SMALL)
    source = task.source("long", seed=4)
    for index in range(5):
        inputs, outputs, _ = read(task.vocab, source[index])
        assert task.decode_example(source[index]) == (inputs, outputs)


@pytest.mark.parametrize("name", ["bucket_sort", "reverse_string", "parity_check"])
@pytest.mark.parametrize("split", ["test", "long"])
def test_repeat_rule_scores_the_previous_true_output_token(name: str, split: str) -> None:
    """The no-model floor, recomputed from the decoded outputs: each output symbol guessed as
    the one before it, the first as the most frequent first symbol; per-length token accuracy,
    then the mean over lengths."""
    task = make_task(name, SMALL)
    source = task.source(split, seed=3)
    outputs = [read(task.vocab, source[i])[1:] for i in range(len(source))]
    firsts = [out[0] for out, _ in outputs]
    guess = max(sorted(set(firsts)), key=firsts.count)
    right: dict[int, list[bool]] = {}
    for out, sep in outputs:
        hits = [a == b for a, b in zip([guess, *out[:-1]], out, strict=True)]
        right.setdefault(sep, []).extend(hits)
        if name == "bucket_sort":  # sorted: wrong only where the symbol changes, <= 4 times
            assert hits.count(False) <= 4 + (out[0] != guess)
    expected = np.mean([np.mean(hits) for hits in right.values()])
    got = repeat_rule_accuracy(task, split, seed=3)
    assert got["accuracy"] == pytest.approx(expected, abs=1e-12)
    assert sorted(k for k in got if k.startswith("accuracy/")) == sorted(
        f"accuracy/{n}" for n in right
    )
    if name == "bucket_sort" and split == "long":
        assert got["accuracy"] > 0.7  # far above the 1/5 of a uniform guess
