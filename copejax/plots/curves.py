"""Training curves of several runs, one line per position scheme (CoPE Figure 5 style, arXiv
2405.18719): a metric of ``metrics.jsonl`` against the training step.

    python -m copejax.plots.curves --workdir=workdirs/lm_rope --workdir=workdirs/lm_cope \
        --metric=eval/valid/loss --metric=train/loss --out=workdirs/lm_curves.png

Each workdir's label is its ``model.position`` (from ``config.json``), else its directory name.
One panel per metric; a run without a metric is left out of that panel.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
from absl import app, flags

from copejax.metrics import read_jsonl
from copejax.workdir import read_config


def run_label(workdir: str | os.PathLike) -> str:
    """``model.position`` of the run in ``workdir``, or the directory name."""
    config = read_config(workdir) or {}
    return str(config.get("model", {}).get("position") or Path(workdir).name)


def series(records: Sequence[Mapping[str, float]], metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records holding ``metric``; a resumed run's repeats keep the last."""
    by_step = {int(r["step"]): float(r[metric]) for r in records if metric in r}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_curves(
    runs: Mapping[str, Sequence[Mapping[str, float]]],
    metrics: Sequence[str],
    path: str | os.PathLike,
    log_y: bool = False,
) -> None:
    """Writes a PNG with one panel per metric and one line per run (label -> records).

    Raises:
      ValueError: no run has any of the metrics (the message lists the keys they have).
    """
    if not any(series(records, m)[0] for records in runs.values() for m in metrics):
        keys = sorted({k for records in runs.values() for r in records for k in r} - {"step"})
        raise ValueError(f"no run has any of the metrics {list(metrics)}; available: {keys}")
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4), squeeze=False)
    for axis, metric in zip(axes[0], metrics, strict=True):
        for label, records in runs.items():
            steps, values = series(records, metric)
            if steps:
                axis.plot(steps, values, marker="." if len(steps) < 30 else None, label=label)
        axis.set_xlabel("step")
        axis.set_ylabel(metric)
        axis.set_title(metric)
        if log_y:
            axis.set_yscale("log")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    runs = {}
    for workdir in flags.FLAGS.workdir:
        label = run_label(workdir)
        runs[label if label not in runs else f"{label} ({workdir})"] = read_jsonl(
            Path(workdir) / "metrics.jsonl"
        )
    plot_curves(runs, flags.FLAGS.metric, flags.FLAGS.out, flags.FLAGS.log_y)
    print(f"wrote {flags.FLAGS.out}", flush=True)


def define_flags() -> None:
    """The command line's flags (defined only when run as a program, so that importing this
    module next to other tools defines no clashing flags)."""
    flags.DEFINE_multi_string("workdir", None, "Workdirs holding metrics.jsonl.")
    flags.DEFINE_multi_string("metric", ["eval/valid/loss"], "Metric key(s) to plot.")
    flags.DEFINE_string("out", "curves.png", "PNG file to write.")
    flags.DEFINE_bool("log_y", False, "Logarithmic y axis.")
    flags.mark_flags_as_required(["workdir"])


if __name__ == "__main__":
    define_flags()
    app.run(main)
