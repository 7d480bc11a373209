"""Every task config's ``smoke`` variant with every registered position scheme, a few steps each.

    python -m experiments.smoke_all                  # all tasks x all schemes, 3 steps each
    python -m experiments.smoke_all --tasks flipflop,lm --schemes rope,cope --steps 2 --jobs 2

Runs ``python -m copejax.main --config=configs/<task>.py:smoke --workdir=<tmp>
--config.model.position=<scheme> --config.train.steps=<steps>`` once per pair (a fresh process
each, so one failure cannot hide another), prints a table task x scheme of ok / FAIL and the
last error line of each failure, and exits 1 when any pair fails. Tasks are the files of
``configs/``; schemes are the registry's (``python -m copejax.positions``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from copejax.positions import registry

ROOT = Path(__file__).resolve().parents[1]


def all_tasks() -> list[str]:
    """The task config files of ``configs/`` (their stems), sorted."""
    return sorted(p.stem for p in (ROOT / "configs").glob("*.py") if not p.stem.startswith("_"))


def run_pair(task: str, scheme: str, steps: int, workroot: Path) -> tuple[bool, str, float]:
    """(ok, last error line or "", seconds) of one smoke run."""
    command = [
        sys.executable,
        "-m",
        "copejax.main",
        f"--config={ROOT / 'configs' / task}.py:smoke",
        f"--workdir={workroot / f'{task}_{scheme}'}",
        f"--config.model.position={scheme}",
        f"--config.train.steps={steps}",
    ]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode == 0:
        return True, "", seconds
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or line.startswith("error:")]
    return False, (errors or lines or [f"exit {done.returncode}"])[-1].strip(), seconds


def table(tasks: list[str], schemes: list[str], results: dict[tuple[str, str], bool]) -> str:
    """A Markdown table: one row per scheme, one column per task, ok / FAIL (or - if not run)."""
    rows = ["| scheme | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for scheme in schemes:
        cells = []
        for task in tasks:
            ok = results.get((task, scheme))
            cells.append("-" if ok is None else "ok" if ok else "FAIL")
        rows.append(f"| `{scheme}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _names(value: str, allowed: list[str], what: str) -> list[str]:
    if not value:
        return allowed
    chosen = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in allowed]
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; allowed: {allowed}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="", help="comma-separated config names (default all)")
    parser.add_argument("--schemes", default="", help="comma-separated schemes (default all)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at the same time")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.jobs < 1:
        raise SystemExit(f"--steps and --jobs must be >= 1, got {args.steps}, {args.jobs}")
    tasks = _names(args.tasks, all_tasks(), "tasks")
    schemes = _names(args.schemes, registry.names(), "schemes")

    results: dict[tuple[str, str], bool] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="smoke_all_") as tmp:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = {
                pool.submit(run_pair, task, scheme, args.steps, Path(tmp)): (task, scheme)
                for task in tasks
                for scheme in schemes
            }
            for future in concurrent.futures.as_completed(futures):
                task, scheme = futures[future]
                ok, error, seconds = future.result()
                results[task, scheme] = ok
                status = "ok" if ok else f"FAIL: {error}"
                print(f"{task:>15} {scheme:<16} {seconds:6.1f}s {status}", flush=True)
                if not ok:
                    failures.append(f"- {task} x {scheme}: {error}")
    print()
    print(table(tasks, schemes, results))
    if failures:
        print(f"\n{len(failures)} of {len(results)} runs failed:")
        print("\n".join(sorted(failures)))
        return 1
    print(f"\nall {len(results)} runs ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
