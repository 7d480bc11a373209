"""The programs users run: ``python -m copejax.main`` and the demo's table and plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from copejax.runtime.metrics import read_jsonl
from experiments import demo

ROOT = Path(__file__).resolve().parents[2]


def test_main_trains_a_smoke_config_with_overrides(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "copejax.main", "--config=configs/flipflop.py:smoke",
        f"--workdir={tmp_path}", "--config.train.steps=3", "--config.train.log_every=1",
        "--config.eval.max_examples=16",
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 3/3 | loss" in done.stdout and "tokens/s | ETA" in done.stdout
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["train"]["steps"] == 3 and saved["task"]["name"] == "flipflop"
    refused = subprocess.run(
        [*command[:-1], "--config.eval.max_examples=8"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert refused.returncode == 1
    assert "eval.max_examples: 16 -> 8" in refused.stderr and "--restart" in refused.stderr


@pytest.mark.slow  # two runs side by side, then a re-read: about 20 s on 2 cores
def test_demo_trains_its_runs_side_by_side_then_only_reads_them(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "experiments.demo", "--variant=smoke,steps=4",
        "--positions=rope,cope", f"--workdir={tmp_path}",
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for position in ("rope", "cope"):
        assert f"[{position}] step 4/4 | loss" in done.stdout
        assert (tmp_path / position / "loss.png").exists()
    assert "learned the task" in done.stdout and (tmp_path / "errors.png").exists()
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert again.returncode == 0 and "run(s)" not in again.stdout
    assert f"Flip-Flop with cope: complete in {tmp_path / 'cope'}, read" in again.stdout
    table = done.stdout[done.stdout.index("scheme ") :]
    assert again.stdout.endswith(table)


def test_demo_table_and_plot(tmp_path: Path) -> None:
    records = [
        {"step": 10, "train/loss": 2.0},
        {"step": 20, "train/loss": 1.0, "eval/test/loss": 1.1, "eval/test/error": 0.25,
         "eval/ood/loss": 1.5, "eval/ood/error": 0.5},
    ]  # fmt: skip
    table = demo.results_table(records).splitlines()
    assert table[0] == "step 20"
    assert table[1].split() == ["split", "error", "loss"]
    assert table[2].split() == ["ood", "0.5000", "1.5000"]
    assert table[3].split() == ["test", "0.2500", "1.1000"]
    demo.plot_losses(records, tmp_path / "loss.png", "t")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_reading_says_which_schemes_learned_the_task_from_the_numbers() -> None:
    """Below 1 % test error a scheme learned the task (study 1's rule); only those are ranked
    at 4x the length, and the one-seed caveat is always there."""
    last = {
        "learned": {"eval/test/error": 0.28, "eval/long_sparse/error": 0.47},
        "rope": {"eval/test/error": 0.0, "eval/long_sparse/error": 0.27},
        "cope": {"eval/test/error": 0.009, "eval/long_sparse/error": 0.05},
        "alibi": {},
    }
    lines = demo.reading(last, 600).splitlines()
    assert lines[0] == "learned the task (test error below 1 %): rope, cope"
    assert lines[1] == "not learned yet: learned (28.0 %), alibi (no evaluation)"
    assert lines[2].endswith("lowest first: cope 5.0 %, rope 27.0 %")
    assert lines[3].startswith("one seed, 600 steps: ")
    lines = demo.reading({"cope": {"eval/test/error": 0.15}}, 1200).splitlines()
    assert lines[:2] == [
        "learned the task (test error below 1 %): none",
        "not learned yet: cope (15.0 %)",
    ]
    assert lines[2].startswith("one seed, 1200 steps: ")
