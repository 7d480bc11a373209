"""Run records: the config and metrics of a study's complete runs, kept in the repository so
that a study that takes longer than one machine's life can be trained over several.

A study run with ``--records=<dir>`` first copies the records under ``<dir>/<study>/<scale>/``
into the workdirs of ``--workroot`` that hold no run yet (a complete run of the same config is
then only read: ``sweep.train_arm``; one of a different config is refused by ``train.run``,
naming the differing keys), and when it is done copies back ``config.json`` and
``metrics.jsonl`` of every complete run and the peer's result files (``peer/*.json``). A
record is about 10 kB; checkpoints are not kept, so a record cannot be resumed, only read.
To keep what a sweep still in progress has finished:

    python -m experiments.run_records --study=length_generalization --scale=cpu \
        --records=experiments/records
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
from collections.abc import Sequence
from pathlib import Path

import ml_collections

from copejax.runtime.metrics import read_jsonl
from copejax.runtime.workdir import CONFIG_FILE, config_to_dict, read_config, same_run

RUN_FILES = (CONFIG_FILE, "metrics.jsonl")
PEER = "peer"  # the directory of a study's peer results, one JSON file per run


def finished(workdir: Path, steps: int) -> bool:
    """Whether ``workdir``'s metrics.jsonl holds a record of step ``steps``."""
    metrics = workdir / "metrics.jsonl"
    return metrics.exists() and any(r.get("step") == steps for r in read_jsonl(metrics))


def finished_run_of(workdir: Path, config: ml_collections.ConfigDict) -> bool:
    """Whether ``workdir`` holds the last step of a run that ``config`` would resume (the same
    config up to ``copejax.runtime.workdir.RESUMABLE``): nothing is left to train, and its
    metrics can be read without restoring its checkpoint (~25 s a run)."""
    saved = read_config(workdir)
    return (
        saved is not None
        and same_run(saved, config_to_dict(config))
        and finished(workdir, config.train.steps)
    )


def complete(workdir: Path) -> bool:
    """Whether ``workdir`` holds its config and the metrics of that config's last step."""
    config = read_config(workdir)
    return config is not None and finished(workdir, config["train"]["steps"])


def _runs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name != PEER)


def _copy_changed(src: Path, dst: Path) -> bool:
    if dst.exists() and filecmp.cmp(src, dst, shallow=False):
        return False
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return True


def restore(records: str | Path, workroot: str | Path, study: str, scale: str) -> int:
    """Copies the records of ``study`` at ``scale`` into workdirs under ``workroot`` that have
    neither metrics nor checkpoints, and peer results not there yet; returns how many."""
    source, target = Path(records) / study / scale, Path(workroot) / study / scale
    if not source.is_dir():
        return 0
    copied = 0
    for run in _runs(source):
        workdir = target / run.name
        if (workdir / "metrics.jsonl").exists() or (workdir / "checkpoints").exists():
            continue  # a run on this machine, finished or not, is never overwritten
        for name in RUN_FILES:
            _copy_changed(run / name, workdir / name)
        copied += 1
    for result in sorted((source / PEER).glob("*.json")):
        if not (target / PEER / result.name).exists():
            copied += _copy_changed(result, target / PEER / result.name)
    return copied


def save(workroot: str | Path, records: str | Path, study: str, scale: str) -> int:
    """Copies ``config.json`` and ``metrics.jsonl`` of every complete run of ``study`` at
    ``scale`` under ``workroot``, and its peer results, into ``records``; returns how many
    records were new or changed."""
    source, target = Path(workroot) / study / scale, Path(records) / study / scale
    if not source.is_dir():
        return 0
    changed = 0
    for run in _runs(source):
        if complete(run):
            copies = [_copy_changed(run / name, target / run.name / name) for name in RUN_FILES]
            changed += any(copies)
    for result in sorted((source / PEER).glob("*.json")):
        changed += _copy_changed(result, target / PEER / result.name)
    return changed


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.run_records")
    parser.add_argument("--study", required=True)
    parser.add_argument("--scale", default="cpu")
    parser.add_argument("--workroot", default="/tmp/copejax_experiments")
    parser.add_argument("--records", required=True)
    args = parser.parse_args(argv)
    changed = save(args.workroot, args.records, args.study, args.scale)
    print(f"{changed} new or changed records under {Path(args.records) / args.study / args.scale}")


if __name__ == "__main__":
    main()
