"""Checkpoints with orbax-checkpoint: train state, grain iterator state and resolved config.

Each step directory ``<workdir>/checkpoints/<step>`` holds four items: ``state`` (parameters,
optimizer state, step; sharded arrays), ``data`` (the grain iterator's position, one file per
process), ``config`` (the resolved config as JSON) and ``host`` (the loop's running sums of the
current logging window, so that a resumed run logs the same averages). orbax writes into a
temporary directory and renames it when complete, so a run killed mid-save leaves the previous
checkpoint as the latest one (the temporary directory is removed at the next start). A latest
checkpoint that is nevertheless unreadable (a truncated file, a missing item) is reported,
moved to ``<workdir>/corrupt_checkpoints`` and the previous one restored
(:meth:`Checkpointer.restore_latest`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import grain
import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils


class CheckpointMismatchError(ValueError):
    """A checkpoint whose arrays do not fit the current config's state."""


class CorruptCheckpointError(ValueError):
    """Every checkpoint of a workdir is unreadable."""


CORRUPT_DIR = "corrupt_checkpoints"  # next to checkpoints/: where unreadable steps are moved
# (saved state's metadata, abstract state) -> (abstract state in the saved layout, function
# from the restored state to the current layout): how a checkpoint written under older names
# is read (copejax.model.param_paths.checkpoint_upgrade renames old parameter paths).
LayoutUpgrade = Callable[[Any, Any], tuple[Any, Callable[[Any], Any]]]


class Restored(NamedTuple):
    """What :meth:`Checkpointer.restore_latest` read back.

    Attributes:
      step: the checkpoint's step.
      state: the train state, in the abstract state's shardings.
      host: the loop's host-side sums saved with it.
      data_restored: whether the data iterator was moved to the saved position (False: the
        caller positions it, see ``check_config`` of ``restore_latest``).
      saved_mesh: the mesh axis sizes the state was saved from (None when not recorded).
    """

    step: int
    state: Any
    host: dict[str, float]
    data_restored: bool
    saved_mesh: dict[str, int] | None


def _leaves_by_path(tree: Any) -> dict[str, Any]:
    """Array leaves keyed by 'a/b/0/c' (metadata trees use dicts where the state has
    dataclass fields and tuples, so only the key names are compared)."""
    leaves = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(leaf, "shape"):
            names = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
            leaves["/".join(str(n) for n in names)] = leaf
    return leaves


def _shape_differences(saved: Any, abstract: Any) -> list[str]:
    """'path: saved shape vs expected shape' for every leaf whose shape or presence differs."""
    saved_leaves = _leaves_by_path(saved)
    wanted_leaves = _leaves_by_path(abstract)
    diffs = []
    for key in sorted(set(saved_leaves) | set(wanted_leaves), key=lambda k: (k[:6] != "params", k)):
        old, new = saved_leaves.get(key), wanted_leaves.get(key)
        old_shape = tuple(getattr(old, "shape", ())) if old is not None else None
        new_shape = tuple(getattr(new, "shape", ())) if new is not None else None
        if old_shape != new_shape:
            describe = lambda s: "absent" if s is None else str(s)
            diffs.append(f"{key}: checkpoint {describe(old_shape)}, config {describe(new_shape)}")
    return diffs


class Checkpointer:
    """An orbax CheckpointManager for (state, data iterator, config), keeping the last ``keep``.

    Args:
      directory: where step directories go (``<workdir>/checkpoints``).
      keep: how many of the latest checkpoints to keep.
      asynchronous: write arrays in a background thread (the loop goes on computing).
    """

    def __init__(self, directory: str | os.PathLike, keep: int, asynchronous: bool = True) -> None:
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            enable_async_checkpointing=asynchronous,
            create=True,
            cleanup_tmp_directories=True,
        )
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(),
            "config": ocp.JsonCheckpointHandler(),
            "host": ocp.JsonCheckpointHandler(),
        }
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(
        self,
        step: int,
        state: Any,
        data_iterator: grain.DatasetIterator | None,
        config: dict[str, Any],
        host: dict[str, float] | None = None,
    ) -> None:
        """Saves (asynchronously when so configured); ``wait`` blocks until it is on disk."""
        items: dict[str, Any] = {
            "state": ocp.args.StandardSave(state),
            "config": ocp.args.JsonSave(config),
            "host": ocp.args.JsonSave(dict(host or {})),
        }
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def saved_config_and_host(self, step: int) -> tuple[dict[str, Any], dict[str, float]]:
        """The resolved config and the loop's host-side sums stored with checkpoint ``step``."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(config=ocp.args.JsonRestore(), host=ocp.args.JsonRestore()),
        )
        return dict(restored["config"]), dict(restored["host"] or {})

    def saved_mesh(self, step: int) -> dict[str, int] | None:
        """Mesh axis name -> size of the sharding that checkpoint ``step``'s arrays were saved
        from (orbax's array metadata), or None when the metadata does not say."""
        metadata = self.manager.item_metadata(step)
        for leaf in jax.tree.leaves((metadata or {}).get("state")):
            mesh = getattr(leaf, "sharding", None)
            names, shape = getattr(mesh, "axis_names", None), getattr(mesh, "shape", None)
            if names is not None and shape is not None:
                return {str(n): int(k) for n, k in zip(names, list(shape), strict=True)}
        return None

    def data_state_fits(self, step: int) -> bool:
        """Whether checkpoint ``step`` holds a data-iterator state for this process of this
        process count (grain writes one file per process, ``process_<i>-of-<n>.json``)."""
        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        return (self.directory / str(step) / "data" / name).exists()

    def restore(
        self,
        step: int,
        abstract_state: Any,
        data_iterator: grain.DatasetIterator | None,
        upgrade: LayoutUpgrade | None = None,
    ) -> Any:
        """Restores checkpoint ``step`` into ``abstract_state``'s shapes, dtypes and shardings.

        ``data_iterator`` is moved to the saved position in place. A checkpoint whose arrays
        have other shapes (written by a different model config) raises CheckpointMismatchError
        listing the differing arrays, before orbax tries to read them. ``upgrade`` reads a
        checkpoint saved under older names (see :data:`LayoutUpgrade`).
        """
        metadata = self.manager.item_metadata(step)
        saved_tree = metadata["state"] if metadata is not None else None
        to_current: Callable[[Any], Any] = lambda state: state
        if saved_tree is not None and upgrade is not None:
            abstract_state, to_current = upgrade(saved_tree, abstract_state)
        if saved_tree is not None:
            diffs = _shape_differences(saved_tree, abstract_state)
            if diffs:
                shown = "\n  ".join(diffs[:10])
                more = f"\n  ... and {len(diffs) - 10} more" if len(diffs) > 10 else ""
                raise CheckpointMismatchError(
                    f"checkpoint {self.directory / str(step)} was written by a different model "
                    f"or optimizer config; arrays that differ:\n  {shown}{more}\n"
                    "Use the config that wrote it, or a fresh workdir (or --restart to discard "
                    "the old checkpoints)."
                )
        items: dict[str, Any] = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return to_current(restored["state"])

    def restore_latest(
        self,
        abstract_state: Any,
        data_iterator: grain.DatasetIterator | None,
        check_config: Callable[[int, dict[str, Any]], bool],
        upgrade: LayoutUpgrade | None = None,
    ) -> Restored | None:
        """Restores the newest readable checkpoint, or returns None if there is none.

        A checkpoint that cannot be read (a truncated or corrupted array file, a missing or
        torn item: a half-written checkpoint) is reported on stderr, moved to
        ``<workdir>/corrupt_checkpoints/<step>`` (so that the step can be saved again) and the
        previous one is tried. ``check_config(step, saved_config)`` may raise to refuse a
        checkpoint written by another config; that error, like CheckpointMismatchError, is a
        config problem rather than corruption and is raised as is. It returns whether the
        checkpoint's data-iterator state fits ``data_iterator`` (the same pipeline); when it
        does not (another number of data workers), or the checkpoint has no state for this
        process (another process count), the iterator is left alone and
        ``Restored.data_restored`` is False: the caller positions it. ``upgrade`` reads
        checkpoints saved under older parameter names (:meth:`restore`).

        Raises:
          CorruptCheckpointError: checkpoints exist but none of them can be read; or none is
            left and earlier ones were set aside as unreadable (a rerun after that refusal
            must not quietly start over at step 0: only --restart, which deletes them, does).
        """
        set_aside = self.directory.parent / CORRUPT_DIR
        if not self.all_steps() and set_aside.is_dir() and any(set_aside.iterdir()):
            raise CorruptCheckpointError(
                f"no readable checkpoint in {self.directory}: the run's checkpoints were "
                f"unreadable and were moved to {set_aside}. Pass --restart to start the run over "
                "(it deletes them), or move a checkpoint back into place to resume from it."
            )
        moved = []
        for step in sorted(self.all_steps(), reverse=True):
            try:
                saved, host = self.saved_config_and_host(step)
            except Exception as error:  # any read failure means corruption
                moved.append(self._set_aside(step, error))
                continue
            fits = check_config(step, saved) and self.data_state_fits(step)
            data = data_iterator if fits else None
            try:
                state = self.restore(step, abstract_state, data, upgrade)
            except CheckpointMismatchError:
                raise
            except Exception as error:
                moved.append(self._set_aside(step, error))
                continue
            return Restored(step, state, host, data is not None, self.saved_mesh(step))
        if moved:
            raise CorruptCheckpointError(
                f"no readable checkpoint in {self.directory}; unreadable ones were moved to "
                f"{', '.join(moved)}. Pass --restart to start the run over."
            )
        return None

    def _set_aside(self, step: int, error: Exception) -> str:
        """Reports checkpoint ``step`` as unreadable and moves it out of the manager's way."""
        source = self.directory / str(step)
        target = self.directory.parent / CORRUPT_DIR / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:400]
        if jax.process_index() == 0:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(source, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"copejax: checkpoint {step} set aside")
        self.manager.reload()
        print(
            f"warning: checkpoint {source} is unreadable (truncated or half-written?): {reason}\n"
            f"  moved it to {target}; trying the previous checkpoint",
            file=sys.stderr,
            flush=True,
        )
        return str(target)

    def close(self) -> None:
        # orbax 0.12.8's close() does not wait for the start-up removal of temporary
        # directories; a run that stops right after starting (a refusal) would otherwise print
        # that thread's traceback at interpreter exit. (Private; skipped where absent.)
        getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()
        self.manager.wait_until_finished()
        self.manager.close()
