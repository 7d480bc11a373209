"""What every study page shares: its header (scale, seeds, wall time, load), the block of
commands that regenerate it, and the one writer of a page and its JSON."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from copejax.runtime.results_json import write_json
from experiments.sweep import Sweep


def commands_block(
    study: str, args: argparse.Namespace, sweep: Sweep, options: Sequence[str] = ()
) -> str:
    """The command that regenerates a page and every training run it makes. The command
    repeats the ``args`` that shape the page (``--scale``, and ``--seeds`` when it was given)
    and the study's own ``options`` (its flags beyond :func:`parse_args`)."""
    seeds = [f"--seeds={args.seeds}"] if args.seeds else []
    lines = [
        "Regenerate this page (all runs, then the table and plots):",
        "",
        "```",
        " ".join([f"python -m experiments.{study}", f"--scale={args.scale}", *seeds, *options]),
        "```",
        "",
        "which trains, one after another (each line also runs alone):",
        "",
        "```",
        *sweep.commands,
        "```",
    ]
    return "\n".join(lines)


def write_outputs(
    out: str | Path,
    study: str,
    scale: str,
    page: str,
    result: Sweep,
    **fields: Any,
) -> Path:
    """The one results writer of the studies: ``<out>/<study>.md`` (``<study>_<scale>.md``
    unless the scale is cpu) and the JSON beside it, ``{"study", "scale", "seeds",
    "wall_time_s", **fields, "commands"}`` with non-finite numbers as null. Returns the
    markdown path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    stem = study if scale == "cpu" else f"{study}_{scale}"
    data = {
        "study": study,
        "scale": scale,
        "seeds": result.seeds,
        "wall_time_s": result.wall_time_s,
        **fields,
        "commands": result.commands,
    }
    write_json(out / f"{stem}.json", data)
    path = out / f"{stem}.md"
    path.write_text(page.rstrip() + "\n")
    return path


def _processes(jobs: int) -> str:
    return "one process" if jobs == 1 else f"{jobs} single-threaded training processes"


def logged_training_s(sweep: Sweep) -> float:
    """Seconds of training steps in the runs' logs: each logged window's steps over its
    ``train/steps_per_sec``, summed over windows, seeds and arms (evaluation left out)."""
    total = 0.0
    for per_seed in sweep.records.values():
        for records in per_seed:
            previous = 0
            for record in records:
                if "train/steps_per_sec" in record:
                    total += (record["step"] - previous) / record["train/steps_per_sec"]
                    previous = record["step"]
    return total


def header(title: str, scale: str, sweep: Sweep, notes: str) -> str:
    return "\n".join(
        [
            f"# {title}",
            "",
            f"Scale `{scale}`, seeds {sweep.seeds}, wall time {sweep.wall_time_s / 60:.1f} min"
            f" (training and evaluation, {_processes(sweep.jobs)} on {os.cpu_count()} CPUs;"
            " 1-minute load "
            f"average {sweep.load_average[0]:.1f} at the start, {sweep.load_average[1]:.1f} "
            "at the end"
            + (
                f"; {sweep.reused} runs were already complete and only re-read; the training"
                f" logs of all {sum(map(len, sweep.records.values()))} runs add up to"
                f" {logged_training_s(sweep) / 60:.1f} min of training steps"
                if sweep.reused
                else ""
            )
            + ").",
            "",
            notes.strip(),
            "",
        ]
    )
