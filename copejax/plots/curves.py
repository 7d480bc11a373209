"""Training curves of several runs, one line per position scheme (CoPE Figure 5 style, arXiv
2405.18719): a metric of ``metrics.jsonl`` against the training step.

    python -m copejax.plots.curves --workdir=workdirs/lm_rope --workdir=workdirs/lm_cope \
        --metric=eval/valid/loss --metric=train/loss --out=workdirs/lm_curves.png

Each workdir's label is its ``model.position`` (from ``config.json``), else its directory name;
runs of one scheme are told apart by their directory names.
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

from copejax.config import command_line
from copejax.runtime.metrics import read_jsonl
from copejax.runtime.workdir import run_labels


def run_label(workdir: str | os.PathLike) -> str:
    """``model.position`` of the run in ``workdir``, or the directory name."""
    return run_labels([str(workdir)])[str(workdir)]


def series(records: Sequence[Mapping[str, float]], metric: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records holding ``metric``; a resumed run's repeats keep the last.

    A null value (a logging window whose steps were all skipped as non-finite) is a gap.
    """
    by_step = {int(r["step"]): float(r[metric]) for r in records if r.get(metric) is not None}
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
    labels = run_labels(flags.FLAGS.workdir)
    runs = {labels[w]: read_jsonl(Path(w) / "metrics.jsonl") for w in flags.FLAGS.workdir}
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
    app.run(command_line.one_line_errors(main))
