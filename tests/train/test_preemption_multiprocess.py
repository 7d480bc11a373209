"""SIGTERM to one process of a two-process run (issue 17): JAX's preemption sync makes both
save the same step and exit 143; rerunning both resumes to the metrics of an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import portpicker
import pytest

from copejax.runtime.metrics import read_jsonl
from tests.train.smoke_flags import FLAGS, ROOT, TIMING


def _start_pair(workdir: Path) -> list[subprocess.Popen]:
    port = portpicker.pick_unused_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    coordinator = [f"--coordinator_address=localhost:{port}", "--num_processes=2"]
    command = [sys.executable, "-m", "copejax.main", f"--workdir={workdir}", *FLAGS, *coordinator]
    return [
        subprocess.Popen(
            [*command, f"--process_id={index}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]


def _finish(pair: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    results = []
    for process in pair:
        out, err = process.communicate(timeout=600)
        results.append((process.returncode, out, err))
    return results


def _deterministic(workdir: Path) -> list[dict[str, float]]:
    return [
        {k: v for k, v in r.items() if k not in TIMING}
        for r in read_jsonl(workdir / "metrics.jsonl")
    ]


@pytest.mark.slow
def test_sigterm_to_one_process_saves_one_step_everywhere(tmp_path: Path) -> None:
    reference = _finish(_start_pair(tmp_path / "reference"))
    assert [code for code, _, _ in reference] == [0, 0], reference[0][2][-3000:]

    workdir = tmp_path / "preempted"
    pair = _start_pair(workdir)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        path = workdir / "metrics.jsonl"
        if path.exists() and read_jsonl(path) and read_jsonl(path)[-1]["step"] >= 20:
            break
        assert all(p.poll() is None for p in pair), "the run ended before the signal"
        time.sleep(0.05)
    pair[1].send_signal(signal.SIGTERM)  # only process 1 is told
    stopped = _finish(pair)
    assert [code for code, _, _ in stopped] == [143, 143], stopped[0][2][-3000:]
    said = [
        [line for line in err.splitlines() if line.startswith("stopped by SIGTERM")]
        for _, _, err in stopped
    ]
    assert len(said[0]) == 1 and said[0] == said[1]  # the same step on both processes
    step = int(said[0][0].split(" at step ")[1].split(":")[0])
    assert (workdir / "checkpoints" / str(step)).is_dir()

    resumed = _finish(_start_pair(workdir))
    assert [code for code, _, _ in resumed] == [0, 0], resumed[0][2][-3000:]
    assert f"resumed from checkpoint {step}" in resumed[0][1]
    assert _deterministic(workdir) == _deterministic(tmp_path / "reference")
