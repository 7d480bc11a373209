"""``experiments/bench_kernels_gpu.py``: the GPU measurement script, so that the one call a GPU
session makes does not fail on a typo. By default its page and its record of a refused CLI
arm (no JAX work); slow: ``--smoke`` end to end on the CPU (Pallas interpret mode), the layer
part in process and the whole script, with its command-line part, as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import bench_kernels_gpu

ROOT = Path(__file__).resolve().parents[3]


def test_page_states_date_device_ratios_and_refusals() -> None:
    row = {"scheme": "fox kernel", "path": "kernel", "time_s": 0.002, "xla_temp_bytes": 2**20}
    row["ratio_to_fastest_nope"] = 1.25
    dpa = {"scheme": "dpa", "path": "dot_product_attention", "time_s": 0.0016}
    layer = [{"B": 2, "N": 4, "H": 64, "T": 4096, "rows": [dpa, row]}]
    cli = [
        {"scheme": "rope", "attention_impl": "auto", "status": "ok", "tokens_per_s": 1000.0},
        {"scheme": "fox", "attention_impl": "kernel", "status": "ok", "tokens_per_s": 700.0},
        bench_kernels_gpu.cli_run("path", "kernel", "paper", steps=1, timeout_s=1),
    ]
    result = {"date": "2026-11-27", "device": "NVIDIA H100", "command": "c", "wall_s": 400.0}
    page = bench_kernels_gpu.page({**result, "layer": layer, "cli": cli, "skipped": ["x"]})
    assert "Measured 2026-11-27 on NVIDIA H100" in page
    assert "| 2 | 4 | 64 | 4096 | fox kernel | kernel | 2.00 | 1.25x | 1 |" in page
    assert "| fox | kernel | ok | 700 | 0.70x |" in page
    assert "refused: model.attention_impl='kernel' has no kernel for scheme 'path'" in page
    assert "Skipped (time budget): x." in page


@pytest.mark.slow
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
    assert cli["path"]["status"] == "refused" and "'path'" in cli["path"]["reason"]
