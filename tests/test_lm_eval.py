"""lm_eval: perplexity and per-bucket loss against a NumPy loop over the same toy model's logits;
sampling; the extrapolation plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import jax
import matplotlib.image
import numpy as np
import pytest

from copejax.data import _tokenizers as tok
from copejax.data.base import make_task
from copejax.evaluation import lm_eval
from copejax.evaluation.sample import continue_text
from copejax.model.config import ModelConfig
from copejax.model.transformer import Transformer
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    directory = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    for i in range(9):
        text = "".join(rng.choice(list("abcdefg \n"), size=int(rng.integers(3, 70))))
        (directory / f"d{i}.txt").write_text(text)
    task = make_task(
        "lm",
        {"corpus": f"files:{directory}/*.txt", "length": 8, "extrapolation": (2, 4),
         "valid_fraction": 0.3},
    )  # fmt: skip
    cfg = tiny_config("rope", vocab_size=len(task.vocab), max_len=8)
    tokens = np.zeros((1, 8), np.int32)
    params = jax.jit(Transformer(cfg).init)(jax.random.key(0), tokens, tokens)["params"]
    return task, cfg, params


def _reference(
    task: Any, cfg: ModelConfig, params: Any, split: str, *, max_rows: int, width: int,
    lo: int, hi: int,
) -> tuple[float, int, dict[int, float], list[float]]:  # fmt: skip
    """Plain loops in float64 over rows, tokens and buckets."""
    source = task.source(split, 0)
    apply = jax.jit(Transformer(cfg).apply)
    total, count, buckets, in_range = 0.0, 0, {}, []
    for i in range(min(max_rows, len(source))):
        ex = source[i]
        logits = np.asarray(
            apply({"params": params}, ex["inputs"][None], ex["positions"][None],
                        ex["segment_ids"][None])[0], np.float64,
        )  # fmt: skip
        for t in range(len(ex["inputs"])):
            if ex["loss_mask"][t] == 0:
                continue
            row = logits[t]
            logz = row.max() + math.log(np.exp(row - row.max()).sum())
            nll = logz - row[ex["targets"][t]]
            total, count = total + nll, count + 1
            key = ex["positions"][t] // width
            buckets.setdefault(key, []).append(nll)
            if lo <= ex["positions"][t] < hi:
                in_range.append(nll)
    return total / count, count, {k: float(np.mean(v)) for k, v in buckets.items()}, in_range


@pytest.mark.parametrize(("split", "max_rows"), [("valid", 0), ("valid_x4", 3)])
def test_perplexity_and_buckets_match_numpy(toy: tuple, split: str, max_rows: int) -> None:
    task, cfg, params = toy
    got = lm_eval.evaluate_split(
        cfg, params, task, split, batch_size=3, max_examples=max_rows, bucket_width=4,
        ranges=((5, 11),),
    )  # fmt: skip
    loss, count, buckets, in_range = _reference(
        task, cfg, params, split, max_rows=max_rows or 10**9, width=4, lo=5, hi=11
    )
    assert got["tokens"] == count > 0
    np.testing.assert_allclose(got["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(got["perplexity"], math.exp(loss), rtol=1e-5)
    np.testing.assert_allclose(got["bits_per_token"], loss / math.log(2), rtol=1e-5)
    assert got["length"] == task.split_length(split)
    assert sorted(got["buckets"]) == sorted(f"{4 * k}-{4 * k + 3}" for k in buckets)
    for k, value in buckets.items():
        np.testing.assert_allclose(got["buckets"][f"{4 * k}-{4 * k + 3}"], value, rtol=1e-5)
    if in_range:
        np.testing.assert_allclose(got["ranges"]["5-10"], np.mean(in_range), rtol=1e-5)
    else:
        assert math.isnan(got["ranges"]["5-10"])


def test_learned_table_too_short_is_reported_not_raised(toy: tuple, tmp_path: Path) -> None:
    task, _, _ = toy
    cfg = tiny_config("learned", vocab_size=len(task.vocab), max_len=8)
    tokens = np.zeros((1, 8), np.int32)
    params = jax.jit(Transformer(cfg).init)(jax.random.key(0), tokens, tokens)["params"]
    results = lm_eval.evaluate_lengths(cfg, params, task, ("valid", "valid_x4"), batch_size=2)
    assert set(results) == {"valid", "valid_x4"}
    assert "perplexity" in results["valid"]
    assert "error" in results["valid_x4"] and results["valid_x4"]["length"] == 32
    path = tmp_path / "x.png"
    lm_eval.plot_extrapolation({"learned": results}, 8, str(path))
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (round(4.2 * 110), 11 * 110)


def test_greedy_generation_is_the_argmax_of_a_full_forward(toy: tuple) -> None:
    task, cfg, params = toy
    # A prompt of 8 tokens: every step's window is the last 8 (one compiled shape).
    text = "abcdefg"
    prompt = np.concatenate([[tok.BOS_ID], task.text_tokenizer().encode(text)]).astype(np.int32)
    new = continue_text(cfg, params, prompt, max_new_tokens=4, temperature=0.0, seed=0, context=8)
    ids = list(prompt)
    apply = jax.jit(Transformer(cfg).apply)
    for token in new:
        window = np.asarray(ids[-8:], np.int32)[None]
        logits = apply({"params": params}, window, np.arange(8)[None])
        assert int(np.argmax(logits[0, -1])) == token
        ids.append(int(token))
    assert 1 <= len(new) <= 4
    with pytest.raises(ValueError, match="temperature"):
        continue_text(cfg, params, prompt, max_new_tokens=1, temperature=-1.0, seed=0, context=8)
