"""The fault matrix (issue 17): one smoke config through every fault a user meets, each time
asserting what is kept on disk and what the program says.

    SIGKILL | SIGTERM | corrupt newest checkpoint | all checkpoints unreadable, then rerun |
    a concurrent second run | a read-only workdir | non-finite loss with stop and with skip

Every run is ``python -m copejax.main`` in a subprocess, as a user runs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from copejax.runtime.metrics import read_jsonl
from tests.train import unprivileged
from tests.train.smoke_flags import FLAGS, ROOT, TIMING

pytestmark = pytest.mark.slow


def _command(workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "copejax.main", f"--workdir={workdir}", *FLAGS, *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")


def _run(workdir: Path, *extra: str, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        _command(workdir, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True,
        check=False, timeout=600, **kwargs,
    )  # fmt: skip


def _start(workdir: Path) -> subprocess.Popen:
    return subprocess.Popen(
        _command(workdir), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def _wait_for_step(
    process: subprocess.Popen, workdir: Path, step: int, checkpoint: int | None = None
) -> None:
    """Waits until ``step`` is logged (and checkpoint ``checkpoint`` is complete on disk)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        path = workdir / "metrics.jsonl"
        records = read_jsonl(path) if path.exists() else []
        saved = checkpoint is None or (workdir / "checkpoints" / str(checkpoint)).is_dir()
        if records and records[-1]["step"] >= step and saved:
            return
        time.sleep(0.02)
    pytest.fail(f"the run ended (rc {process.poll()}) before step {step}; make it longer")


def _deterministic(workdir: Path) -> list[dict[str, float]]:
    return [
        {k: v for k, v in r.items() if k not in TIMING}
        for r in read_jsonl(workdir / "metrics.jsonl")
    ]


def _steps(workdir: Path) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def _error_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    """A directory every user can enter (the read-only case runs as ``nobody`` under root)."""
    path = Path(tempfile.mkdtemp(prefix="copejax-faults-"))
    path.chmod(0o755)
    yield path
    unprivileged.make_writable(path)
    shutil.rmtree(path)


@pytest.fixture(scope="module")
def reference(base: Path) -> Path:
    done = _run(base / "reference")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _steps(base / "reference") == [100, 200, 300]
    return base / "reference"


def _copy(reference: Path, target: Path) -> Path:
    shutil.copytree(reference, target)
    (target / ".lock").unlink(missing_ok=True)
    return target


def test_sigkill_then_rerun_resumes_identically(reference: Path, base: Path) -> None:
    workdir = base / "sigkill"
    victim = _start(workdir)
    _wait_for_step(victim, workdir, 120, checkpoint=100)
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    assert str(victim.pid) in (workdir / ".lock").read_text()  # the dead run's lock file stays
    rerun = _run(workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from checkpoint " in rerun.stdout  # the dead run's lock did not block
    assert _deterministic(workdir) == _deterministic(reference)


def test_sigterm_saves_the_current_step_and_rerun_resumes_identically(
    reference: Path, base: Path
) -> None:
    workdir = base / "sigterm"
    victim = _start(workdir)
    _wait_for_step(victim, workdir, 20)
    victim.send_signal(signal.SIGTERM)
    _, err = victim.communicate(timeout=600)
    assert victim.returncode == 143, err[-3000:]
    assert "Traceback" not in err
    said = [line for line in err.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(said) == 1 and "run the same command to resume" in said[0], err[-3000:]
    step = int(said[0].split(" at step ")[1].split(":")[0])
    assert step < 300 and step in _steps(workdir)
    rerun = _run(workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from checkpoint {step}" in rerun.stdout
    assert _deterministic(workdir) == _deterministic(reference)


def test_corrupt_newest_checkpoint_falls_back(reference: Path, base: Path) -> None:
    workdir = _copy(reference, base / "corrupt_newest")
    arrays = [p for p in (workdir / "checkpoints" / "300" / "state").rglob("*") if p.is_file()]
    largest = max(arrays, key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    rerun = _run(workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "warning: checkpoint" in rerun.stderr and "is unreadable" in rerun.stderr
    assert "resumed from checkpoint 200" in rerun.stdout
    assert len(list((workdir / "corrupt_checkpoints").iterdir())) == 1  # kept for a look
    assert _deterministic(workdir) == _deterministic(reference)


def test_all_checkpoints_unreadable_is_refused_on_every_rerun(reference: Path, base: Path) -> None:
    workdir = _copy(reference, base / "corrupt_all")
    for step in (100, 200, 300):
        shutil.rmtree(workdir / "checkpoints" / str(step) / "state")
    before = (workdir / "metrics.jsonl").read_bytes()
    for _ in range(2):  # the same command twice: refused both times, nothing rewritten
        done = _run(workdir)
        assert done.returncode == 1
        assert "no readable checkpoint" in _error_line(done) and "--restart" in done.stderr
        assert (workdir / "metrics.jsonl").read_bytes() == before
    assert _steps(workdir) == []


def test_a_concurrent_second_run_is_refused(reference: Path, base: Path) -> None:
    workdir = base / "concurrent"
    first = _start(workdir)
    _wait_for_step(first, workdir, 10)
    first.send_signal(signal.SIGSTOP)  # hold it mid-run, holding the lock
    try:
        second = _run(workdir)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 1
    line = _error_line(second)
    assert f"is in use by another run (pid {first.pid} on " in line
    first.communicate(timeout=600)
    assert first.returncode == 0
    assert _deterministic(workdir) == _deterministic(reference)  # nothing logged twice


def test_a_read_only_workdir_is_one_error_and_left_as_is(reference: Path, base: Path) -> None:
    workdir = _copy(reference, base / "read_only")
    fresh = workdir / "new_run"  # a workdir to create inside a read-only directory
    unprivileged.make_read_only(workdir)
    kwargs = unprivileged.subprocess_kwargs(base / "home")
    try:
        done = _run(workdir, **kwargs)
        created = _run(fresh, **kwargs)
    finally:
        unprivileged.make_writable(workdir)
    assert done.returncode == 1 and created.returncode == 1
    assert f"--workdir {workdir} is not writable (Permission denied)" in _error_line(done)
    assert f"cannot create --workdir {fresh}: Permission denied" in _error_line(created)
    assert _deterministic(workdir) == _deterministic(reference)


def test_nonfinite_stop_and_skip(base: Path) -> None:
    blow_up = "--config.train.learning_rate=1e38"  # parameters overflow after a step or two
    stopped = _run(base / "nonfinite_stop", blow_up)
    assert stopped.returncode == 1
    line = _error_line(stopped)
    assert "non-finite loss" in line and "none saved yet" in line
    assert "--config.train.nonfinite=skip" in line
    assert not (base / "nonfinite_stop" / "checkpoints").exists() or not _steps(
        base / "nonfinite_stop"
    )
    skipped = _run(base / "nonfinite_skip", blow_up, "--config.train.nonfinite=skip")
    records = read_jsonl(base / "nonfinite_skip" / "metrics.jsonl")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert None in losses and 0.0 not in losses  # skipped windows: missing, never loss 0
    summary = [line for line in skipped.stderr.splitlines() if "steps were skipped" in line]
    if skipped.returncode == 0:
        assert len(summary) == 1 and summary[0].startswith("warning: "), skipped.stderr[-3000:]
    else:  # every step skipped: an error, not a quiet success
        assert "the model did not train" in _error_line(skipped)
    assert "(10 skipped)" in skipped.stdout  # the console says so, window by window
