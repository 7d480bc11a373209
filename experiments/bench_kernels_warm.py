"""Part ``warm`` of :mod:`experiments.bench_kernels_gpu`: before anything is timed, worker
processes run the kernels' checks and compile every layer arm's programs side by side, and
the command-line runs go ``CLI_WARMERS`` at a time, all into JAX's persistent compilation
cache, which the timed processes then read (issue 45: the whole GPU measurement in one call
of at most 8 minutes, compilation included).

Why: on the first H100 run (``experiments/results/bench_kernels_gpu.md``, 2026-11-27) the
call's budget went to compiling, one program after another, while most of the machine's 16
CPU cores idled: RoPE's 40 command-line steps took 112 s of wall time at about 0.05 s a step
(16,384 tokens at 315,014 tokens/s), and the budget left 16 of the 17 layer groups and 3 of
the 4 command-line runs unmeasured. The timed part stays as it was, one process on the
GPU at a time; only what is not timed (the checks, which compare values, and compilation)
runs side by side here, with no timing in flight.

The cache's key covers the program as lowered, the devices, the compile options and the XLA
flags, so a worker must trace exactly what the timed process traces: the layer arms compile
through :func:`experiments.bench_measure.compile_arm` (the same builder and levers as
:func:`~experiments.bench_measure.side_by_side`, the arguments as shapes); a command-line run
is warmed by running the same command (its learning-rate schedule bakes ``steps`` into the
program). A miss costs what the call cost before: the timed process compiles. Each timed layer
group counts its hits and misses (:func:`cache_counter`) and the page states them, so the
first GPU run also shows whether the cache served.

Workers take the GPU's memory as they need it (``XLA_PYTHON_CLIENT_PREALLOCATE=false``); a
warming command-line run may take at most ``CLI_WARM_FRACTION`` of it (JAX writes a program
to the cache when it has compiled it, so a run that then runs out of memory has still warmed
its training step). Whatever is unfinished at the warm budget's end is stopped: its programs
compile in their timed process, as before. First of all one arm is compiled twice in one
worker, the second time after JAX's in-memory caches are cleared: if that does not read the
cache (a backend whose executables do not serialize), the part stops there.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

# Where the timed processes and the workers share compiled programs; it outlives the call, so
# that a second call on the same warm machine (``--parts layer``) reads the first one's.
CACHE_DIR = "/tmp/copejax-bench-cache"
CACHE_EVENTS = {
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "misses",
}
CLI_WARMERS = 4  # command-line runs at a time: each trains GPT-2 small on the GPU
CLI_WARM_FRACTION = "0.15"  # of the GPU's memory, at most, per warming command-line run


def cache_settings(directory: str) -> dict[str, Any]:
    """The JAX options that make a process read and write ``directory``'s persistent cache,
    every program included (no minimum compile time or size)."""
    return {
        "jax_compilation_cache_dir": directory,
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }


CACHE_OPTIONS = tuple(cache_settings(""))  # their names


def cache_env(directory: str) -> dict[str, str]:
    """:func:`cache_settings` as environment variables, for a JAX process yet to start."""
    return {name.upper(): str(value) for name, value in cache_settings(directory).items()}


def use_cache(directory: str) -> None:
    """:func:`cache_settings` for this process, where JAX has started already."""
    import jax

    for name, value in cache_settings(directory).items():
        jax.config.update(name, value)


@contextlib.contextmanager
def cache_counter() -> Iterator[dict[str, int]]:
    """Counts this process's persistent-cache hits and misses inside the context."""
    import jax

    counts = dict.fromkeys(CACHE_EVENTS.values(), 0)

    def listen(event: str, **_: Any) -> None:
        if event in CACHE_EVENTS:
            counts[CACHE_EVENTS[event]] += 1

    jax.monitoring.register_event_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(listen)


def warm_jobs(tasks: list[tuple[str, tuple]]) -> tuple[list[tuple], list[tuple]]:
    """The plan's tasks as (pool jobs, command-line runs), in the plan's order: each check,
    each layer arm once per (shape, T, scheme, options) (cuDNN's nope stands in most groups),
    and each command-line run."""
    jobs, cli, seen = [], [], set()
    for kind, what in tasks:
        if kind == "check":
            jobs.append(("check", what))
        elif kind == "layer":
            shape, length, arms = what
            for label, scheme, arm_options in arms:
                # as bench_kernels_gpu.layer_group runs the arm
                opts = {**arm_options, "dtype": "bfloat16"}
                key = (tuple(shape), length, scheme, json.dumps(opts, sort_keys=True))
                if key not in seen:
                    seen.add(key)
                    jobs.append(("compile", (tuple(shape), length, label, scheme, opts)))
        else:
            cli.append(what)
    return jobs, cli


def run_job(job: tuple, probe: bool = False) -> dict:
    """One pool job, in a worker: a check's record, or an arm compiled into the cache; with
    ``probe``, the arm compiled again after JAX's in-memory caches are cleared, counting
    whether the second compile read the persistent cache (``probe``: hits and misses)."""
    kind, what = job
    start = time.perf_counter()
    out: dict[str, Any] = {"kind": kind, "what": list(what)}
    if kind == "check":
        from experiments.kernel_check import check_run

        out["record"] = check_run(*what)
    else:
        import jax

        from experiments import bench_measure

        shape, length, _, scheme, opts = what
        try:
            with bench_measure.layer_shape(*shape):
                bench_measure.compile_arm(scheme, length, opts)
                if probe:
                    jax.clear_caches()
                    with cache_counter() as counts:
                        bench_measure.compile_arm(scheme, length, opts)
                    out["probe"] = counts
            out["status"] = "ok"
        except Exception as error:  # its timed process meets the same error and records it
            out.update(status="error", error=f"{type(error).__name__}: {str(error)[:300]}")
    out["wall_s"] = round(time.perf_counter() - start, 1)
    return out


def warm(
    tasks: list[tuple[str, tuple]],
    workers: int,
    budget_s: float,
    cli_run: Callable[..., dict],
    directory: str = CACHE_DIR,
) -> dict:
    """Runs :func:`warm_jobs` for at most ``budget_s``: first one kernel arm as a probe (does
    a compiled program come back from the cache on this machine? If not, the part stops there),
    then the other pool jobs in ``workers`` processes beside the command-line runs,
    ``CLI_WARMERS`` at a time through ``cli_run(what, timeout_s, env)``. Returns the checks'
    records by task (``checks``: what the timed loop need not run again) and a summary for
    the page."""
    jobs, cli = warm_jobs(tasks)
    start = time.perf_counter()
    deadline = start + budget_s
    env = {**cache_env(directory), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    compiles = [job for job in jobs if job[0] == "compile"]
    # the probe: a kernel arm, as most arms are (a cuDNN arm's executable may store otherwise)
    kernels = [job for job in compiles if job[1][4].get("attention_impl") == "kernel"]
    probe_job = (kernels or compiles or [None])[0]
    done: list[dict] = []
    cli_rows: list[dict] = []
    context = multiprocessing.get_context("spawn")  # a forked JAX runtime is not safe
    with _environ(env):
        pool = context.Pool(workers)
    try:
        probe = [] if probe_job is None else _results(pool, [(probe_job, True)], deadline)
        served = bool(probe) and probe[0].get("probe", {}).get("misses", 1) == 0
        if served or probe_job is None:
            rest = [job for job in jobs if job is not probe_job]
            cli_env = {**env, "XLA_PYTHON_CLIENT_MEM_FRACTION": CLI_WARM_FRACTION}
            with ThreadPoolExecutor(CLI_WARMERS) as threads:
                runs = [
                    threads.submit(
                        lambda w: cli_run(w, max(deadline - time.perf_counter(), 1), cli_env), w
                    )
                    for w in cli
                ]
                done = probe + _results(pool, [(job, False) for job in rest], deadline)
                for run in runs:
                    run.cancel()  # those not started: their timed runs compile
                cli_rows = [run.result() for run in runs if not run.cancelled()]
    finally:
        pool.terminate()  # unfinished jobs: their timed processes compile
        pool.join()
    checks = {json.dumps(d["what"]): d["record"] for d in done if d["kind"] == "check"}
    compiled = [d for d in done if d["kind"] == "compile"]
    return {
        "checks": checks,
        "summary": {
            "workers": workers,
            "wall_s": round(time.perf_counter() - start, 1),
            "probe": probe[0].get("probe", probe[0].get("error")) if probe else None,
            "served": served,
            "jobs": len(jobs),
            "done": len(done),
            "compiled": sum(d["status"] == "ok" for d in compiled),
            "compile_errors": [d for d in compiled if d["status"] != "ok"],
            "cli_runs": len(cli),
            "cli_done": sum(r.get("status") in ("ok", "refused") for r in cli_rows),
        },
    }


def _results(pool: Any, calls: list[tuple], deadline: float) -> list[dict]:
    """:func:`run_job` of each (job, probe) of ``calls`` in ``pool``, in order, until they
    are done or ``deadline``."""
    pending = [pool.apply_async(run_job, call) for call in calls]
    out = []
    for result in pending:
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        try:
            out.append(result.get(timeout=left))
        except multiprocessing.TimeoutError:
            break
    return out


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """``env`` in ``os.environ`` inside the context (spawned processes copy it at start)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
