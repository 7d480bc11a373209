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

from copejax.bench import loglog_slope


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
    rows = result["rows"]
    assert {(r["kind"], r["scheme"]) for r in rows} == {
        (kind, scheme) for kind in ("layer", "step") for scheme in ("nope", "cope")
    }
    for row in rows:
        assert row["status"] == "ok", row
        assert row["time_s"] > 0 and row["xla_bytes"] > 0 and row["peak_rss_bytes"] > 0
    assert result["scan"] and result["scan"][0]["cumsum_ms"] > 0
    page = (tmp_path / "bench.md").read_text()
    assert "| cope |" in page and "(1.00x)" in page  # nope's own ratio
    for name in ("bench_time.png", "bench_memory.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loglog_slope() -> None:
    assert math.isclose(loglog_slope([(2, 8), (4, 64), (8, 512)]), 3.0)
    assert math.isclose(loglog_slope([(1, 5), (10, 50), (100, 500)]), 1.0)
    assert loglog_slope([(1, 1)]) is None
