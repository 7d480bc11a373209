"""SIGKILL training at random points, and in the middle of a checkpoint save; re-running the
same command each time ends with the metrics of an uninterrupted run (slow: subprocesses)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from copejax.runtime.checkpoint import Checkpointer
from copejax.runtime.metrics import read_jsonl
from tests.train.test_metrics import tensorboard_scalars

ROOT = Path(__file__).resolve().parents[2]
TRAIN = {"steps": 40, "log_every": 1, "eval_every": 10, "checkpoint_every": 4}
TIMING = ("train/steps_per_sec", "train/tokens_per_sec")
ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _command(workdir: Path, **extra: object) -> list[str]:
    spec = json.dumps({"train": TRAIN, **extra})
    return [sys.executable, "-m", "tests.train.run_tiny", str(workdir), spec]


def _deterministic(workdir: Path) -> list[dict[str, float]]:
    records = read_jsonl(workdir / "metrics.jsonl")
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _last_step(workdir: Path) -> int:
    path = workdir / "metrics.jsonl"
    records = read_jsonl(path) if path.exists() else []
    return int(records[-1]["step"]) if records else 0


def _event_steps(workdir: Path) -> list[int]:
    """The steps of train/loss as TensorBoard's own reader shows them (purges applied)."""
    return [step for step, _ in tensorboard_scalars(workdir / "tb")["train/loss"]]


def _finish(workdir: Path) -> str:
    run = subprocess.run(
        _command(workdir), cwd=ROOT, env=ENV, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("reference") / "run"
    _finish(workdir)
    return workdir


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_save(reference: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "run"
    victim = subprocess.run(
        _command(workdir, kill_during_save=8), cwd=ROOT, env=ENV, capture_output=True, check=False
    )
    assert victim.returncode == -signal.SIGKILL
    partial = [p.name for p in (workdir / "checkpoints").iterdir()]
    assert any(name.startswith("8.orbax-checkpoint-tmp") for name in partial), (
        f"the kill should land while step 8 is being written; found {partial}"
    )
    assert Checkpointer(workdir / "checkpoints", keep=5).all_steps() == [4]
    assert "resumed from checkpoint 4" in _finish(workdir)
    assert not [p for p in (workdir / "checkpoints").iterdir() if "tmp" in p.name]
    assert _deterministic(workdir) == _deterministic(reference)
    assert _event_steps(workdir) == list(range(1, TRAIN["steps"] + 1))


@pytest.mark.slow
def test_sigkill_at_random_points(reference: Path, tmp_path: Path) -> None:
    seed = int(os.environ.get("COPEJAX_KILL_SEED", time.time_ns() % 2**31))
    rng = random.Random(seed)
    workdir = tmp_path / "run"
    # One kill at a random moment of start-up (imports, compilation, restore), then kills
    # at random training steps (async saves every 4 steps are often in flight).
    plan = [("seconds", rng.uniform(0.5, 6.0))]
    plan += [("step", s) for s in sorted(rng.sample(range(2, TRAIN["steps"]), 3))]
    done = []
    for index, (kind, value) in enumerate(plan):
        log = tmp_path / f"victim{index}.log"
        with open(log, "w") as stderr:
            victim = subprocess.Popen(
                _command(workdir), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=stderr
            )
        started, deadline = time.monotonic(), time.monotonic() + 600
        while victim.poll() is None and time.monotonic() < deadline:
            if kind == "seconds" and time.monotonic() - started >= value:
                break
            if kind == "step" and _last_step(workdir) >= value:
                break
            time.sleep(0.002)
        if victim.poll() is None:
            victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert victim.returncode in (0, -signal.SIGKILL), f"seed {seed}: {log.read_text()[-3000:]}"
        done.append((kind, value, _last_step(workdir)))
    _finish(workdir)
    context = f"seed {seed} (COPEJAX_KILL_SEED reproduces it), kills {done}"
    assert _deterministic(workdir) == _deterministic(reference), context
    assert _event_steps(workdir) == list(range(1, TRAIN["steps"] + 1)), context
