"""Sweeps for the results pages: train arms (a config plus options) over seeds with
``copejax.training.train.run``, average the last evaluation over seeds, and format the cells of
the tables that set them next to the papers' numbers (CoPE, arXiv 2405.18719; TAPE,
arXiv 2501.00712). A page's header, commands and files are ``experiments.sweep_page``'s, its
plots ``experiments.sweep_plots``'.

Every run is an ordinary copejax workdir, so any of them can be re-run alone with the
command the page lists (``python -m copejax.main --config=... --workdir=...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from copejax.config.base import load_config
from copejax.runtime.metrics import read_jsonl
from experiments import run_records, workers

ROOT = Path(__file__).resolve().parents[1]
SCALES = ("smoke", "cpu", "paper")
REUSED: set[Path] = set()  # workdirs found complete (their training time is not in this run's)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One row of a study: a config file and its argument string.

    Attributes:
      label: the row's name in tables and plots.
      config_file: path relative to the repository root, e.g. ``configs/flipflop.py``.
      arg: the config argument without the seed, e.g. ``cpu,position=cope``.
      home: another study's name, to reuse that study's runs of the same config.
    """

    label: str
    config_file: str
    arg: str
    home: str = ""  # the study whose workdirs hold this arm's runs (default: the sweep's)

    def config_arg(self, seed: int) -> str:
        return f"{self.arg},seed={seed}"

    def config(self, seed: int) -> ml_collections.ConfigDict:
        """The config that trains this arm and seed."""
        return load_config(ROOT / self.config_file, self.config_arg(seed))

    def command(self, seed: int, workdir: Path) -> str:
        """The CLI command that trains this arm and seed alone."""
        return (
            f"python -m copejax.main --config={self.config_file}:{self.config_arg(seed)}"
            f" --workdir={workdir}"
        )


def parse_args(argv: Sequence[str] | None, study: str) -> argparse.Namespace:
    """The options every study script takes."""
    parser = argparse.ArgumentParser(prog=f"python -m experiments.{study}")
    parser.add_argument("--scale", choices=SCALES, default="cpu")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    parser.add_argument("--workroot", default="/tmp/copejax_experiments")
    parser.add_argument("--seeds", type=int, default=0, help="0: the scale's default")
    parser.add_argument("--jobs", type=int, default=1, help="runs trained at once, each on one CPU")
    args = parser.parse_args(argv)
    if args.seeds < 0:
        parser.error(f"--seeds must be >= 0, got {args.seeds}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    return args


def workdir_of(workroot: str | Path, study: str, scale: str, arm: Arm, seed: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in arm.label)
    return Path(workroot) / study / scale / f"{safe}_seed{seed}"


def train_arm(arm: Arm, seed: int, workdir: Path) -> list[dict[str, float]]:
    """Trains (or resumes, or finds complete) one arm and seed; returns its metric records.

    A complete run of the same config (:func:`experiments.run_records.finished_run_of`) is only
    read. Any other workdir goes through ``train.run``, which resumes it or refuses a different
    config."""
    from copejax.training import train

    config = arm.config(seed)
    print(f"== {arm.label} seed {seed} -> {workdir}", flush=True)
    if run_records.finished_run_of(workdir, config):
        REUSED.add(workdir)
        print("complete: its metrics are read, its checkpoints left alone", flush=True)
    else:
        train.run(config, workdir)
    return read_jsonl(workdir / "metrics.jsonl")


def last_eval(records: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The ``eval/...`` scalars of the last record that has any (prefix dropped)."""
    for record in reversed(records):
        found = {k.removeprefix("eval/"): v for k, v in record.items() if k.startswith("eval/")}
        if found:
            return {"step": record["step"], **found}
    raise ValueError("no evaluation record in the metrics")


def eval_curve(records: Sequence[Mapping[str, float]], key: str) -> list[tuple[int, float]]:
    """(step, value) of ``eval/<key>`` at every evaluation."""
    return [(int(r["step"]), float(r[f"eval/{key}"])) for r in records if f"eval/{key}" in r]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population standard deviation (0 for a single seed); NaN when empty."""
    array = np.asarray(values, dtype=np.float64)
    if array.size == 0:
        return float("nan"), float("nan")
    return float(array.mean()), float(array.std())


@dataclasses.dataclass
class Sweep:
    """The outcome of :func:`run_sweep`: per arm, per seed, the metric records and commands."""

    study: str
    scale: str
    seeds: list[int]
    records: dict[str, list[list[dict[str, float]]]]
    commands: list[str]
    wall_time_s: float
    workdirs: dict[str, list[Path]]
    reused: int = 0
    load_average: tuple[float, float] = (float("nan"), float("nan"))  # 1-min, start and end
    jobs: int = 1  # runs trained at once

    def final(self, label: str, key: str) -> list[float]:
        """``eval/<key>`` of the last evaluation of each seed of arm ``label``."""
        return [last_eval(r)[key] for r in self.records[label] if key in last_eval(r)]


def train_parallel(jobs: Sequence[tuple[Arm, int, Path]], processes: int) -> None:
    """Trains ``(arm, seed, workdir)`` jobs, ``processes`` at a time, each with its command
    (:meth:`Arm.command`) in its own process on one CPU (:func:`experiments.workers.run_pinned`),
    its output lines labelled ``[arm seed N]``. A failed run raises; Ctrl-C or SIGTERM stops
    the runs after they save and exits with 128 + the signal (the same command resumes)."""
    work = [
        workers.Job.training(
            f"{arm.label} seed {seed}", ROOT / arm.config_file, arm.config_arg(seed), workdir
        )
        for arm, seed, workdir in jobs
    ]
    outcome = workers.run_pinned(work, processes)
    if outcome.stopped_by is not None:
        raise SystemExit(128 + outcome.stopped_by)
    failed = set(outcome.failed())
    if failed:
        commands = [job.command() for job in work if job.label in failed]
        raise RuntimeError("runs failed (their output above): " + "; ".join(commands))


def run_sweep(
    study: str,
    scale: str,
    arms: Sequence[Arm],
    seeds: Sequence[int],
    workroot: str | Path,
    *,
    jobs: int = 1,
    records_dir: str | Path = "",
) -> Sweep:
    """Trains every arm with every seed: one after another, or ``jobs`` runs at a time (see
    :func:`train_parallel`), then reads every run's records in order. With ``records_dir``, the
    runs kept there are copied in first and every complete run is kept there at the end
    (:mod:`experiments.run_records`; only for studies that read nothing but the runs'
    metrics, since a kept run has no checkpoints)."""
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    if records_dir:
        restored = run_records.restore(records_dir, workroot, study, scale)
        print(f"{restored} runs from {records_dir}")
    trained_by_workers: set[Path] = set()
    if jobs > 1:
        todo = [
            (arm, seed, workdir_of(workroot, arm.home or study, scale, arm, seed))
            for arm in arms
            for seed in seeds
        ]
        todo = [(a, s, w) for a, s, w in todo if not run_records.finished_run_of(w, a.config(s))]
        train_parallel(todo, jobs)
        trained_by_workers = {w for _, _, w in todo}
    records: dict[str, list[list[dict[str, float]]]] = {}
    workdirs: dict[str, list[Path]] = {}
    commands = []
    for arm in arms:
        for seed in seeds:
            workdir = workdir_of(workroot, arm.home or study, scale, arm, seed)
            commands.append(arm.command(seed, workdir))
            records.setdefault(arm.label, []).append(train_arm(arm, seed, workdir))
            workdirs.setdefault(arm.label, []).append(workdir)
    REUSED.difference_update(trained_by_workers)
    reused = sum(w in REUSED for ws in workdirs.values() for w in ws)
    if records_dir:
        saved = run_records.save(workroot, records_dir, study, scale)
        print(f"{saved} runs kept in {records_dir}")
    return Sweep(
        study, scale, list(seeds), records, commands, time.perf_counter() - start, workdirs,
        reused, (load_start, os.getloadavg()[0]), jobs,
    )  # fmt: skip


# Issue 15's schemes since CoPE, arms of studies 1-3 beside the seed-paper arms.
CONTEXTUAL_SINCE_COPE = ("path", "path+fox", "selective", "dape")


def seed_comparison(
    label: str, base: str, per_seed: Mapping[str, Sequence[float]], what: str
) -> str:
    """``"`path` OOD sparse 1.20 % vs `rope` 9.00 % (below on every seed)"``: two arms' mean
    errors and whether every seed of ``label`` is below (or above) every seed of ``base``."""
    mine, theirs = list(per_seed[label]), list(per_seed[base])
    if max(mine) < min(theirs):
        order = "below on every seed"
    elif min(mine) > max(theirs):
        order = "above on every seed"
    elif mine == theirs and len(set(mine)) == 1:
        order = "equal on every seed"
    else:
        order = "the seeds overlap"
    return (
        f"`{label}` {what} ".replace("  ", " ") + f"{100 * np.mean(mine):.2f} % vs `{base}` "
        f"{100 * np.mean(theirs):.2f} % ({order})"
    )


def percent(mean_std_pair: tuple[float, float], scale: float = 100.0, digits: int = 1) -> str:
    """``"12.3 ± 4.5"`` (the pair times ``scale``)."""
    mean, std = mean_std_pair
    if np.isnan(mean):
        return "n/a"
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


def median_range(values: Sequence[float], digits: int = 1, unit: str = "") -> str:
    """``"12.3 (10.1-15.0)"``: the median of ``values`` (NaNs left out), then ``unit``, and in
    brackets the smallest and largest; ``"n/a"`` for none. For timings and speed ratios on a
    shared machine, where one run that trained alone should show in the range without moving
    the cell, as it moves a mean."""
    array = np.asarray(values, dtype=np.float64)
    array = array[~np.isnan(array)]
    if array.size == 0:
        return "n/a"
    median = float(np.median(array))
    return f"{median:.{digits}f}{unit} ({array.min():.{digits}f}-{array.max():.{digits}f})"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def per_seed_table(
    result: Sweep, keys: Mapping[str, str], scale: float = 100.0, digits: int = 1
) -> str:
    """A markdown table of every seed's last evaluation: one row per arm, one column per
    ``eval/<key>`` (``keys`` maps each key to its header), cells ``"v0 / v1 / ..."`` in seed
    order, so that a reader sees the spread behind each mean."""
    rows = [
        [
            label,
            *(
                " / ".join(f"{scale * v:.{digits}f}" for v in result.final(label, key)) or "-"
                for key in keys
            ),
        ]
        for label in result.records
    ]
    return markdown_table(["arm", *keys.values()], rows)


def paper_cell(paper: Mapping[str, Mapping[str, float]], label: str, column: str) -> str:
    value = paper.get(label, {}).get(column)
    return "-" if value is None else f"{value:g}"


def spread(mean: float, std: float, per_seed: Sequence[float]) -> dict[str, Any]:
    """One cell of a results JSON: the mean and standard deviation over seeds, and each
    seed's value."""
    return {"mean": mean, "std": std, "per_seed": list(per_seed)}


def seeds_for(args: argparse.Namespace, default: int) -> list[int]:
    return list(range(args.seeds or default))
