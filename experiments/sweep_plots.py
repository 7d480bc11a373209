"""The studies' plots: grouped bars of a result per arm (with the papers' numbers) and curves
averaged over seeds with a one-std band, written as PNGs beside the pages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


def plot_path(out: str | Path, study: str, scale: str, name: str) -> Path:
    stem = study if scale == "cpu" else f"{study}_{scale}"
    Path(out).mkdir(parents=True, exist_ok=True)
    return Path(out) / f"{stem}_{name}.png"


def bar_plot(
    labels: Sequence[str],
    series: Mapping[str, Sequence[tuple[float, float]]],
    path: Path,
    *,
    ylabel: str,
    title: str,
    paper: Mapping[str, Sequence[float | None]] | None = None,
) -> None:
    """Grouped bars: one group per label, one bar per series (mean with a std whisker); the
    paper's numbers, where given, as black crosses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(max(5.0, 1.2 * len(labels) + 2), 3.8))
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(labels))
    for i, (name, values) in enumerate(series.items()):
        means = [v[0] for v in values]
        stds = [v[1] for v in values]
        offset = x + (i - (len(series) - 1) / 2) * width
        axes.bar(offset, means, width, yerr=stds, capsize=3, label=name)
        if paper and name in paper:
            points = [(o, p) for o, p in zip(offset, paper[name], strict=True) if p is not None]
            if points:
                axes.scatter(*zip(*points, strict=True), marker="x", color="black", zorder=3)
    axes.set_xticks(x, labels, rotation=20)
    axes.set(ylabel=ylabel, title=title + ("  (x: paper)" if paper else ""))
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def curve_plot(
    curves: Mapping[str, Sequence[Sequence[tuple[float, float]]]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    log_y: bool = False,
) -> None:
    """One line per label: the mean over seeds of (x, y) curves sharing their x values, with
    a band of one std."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for label, per_seed in curves.items():
        length = min((len(c) for c in per_seed), default=0)
        if length == 0:
            continue
        xs = np.asarray([p[0] for p in per_seed[0][:length]], dtype=np.float64)
        ys = np.asarray([[p[1] for p in c[:length]] for c in per_seed], dtype=np.float64)
        mean, std = ys.mean(0), ys.std(0)
        axes.plot(xs, mean, marker="o", markersize=3, label=label)
        axes.fill_between(xs, mean - std, mean + std, alpha=0.2)
    if log_y:
        axes.set_yscale("log")
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
