"""Long-run check: a 10,000-step smoke run keeps host memory flat and step time steady.

Trains the Flip-Flop smoke model (Liu et al. 2023, arXiv 2306.00946) with the ordinary
program, ``python -m copejax.main``, in a child process, samples the child's resident set size
(VmRSS) twice a second, and reads the per-window speed from its metrics.jsonl. Writes
experiments/results/long_run.md and long_run.json.

    python -m experiments.long_run                       # 10,000 steps (CPU: tens of minutes)
    python -m experiments.long_run --steps=2000 --out=/tmp/lr   # a shorter look

Pass/fail bounds (recorded with the figures): resident memory at the end may exceed the
median over the first tenth after warm-up by at most ``--rss_bound_mib`` (default 64 MiB),
and the median steps/s of the last tenth of the run is within 25% of that of the second tenth.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mib(pid: int) -> float | None:
    """The resident set size of ``pid`` in MiB (Linux /proc), or None once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def last_step(metrics: Path) -> int:
    """The step of the last complete line of metrics.jsonl (0 when none)."""
    if not metrics.exists():
        return 0
    step = 0
    for line in metrics.read_text(encoding="utf-8").splitlines():
        try:
            step = int(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            continue
    return step


def measure(steps: int, workdir: Path, log_every: int) -> dict:
    """Runs the training child; returns the RSS samples (step, MiB) and speed records."""
    command = [
        sys.executable,
        "-m",
        "copejax.main",
        f"--config=configs/flipflop.py:smoke,steps={steps}",
        f"--workdir={workdir}",
        f"--config.train.log_every={log_every}",
        f"--config.train.eval_every={max(steps // 10, 1)}",
        f"--config.train.checkpoint_every={max(steps // 10, 1)}",
        "--restart",
    ]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    started = time.monotonic()
    log = open(workdir.parent / f"{workdir.name}.log", "w", encoding="utf-8")
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    samples: list[tuple[int, float]] = []
    while child.poll() is None:
        rss = rss_mib(child.pid)
        if rss is not None:
            samples.append((last_step(workdir / "metrics.jsonl"), rss))
        time.sleep(0.5)
    log.close()
    if child.returncode != 0:
        raise RuntimeError(f"training failed (rc {child.returncode}); see {log.name}")
    records = [
        json.loads(line)
        for line in (workdir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    ]
    speeds = [(r["step"], r["train/steps_per_sec"]) for r in records if "train/steps_per_sec" in r]
    return {
        "steps": steps,
        "wall_seconds": time.monotonic() - started,
        "rss_samples": samples,
        "speeds": speeds,
        "final": records[-1],
    }


def summarize(result: dict, rss_bound_mib: float) -> dict:
    """The figures and the pass/fail verdicts of a measurement."""
    steps = result["steps"]
    tenth = steps // 10
    # The first tenth holds compilation and the first checkpoints: memory settles after it.
    early = [m for s, m in result["rss_samples"] if tenth <= s < 2 * tenth] or [
        m for _, m in result["rss_samples"]
    ]
    late = [m for s, m in result["rss_samples"] if s >= steps - tenth]
    speed_early = [v for s, v in result["speeds"] if tenth < s <= 2 * tenth]
    speed_late = [v for s, v in result["speeds"] if s > steps - tenth]
    rss_early = statistics.median(early)
    rss_end = max(late) if late else result["rss_samples"][-1][1]
    ratio = statistics.median(speed_late) / statistics.median(speed_early)
    return {
        "rss_early_median_mib": rss_early,
        "rss_late_max_mib": rss_end,
        "rss_growth_mib": rss_end - rss_early,
        "rss_peak_mib": max(m for _, m in result["rss_samples"]),
        "steps_per_sec_early_median": statistics.median(speed_early),
        "steps_per_sec_late_median": statistics.median(speed_late),
        "speed_ratio_late_over_early": ratio,
        "memory_flat": rss_end - rss_early <= rss_bound_mib,
        "speed_steady": 0.75 <= ratio <= 1.25,
    }


def write_report(result: dict, summary: dict, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "long_run.json").write_text(
        json.dumps({"summary": summary, **result}, indent=1) + "\n", encoding="utf-8"
    )
    steps = result["steps"]
    by_tenth = []
    for k in range(10):
        lo, hi = k * steps // 10, (k + 1) * steps // 10
        rss = [m for s, m in result["rss_samples"] if lo <= s < hi]
        speed = [v for s, v in result["speeds"] if lo < s <= hi]
        by_tenth.append(
            f"| {lo + 1}-{hi} | {statistics.median(rss) if rss else float('nan'):.1f} | "
            f"{max(rss) if rss else float('nan'):.1f} | "
            f"{statistics.median(speed) if speed else float('nan'):.1f} |"
        )
    final = result["final"]
    lines = [
        "# Long run: host memory and step time over 10,000 steps",
        "",
        f"Command: `{command}`",
        "",
        "The Flip-Flop smoke model (2 layers, D = 32, 2 heads, rope, batch 8, 31 tokens) trained "
        f"for {steps:,} steps by `python -m copejax.main` on the CPU, with an evaluation and a "
        f"checkpoint every {max(steps // 10, 1):,} steps; the child's resident memory (VmRSS) "
        "sampled twice a second, speeds from metrics.jsonl (one value per logging window; the "
        "machine has 2 cores shared with other work, so speeds are noisy).",
        "",
        "| steps | RSS median (MiB) | RSS max (MiB) | steps/s median |",
        "|---|---|---|---|",
        *by_tenth,
        "",
        f"- wall time: {result['wall_seconds']:.0f} s; final train loss "
        f"{final.get('train/loss', float('nan')):.4f}",
        f"- resident memory: {summary['rss_early_median_mib']:.1f} MiB (median, steps "
        f"{steps // 10}-{2 * steps // 10}) -> {summary['rss_late_max_mib']:.1f} MiB (max, last "
        f"tenth): growth {summary['rss_growth_mib']:+.1f} MiB; peak "
        f"{summary['rss_peak_mib']:.1f} MiB. Flat (growth <= bound): "
        f"**{summary['memory_flat']}**",
        f"- steps/s: {summary['steps_per_sec_early_median']:.1f} (second tenth) -> "
        f"{summary['steps_per_sec_late_median']:.1f} (last tenth), ratio "
        f"{summary['speed_ratio_late_over_early']:.2f}. Steady (within 25%): "
        f"**{summary['speed_steady']}**",
        "",
    ]
    (out / "long_run.md").write_text("\n".join(lines), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--log_every", type=int, default=100)
    parser.add_argument("--rss_bound_mib", type=float, default=64.0)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="copejax-long-run-")) / "run"
    result = measure(args.steps, workdir, args.log_every)
    summary = summarize(result, args.rss_bound_mib)
    command = "python -m experiments.long_run" + (
        f" --steps={args.steps}" if args.steps != 10_000 else ""
    )
    write_report(result, summary, args.out, command)
    print(json.dumps(summary, indent=1))
    if not (summary["memory_flat"] and summary["speed_steady"]):
        sys.exit(1)


if __name__ == "__main__":
    main()
