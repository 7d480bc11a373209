"""experiments/smoke_all.py: the task x scheme table, and (slow) every pair's smoke run."""

from __future__ import annotations

from pathlib import Path

import pytest

from copejax.positions import registry
from experiments import smoke_all


def test_table_marks_each_pair() -> None:
    results = {("addition", "rope"): True, ("addition", "cope"): False, ("lm", "rope"): True}
    got = smoke_all.table(["addition", "lm"], ["rope", "cope"], results)
    assert got.splitlines() == [
        "| scheme | addition | lm |",
        "|---|---|---|",
        "| `rope` | ok | ok |",
        "| `cope` | FAIL | - |",
    ]


def test_every_config_is_a_task_and_unknown_names_are_refused() -> None:
    assert set(smoke_all.all_tasks()) >= {"flipflop", "selective_copy", "counting", "addition"}
    assert {"passkey", "lm"} <= set(smoke_all.all_tasks())
    with pytest.raises(SystemExit, match="unknown schemes"):
        smoke_all.main(["--schemes", "rope,not_a_scheme"])


def test_a_failing_run_is_reported(tmp_path: Path) -> None:
    """A run the trainer refuses (0 steps) is a failure with its error line."""
    ok, error, _ = smoke_all.run_pair("flipflop", "rope", 0, tmp_path)
    assert not ok
    assert "steps" in error


@pytest.mark.slow
def test_every_task_with_every_scheme() -> None:
    """Tens of minutes on 2 cores: 6 tasks x every registered scheme, 3 steps each."""
    assert registry.names()
    assert smoke_all.main(["--jobs", "2"]) == 0
