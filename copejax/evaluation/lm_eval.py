"""Perplexity past the training length and loss per position bucket (CoPE Figure 3, arXiv
2405.18719; the length-extrapolation protocol of Press et al. 2021, arXiv 2108.12409).

For each evaluation split of the ``lm`` task (``valid`` at T, ``valid_x2`` ... at 2T, 4T, 8T)
the model reads packed rows of that length and every scored next-token prediction is charged
its cross-entropy (float32). Per split: mean loss, perplexity exp(loss), bits per token, and
the mean loss of the predictions made at positions ``[k W, (k + 1) W)`` of their document
(``W = bucket_width``) and in the given ``ranges`` (e.g. 256-511, the positions past a 256-token
training length that seed 003 plots).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from copejax.data.lm import LanguageModel
from copejax.model.config import ModelConfig
from copejax.model.transformer import Transformer
from copejax.training.input_pipeline import eval_batches


def token_nll_BT(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Cross-entropy of every target, float32 (B, T)."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]


def bucket_sums(
    nll_BT: np.ndarray, positions_BT: np.ndarray, mask_BT: np.ndarray, width: int, buckets: int
) -> tuple[np.ndarray, np.ndarray]:
    """(loss sum, count) of scored tokens per position bucket ``position // width``, [buckets]."""
    keep = mask_BT > 0
    index = np.minimum(positions_BT[keep] // width, buckets - 1)
    sums = np.bincount(index, weights=nll_BT[keep].astype(np.float64), minlength=buckets)
    counts = np.bincount(index, minlength=buckets).astype(np.float64)
    return sums, counts


def evaluate_split(
    model_config: ModelConfig,
    params: Any,
    task: LanguageModel,
    split: str,
    *,
    batch_size: int = 8,
    max_examples: int = 0,
    bucket_width: int = 64,
    ranges: Sequence[tuple[int, int]] = ((256, 512),),
) -> dict[str, Any]:
    """Loss, perplexity and per-bucket loss of one split.

    Args:
      model_config: the model.
      params: its parameters.
      task: the lm task.
      split: a split name of ``task``.
      batch_size: rows per batch at length T; longer splits use proportionally fewer rows.
      max_examples: rows evaluated (0 = all), the first ones of the split.
      bucket_width: W of the position buckets.
      ranges: extra [start, end) position ranges to report.

    Returns:
      ``{"length", "rows", "tokens", "loss", "perplexity", "bits_per_token", "buckets":
      {"0-63": loss, ...}, "ranges": {"256-511": loss, ...}}``; buckets without tokens are
      left out, a range without tokens is NaN.
    """
    length = task.split_length(split)
    size = task.splits()[split]
    rows = size if max_examples <= 0 else min(max_examples, size)
    batch = max(1, batch_size * task.seq_len // length)
    buckets = -(-length // bucket_width)
    model = Transformer(model_config)

    @jax.jit
    def nll_fn(params: Any, inputs_BT: jax.Array, positions_BT: jax.Array, seg_BT: jax.Array,
               targets_BT: jax.Array) -> jax.Array:  # fmt: skip
        logits_BTV = model.apply({"params": params}, inputs_BT, positions_BT, seg_BT)
        return token_nll_BT(logits_BTV, targets_BT)

    sums, counts = np.zeros(buckets), np.zeros(buckets)
    position_sums, position_counts = np.zeros(length), np.zeros(length)
    # One compiled shape per split: the last batch is padded with unscored rows.
    for stacked, _ in eval_batches(task, split, 0, batch, max_examples=rows):
        nll_BT = np.asarray(
            nll_fn(params, stacked["inputs"], stacked["positions"], stacked["segment_ids"],
                   stacked["targets"])
        )  # fmt: skip
        s, c = bucket_sums(
            nll_BT, stacked["positions"], stacked["loss_mask"], bucket_width, buckets
        )
        sums, counts = sums + s, counts + c
        s, c = bucket_sums(nll_BT, stacked["positions"], stacked["loss_mask"], 1, length)
        position_sums, position_counts = position_sums + s, position_counts + c
    tokens = counts.sum()
    loss = float(sums.sum() / max(tokens, 1.0))
    range_losses = {}
    for lo, hi in ranges:
        n = position_counts[lo:hi].sum()
        range_losses[f"{lo}-{hi - 1}"] = float(position_sums[lo:hi].sum() / n) if n else math.nan
    return {
        "length": length,
        "rows": rows,
        "tokens": int(tokens),
        "loss": loss,
        "perplexity": math.exp(loss),
        "bits_per_token": loss / math.log(2.0),
        "buckets": {
            f"{k * bucket_width}-{(k + 1) * bucket_width - 1}": float(sums[k] / counts[k])
            for k in range(buckets)
            if counts[k]
        },
        "ranges": range_losses,
    }


def evaluate_lengths(
    model_config: ModelConfig,
    params: Any,
    task: LanguageModel,
    splits: Sequence[str] | None = None,
    **kwargs: Any,
) -> dict[str, dict[str, Any]]:
    """:func:`evaluate_split` for ``valid`` and every ``valid_x<k>`` split (or ``splits``).

    A split the model cannot run (a learned position table shorter than the split) is
    reported as ``{"length": L, "error": message}`` instead of failing the others.
    """
    if splits is None:
        splits = ("valid", *(f"valid_x{f}" for f in task.extrapolation))
    results: dict[str, dict[str, Any]] = {}
    for split in splits:
        try:
            results[split] = evaluate_split(model_config, params, task, split, **kwargs)
        except ValueError as error:
            results[split] = {"length": task.split_length(split), "error": str(error)}
    return results


def plot_extrapolation(
    runs: Mapping[str, Mapping[str, Mapping[str, Any]]], train_length: int, path: str
) -> None:
    """Writes a PNG: perplexity against evaluation length (left) and loss per position bucket
    on each run's longest evaluated split (right), one line per run (label -> results)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, results in runs.items():
        ok = sorted((r["length"], r) for r in results.values() if "error" not in r)
        if not ok:
            continue
        left.plot([n for n, _ in ok], [r["perplexity"] for _, r in ok], marker="o", label=label)
        longest = ok[-1][1]
        starts = [int(k.split("-")[0]) for k in longest["buckets"]]
        right.plot(starts, list(longest["buckets"].values()), label=f"{label} ({ok[-1][0]})")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("evaluation length (tokens)")
    left.set_ylabel("perplexity")
    left.set_title("Perplexity past the training length")
    right.set_xlabel("position in document (bucket start)")
    right.set_ylabel("loss (nats / token)")
    right.set_title("Loss per position bucket, longest split")
    for axis in (left, right):
        axis.axvline(train_length, color="grey", linestyle="--", linewidth=1)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
