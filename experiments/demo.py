"""The first command to run: a short version of study 1 (experiments/flipflop.py), Flip-Flop
language modelling (Liu et al. 2023, arXiv 2306.00946) with token-position schemes against CoPE
(Golovneva et al. 2024, arXiv 2405.18719, Table 2), trained on CPU in a few minutes.

    python -m experiments.demo [--positions=learned,rope,cope] [--workdir=workdirs/demo] [--jobs=N]

Trains ``configs/flipflop.py:cpu`` (a small model on 63-token sequences, 600 steps, seed 0)
once per scheme, each run ``python -m copejax.main`` in its own process on one CPU, as many at
once as there are CPUs (``--jobs``; :mod:`experiments.workers`: the numbers then do not depend
on the machine's core count), printing the loss as it falls, each line labelled with its
scheme. Then a table of every scheme's test, out-of-distribution and 4x-length (255-token)
errors, which schemes learned the task (read from those numbers: one seed may still be on the
task's plateau), ``errors.png`` (error against step, per scheme and split) in ``<workdir>`` and
``loss.png`` in each ``<workdir>/<position>``. Re-running resumes or, when the runs are
complete, just prints the results again; Ctrl-C stops every run after it saves. The full
study, with more seeds, twice the steps and the paper's numbers: ``python -m
experiments.flipflop``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from absl import app, flags

from copejax.config.base import load_config
from copejax.runtime.metrics import read_jsonl
from experiments import workers
from experiments.flipflop import LEARNED_ERROR
from experiments.run_records import finished_run_of

ROOT = Path(__file__).resolve().parents[1]
_POSITIONS = flags.DEFINE_list(
    "positions", ["learned", "rope", "cope"], "Position schemes (python -m copejax.positions)."
)
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/demo", "Parent of the runs' workdirs.")
_ARG = flags.DEFINE_string("variant", "cpu", "Argument of configs/flipflop.py (smoke, cpu).")
_JOBS = flags.DEFINE_integer("jobs", 0, "Runs trained at once, each on one CPU (0: one per CPU).")


def results_table(records: list[dict[str, float]]) -> str:
    """A plain-text table of the last evaluation: one row per split."""
    last = next((r for r in reversed(records) if any(k.startswith("eval/") for k in r)), None)
    if last is None:
        return "(no evaluation yet)"
    splits = sorted({k.split("/")[1] for k in last if k.startswith("eval/")})
    names = sorted({k.split("/")[2] for k in last if k.startswith("eval/")})
    width = max(len(s) for s in splits)
    lines = [f"step {last['step']}", f"{'split':<{width}}  " + "  ".join(f"{n:>11}" for n in names)]
    for split in splits:
        cells = "  ".join(f"{last.get(f'eval/{split}/{n}', float('nan')):>11.4f}" for n in names)
        lines.append(f"{split:<{width}}  {cells}")
    return "\n".join(lines)


def plot_losses(records: list[dict[str, float]], path: Path, title: str) -> None:
    """Training loss (and each split's evaluation loss) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    train = [(r["step"], r["train/loss"]) for r in records if r.get("train/loss") is not None]
    if train:
        axes.plot(*zip(*train, strict=True), label="train")
    splits = sorted({k.split("/")[1] for r in records for k in r if k.startswith("eval/")})
    for split in splits:
        points = [
            (r["step"], r[f"eval/{split}/loss"]) for r in records if f"eval/{split}/loss" in r
        ]
        axes.plot(*zip(*points, strict=True), marker="o", label=f"eval {split}")
    axes.set(xlabel="step", ylabel="cross-entropy (scored tokens)", title=title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def comparison_table(last: dict[str, dict[str, float]], splits: tuple[str, ...]) -> str:
    """A plain-text table: one row per scheme, its last evaluation's error (%) per split."""
    width = max(len("scheme"), *(len(p) for p in last))
    lines = [f"{'scheme':<{width}}  " + "  ".join(f"{s + ' %':>14}" for s in splits)]
    for position, record in last.items():
        cells = "  ".join(
            f"{100 * record.get(f'eval/{s}/error', float('nan')):>14.2f}" for s in splits
        )
        lines.append(f"{position:<{width}}  {cells}")
    return "\n".join(lines)


def reading(last: dict[str, dict[str, float]], steps: int) -> str:
    """Sentences read from each scheme's last evaluation (``comparison_table``'s records): which
    schemes learned the task (in-distribution error below ``LEARNED_ERROR``, study 1's rule)
    and, of those, the errors at 4x the training length, lowest first. One seed is a first
    look: Flip-Flop's training has a plateau that some seeds leave late, so it says so."""
    test = {p: record.get("eval/test/error") for p, record in last.items()}
    learned = [p for p, e in test.items() if e is not None and e < LEARNED_ERROR]
    lines = [
        f"learned the task (test error below {100 * LEARNED_ERROR:g} %): "
        + (", ".join(learned) if learned else "none")
    ]
    rest = [
        f"{p} ({'no evaluation' if e is None else f'{100 * e:.1f} %'})"
        for p, e in test.items()
        if p not in learned
    ]
    if rest:
        lines.append("not learned yet: " + ", ".join(rest))
    long = {p: last[p].get("eval/long_sparse/error") for p in learned}
    if learned and None not in long.values():
        lines.append(
            "at 4x the training length with sparse writes (long_sparse), lowest first: "
            + ", ".join(f"{p} {100 * long[p]:.1f} %" for p in sorted(learned, key=long.get))
        )
    lines.append(
        f"one seed, {steps} steps: a scheme still on the task's plateau may leave it later;\n"
        "study 1 (python -m experiments.flipflop, experiments/results/flipflop.md) trains "
        "more seeds for longer"
    )
    return "\n".join(lines)


def plot_errors(
    runs: dict[str, list[dict[str, float]]], splits: tuple[str, ...], path: Path
) -> None:
    """Error against step for every scheme (colour) and split (line style), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 4))
    styles = ("-", "--", ":")
    for i, (position, records) in enumerate(runs.items()):
        for split, style in zip(splits, styles, strict=False):
            points = [
                (r["step"], r[f"eval/{split}/error"]) for r in records if f"eval/{split}/error" in r
            ]
            if points:
                axes.plot(
                    *zip(*points, strict=True), style, color=f"C{i}", marker="o",
                    markersize=3, label=f"{position} {split}",
                )  # fmt: skip
    axes.set(xlabel="step", ylabel="error (wrong reads / reads)", title="Flip-Flop")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _JOBS.value < 0:
        raise app.UsageError(f"--jobs must be >= 0 (0: one per CPU), got {_JOBS.value}")
    root = Path(_WORKDIR.value).resolve()
    config_file = ROOT / "configs" / "flipflop.py"
    splits: tuple[str, ...] = ()
    steps = 0
    todo = []
    for position in _POSITIONS.value:
        arg = f"{_ARG.value},position={position}"
        config = load_config(config_file, arg)
        splits, steps = tuple(config.eval.splits), config.train.steps
        workdir = root / position
        if finished_run_of(workdir, config):
            print(f"Flip-Flop with {position}: complete in {workdir}, read", flush=True)
            continue
        print(f"Flip-Flop with {position}: {steps} steps -> {workdir}", flush=True)
        todo.append(workers.Job.training(position, config_file, arg, workdir))
    if todo:
        processes = _JOBS.value or min(len(workers.usable_cpus()), len(todo))
        print(f"training {len(todo)} run(s), {processes} at a time, each on one CPU", flush=True)
        outcome = workers.run_pinned(todo, processes)
        if outcome.stopped_by is not None:  # Ctrl-C or SIGTERM: saved; the same command resumes
            print("stopped: the runs saved their step; the same command resumes", file=sys.stderr)
            sys.exit(128 + outcome.stopped_by)
        if outcome.failed():
            sys.exit(f"failed (output above, exit status): {outcome.codes}")
    runs: dict[str, list[dict[str, float]]] = {}
    for position in _POSITIONS.value:
        runs[position] = read_jsonl(root / position / "metrics.jsonl")
        plot_losses(runs[position], root / position / "loss.png", f"Flip-Flop, {position}")
    last = {}
    for position, records in runs.items():
        last[position] = next(
            (r for r in reversed(records) if any(k.startswith("eval/") for k in r)), {}
        )
    print("\nerror = wrong reads / reads at the last evaluation (CoPE paper Table 2: in-dist.")
    print("learned 6.8 %, RoPE 1.8 %, CoPE 0.0 %; OOD learned 21.7 %, RoPE 20.3 %, CoPE 4.9 %)")
    print("long_*: 4x the training length (255 tokens at cpu scale), p_i 0.8 and sparse 0.98")
    print(comparison_table(last, splits))
    print()
    print(reading(last, steps))
    plot = root / "errors.png"
    shown = tuple(s for s in ("test", "ood_sparse", "long_sparse") if s in splits)
    plot_errors(runs, shown, plot)
    print(f"\nerror plot: {plot}\nper-run loss plots and metrics: {root}/<position>/")


if __name__ == "__main__":
    app.run(main)
