"""Issue 45's GPU measurement of the fused kernels, in one prepared call of at most 8 minutes.

    JAX_PLATFORMS=cuda python -m experiments.bench_kernels_gpu   # on the GPU machine
    python -m experiments.bench_kernels_gpu --smoke                # CPU, interpret mode

The GPU image lacks grain, ml_collections and a few more: ``python -m
experiments.device_wheels`` downloads them here and prints the install line that starts the
device call (carry ``.whl``).

Part ``warm`` (:mod:`experiments.bench_kernels_warm`), before anything is timed, unless
``--warm_workers 0``: worker processes run the checks and compile every layer arm into JAX's
persistent compilation cache (``--cache_dir``), and the command-line runs run once each, four
at a time, for at most ``--warm_budget_s`` of the budget; the timed processes then read their
programs from the cache, and the page says how many they read.
Part ``check``: each kernel scheme's one-layer model against its naive path on this device
(:mod:`experiments.kernel_check`), stick-breaking's and CoPE's again with their key
tiles in one carry group, and selective attention's again without grouped heads; a scheme
that fails is flagged and gets no dispatch entry.
Part ``layer``: one attention layer's forward + backward in bfloat16 (the layer and the
interleaved rounds of :func:`experiments.bench_measure.side_by_side`; ratios as on
``bench_gpu.md``: the median over rounds of an arm's time over the round's fastest nope arm,
here cuDNN's fused kernel, ``dpa``) at the issue's shapes, (B, N, H) = (2, 4, 64) (B x N =
8) and (4, 16, 128), T = 4096 and 16384. Arms: ``dpa`` (``jax.nn.dot_product_attention``,
``implementation="cudnn"``), the kernels (``model.attention_impl="kernel"``: nope, ALiBi,
T5, FoX, stick-breaking, CoPE, selective, PaTH), and beside each the path ``auto``'s rules take
for that scheme there (``rule_arms``). A group of its own measures the cheaper lever of
larger engine blocks (512 and 1024 keys) for the contextual schemes at the first shape and T
= 4096.
Part ``cli``: steady-state tokens/s of ``python -m copejax.main`` on ``configs/lm.py:paper``
with ``corpus=stdlib``, T = 2048, batch 8, bfloat16 (the setup of issue 45's "Why"), then T =
8192, batch 2 (its other command-line target): RoPE with ``auto`` (cuDNN) against each of
CoPE, FoX and stick-breaking with ``attention_impl="kernel"`` (a scheme the kernels refuse is
recorded with the refusal).
Tasks run in priority order (the checks, the first shape's layer group, CoPE's layer group
(its own, so that a slow compile costs it alone), a group of each kernel scheme at 4 and 8
Triton warps (``warps_arms``), the CLI arms, the lever group, the CLI's own attention layer at
T = 2048 (``CLI_LAYER``: the evidence ``auto`` needs to take a kernel there), selective
attention's and PaTH's groups (their own, as CoPE's), the other shapes' groups) and none
starts past ``--budget_s``, so that the whole call, compilation included, stays within 8
minutes; skipped ones are listed on the page, which is rewritten after every task. Each layer
group runs in a child process stopped after at most ``GROUP_TIMEOUT_S`` (its arms then are
error rows): on the first H100 run CoPE's kernels compiled for over 5.5 minutes and took the
rest of the call. The page
ends with the entries for ``copejax.model.measured_paths.MEASURED`` that the measurements
support.

The arms, checks and their order (``rule_arms``, ``warps_arms``, ``plan`` and the rest) are
:mod:`experiments.bench_kernels_plan`'s; this module runs them and writes the page.

Writes ``bench_kernels_gpu.md`` (dated, stating the device) and ``bench_kernels_gpu.json``
under ``--out_dir`` (default ``experiments/results``). ``--smoke`` runs tiny shapes in
Pallas interpret mode on the CPU (and the CLI part on ``configs/lm.py:smoke``), to check the
script end to end without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from copejax.runtime.results_json import write_json
from experiments import bench_measure
from experiments.bench import ROOT
from experiments.bench_gpu import ratios
from experiments.bench_kernels_cli import MEM_FRACTION, cli_run, run_child
from experiments.bench_kernels_page import page
from experiments.bench_kernels_plan import PARTS, plan, rule_path, task_label
from experiments.bench_kernels_warm import (
    CACHE_DIR,
    CLI_WARMERS,
    cache_counter,
    cache_env,
    use_cache,
    warm,
)
from experiments.kernel_check import check_run

# A layer group (its compilations included) runs in a child stopped after at most this long.
GROUP_TIMEOUT_S = 240.0


def layer_group(shape: tuple[int, int, int], length: int, arms: tuple, rounds: int) -> dict:
    """One (shape, T) group of side-by-side rounds with its ratios to the fastest nope; the
    group records each arm's scheme and explicit path, which
    ``bench_kernels_page.dispatch_entries`` reads."""
    arms = [(label, scheme, {**opts, "dtype": "bfloat16"}) for label, scheme, opts in arms]
    batch, heads, head_dim = shape
    group = {"B": batch, "N": heads, "H": head_dim, "T": length}
    group["arms"] = {
        label: {"scheme": scheme, "impl": opts.get("attention_impl", "auto"), "options": opts}
        for label, scheme, opts in arms
    }
    schemes = {scheme for _, scheme, _ in arms if scheme != "dpa"}
    group["rules"] = {scheme: rule_path(scheme, shape, length) for scheme in sorted(schemes)}
    # an arm that fails to compile or run is a row with its error
    with bench_measure.layer_shape(*shape):
        rows = bench_measure.side_by_side(length, arms, rounds)
    ratios(rows)
    return {**group, "rows": rows}


def isolated_group(
    shape: tuple[int, int, int], length: int, arms: tuple, rounds: int, timeout_s: float
) -> dict:
    """:func:`layer_group` in a child process stopped after ``timeout_s``: a compilation
    that never ends (CoPE's kernels at T = 4096 on the H100 compiled for over 5.5 minutes)
    costs its own group and no more of the call. The child takes ``CLI_MEM_FRACTION`` of
    the GPU's memory, as a command-line run does."""
    with tempfile.TemporaryDirectory() as workdir:
        out = Path(workdir) / "group.json"
        task = json.dumps([shape, length, arms, rounds, str(out)])
        command = [sys.executable, "-m", "experiments.bench_kernels_gpu", "--group", task]
        done = run_child(command, timeout_s)
        if done is not None and done.returncode == 0:
            return json.loads(out.read_text())
    batch, heads, head_dim = shape
    why = (
        f"stopped after {timeout_s:.0f} s (compilation included)"
        if done is None
        else f"exit {done.returncode}: {done.stderr[-600:]}"
    )
    rows = [{"scheme": label, "status": "error", "error": why} for label, _, _ in arms]
    return {"B": batch, "N": heads, "H": head_dim, "T": length, "rows": rows, "rules": {}}


def main(argv: list[str] | None = None) -> None:
    import jax

    parser = argparse.ArgumentParser(prog="python -m experiments.bench_kernels_gpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget_s", type=float, default=420.0)
    parser.add_argument(
        "--warm_workers", type=int, help="part warm's compile workers (0: none; default: cores)"
    )
    parser.add_argument("--warm_budget_s", type=float, default=180.0, help="of --budget_s")
    parser.add_argument("--cache_dir", help=f"the persistent cache (default {CACHE_DIR})")
    parser.add_argument("--cli_steps", type=int, default=40)
    parser.add_argument("--out_dir", default=str(ROOT / "experiments" / "results"))
    parser.add_argument("--render", help="rewrite the page of this JSON (ratios recomputed)")
    parser.add_argument("--group", help=argparse.SUPPRESS)  # isolated_group's child: its task
    parser.add_argument("--note", action="append", default=[], help="with --render: a note")
    args = parser.parse_args(argv)
    if args.render:
        render(Path(args.render), Path(args.out_dir), args.note)
        return
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)  # before JAX starts
    if args.group:
        shape, length, arms, rounds, out = json.loads(args.group)
        arms = tuple((label, scheme, opts) for label, scheme, opts in arms)
        with cache_counter() as counts:
            group = layer_group(tuple(shape), length, arms, rounds)
        write_json(Path(out), {**group, "cache": counts})
        return
    # This process allocates as it needs: the warm part's workers share the GPU with it.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if not args.smoke and jax.default_backend() != "gpu":
        raise SystemExit(f"needs a GPU backend (or --smoke), JAX has {jax.default_backend()!r}")
    start = time.perf_counter()
    tasks, rounds = plan(args.smoke, args.parts.split(","))
    variant, steps = ("smoke", 2) if args.smoke else ("paper", args.cli_steps)
    scratch = tempfile.TemporaryDirectory()  # the smoke's cache: CPU programs, thrown away
    cache_dir = args.cache_dir or (scratch.name if args.smoke else CACHE_DIR)
    os.environ.update(cache_env(cache_dir))  # for every child: the layer groups, the CLI runs
    use_cache(cache_dir)  # and this process (the checks when the warm part is off)

    def run_cli(what: tuple, timeout_s: float, env: dict[str, str] | None = None) -> dict:
        scheme, impl, *size = what  # the smoke's arms: the smoke config's size
        sizes = dict(zip(("length", "batch"), size, strict=False))
        return cli_run(scheme, impl, variant, steps, timeout_s, **sizes, env=env)

    workers = args.warm_workers
    if workers is None:  # the GPU machine's cores, less the command-line warmers'
        workers = 2 if args.smoke else max(1, min(8, (os.cpu_count() or 1) - CLI_WARMERS - 2))
    result = {
        "date": datetime.date.today().isoformat(),
        "device": f"{jax.devices()[0].device_kind}, jax {jax.__version__}",
        "command": "python -m experiments.bench_kernels_gpu " + " ".join(argv or sys.argv[1:]),
        "check": [],
        "layer": [],
        "cli": [],
        "skipped": [],
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    warmed: dict = {"checks": {}}
    if workers > 0:
        warmed = warm(tasks, workers, min(args.warm_budget_s, args.budget_s), run_cli, cache_dir)
        result["warm"] = warmed["summary"]
        print(f"warm: {warmed['summary']}", flush=True)
    for kind, what in tasks:
        elapsed = time.perf_counter() - start
        if kind == "check" and (record := warmed["checks"].get(json.dumps(list(what)))):
            result["check"].append(record)
            continue
        if elapsed > args.budget_s:
            result["skipped"].append(task_label(kind, what))
            continue
        if kind == "check":
            result["check"].append(check_run(*what))
        elif kind == "layer":
            shape, length, arms = what
            left = min(max(args.budget_s + 60 - elapsed, 30), GROUP_TIMEOUT_S)
            group = isolated_group(shape, length, arms, rounds or args.rounds, left)
            result["layer"].append(group)
        else:
            result["cli"].append(run_cli(what, max(args.budget_s + 60 - elapsed, 30)))
        print(f"{kind} {what[:2]}: {time.perf_counter() - start:.0f} s", flush=True)
        # Written after every task: a call cut short by the device's time limit keeps them.
        result["wall_s"] = time.perf_counter() - start
        write_json(out / "bench_kernels_gpu.json", result)
        (out / "bench_kernels_gpu.md").write_text(page(result))
    result["wall_s"] = time.perf_counter() - start
    write_json(out / "bench_kernels_gpu.json", result)
    (out / "bench_kernels_gpu.md").write_text(page(result))
    print(page(result), flush=True)
    scratch.cleanup()


def render(source: Path, out: Path, notes: list[str]) -> None:
    """Rewrites the page (and JSON) of a run's ``source`` JSON under ``out``: the ratios
    recomputed with today's rules (``bench_settings.NOPE_ARMS``), ``notes`` added to its
    own."""

    result = json.loads(source.read_text())
    for group in result["layer"]:
        ratios(group["rows"])
    result["notes"] = [*result.get("notes", []), *notes]
    labels = {f"{kind} {what}": task_label(kind, what) for kind, what in plan(False, PARTS)[0]}
    result["skipped"] = [labels.get(task, task) for task in result["skipped"]]
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench_kernels_gpu.json", result)
    (out / "bench_kernels_gpu.md").write_text(page(result))


if __name__ == "__main__":
    main()
