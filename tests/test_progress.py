"""The console eval line: scalars printed, per-bucket breakdowns only counted."""

from __future__ import annotations

import pytest

from copejax.progress import Progress


def test_eval_line_prints_scalars_and_counts_breakdowns(capsys: pytest.CaptureFixture) -> None:
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
    line = capsys.readouterr().out
    assert line == (
        "eval at step 40: valid/loss 0.5000 | valid/accuracy 0.8750 | grid/error 0.1250 | "
        "+2500 breakdown values in metrics.jsonl\n"
    )


def test_eval_line_without_breakdowns_has_no_count(capsys: pytest.CaptureFixture) -> None:
    record = {"eval/valid/loss": 2.0, "eval/valid_x2/error": 0.25, "train/loss": 1.0}
    Progress(total_steps=10, start_step=0, tokens_per_step=8).print_eval(3, record)
    assert capsys.readouterr().out == "eval at step 3: valid/loss 2.0000 | valid_x2/error 0.2500\n"
