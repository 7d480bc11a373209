"""Everyday reliability of train.run (issue 17): skipped steps are not logged as loss 0, the
"no readable checkpoint" refusal holds on rerun, a workdir lock, SIGTERM / Ctrl-C save and
resume exactly, --restart says what it deletes, a rerun of a finished run adds no event file."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
from pathlib import Path

import pytest

from copejax.runtime.checkpoint import Checkpointer, CorruptCheckpointError
from copejax.runtime.metrics import read_jsonl
from copejax.runtime.preemption import Preempted
from copejax.runtime.workdir_lock import (
    LOCK_FILE,
    WorkdirBusyError,
    WorkdirLock,
    WorkdirUnusableError,
)
from copejax.training import train
from tests.train.test_recovery import _deterministic, _event_steps, _remove_state_item
from tests.train.tiny_task import tiny_config


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("full")
    train.run(tiny_config(), root)
    return root


def _poisoned_at_step_4() -> object:
    config = tiny_config(nonfinite="skip")
    config.task.options.poison_index = 3 * 8 + 5  # a row of step 4's batch (no shuffling)
    config.data.shuffle = False
    return config


def test_a_skipped_window_is_logged_as_missing_not_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    train.run(_poisoned_at_step_4(), tmp_path)  # log_every=1: step 4's window is all skipped
    records = {r["step"]: r for r in read_jsonl(tmp_path / "metrics.jsonl")}
    assert records[4]["train/loss"] is None and records[4]["train/grad_norm"] is None
    assert all(records[s]["train/loss"] > 0 for s in (1, 2, 3, 5, 6))
    out = capsys.readouterr()
    assert "step 4/6 | loss n/a (1 skipped)" in out.out
    assert "warning: 1 of 6 steps were skipped" in out.err


def test_a_run_that_skipped_every_step_fails(tmp_path: Path) -> None:
    config = tiny_config(nonfinite="skip")
    config.task.options.poison_all = True
    with pytest.raises(train.NonFiniteLossError, match=r"all 6 steps .* skipped"):
        train.run(config, tmp_path)
    assert all(r["train/loss"] is None for r in read_jsonl(tmp_path / "metrics.jsonl"))
    with pytest.raises(train.NonFiniteLossError, match=r"all 6 steps"):
        train.run(config, tmp_path)  # a rerun of the finished run says so again


def test_no_readable_checkpoint_is_refused_again_on_rerun(
    uninterrupted: Path, tmp_path: Path
) -> None:
    root = tmp_path / "run"
    shutil.copytree(uninterrupted, root)
    for step in (3, 6):
        _remove_state_item(root / "checkpoints" / str(step))
    before = read_jsonl(root / "metrics.jsonl")
    with pytest.raises(CorruptCheckpointError, match="no readable checkpoint"):
        train.run(tiny_config(), root)
    with pytest.raises(CorruptCheckpointError, match=r"no readable checkpoint.*--restart"):
        train.run(tiny_config(), root)  # the same command again: still refused
    assert read_jsonl(root / "metrics.jsonl") == before  # nothing was rewritten


def test_a_second_run_on_a_locked_workdir_is_refused(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    held = WorkdirLock(tmp_path)
    held.acquire()  # another run holds the workdir
    try:
        with pytest.raises(WorkdirBusyError, match=rf"in use by another run \(pid {os.getpid()}"):
            train.run(tiny_config(), tmp_path)
    finally:
        held.release()
    assert not (tmp_path / "checkpoints").exists()


def test_a_stale_lock_file_does_not_block(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_text("pid 999999 on gone-host, started long ago\n")
    train.run(tiny_config(steps=1), tmp_path)  # no live holder: the run goes on
    assert str(os.getpid()) in (tmp_path / LOCK_FILE).read_text()


def test_a_workdir_that_is_a_file_is_one_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(WorkdirUnusableError, match="is a file, not a directory"):
        train.run(tiny_config(), path)


def _signal_after_step(monkeypatch: pytest.MonkeyPatch, signum: int, at: int) -> None:
    make_steps = train.make_steps

    def signalling(*args: object, **kwargs: object) -> object:
        steps = make_steps(*args, **kwargs)

        def step_fn(state: object, batch: object) -> tuple:
            state, out = steps.train(state, batch)
            if int(state.step) == at:
                os.kill(os.getpid(), signum)
            return state, out

        return dataclasses.replace(steps, train=step_fn)

    monkeypatch.setattr(train, "make_steps", signalling)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_the_current_step_and_the_rerun_matches(
    uninterrupted: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: int, code: int
) -> None:
    _signal_after_step(monkeypatch, signum, at=4)  # between checkpoints 3 and 6
    with pytest.raises(Preempted, match=r"stopped by SIG\w+ at step 4: saved checkpoint 4") as info:
        train.run(tiny_config(), tmp_path)
    assert info.value.exit_code == code
    assert Checkpointer(tmp_path / "checkpoints", keep=5).all_steps() == [3, 4]
    assert signal.getsignal(signum) is not None  # the handlers were put back
    monkeypatch.undo()
    train.run(tiny_config(), tmp_path)
    assert _deterministic(tmp_path) == _deterministic(uninterrupted)
    assert _event_steps(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_rerun_of_a_finished_run_adds_no_event_file(uninterrupted: Path, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(uninterrupted, root)
    before = sorted(p.name for p in (root / "tb").iterdir())
    train.run(tiny_config(), root)
    assert sorted(p.name for p in (root / "tb").iterdir()) == before


def test_restart_says_what_it_deleted_and_removes_tool_outputs(
    uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    root = tmp_path / "run"
    shutil.copytree(uninterrupted, root)
    for name in ("extrapolation.json", "extrapolation.png", "maps_l0_h1.png"):
        (root / name).write_text("old run")
    train.run(tiny_config(steps=1), root, restart=True)
    said = capsys.readouterr().out
    assert "--restart: deleted checkpoints/, " in said and "extrapolation.json" in said
    assert "maps_l0_h1.png" in said
    assert not any((root / n).exists() for n in ("extrapolation.json", "maps_l0_h1.png"))
