"""Smoke test of the benchmark script (``python -m copejax.bench --mode quick``), not a timing.

Checks that every measurement ran in its subprocess and came back with a time, XLA's memory
and a peak RSS, that the page, JSON and plots are written, and the log-log slope helper.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from copejax.bench import loglog_slope, markdown, round_ratios, targets


def rows_side(result: dict) -> list[dict]:
    return [r for r in result["rows"] if r["kind"] == "side_by_side"]


@pytest.mark.slow  # about a minute of subprocess compiles on 2 cores; keeps CI under 10 min
def test_quick_mode_writes_json_page_and_plots(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "copejax.bench", "--mode", "quick", "--out_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    rows = [r for r in result["rows"] if r["kind"] != "side_by_side"]
    assert {(r["kind"], r["scheme"]) for r in rows} == {
        (kind, scheme) for kind in ("layer", "step") for scheme in ("nope", "cope")
    }
    for row in rows:
        assert row["status"] == "ok", row
        assert row["time_s"] > 0 and row["xla_bytes"] > 0 and row["peak_rss_bytes"] > 0
    assert result["scan"] and result["scan"][0]["cumsum_ms"] > 0
    page = (tmp_path / "bench.md").read_text()
    assert "| cope |" in page and "(1.00x / -)" in page  # nope's own ratio; no dpa in quick
    side = [r for r in rows_side(result) if r["status"] == "ok"]
    assert {r["scheme"] for r in side} == {"nope", "cope", "cope naive", "cope blockwise"}
    assert all(len(r["times_s"]) == 2 for r in side)
    assert "## Side by side" in page
    for name in ("bench_time.png", "bench_memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loglog_slope() -> None:
    assert math.isclose(loglog_slope([(2, 8), (4, 64), (8, 512)]), 3.0)
    assert math.isclose(loglog_slope([(1, 5), (10, 50), (100, 500)]), 1.0)
    assert loglog_slope([(1, 1)]) is None


def _side(label: str, times: list[float]) -> dict:
    return {"kind": "side_by_side", "scheme": label, "T": 1024, "status": "ok",
            "times_s": times, "time_s": sorted(times)[len(times) // 2]}  # fmt: skip


def test_speed_target_reads_interleaved_rounds_against_both_baselines() -> None:
    rows = [
        _side("nope", [1.0, 2.0, 1.0]),
        _side("dpa", [2.0, 4.0, 2.0]),
        _side("cope", [1.4, 4.0, 1.6]),  # per round: 1.4x, 2.0x, 1.6x nope; 0.7x, 1.0x, 0.8x dpa
    ]
    assert round_ratios(rows, "cope", 1024) == [1.4, 2.0, 1.6]
    assert round_ratios(rows, "cope", 1024, base="dpa") == [0.7, 1.0, 0.8]
    assert round_ratios(rows, "cope", 2048) == []
    lines = targets({"rows": rows})
    assert "(`dpa`, the issue's baseline): met, median ratio 0.80x" in lines[0]
    assert "einsum nope (stricter): NOT met, median ratio 1.60x" in lines[1]
    assert "range 1.40-2.00" in lines[1]
    meta = {"command": "c", "jax": "j", "backend": "cpu", "cpu_count": 2, "batch": 2,
            "heads": 4, "head_dim": 64, "pallas": "-", "time_cap_s": 1,
            "memory_cap_bytes": 2**30}  # fmt: skip
    page = markdown({"rows": rows, "meta": meta})
    assert "| cope | 1600 (1.60x (1.40-2.00)) |" in page
