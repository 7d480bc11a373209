"""Micro-benchmark: associative_scan against lax.cumsum for CoPE's suffix sums (not a test).

CoPE (Golovneva et al. 2024, arXiv 2405.18719) sums gates over keys for every query, a reverse
cumulative sum over the last axis of a (B, N, T, S) float32 array. This script times both
implementations of ``copejax.ops.scan.cumsum(..., reverse=True)``, forward and forward+backward,
interleaved in one run so that both see the same machine load, and reports the ratio.

    .venv/bin/python -m experiments.bench_scan                       # default sizes
    .venv/bin/python -m experiments.bench_scan --out /tmp/b.json --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp

from copejax.ops.scan import cumsum

DEFAULT_SHAPES = ((16, 4, 512, 512), (4, 4, 128, 128))
IMPLS = ("associative_scan", "cumsum")


def _programs(impl: str) -> dict[str, Callable[[jax.Array], jax.Array]]:
    def forward(x_BNTS: jax.Array) -> jax.Array:
        return cumsum(x_BNTS, axis=-1, reverse=True, impl=impl)

    def loss(x_BNTS: jax.Array) -> jax.Array:
        # A non-uniform cotangent, so the backward pass is a real scan too.
        return jnp.sum(forward(x_BNTS) * x_BNTS)

    return {"forward": jax.jit(forward), "forward+backward": jax.jit(jax.grad(loss))}


def _time_once(fn: Callable[[jax.Array], jax.Array], x: jax.Array) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(x))
    return time.perf_counter() - start


def bench(shapes: tuple[tuple[int, ...], ...], repeats: int, seed: int = 0) -> list[dict]:
    """Median seconds per call for each (shape, pass, impl); impls alternate call by call."""
    rows = []
    for shape in shapes:
        x = jax.random.uniform(jax.random.key(seed), shape, jnp.float32)
        programs = {impl: _programs(impl) for impl in IMPLS}
        for pass_name in ("forward", "forward+backward"):
            fns = {impl: programs[impl][pass_name] for impl in IMPLS}
            for fn in fns.values():  # compile and warm up
                _time_once(fn, x)
                _time_once(fn, x)
            times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
            for _ in range(repeats):
                for impl, fn in fns.items():
                    times[impl].append(_time_once(fn, x))
            median = {impl: statistics.median(t) for impl, t in times.items()}
            rows.append(
                {
                    "shape": list(shape),
                    "pass": pass_name,
                    "associative_scan_ms": 1e3 * median["associative_scan"],
                    "cumsum_ms": 1e3 * median["cumsum"],
                    "ratio_scan_over_cumsum": median["associative_scan"] / median["cumsum"],
                    "repeats": repeats,
                }
            )
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| shape (B, N, T, S) | pass | associative_scan (ms) | lax.cumsum (ms) | ratio |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {tuple(r['shape'])} | {r['pass']} | {r['associative_scan_ms']:.2f} | "
            f"{r['cumsum_ms']:.2f} | {r['ratio_scan_over_cumsum']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="experiments/results/bench_scan.json")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if args.repeats <= 0:
        raise ValueError(f"--repeats must be a positive integer, got {args.repeats}")
    rows = bench(DEFAULT_SHAPES, args.repeats)
    device = jax.devices()[0]
    meta = {
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "command": "python -m experiments.bench_scan",
    }
    print(f"backend {meta['backend']} ({meta['device']}), jax {meta['jax']}")
    print(markdown_table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
