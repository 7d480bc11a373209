"""SIGKILL a training subprocess mid-run; re-running the same command finishes with metrics
identical to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from copejax.runtime.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
SPEC = {"train": {"steps": 30, "log_every": 1, "eval_every": 10, "checkpoint_every": 4}}
TIMING = ("train/steps_per_sec", "train/tokens_per_sec")


def _command(workdir: Path) -> list[str]:
    return [sys.executable, "-m", "tests.train.run_tiny", str(workdir), json.dumps(SPEC)]


def _deterministic(workdir: Path) -> list[dict[str, float]]:
    records = read_jsonl(workdir / "metrics.jsonl")
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.mark.slow
def test_sigkill_then_rerun_equals_uninterrupted(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    full, killed = tmp_path / "full", tmp_path / "killed"
    reference = subprocess.Popen(_command(full), cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    victim = subprocess.Popen(_command(killed), cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and victim.poll() is None:
        steps = (
            [r["step"] for r in read_jsonl(killed / "metrics.jsonl")]
            if (killed / "metrics.jsonl").exists()
            else []
        )
        if steps and steps[-1] >= 14:  # past checkpoints 4, 8, 12 and an evaluation
            break
        time.sleep(0.05)
    assert victim.poll() is None, "the run finished before it could be killed; make it longer"
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    assert 14 <= read_jsonl(killed / "metrics.jsonl")[-1]["step"] < 30
    rerun = subprocess.run(
        _command(killed), check=False, cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed from checkpoint" in rerun.stdout
    assert reference.wait(timeout=600) == 0
    assert _deterministic(killed) == _deterministic(full)
