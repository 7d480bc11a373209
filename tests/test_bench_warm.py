"""``experiments/bench_kernels_warm.py``: the GPU script's warm part compiles, into the
persistent compilation cache, the very programs its timed processes run (else it would cost
the call's time and save none), once each, in the plan's order; the page says what it did."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
from jax._src import compilation_cache

from experiments import bench_kernels_page, bench_kernels_plan, bench_measure
from experiments.bench_kernels_warm import cache_counter, use_cache, warm_jobs


@pytest.fixture
def cache_dir(tmp_path: Path, jax_state_kept: None) -> str:
    """A persistent compilation cache in ``tmp_path`` for this test only."""
    compilation_cache.reset_cache()
    use_cache(str(tmp_path))
    jax.clear_caches()  # what this process compiled before: compiled again, into the cache
    return str(tmp_path)


def test_the_timed_process_reads_every_program_the_warm_part_compiled(cache_dir: str) -> None:
    """compile_arm (shapes only, the arm's levers on) then side_by_side in a fresh state:
    every program comes from the cache, none compiles again."""
    arm = {"attention_impl": "kernel", "dtype": "bfloat16", "kernel_full_tiles": False}
    with bench_measure.layer_shape(1, 2, 16):
        bench_measure.compile_arm("fox", 64, arm)
        jax.clear_caches()
        with cache_counter() as counts:
            (row,) = bench_measure.side_by_side(64, [("fox kernel", "fox", arm)], rounds=1)
    assert row["status"] == "ok", row
    assert counts["hits"] >= 2 and counts["misses"] == 0, counts  # init and forward + backward


def test_warm_jobs_follow_the_plan_and_compile_each_arm_once() -> None:
    tasks, _ = bench_kernels_plan.plan(False, list(bench_kernels_plan.PARTS))
    jobs, cli = warm_jobs(tasks)
    checks = [what for kind, what in tasks if kind == "check"]
    assert [what for kind, what in jobs if kind == "check"] == checks
    assert cli == [what for kind, what in tasks if kind == "cli"]
    compiles = [what for kind, what in jobs if kind == "compile"]
    keys = [
        (shape, length, scheme, str(sorted(opts.items())))
        for shape, length, _, scheme, opts in compiles
    ]
    assert len(keys) == len(set(keys))
    _, _, first_arms = next(what for kind, what in tasks if kind == "layer")
    assert [c[2] for c in compiles[: len(first_arms)]] == [label for label, _, _ in first_arms]
    assert all(opts["dtype"] == "bfloat16" for *_, opts in compiles)
    # cuDNN's nope at each (shape, T), not once per group
    dpa = {(shape, length) for shape, length, _, scheme, _ in compiles if scheme == "dpa"}
    assert sum(scheme == "dpa" for *_, scheme, _ in compiles) == len(dpa)


def _result(warm: dict | None, cache: list[dict]) -> dict:
    layer = [{"B": 1, "N": 2, "H": 16, "T": 64, "rows": [], "cache": c} for c in cache]
    return {
        "date": "2026-12-07",
        "device": "cpu",
        "wall_s": 1.0,
        "command": "x",
        "check": [],
        "layer": layer,
        "cli": [],
        "skipped": [],
        **({"warm": warm} if warm else {}),
    }


def test_the_page_states_what_the_warm_part_did_and_the_cache_hits() -> None:
    warm = {
        "workers": 8,
        "wall_s": 95.0,
        "probe": {"hits": 9, "misses": 0},
        "served": True,
        "jobs": 105,
        "done": 100,
        "compiled": 87,
        "compile_errors": [{"what": [[2, 4, 64], 4096, "cope kernel"], "error": "E: x"}],
        "cli_runs": 8,
        "cli_done": 6,
    }
    text = bench_kernels_page.page(
        _result(warm, [{"hits": 7, "misses": 1}, {"hits": 4, "misses": 0}])
    )
    assert "8 worker processes finished 100 of 105 jobs" in text
    assert "87 layer arms compiled) and 6 of 8 command-line runs finished, in 95 s" in text
    assert "Arms that failed to compile: cope kernel: E: x." in text
    assert "read 11 programs from the persistent cache and compiled 1" in text
    unserved = {**warm, "served": False, "probe": {"hits": 0, "misses": 9}, "wall_s": 20.0}
    text = bench_kernels_page.page(_result(unserved, []))
    assert "did not read the persistent cache the second time" in text
    assert "`--warm_workers 0`" in text
    assert "Compilation ahead" not in bench_kernels_page.page(_result(None, []))
