"""The console lines: eval scalars one split per line, breakdowns counted; the ETA's window."""

from __future__ import annotations

import time

import pytest

from copejax.runtime import progress
from copejax.runtime.progress import Progress


def test_eval_lines_print_scalars_per_split_and_count_breakdowns(
    capsys: pytest.CaptureFixture,
) -> None:
    record = {
        "step": 40.0,
        "train/loss": 1.25,
        "eval/valid/loss": 0.5,
        "eval/valid/accuracy": 0.875,
        "eval/grid/error": 0.125,
    }
    pairs = {
        f"eval/grid/accuracy/{a}x{b}": (a * b % 7) / 7 for a in range(1, 51) for b in range(1, 51)
    }
    Progress(total_steps=100, start_step=0, tokens_per_step=8).print_eval(40, {**record, **pairs})
    assert capsys.readouterr().out == (
        "eval step 40 | valid: loss 0.5000, accuracy 0.8750\n"
        "eval step 40 | grid: error 0.1250, +2500 breakdown values in metrics.jsonl\n"
    )


def test_eval_lines_stay_short_with_many_splits(capsys: pytest.CaptureFixture) -> None:
    splits = ("test", "ood_sparse", "ood_dense", "long_test", "long_sparse")
    record = {f"eval/{s}/{m}": 0.5 for s in splits for m in ("loss", "error", "glitch_rate")}
    Progress(total_steps=20, start_step=0, tokens_per_step=8).print_eval(20, record)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and max(map(len, lines)) < 100, lines


def test_eta_leaves_out_compilation_and_eval_time(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    bar = Progress(total_steps=1000, start_step=0, tokens_per_step=8)
    clock[0] = 60.0  # the first 10 steps include a minute of compilation
    bar.update(10)
    for step in range(20, 110, 10):
        clock[0] += 1.0  # 10 steps a second...
        if step == 50:
            with bar.paused():
                clock[0] += 120.0  # ...and an evaluation that takes two minutes
        bar.update(step)
    assert bar.eta_seconds(100) == pytest.approx(90.0)  # 900 steps left at 10 steps/s


def test_skipped_window_prints_loss_na(capsys: pytest.CaptureFixture) -> None:
    record = {"train/loss": float("nan"), "train/steps_per_sec": 1.0, "train/tokens_per_sec": 8.0}
    Progress(total_steps=10, start_step=0, tokens_per_step=8).print(5, record, skipped=5)
    assert "loss n/a (5 skipped)" in capsys.readouterr().out


def test_real_clock_smoke() -> None:
    bar = Progress(total_steps=4, start_step=0, tokens_per_step=2)
    time.sleep(0.01)
    assert bar.update(2)["train/steps_per_sec"] > 0
