"""Smoke test of the benchmark script (``python -m experiments.bench --mode quick``), not a timing.

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

from experiments.bench_page import (
    fastest_nope_ratios,
    loglog_slope,
    markdown,
    round_ratios,
    targets,
)


def rows_side(result: dict) -> list[dict]:
    return [r for r in result["rows"] if r["kind"] == "side_by_side"]


@pytest.mark.slow  # about a minute of subprocess compiles on 2 cores; keeps CI under 10 min
def test_quick_mode_writes_json_page_and_plots(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "experiments.bench", "--mode", "quick", "--out_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    rows = [r for r in result["rows"] if r["kind"] != "side_by_side"]
    assert {(r["kind"], r["scheme"]) for r in rows} == {("layer", "nope"), ("layer", "cope")}
    for row in rows:
        assert row["status"] == "ok", row
        assert row["time_s"] > 0 and row["xla_bytes"] > 0 and row["peak_rss_bytes"] > 0
    assert result["scan"] and result["scan"][0]["cumsum_ms"] > 0
    page = (tmp_path / "bench.md").read_text()
    assert "| cope |" in page and "(1.00x / -)" in page  # nope's own ratio; no dpa in quick
    side = [r for r in rows_side(result) if r["status"] == "ok"]
    assert {r["scheme"] for r in side} == {
        "nope",
        "nope naive",
        "nope blockwise",
        "cope",
        "cope naive",
        "cope remat",
    }
    assert all(len(r["times_s"]) == 2 for r in side)
    assert "## Side by side" in page
    for name in ("bench_time.png", "bench_memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loglog_slope() -> None:
    assert math.isclose(loglog_slope([(2, 8), (4, 64), (8, 512)]), 3.0)
    assert math.isclose(loglog_slope([(1, 5), (10, 50), (100, 500)]), 1.0)
    assert loglog_slope([(1, 1)]) is None


def _side(label: str, times: list[float], length: int = 1024) -> dict:
    return {"kind": "side_by_side", "scheme": label, "T": length, "status": "ok",
            "times_s": times, "time_s": sorted(times)[len(times) // 2]}  # fmt: skip


def test_speed_targets_read_interleaved_rounds_against_the_fastest_nope() -> None:
    rows = [
        _side("nope", [1.0, 2.0, 1.0]),
        _side("nope naive", [1.0, 2.0, 1.0]),
        _side("nope blockwise", [0.5, 2.5, 1.0]),  # the fastest nope in rounds 1 and 3
        _side("dpa", [2.0, 4.0, 2.0]),
        _side("cope", [1.4, 4.0, 1.6]),  # per round: 2.8x, 2.0x, 1.6x the fastest nope
        _side("cope", [1.0, 1.0], length=4096),
        _side("cope naive", [2.0, 0.5], length=4096),  # default / naive: 0.5x, 2.0x
        _side("fox", [1.0, 1.0], length=4096),
        _side("fox naive", [2.0, 2.0], length=4096),
    ]
    assert fastest_nope_ratios(rows, "cope", 1024) == [2.8, 2.0, 1.6]
    assert round_ratios(rows, "nope blockwise", 1024, "nope naive") == [0.5, 1.25, 1.0]
    lines = targets({"rows": rows})
    assert "blockwise nope at most 1.2x einsum (naive) nope: met, 1.00x (0.50-1.25)" in lines[0]
    assert any(
        "At T = 4096, every scheme's default path at most its naive path: NOT met" in line
        and "cope 1.25x" in line
        and "fox 0.50x" in line
        and "slower: cope." in line
        for line in lines
    )
    assert any(
        "cope's default at most 1.5x the fastest nope path at T = 1024: NOT met, 2.00x "
        "(1.60-2.80)" in line
        for line in lines
    )
    meta = {"command": "c", "jax": "j", "backend": "cpu", "cpu_count": 2, "batch": 2,
            "heads": 4, "head_dim": 64, "pallas": "-", "time_cap_s": 1,
            "memory_cap_bytes": 2**30}  # fmt: skip
    page = markdown({"rows": rows, "meta": meta})
    assert "| cope | 1600 (2.00x (1.60-2.80)) | 1000 (-) |" in page


def test_a_default_that_is_the_naive_path_is_not_timed_against_itself() -> None:
    """A scheme whose ``auto`` keeps the naive path at a length (its auto_blockwise_from) has
    its default and naive arms run the same program: the page says so instead of reading the
    noise between them as a ratio."""
    rows = [
        {**_side("tape", [1.1, 1.2], length=4096), "path": "naive"},
        _side("tape naive", [1.0, 1.0], length=4096),
        {**_side("fox", [1.0, 1.0], length=4096), "path": "blockwise"},
        _side("fox naive", [2.0, 2.0], length=4096),
    ]
    line = next(t for t in targets({"rows": rows}) if "every scheme's default path" in t)
    assert "naive: fox 0.50x; tape: the default is the naive path)" in line
    assert "NOT met" not in line


def test_gpu_page_says_when_each_group_was_measured() -> None:
    """bench_gpu's ``--keep`` mixes groups of different runs: the reading names each group's
    day, and a group kept from before the field existed says that it has none."""
    from experiments.bench_gpu import page

    def row(scheme: str, seconds: float) -> dict:
        return {"scheme": scheme, "T": 8, "time_s": seconds, "xla_temp_bytes": 0,
                "ratio_to_fastest_nope": seconds / 0.001}  # fmt: skip

    rows = [row("nope", 0.001), row("cope", 0.002)]
    new = {"T": 8, "dtype": "float32", "measured": "2026-11-26", "rows": rows}
    kept = {"T": 8, "dtype": "bfloat16", "rows": rows}
    text = page([kept, new], "a GPU")
    assert (
        "- T = 8, float32 (measured 2026-11-26): fastest nope by median `nope`; cope 2.00x." in text
    )
    assert "- T = 8, bfloat16 (measured: not recorded)" in text


def test_cope_listing_script_imports_only_the_standard_library() -> None:
    """The listing's torch worker runs ``experiments/cope_listing_torch.py`` in a side venv that
    has torch and numpy but not copejax or JAX, so the script's top level must import the
    standard library only (``-S``: no site-packages)."""
    script = Path(__file__).resolve().parents[1] / "experiments" / "cope_listing_torch.py"
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(script), "--help"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
