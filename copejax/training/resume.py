"""Resuming a run whose settings changed: every change named in the log, the data repositioned.

A resumed run may change the keys of ``copejax.runtime.workdir.RESUMABLE`` (the step count,
the mesh, cadences, data workers), and it may run on another device count. What each change
means for the run goes into the log when the checkpoint is restored: the keys with their old
and new values; for ``train.steps`` under a decaying schedule, the learning rate the next step
trains at under the new schedule and the old one; for the mesh and device count, the mesh the
arrays were saved from and the one orbax restored them into. The data iterator's saved state
belongs to its pipeline (one file per process, a state shaped by the number of workers); when
that changed, a fresh iterator is moved to the batch the restored step reads next.
"""

from __future__ import annotations

from typing import Any

import grain
import jax
import ml_collections

from copejax.runtime import sharding, workdir
from copejax.runtime.checkpoint import Restored
from copejax.training import input_pipeline, optim


def _mesh_text(sizes: dict[str, int]) -> str:
    axes = " x ".join(f"{axis}={sizes.get(axis, 1)}" for axis in sharding.MESH_AXES)
    count = 1
    for axis in sharding.MESH_AXES:
        count *= sizes.get(axis, 1)
    return f"{axes} ({count} devices)"


def _schedule_note(saved: dict[str, Any], train: ml_collections.ConfigDict, start: int) -> str:
    """What a new ``train.steps`` does to the learning rate of the next step."""
    if train.schedule == "constant":
        return ""
    old_train = ml_collections.ConfigDict(saved["train"])
    before = float(optim.learning_rate_schedule(old_train)(start))
    after = float(optim.learning_rate_schedule(train)(start))
    return (
        f" (the {train.schedule} learning-rate schedule now runs to step {train.steps}: step "
        f"{start + 1} trains at {after:.4g}, where the saved run's schedule gave {before:.4g})"
    )


def changes(
    saved: dict[str, Any],
    resolved: dict[str, Any],
    train: ml_collections.ConfigDict,
    restored: Restored,
    mesh: jax.sharding.Mesh,
) -> list[str]:
    """The log lines naming what this invocation changed from the checkpoint's run.

    Args:
      saved: the resolved config stored with the restored checkpoint.
      resolved: this invocation's resolved config.
      train: this invocation's ``config.train``.
      restored: the restored checkpoint.
      mesh: the mesh the state was restored into.

    Returns:
      One line per changed RESUMABLE key, one for a changed mesh or device count; empty when
      nothing changed.
    """
    lines = []
    for change in workdir.resumable_changes(saved, resolved):
        steps = change.startswith("train.steps:")
        note = _schedule_note(saved, train, restored.step) if steps else ""
        lines.append(f"  {change}{note}")
    now = {str(axis): int(size) for axis, size in mesh.shape.items()}
    if restored.saved_mesh is not None and restored.saved_mesh != now:
        lines.append(
            f"  mesh: {_mesh_text(restored.saved_mesh)} -> {_mesh_text(now)} (the arrays are "
            "restored into the new shardings)"
        )
    return lines


def position_data(data: grain.DatasetIterator, restored: Restored, worker_count: int) -> str | None:
    """Moves ``data`` to the restored step's batch when its saved state was not restored
    (another number of workers or processes); returns the line to log, or None."""
    if restored.data_restored:
        return None
    input_pipeline.seek(data, restored.step, worker_count)
    return (
        f"  data: the saved iterator state is for another pipeline (data.worker_count or the "
        f"process count); the iterator starts at batch {restored.step}, the one step "
        f"{restored.step + 1} reads"
    )
