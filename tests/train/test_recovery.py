"""Recovery: unreadable checkpoints are reported and skipped, non-finite state is never saved,
a resumed run logs every step once (metrics.jsonl and TensorBoard), the config is written
atomically."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from copejax.runtime import workdir
from copejax.runtime.checkpoint import CORRUPT_DIR, Checkpointer, CorruptCheckpointError
from copejax.runtime.metrics import MetricsWriter, read_jsonl
from copejax.training import train
from tests.train.test_metrics import tensorboard_scalars
from tests.train.tiny_task import tiny_config

TIMING = ("train/steps_per_sec", "train/tokens_per_sec")


def _deterministic(root: Path) -> list[dict[str, float]]:
    records = read_jsonl(root / "metrics.jsonl")
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _event_steps(root: Path) -> list[int]:
    """The steps of train/loss as TensorBoard's own reader shows them (purges applied)."""
    return [step for step, _ in tensorboard_scalars(root / "tb")["train/loss"]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("full")
    train.run(tiny_config(), root)
    return root


def _truncate_array_files(step_dir: Path) -> None:
    """Halves every array data file (OCDBT's ``d/`` files). Halving only the largest file of
    the item was flaky under load: an OCDBT save can leave a data file the manifest no
    longer references, and when that one was the largest the restore still succeeded."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no array data files under {step_dir / 'state'}"
    for path in files:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _remove_state_item(step_dir: Path) -> None:  # as if the save stopped before the arrays
    shutil.rmtree(step_dir / "state")


def _tear_config_json(step_dir: Path) -> None:
    path = step_dir / "config" / "metadata"
    path.write_bytes(path.read_bytes()[:40])


# Restoring truncated array files fails inside tensorstore while other reads are in flight; their
# callbacks can arrive after orbax's event loop closed (intermittent, third-party cleanup, after
# the error copejax handles). Only that unraisable is ignored, only for that case.
_LATE_TENSORSTORE_CALLBACK = pytest.mark.filterwarnings(
    "ignore:(?s)Exception ignored in.*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
)


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(_truncate_array_files, marks=_LATE_TENSORSTORE_CALLBACK),
        _remove_state_item,
        _tear_config_json,
    ],
)
def test_unreadable_latest_checkpoint_falls_back(
    corrupt: object, uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = tmp_path / "run"
    shutil.copytree(uninterrupted, root)
    corrupt(root / "checkpoints" / "6")  # type: ignore[operator]
    capsys.readouterr()
    train.run(tiny_config(), root)
    captured = capsys.readouterr()
    assert f"checkpoint {root / 'checkpoints' / '6'} is unreadable" in captured.err
    assert "resumed from checkpoint 3" in captured.out
    (moved,) = (root / CORRUPT_DIR).iterdir()
    assert moved.name.startswith("6-") and str(moved) in captured.err
    assert Checkpointer(root / "checkpoints", keep=5).all_steps() == [3, 6]
    assert _deterministic(root) == _deterministic(uninterrupted)
    assert _event_steps(root) == [1, 2, 3, 4, 5, 6]


def test_no_readable_checkpoint_is_a_clear_error(uninterrupted: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(uninterrupted, root)
    for step in (3, 6):
        _remove_state_item(root / "checkpoints" / str(step))
    with pytest.raises(CorruptCheckpointError, match=r"no readable checkpoint .*--restart"):
        train.run(tiny_config(), root)
    train.run(tiny_config(), root, restart=True)  # --restart clears the corrupt ones too
    assert not (root / CORRUPT_DIR).exists()
    assert _deterministic(root) == _deterministic(uninterrupted)


def test_resume_logs_every_step_once(uninterrupted: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    train.run(tiny_config(), root, stop_after=5)  # checkpoint 3; steps 4 and 5 are re-done
    assert _event_steps(root) == [1, 2, 3, 4, 5]
    train.run(tiny_config(), root)
    assert _event_steps(root) == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_jsonl(root / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert _deterministic(root) == _deterministic(uninterrupted)


def test_stopped_before_the_first_checkpoint_starts_clean(
    uninterrupted: Path, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    train.run(tiny_config(), root, stop_after=2)  # nothing saved yet
    train.run(tiny_config(), root)
    assert _event_steps(root) == [1, 2, 3, 4, 5, 6]
    assert _deterministic(root) == _deterministic(uninterrupted)


def test_a_torn_event_record_and_a_resume(tmp_path: Path) -> None:
    """A run killed mid-write leaves a torn last record; TensorBoard reads the events before
    it, and the resumed run's purge marker hides the old events of the steps it re-does."""
    writer = MetricsWriter(tmp_path)
    for step in (1, 2, 3, 4):
        writer.write(step, {"train/loss": float(step)})
    writer.close()
    (path,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    blob = path.read_bytes()
    path.write_bytes(blob + blob[-30:-7])  # a record cut short
    resumed = MetricsWriter(tmp_path, resumed_from=2)
    resumed.write(3, {"train/loss": 30.0})
    resumed.close()
    assert tensorboard_scalars(tmp_path / "tb") == {"train/loss": [(1, 1.0), (2, 2.0), (3, 30.0)]}


def test_nonfinite_state_is_never_saved(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """With nonfinite=skip, parameters that became NaN with a finite loss (an injected fault)
    make the run stop at the next save instead of overwriting good checkpoints."""
    make_steps = train.make_steps

    def poisoned(*args: object, **kwargs: object) -> object:
        steps = make_steps(*args, **kwargs)

        def step_fn(state: object, batch: object) -> tuple:
            state, out = steps.train(state, batch)
            if int(state.step) == 4:
                nan_params = jax.tree.map(lambda x: x * jnp.nan, state.params)
                state = state.replace(params=nan_params)
            return state, out

        return dataclasses.replace(steps, train=step_fn)

    monkeypatch.setattr(train, "make_steps", poisoned)
    config = tiny_config(nonfinite="skip")
    with pytest.raises(train.NonFiniteLossError, match=r"at step 6 .*not saved.*checkpoint 3"):
        train.run(config, tmp_path / "run")
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", keep=5)
    assert ckpt.all_steps() == [3]
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert records[-1]["train/nonfinite_steps"] == 2.0  # steps 5 and 6 were skipped


def test_config_is_written_by_rename(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / workdir.CONFIG_FILE
    workdir.write_json_atomic(path, {"a": 1})

    def crash(*args: object) -> None:
        raise OSError("killed between write and rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        workdir.write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}  # the old config is intact


def test_stopped_by_a_nan_resumes_with_skip(tmp_path: Path) -> None:
    config = tiny_config()
    config.task.options.poison_index = 3 * 8 + 5  # a row of step 4's batch (no shuffling)
    config.data.shuffle = False
    root = tmp_path / "run"
    with pytest.raises(train.NonFiniteLossError, match=r"at step 4;.*checkpoint 3 in .*skip"):
        train.run(config, root)
    other = tiny_config(learning_rate=2e-2)
    other.task.options.poison_index = 3 * 8 + 5
    other.data.shuffle = False
    with pytest.raises(workdir.WorkdirConflictError, match=r"train\.learning_rate: 0\.01 -> 0\.02"):
        train.run(other, root)  # train.nonfinite may change on resume, the optimizer may not
    config.train.nonfinite = "skip"
    final = train.run(config, root)
    records = read_jsonl(root / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert final["train/nonfinite_steps"] == 1.0
    # Step 4's logging window (log_every=1) was all skipped: no loss, not a loss of 0.
    assert [r["train/loss"] is None for r in records] == [False, False, False, True, False, False]
    assert workdir.read_config(root)["train"]["nonfinite"] == "skip"
