"""The flip-flop smoke run that the slow process-level tests (fault matrix, preemption) start."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FLAGS = [
    "--config=configs/flipflop.py:smoke,steps=300",
    "--config.train.log_every=10",
    "--config.train.eval_every=150",
    "--config.train.checkpoint_every=100",
    "--config.eval.splits=('test',)",
]
# Metrics that depend on the machine's speed, left out when runs are compared.
TIMING = ("train/steps_per_sec", "train/tokens_per_sec")
