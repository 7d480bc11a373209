"""A 10,000-step smoke run through ``python -m copejax.main`` keeps host memory flat (slow).

Step time is recorded by ``python -m experiments.long_run`` in
experiments/results/long_run.md, not asserted here: timings on a shared machine are noise.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from experiments import long_run


@pytest.mark.slow
def test_ten_thousand_steps_keep_host_memory_flat(tmp_path: Path) -> None:
    result = long_run.measure(10_000, tmp_path / "run", log_every=100)
    summary = long_run.summarize(result, rss_bound_mib=64.0)
    assert result["final"]["step"] == 10_000
    assert math.isfinite(result["final"]["train/loss"])
    assert len(result["rss_samples"]) > 20, "too few memory samples to judge"
    assert summary["memory_flat"], summary
