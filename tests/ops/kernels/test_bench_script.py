"""``experiments/bench_kernels_gpu.py --smoke``: the GPU measurement script end to end on the
CPU (Pallas interpret mode), so that the one call a GPU session makes does not fail on a
typo. The layer part runs by default; the command-line part (a training run) is slow."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import bench_kernels_gpu

ROOT = Path(__file__).resolve().parents[3]


def test_smoke_layer_part_writes_a_dated_page(tmp_path: Path) -> None:
    bench_kernels_gpu.main(["--smoke", "--parts", "layer", "--out_dir", str(tmp_path)])
    result = json.loads((tmp_path / "bench_kernels_gpu.json").read_text())
    (group,) = result["layer"]
    rows = {row["scheme"]: row for row in group["rows"]}
    assert "error" not in group
    assert rows["fox kernel"]["status"] == "ok" and rows["fox kernel"]["path"] == "kernel"
    assert rows["dpa"]["ratio_to_fastest_nope"] > 0
    page = (tmp_path / "bench_kernels_gpu.md").read_text()
    assert f"Measured {result['date']} on {result['device']}" in page
    assert "| 1 | 2 | 16 | 128 | fox kernel | kernel |" in page


@pytest.mark.slow
def test_smoke_whole_script_with_the_command_line_part(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "experiments.bench_kernels_gpu", "--smoke"]
    subprocess.run([*command, "--out_dir", str(tmp_path)], cwd=ROOT, check=True)
    result = json.loads((tmp_path / "bench_kernels_gpu.json").read_text())
    cli = {row["scheme"]: row for row in result["cli"]}
    assert cli["rope"]["status"] == "ok" and cli["rope"]["tokens_per_s"] > 0
    assert cli["cope"]["status"] == "refused" and "'cope'" in cli["cope"]["reason"]
