"""Benchmark of every position scheme: time and memory of attention against length (a script).

Issue 13's benchmark of the attention engine: forward+backward time and peak memory of one
attention layer (the scheme's embed site, then one ``copejax.model.attention.Attention`` with
projections) for every scheme over T = 1K..16K, 32K for the schemes the issue names, one
training step through the command line at 16K, and interleaved side-by-side rounds (one
process, ratios within rounds) of each scheme's default path against its naive path and the
fastest nope path. ``dpa`` is nope on ``jax.nn.dot_product_attention``. Measurements run in
subprocesses (an out-of-memory death does not stop the script); a series stops at its first
failure, time over the cap, or predicted memory over the cap (XLA's buffer assignment, read
before running). Also runs ``experiments.bench_scan``.

    .venv/bin/python -m experiments.bench --mode full     # writes experiments/results/bench.*
    .venv/bin/python -m experiments.bench --mode quick --out_dir /tmp/bench   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from experiments.bench_settings import (
    BATCH,
    CORE_ARMS,
    HEAD_DIM,
    HEADS,
    LONG_ARMS,
    LONG_SCHEMES,
    MEMORY_CAP_BYTES,
    MODES,
    NOPE_ARMS,
    PARTS,
    QUICK_SCHEMES,
    ROOT,
    SINCE_COPE,
    STEP_MODEL,
)


def _worker(spec: dict) -> None:
    """Measures spec["lengths"] in ascending order, one BENCH_ROW line each; stops after a
    run over the time cap or over the memory cap (peak RSS is then per length because memory
    grows with T)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from experiments.bench_measure import cli_step, measure, side_by_side

    if spec["kind"] == "side_by_side":
        for row in side_by_side(spec["lengths"][0], spec["arms"], spec["rounds"]):
            print("BENCH_ROW " + json.dumps(row), flush=True)
        return
    for length in spec["lengths"]:
        start = time.perf_counter()
        if spec["kind"] == "cli_step":
            row = cli_step(spec["scheme"], length)
        else:
            row = measure(spec["kind"], spec["scheme"], length, spec["repeats"], spec["options"])
        row["isolated"] = len(spec["lengths"]) == 1
        if row["status"] == "ok" and time.perf_counter() - start > spec["cap_s"]:
            row["status"] = f"over_time_cap_{spec['cap_s']:.0f}s"
        print("BENCH_ROW " + json.dumps(row), flush=True)
        if row["status"] != "ok":
            return


def tree_environment(tree: Path) -> dict[str, str]:
    """The environment of a worker of ``tree``: its copejax before any installed one."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def run_series(spec: dict, tree: Path = ROOT) -> list[dict]:
    """Runs spec's lengths in one subprocess of ``tree``'s own worker (another revision's
    source tree: ``experiments.bench_revisions``); a death or a timeout becomes a failed row
    for the first length without a result."""
    command = [sys.executable, "-m", "experiments.bench", "--worker", json.dumps(spec)]
    timeout = spec["cap_s"] * len(spec["lengths"])
    rows: list[dict] = []
    try:
        done = subprocess.run(
            command,
            cwd=tree,
            env=tree_environment(tree),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        stdout, stderr, returncode = done.stdout, done.stderr, done.returncode
        failure = "error"
        if returncode < 0 or "RESOURCE_EXHAUSTED" in stderr or "MemoryError" in stderr:
            failure = "out_of_memory"
    except subprocess.TimeoutExpired as timed_out:
        stdout = timed_out.stdout.decode() if isinstance(timed_out.stdout, bytes) else ""
        stderr, returncode, failure = "", None, f"over_time_cap_{spec['cap_s']:.0f}s"
    for line in (stdout or "").splitlines():
        if line.startswith("BENCH_ROW "):
            rows.append(json.loads(line[len("BENCH_ROW ") :]))
    if spec["kind"] == "side_by_side":
        if not rows:
            rows.append({"kind": "side_by_side", "scheme": "all", "T": spec["lengths"][0],
                         "status": failure, "stderr_tail": (stderr or "")[-800:]})  # fmt: skip
        return rows
    if (not rows or rows[-1]["status"] == "ok") and len(rows) < len(spec["lengths"]):
        rows.append(
            {
                "kind": spec["kind"],
                "scheme": spec["scheme"],
                "T": spec["lengths"][len(rows)],
                "status": failure,
                "returncode": returncode,
                "stderr_tail": (stderr or "")[-800:],
            }
        )
    return rows


def side_by_side_arms(groups: tuple[str, ...], schemes: list[str]) -> list[tuple]:
    """The arms of a side-by-side length: "core" (CORE_ARMS), "every" (each scheme's
    default against its naive path) and "since_cope" (the nope arms, then SINCE_COPE's
    defaults and naive paths of the chosen schemes)."""
    arms = [arm for arm in CORE_ARMS if arm[1] in schemes] if "core" in groups else []
    if "long" in groups:
        arms = [arm for arm in CORE_ARMS if arm[0] in LONG_ARMS and arm[1] in schemes]
    if "since_cope" in groups:
        chosen = [s for s in SINCE_COPE if s.split("+")[0] in schemes]
        arms = [arm for arm in CORE_ARMS if arm[0] in NOPE_ARMS] if chosen else []
        for scheme in chosen:
            arms += [(scheme, scheme, {}), (f"{scheme} naive", scheme, {"attention_impl": "naive"})]
    if "every" in groups:
        labels = {label for label, _, _ in arms}
        for scheme in schemes:
            if scheme == "dpa":
                continue
            for label, options in ((scheme, {}), (f"{scheme} naive", {"attention_impl": "naive"})):
                if label not in labels:
                    arms.append((label, scheme, options))
    return arms


def run_benchmark(
    mode: str,
    schemes: list[str] | None = None,
    partial: Path | None = None,
    done: list[dict] | None = None,
    parts: tuple[str, ...] = PARTS,
) -> dict:
    """Runs ``mode``'s measurements of ``parts``, writing what has run to ``partial`` after
    each one; ``done`` (rows of an earlier partial run) are kept and their measurements
    skipped."""
    from copejax.positions import registry

    settings = MODES[mode]
    load_at_start = os.getloadavg()
    if schemes is None:
        first = ["nope", "dpa", "cope", "fox", "stickbreaking"]
        others = [name for name in registry.names() if name not in first]
        schemes = list(QUICK_SCHEMES) if mode == "quick" else first + others
    rows: list[dict] = list(done or [])
    measured = {(r["kind"], r["scheme"], r["T"]) for r in rows}
    measured |= {("side_by_side", "all", r["T"]) for r in rows if r["kind"] == "side_by_side"}

    def run(spec: dict) -> list[dict]:
        if all((spec["kind"], spec["scheme"], t) in measured for t in spec["lengths"]):
            return []
        spec = {"repeats": settings["repeats"], "cap_s": settings["cap_s"], "options": {}, **spec}
        series = run_series(spec)
        for row in series:
            print(_row_line(row), flush=True)
        if partial is not None:  # what has run so far, renderable with --render
            done = {"meta": _meta(mode), "rows": [*rows, *series]}
            partial.write_text(json.dumps(done, indent=1) + "\n")
        return series

    def side(lengths: list[int]) -> None:
        nonlocal rows
        for length in lengths if "side_by_side" in parts else []:
            arms = side_by_side_arms(settings["side_by_side"][length], schemes)
            if not arms:  # e.g. --schemes=path in quick mode: no core arm to time
                continue
            spec = {"kind": "side_by_side", "scheme": "all", "lengths": [length], "arms": arms}
            rows += run({**spec, "rounds": settings["rounds"], "cap_s": 4 * settings["cap_s"]})

    # The shortest side-by-side length first, the longest last, the others after the layers.
    lengths = sorted(settings["side_by_side"])
    side(lengths[:1])
    for scheme in schemes if "layer" in parts else []:
        rows += run({"kind": "layer", "scheme": scheme, "lengths": settings["layer"]})
    side(lengths[1:-1])
    for length in settings["long"] if "long" in parts else []:
        for scheme in (s for s in LONG_SCHEMES if s in schemes):
            rows += run({"kind": "layer", "scheme": scheme, "lengths": [length]})
    side(lengths[-1:] if len(lengths) > 1 else [])
    for length in settings["cli_step"] if "cli_step" in parts else []:
        for scheme in (s for s in schemes if s != "dpa"):
            rows += run({"kind": "cli_step", "scheme": scheme, "lengths": [length]})
    return {"meta": {**_meta(mode), "load_average_start": load_at_start}, "rows": rows}


def _row_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['kind']:5} {row['scheme']:16} T={row['T']:6} {row['status']}"
    return (
        f"{row['kind']:5} {row['scheme']:16} T={row['T']:6} {1e3 * row['time_s']:10.1f} ms "
        f"xla {row.get('xla_bytes', row.get('xla_temp_bytes', 0)) / 2**20:9.1f} MiB  "
        f"rss {row.get('peak_rss_bytes', 0) / 2**20:8.1f} MiB"
    )


def _meta(mode: str) -> dict:
    import jax

    return {
        "mode": mode,
        "command": f"python -m experiments.bench --mode {mode}",
        "batch": BATCH,
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "step_model": STEP_MODEL,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_start": os.getloadavg(),
        "memory_cap_bytes": MEMORY_CAP_BYTES,
        "time_cap_s": MODES[mode]["cap_s"],
        "pallas": "not measured: no GPU in this session",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument("--out_dir", default="experiments/results")
    parser.add_argument("--schemes", default=None, help="comma-separated; default: all")
    parser.add_argument("--render", default=None, help="rewrite page and plots from a JSON")
    parser.add_argument("--resume", default=None, help="a partial JSON whose rows are kept")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated of {PARTS}")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        _worker(json.loads(args.worker))
        return
    from experiments.bench_page import markdown, plots

    out_dir = Path(args.out_dir)
    if args.render is not None:
        result = json.loads(Path(args.render).read_text())
        (out_dir / "bench.md").write_text(markdown(result))
        plots(result, out_dir)
        return
    from experiments import bench_scan

    schemes = args.schemes.split(",") if args.schemes else None
    parts = tuple(args.parts.split(","))
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"--parts: unknown {unknown}; allowed: {', '.join(PARTS)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier = json.loads(Path(args.resume).read_text()) if args.resume else {}
    result = run_benchmark(
        args.mode, schemes, out_dir / "bench.partial.json", earlier.get("rows"), parts
    )
    if "scan" in parts:
        scan_shapes = ((2, 2, 64, 64),) if args.mode == "quick" else bench_scan.DEFAULT_SHAPES
        result["scan"] = bench_scan.bench(scan_shapes, MODES[args.mode]["repeats"])
    elif "scan" in earlier:
        result["scan"] = earlier["scan"]
    result["meta"]["load_average_end"] = os.getloadavg()
    if earlier:  # the first run's meta stays; each resumed run is listed after it
        this_run = {
            "command": "python -m experiments.bench " + " ".join(sys.argv[1:]),
            "load_average_start": result["meta"]["load_average_start"],
            "load_average_end": result["meta"]["load_average_end"],
        }
        resumed = [*earlier["meta"].get("resumed", []), this_run]
        result["meta"] = {**earlier["meta"], "resumed": resumed}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / "bench.md").write_text(markdown(result))
    for path in plots(result, out_dir):
        print(f"wrote {path}")
    print(f"wrote {out_dir / 'bench.json'} and {out_dir / 'bench.md'}")


if __name__ == "__main__":
    main()
