"""The addition heatmap: the grid read back from metrics records, and the PNG written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from copejax.plots.addition import last_grid, write_heatmap


def test_last_grid_reads_the_latest_eval_and_draws(tmp_path: Path) -> None:
    records = [
        {"step": 10, "eval/grid/accuracy/1x1": 0.0, "eval/grid/accuracy/2x1": 0.0},
        {"step": 15, "train/loss": 1.0},
        {
            "step": 20,
            "eval/grid/accuracy/1x1": 1.0,
            "eval/grid/accuracy/2x1": 0.25,
            "eval/test/accuracy/1x2": 0.5,
        },
    ]
    step, grid = last_grid(records, "grid")
    assert step == 20
    expected = np.array([[1.0, np.nan], [0.25, np.nan]])
    np.testing.assert_array_equal(grid, expected)
    path = tmp_path / "grid.png"
    write_heatmap(grid, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="ood"):
        last_grid(records, "ood")


def test_flags_are_defined_only_when_run_as_a_program(tmp_path: Path) -> None:
    """Importing every tool next to copejax.main defines no flag twice; the program still runs."""
    tools = "copejax.main, copejax.plots.addition, copejax.plots.maps, copejax.plots.curves"
    imports = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import {tools}, copejax.evaluation.sample, copejax.evaluation.extrapolate",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert imports.returncode == 0, imports.stderr
    record = {"step": 7, "eval/grid/accuracy/1x1": 0.5, "eval/grid/accuracy/1x2": 1.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    out = tmp_path / "grid.png"
    command = [sys.executable, "-m", "copejax.plots.addition", f"--workdir={tmp_path}"]
    program = subprocess.run(
        [*command, f"--out={out}"], capture_output=True, text=True, check=False
    )
    assert program.returncode == 0, program.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
