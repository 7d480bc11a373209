"""The length-generalisation study's numbers from its runs: per arm and task the accuracy
and step time over seeds, accuracy by input length, the repeat rule on the same splits, and
the x-transformers peer's runs (trained, cached and read back) in copejax's shape."""

from __future__ import annotations

import concurrent.futures
import json
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from copejax.config.base import load_config
from copejax.data._length_suite import repeat_rule_accuracy
from copejax.data.base import make_task
from experiments import length_generalization_peer as peer_module
from experiments import run_records, sweep
from experiments.length_generalization_arms import (
    ARGS,
    ARMS,
    CONFIG,
    REPEAT_SAMPLES,
    SPLITS,
    STUDY,
    label,
)


def step_ms(records: Sequence[Mapping[str, float]]) -> float:
    """Milliseconds per training step: 1000 / the median logged steps/s, the first logged
    window (compilation) left out when there are others."""
    speeds = [r["train/steps_per_sec"] for r in records if "train/steps_per_sec" in r]
    speeds = speeds[1:] if len(speeds) > 1 else speeds
    return 1000.0 / statistics.median(speeds) if speeds else float("nan")


def summarize(
    result: sweep.Sweep,
    tasks: Sequence[str],
    arms: Sequence[str] = ARMS,
    label_of: Callable[[str, str], str] = label,
) -> dict[str, dict[str, Any]]:
    """arm -> task -> {split: spread of accuracy, "step_ms": spread} of the runs labelled
    ``label_of(task, arm)`` (the study's arms, or the init probe's with ``probe_label``)."""
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        for task in tasks:
            key = label_of(task, arm)
            if key not in result.records:
                continue
            cell: dict[str, Any] = {}
            for split in SPLITS:
                values = result.final(key, f"{split}/accuracy")
                cell[split] = sweep.spread(*sweep.mean_std(values), values)
            times = [step_ms(r) for r in result.records[key]]
            cell["step_ms"] = sweep.spread(*sweep.mean_std(times), times)
            out.setdefault(arm, {})[task] = cell
    return out


def length_curves(result: sweep.Sweep, task: str) -> dict[str, list[list[tuple[float, float]]]]:
    """arm -> per seed, (input length, accuracy) over the training and test lengths of the
    last evaluation (``test/accuracy/<n>`` and ``long/accuracy/<n>``)."""
    curves: dict[str, list[list[tuple[float, float]]]] = {}
    for arm in ARMS:
        for records in result.records.get(label(task, arm), []):
            final = sweep.last_eval(records)
            points = {
                int(key.rsplit("/", 1)[1]): float(value)
                for key, value in final.items()
                if key.startswith(("test/accuracy/", "long/accuracy/"))
            }
            curves.setdefault(arm, []).append(sorted(points.items()))
    return curves


def repeat_rule(tasks: Sequence[str], scale: str) -> dict[str, dict[str, dict[str, float]]]:
    """task -> split -> :func:`repeat_rule_accuracy` (``accuracy`` and ``accuracy/<n>``) on
    the study's evaluation splits at ``scale``, data seed 0, at least ``REPEAT_SAMPLES``
    sequences per length."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for task in tasks:
        options = load_config(CONFIG, f"{task},{ARGS[scale]}").task.options.to_dict()
        per_length = max(options.get("samples_per_length", 0), REPEAT_SAMPLES)
        made = make_task(task, {**options, "samples_per_length": per_length})
        out[task] = {split: repeat_rule_accuracy(made, split, seed=0) for split in SPLITS}
    return out


def repeat_curve(by_split: Mapping[str, Mapping[str, float]]) -> list[tuple[int, float]]:
    """(input length, accuracy) of the repeat rule over the training and test lengths of one
    task, from its :func:`repeat_rule` entry."""
    points = {
        int(key.rsplit("/", 1)[1]): float(value)
        for summary in by_split.values()
        for key, value in summary.items()
        if key.startswith("accuracy/")
    }
    return sorted(points.items())


def run_peer(
    tasks: Sequence[str],
    scale: str,
    seeds: Sequence[int],
    workroot: str,
    threads: int,
    *,
    jobs: int = 1,
    parametrisation: str = peer_module.PARAMETRISATIONS[0],
    arms: Sequence[str] = peer_module.ARMS,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """x-transformers results: arm -> task -> one result dict per seed (cached as JSON under
    ``<workroot>/length_generalization/<scale>/peer``, so a re-run only reads them). Runs not
    cached yet train ``jobs`` at a time, each in its own side-venv process, for ``arms``.
    Runs with ``parametrisation="copejax"`` (the probe) are cached apart."""
    cache = Path(workroot) / STUDY / scale / run_records.PEER
    cache.mkdir(parents=True, exist_ok=True)
    default = parametrisation == peer_module.PARAMETRISATIONS[0]
    runs = [(task, arm, seed) for task in tasks for arm in arms for seed in seeds]
    suffix = "" if default else f"_{parametrisation}"

    def path_of(task: str, arm: str, seed: int) -> Path:
        return cache / f"{task}_{arm}_seed{seed}{suffix}.json"

    def train(run: tuple[str, str, int]) -> None:
        task, arm, seed = run
        print(f"== peer x-transformers ({parametrisation}) {task}, {arm} seed {seed}", flush=True)
        config_arg = f"{task},{ARGS[scale]},seed={seed}"
        result = peer_module.run(config_arg, arm, threads, parametrisation)
        path_of(*run).write_text(json.dumps(result))

    todo = [run for run in runs if not path_of(*run).exists()]
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        list(pool.map(train, todo))  # re-raises a failed run's error
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for task, arm, seed in runs:
        result = json.loads(path_of(task, arm, seed).read_text())
        out.setdefault(arm, {}).setdefault(task, []).append(result)
    return out


def peer_json(
    peer: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]],
) -> dict[str, dict[str, Any]]:
    """arm -> task -> {split: spread of accuracy, "step_ms": spread} of the peer's runs, in
    the shape of copejax's ``results``."""
    out: dict[str, dict[str, Any]] = {}
    for arm, by_task in peer.items():
        for task, runs in by_task.items():
            cell = {}
            for key in [f"{s}/accuracy" for s in SPLITS] + ["step_ms"]:
                values = [r[key] for r in runs]
                cell[key.split("/")[0]] = sweep.spread(*sweep.mean_std(values), values)
            out.setdefault(arm, {})[task] = cell
    return out
