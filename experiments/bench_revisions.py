"""Is this checkout slower than an earlier revision? One attention layer's forward+backward on
the CPU, timed under both source trees in interleaved rounds (a script; issue 45's CPU target:
"it keeps the engine, with no slowdown on `experiments/results/bench.md`'s rows").

The earlier revision is unpacked with ``git archive`` into a folder of its own; each timing is
that tree's own benchmark worker (``python -m experiments.bench --worker``: one process, the
layer compiled, a warm-up, then the median of ``repeats`` calls), run with the tree's
``copejax`` first on the path. Both trees run in the same Python with the same packages, so
only the code differs. Each round times every (scheme, length) under both trees, the order of
the two alternating from round to round; a ratio is this checkout's time over the base's
within one round, and the page gives their median and range. Machines drift, so a ratio
taken across rounds or against a page measured on another day says little.

    .venv/bin/python -m experiments.bench_revisions --base bcea296 --out_dir experiments/results
    .venv/bin/python -m experiments.bench_revisions --base HEAD --schemes nope --lengths 64 \
        --rounds 1 --out_dir /tmp/revisions    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from experiments.bench import run_series, tree_environment
from experiments.bench_settings import ROOT

# bench.md's page commit: its rows were measured on the engine as it stood there, before the
# fused kernels (issue 45) began.
BENCH_PAGE_BASE = "bcea296"
# A median ratio past 1 + TOLERANCE with every round above 1 is a slowdown; below
# 1 - TOLERANCE with every round below 1, a speed-up; anything else is within the noise.
TOLERANCE = 0.10
# Calls timed per worker (the worker's ``repeats``); a run over 5 s is timed once.
REPEATS = 3
CAP_S = 900.0


def unpack(revision: str, into: Path) -> Path:
    """The tree of ``revision`` (any name git resolves) under ``into``/<full sha>; unpacked
    once, reused after."""
    sha = _git("rev-parse", "--verify", f"{revision}^{{commit}}").strip()
    tree = into / sha
    if not (tree / ".unpacked").exists():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", sha], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        (tree / ".unpacked").write_text(sha + "\n")
    return tree


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def imported_from(tree: Path) -> Path:
    """Where ``import copejax`` resolves in a worker of ``tree``; it must be inside ``tree``
    (an editable install of another checkout must not win)."""
    done = subprocess.run(
        [sys.executable, "-c", "import copejax; print(copejax.__file__)"],
        cwd=tree,
        env=tree_environment(tree),
        capture_output=True,
        text=True,
        check=True,
    )
    origin = Path(done.stdout.strip()).resolve()
    if tree.resolve() not in origin.parents:
        raise SystemExit(f"a worker in {tree} imports copejax from {origin}, not from the tree")
    return origin


def time_layer(tree: Path, scheme: str, length: int, repeats: int, cap_s: float) -> dict:
    """One layer timing by ``tree``'s own benchmark worker: its BENCH_ROW, or a row with a
    failed status (``experiments.bench.run_series``)."""
    spec = {
        "kind": "layer",
        "scheme": scheme,
        "lengths": [length],
        "repeats": repeats,
        "options": {},
        "cap_s": cap_s,
    }
    return run_series(spec, tree)[0]


def summarize(rounds: list[dict[str, float]], tolerance: float = TOLERANCE) -> dict:
    """Per-round {"base": s, "head": s} -> medians, the within-round ratios head / base, and
    the verdict: "slower", "faster" or "within noise" (see TOLERANCE)."""
    if not rounds:
        raise ValueError("summarize needs at least one round with both timings")
    ratios = [r["head"] / r["base"] for r in rounds]
    median = statistics.median(ratios)
    verdict = "within noise"
    if median > 1 + tolerance and min(ratios) > 1:
        verdict = "slower"
    elif median < 1 - tolerance and max(ratios) < 1:
        verdict = "faster"
    return {
        "base_s": statistics.median(r["base"] for r in rounds),
        "head_s": statistics.median(r["head"] for r in rounds),
        "ratios": ratios,
        "ratio": median,
        "verdict": verdict,
    }


def measure(
    trees: dict[str, Path],
    cases: list[tuple[str, int]],
    rounds: int,
    done: dict[str, dict],
    save: Callable[[dict[str, dict]], None],
) -> dict[str, dict]:
    """Times every case under both trees for ``rounds`` rounds, the order of the trees
    alternating by round; ``done`` holds finished cases (kept), ``save`` is called after each
    case. A case whose timing fails under either tree records the failure and stops there."""
    for scheme, length in cases:
        key = f"{scheme}@{length}"
        if key in done:
            continue
        timings: list[dict[str, float]] = []
        failure = None
        for index in range(rounds):
            order = ("base", "head") if index % 2 == 0 else ("head", "base")
            timing: dict[str, float] = {}
            for side in order:
                row = time_layer(trees[side], scheme, length, REPEATS, CAP_S)
                if row.get("status") != "ok":
                    failure = {"side": side, **row}
                    break
                timing[side] = row["time_s"]
            if failure is not None:
                break
            timings.append(timing)
            print(f"{key} round {index + 1}: {json.dumps(timing)}", flush=True)
        result = {"scheme": scheme, "T": length, "rounds": timings}
        if failure is not None:
            result["failure"] = failure
        elif timings:
            result.update(summarize(timings))
        done[key] = result
        save(done)
    return done


def render(result: dict) -> str:
    """The page: one row per case, and what the verdicts mean."""
    meta = result["meta"]
    lines = [
        "# This checkout against an earlier revision, one layer on the CPU (issue 45)",
        "",
        f"Measured {meta['date']} on {meta['machine']}; jax {meta['jax']}. Base: "
        f"`{meta['base']}` ({meta['base_sha'][:10]}); this checkout: {meta['head']} "
        f"({meta['head_sha'][:10]}"
        f"{', with uncommitted changes' if meta['dirty'] else ''}).",
        "",
        "Commands (in order; a resumed run keeps the finished cases): "
        + "; ".join(f"`{command}`" for command in meta["commands"]),
        "",
        "One attention layer's forward+backward, (B, N, H) = (2, 4, 64), float32, each scheme's "
        "default path (`attention_impl='auto'`), timed by each tree's own benchmark worker "
        "(`experiments.bench`: the median of its calls after a warm-up; a call over 5 s is "
        "timed once). Ratio: this checkout's time over the base's within a round (the order of "
        "the two alternates by round); median (min-max). Verdict: slower where the median "
        f"ratio is over {1 + TOLERANCE:.2f} and every round's over 1; faster where under "
        f"{1 - TOLERANCE:.2f} and every round's under 1; otherwise within noise.",
        "",
        "| scheme | T | base s | this s | ratio | rounds | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in result["cases"].values():
        if "failure" in case:
            failure = case["failure"]
            lines.append(
                f"| {case['scheme']} | {case['T']} | - | - | - | {len(case['rounds'])} | "
                f"failed under {failure['side']}: {failure.get('status')} |"
            )
            continue
        ratios = case["ratios"]
        lines.append(
            f"| {case['scheme']} | {case['T']} | {case['base_s']:.3f} | {case['head_s']:.3f} | "
            f"{case['ratio']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | {len(ratios)} | "
            f"{case['verdict']} |"
        )
    verdicts = [c.get("verdict", "failed") for c in result["cases"].values()]
    lines += [
        "",
        f"Slower: {verdicts.count('slower')}; within noise: {verdicts.count('within noise')}; "
        f"faster: {verdicts.count('faster')}; failed: {verdicts.count('failed')}.",
    ]
    return "\n".join(lines) + "\n"


def _meta(base: str, base_sha: str, head: str, head_tree: Path, command: str) -> dict:
    import jax

    # the working tree: its commit, and whether tracked files differ from it
    dirty = not head and bool(_git("status", "--porcelain", "--untracked-files=no").strip())
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "jax": jax.__version__,
        "base": base,
        "base_sha": base_sha,
        "head": head or "the working tree",
        "head_sha": head_tree.name if head else _git("rev-parse", "HEAD").strip(),
        "dirty": dirty,
        "commands": [command],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=BENCH_PAGE_BASE, help="the earlier revision")
    parser.add_argument("--schemes", default="", help="comma-separated; default: every scheme")
    parser.add_argument("--lengths", default="4096", help="comma-separated sequence lengths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--head", default="", help="the later revision; default: this working tree as it is"
    )
    parser.add_argument("--out_dir", default="experiments/results")
    parser.add_argument("--trees", default="/tmp/copejax-revisions", help="where bases unpack")
    parser.add_argument("--resume", action="store_true", help="keep the JSON's finished cases")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    from copejax.positions import registry

    known = [*registry.names(), "dpa"]  # dpa: nope on jax.nn.dot_product_attention
    schemes = [s for s in args.schemes.split(",") if s] or registry.names()
    unknown = [s for s in schemes if s not in known]
    if unknown:
        parser.error(f"unknown schemes {unknown}; known: {known}")
    lengths = [int(t) for t in args.lengths.split(",") if t]
    base_tree = unpack(args.base, Path(args.trees))
    head_tree = unpack(args.head, Path(args.trees)) if args.head else ROOT
    trees = {"base": base_tree, "head": head_tree}
    for tree in trees.values():
        imported_from(tree)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "bench_revisions.json"
    command = "python -m experiments.bench_revisions " + " ".join(sys.argv[1:])
    meta = _meta(args.base, base_tree.name, args.head, head_tree, command)
    done: dict[str, dict] = {}
    if args.resume and json_path.exists():
        previous = json.loads(json_path.read_text())
        for side in ("base_sha", "head_sha"):
            if previous["meta"][side] != meta[side]:
                raise SystemExit(
                    f"{json_path} measured {side} {previous['meta'][side]}, this run "
                    f"{meta[side]}: resume only the same two revisions"
                )
        done = previous["cases"]
        meta["commands"] = previous["meta"]["commands"] + meta["commands"]

    def save(cases: dict[str, dict]) -> None:
        result = {"meta": meta, "cases": cases}
        json_path.write_text(json.dumps(result, indent=1) + "\n")
        (out_dir / "bench_revisions.md").write_text(render(result))

    cases = [(scheme, length) for length in lengths for scheme in schemes]
    measure(trees, cases, args.rounds, done, save)
    print((out_dir / "bench_revisions.md").read_text())


if __name__ == "__main__":
    main()
