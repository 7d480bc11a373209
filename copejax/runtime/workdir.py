"""Workdir safety: one run per workdir, its config written atomically, restarts on request.

``<workdir>/config.json`` holds the resolved config of the run that owns the workdir. Running
the same config again resumes; keys that change neither the model nor the data stream may
change on resume (RESUMABLE: the step count, the mesh, cadences, data workers), and the run
names each change. Any other difference is refused, naming the keys that differ, the keys
that may change, and the ways on: a new workdir initialised from this one (``train.init_from``)
or a restart, which removes the old run's checkpoints and metrics.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import ml_collections

CONFIG_FILE = "config.json"
RUN_OUTPUTS = ("checkpoints", "corrupt_checkpoints", "metrics.jsonl", "tb", CONFIG_FILE)
# What the tools write into a run's workdir (copejax.evaluation.extrapolate, copejax.plots.maps):
# they
# describe that run, so --restart deletes them with it.
TOOL_OUTPUTS = ("extrapolation.json", "extrapolation.png", "maps_l*_h*.png")


class WorkdirConflictError(ValueError):
    """The workdir belongs to a run with a different config."""


def config_to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """The config as plain JSON data (tuples become lists), as stored in config.json."""
    return json.loads(config.to_json(sort_keys=True))


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat or {prefix[:-1]: {}}
    return {prefix[:-1]: tree}


# Sizes that configs saved before copejax.model.config.ModelConfig.from_config wrote as 0 for
# "unset" (now null): a saved 0 equals a new null.
UNSET_AS_ZERO = (
    "model.head_dim",
    "model.mlp_dim",
    "model.max_len",
    "model.window",
    "model.num_kv_heads",
)


# Keys added to the schema after runs were saved, with the value that reproduces those runs:
# a saved config without the key equals a new one that holds this value.
ADDED_KEYS: dict[str, Any] = {
    "model.norm_eps": 1e-6,
    "train.init_from": "",
    "model.dense_init": "normal",
    # Earlier runs decoded window layers of key-ordered schemes with the full cache; the ring
    # gives the same numbers (tests/test_ring_decode.py), and training never decodes.
    "model.window_decode_cache": "ring",
}


def _unset_zero_as_none(flat: dict[str, Any]) -> dict[str, Any]:
    flat = {**{k: v for k, v in ADDED_KEYS.items() if k not in flat}, **flat}
    return {k: (None if k in UNSET_AS_ZERO and v == 0 else v) for k, v in flat.items()}


def config_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key: old -> new' for every dotted key whose value differs (RESUMABLE keys included)."""
    flat_old = _unset_zero_as_none(_flatten(old))
    flat_new = _unset_zero_as_none(_flatten(new))
    missing = "<absent>"
    return [
        f"{key}: {flat_old.get(key, missing)!r} -> {flat_new.get(key, missing)!r}"
        for key in sorted(set(flat_old) | set(flat_new))
        if flat_old.get(key, missing) != flat_new.get(key, missing)
    ]


# Keys a resumed run may change: they decide what happens at future steps or where the
# computation runs, not what the saved state is or which batches come next.
# - train.steps: a run goes on to the new count (a finished one too); the learning-rate
#   schedule is a function of it, so its later steps follow the schedule of the new count
#   (the resume log says so).
# - mesh.*: orbax restores the arrays into the new mesh's shardings; the device count is not a
#   key (mesh.data=-1 takes what there is), the resume log names a change of it too.
# - cadences: logging, evaluating (it leaves training untouched: tests/train/test_train.py),
#   checkpointing and how many checkpoints are kept.
# - data.worker_count: the data iterator is positioned at the restored step whatever the
#   number of workers (copejax.training.resume).
# - train.nonfinite: a run stopped by a non-finite loss can go on with nonfinite=skip.
# The config file then records the latest invocation's values.
RESUMABLE = (
    "train.steps",
    "mesh.data",
    "mesh.fsdp",
    "mesh.tensor",
    "train.log_every",
    "train.eval_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "data.worker_count",
    "train.nonfinite",
)


def _key(difference: str) -> str:
    return difference.split(":", maxsplit=1)[0]


def resumable_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key: old -> new' for every RESUMABLE key that ``new`` changes."""
    return [d for d in config_differences(old, new) if _key(d) in RESUMABLE]


def same_run(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """True when ``new`` may resume a run of ``old``: equal apart from RESUMABLE keys."""
    return not [d for d in config_differences(old, new) if _key(d) not in RESUMABLE]


def refusal(what: str, old: dict[str, Any], new: dict[str, Any]) -> str:
    """The message refusing to resume ``what`` (a workdir, a checkpoint) of config ``old``
    with ``new``: the keys that differ, those that may change, and the ways on."""
    diffs = [d for d in config_differences(old, new) if _key(d) not in RESUMABLE]
    shown = "\n  ".join(diffs[:20])
    more = f"\n  ... and {len(diffs) - 20} more" if len(diffs) > 20 else ""
    return (
        f"{what} holds a run with a different config; differing keys:\n  {shown}{more}\n"
        f"A resumed run may change only {', '.join(RESUMABLE)}.\n"
        "To keep that run and train this config from its weights, use a new --workdir with "
        "--config.train.init_from=<this workdir> (a fine-tune: it starts at step 0 from the "
        "run's latest checkpoint); to discard that run, pass --restart (it deletes its "
        "checkpoints and metrics and starts over)."
    )


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Writes JSON to a temporary file in the same directory, then renames it over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_config(workdir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(workdir) / CONFIG_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


def _outputs(workdir: str | os.PathLike) -> list[Path]:
    root = Path(workdir)
    found = [root / name for name in RUN_OUTPUTS if (root / name).exists()]
    for pattern in TOOL_OUTPUTS:
        found.extend(sorted(root.glob(pattern)))
    return found


def check(workdir: str | os.PathLike, config: dict[str, Any], restart: bool) -> bool:
    """Checks that ``workdir`` may run ``config``; returns True when its outputs must be wiped.

    Raises:
      WorkdirConflictError: the workdir holds a run of a different config and ``restart`` is
        False; the message lists the differing keys.
    """
    old = read_config(workdir)
    if restart:
        return bool(_outputs(workdir))
    if old is None or same_run(old, config):
        return False
    raise WorkdirConflictError(refusal(f"workdir {workdir}", old, config))


def wipe(workdir: str | os.PathLike) -> list[str]:
    """Removes a previous run's outputs (only the files copejax and its tools write there).

    Returns the names removed, for the message that says what --restart deleted.
    """
    removed = []
    for path in _outputs(workdir):
        if path.is_dir():
            shutil.rmtree(path)
            removed.append(f"{path.name}/")
        else:
            path.unlink()
            removed.append(path.name)
    return removed


def run_labels(workdirs: list[str]) -> dict[str, str]:
    """A legend label per workdir: its ``model.position`` (else the directory name); runs that
    share a scheme all get ``"<scheme> (<directory name>)"``, or the whole path when the
    directory names repeat too."""
    schemes = {}
    for path in workdirs:
        config = read_config(path) if Path(path).is_dir() else None
        schemes[path] = str((config or {}).get("model", {}).get("position") or Path(path).name)
    labels = {}
    for path, scheme in schemes.items():
        twins = [p for p, s in schemes.items() if s == scheme]
        if len(twins) == 1:
            labels[path] = scheme
        else:
            names = [Path(p).name for p in twins]
            unique = names.count(Path(path).name) == 1
            labels[path] = f"{scheme} ({Path(path).name if unique else path})"
    return labels
