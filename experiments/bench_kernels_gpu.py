"""Issue 45's GPU measurement of the fused kernels, in one prepared call of at most 8 minutes.

    JAX_PLATFORMS=cuda python -m experiments.bench_kernels_gpu   # on the GPU machine
    python -m experiments.bench_kernels_gpu --smoke                # CPU, interpret mode

The GPU image lacks grain, ml_collections and a few more: ``python -m
experiments.device_wheels`` downloads them here and prints the install line that starts the
device call (carry ``.whl``).

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
with ``corpus=stdlib``, T = 2048, batch 8, bfloat16 (the setup of issue 45's "Why"): RoPE
with ``auto`` (cuDNN) against each of CoPE, FoX and stick-breaking with
``attention_impl="kernel"`` (a scheme the kernels refuse is recorded with the refusal).
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
import time
from pathlib import Path

from copejax.runtime.results_json import write_json
from experiments import bench_measure, kernel_check
from experiments.bench import ROOT
from experiments.bench_gpu import ratios
from experiments.bench_kernels_cli import MEM_FRACTION, cli_run, run_child
from experiments.bench_kernels_page import page

KERNEL = {"attention_impl": "kernel"}
# Each scheme's kernel arm; beside it runs the path auto's rules take for the scheme at the
# group's shape (``rule_arms``), so that the page names the fastest path per scheme.
LAYER_ARMS = (
    ("dpa", "dpa", {}),
    ("nope kernel", "nope", KERNEL),
    ("alibi kernel", "alibi", KERNEL),
    ("t5 kernel", "t5", KERNEL),
    ("fox kernel", "fox", KERNEL),
    ("stickbreaking kernel", "stickbreaking", KERNEL),
)
# CoPE's kernels (an unrolled loop over its 64 table rows) may compile longest: a group of
# their own beside cuDNN's nope, after the others, so that a slow compile delays no other arm.
COPE_ARMS = (("dpa", "dpa", {}), ("cope kernel", "cope", KERNEL))
# Selective attention's kernels (a prefix kernel, then penalties per tile pair): likewise.
SELECTIVE_ARMS = (("dpa", "dpa", {}), ("selective kernel", "selective", KERNEL))
# PaTH: the kernels between key chunks, XLA's chunk products and pairs within chunks
# (copejax.model.kernel_path); its engine walk (auto's rule) is the slowest arm of all.
PATH_ARMS = (("dpa", "dpa", {}), ("path kernel", "path", KERNEL))
# Issue 45's cheaper lever "larger engine blocks on accelerators": the contextual schemes'
# blockwise engine with blocks of 512 and 1024 keys (fewer trips of the latency-bound walk;
# auto's rules take 256 from T = 4096), beside their kernels, on the first shape.
LEVER_BLOCKS = (512, 1024)
# Another lever: 8 warps per Triton program at H = 64 (4 by default), which spills less on the
# H100 target (experiments/kernel_ptx.py), beside the default, for each kernel scheme
# (selective attention's one backward kernel spills 2.2 KB per thread at 4 warps, 1.7 at 8).
WARPS_SCHEMES = ("nope", "alibi", "t5", "fox", "stickbreaking", "cope", "selective")
# And the within-tile sums: prefix sums by default on a GPU, tensor-core matmuls (what issue
# 45 suggested, and the TPU's) beside them; the scan spills less on the H100 target.
SCAN_SCHEMES = ("stickbreaking", "cope")
# And stick-breaking's and CoPE's carries: one checkpoint per carry group by default (O(T H)
# memory, fewer and longer dk / dv programs), one per key tile beside it (O(T^2 / 64), one
# program per key tile: copejax.ops.kernels.carry_groups).
PER_TILE_CARRIES = {**KERNEL, "kernel_carry_groups": 2**30}
# And the softmax kernels' full pairs (every entry allowed: below the diagonal, one segment,
# inside any window) without the mask's compares and selects by default, masked beside it:
# 42-45% fewer non-matrix instructions per full pair in nope's PTX (kernel_ptx.md).
MASKED_TILES = {**KERNEL, "kernel_full_tiles": False}
MASKED_TILES_SCHEMES = ("nope", "alibi", "t5", "fox")
# And stick-breaking's log1p as lg2.approx (the stick-breaking authors' softplus) beside
# libdevice's log1pf, about 30 instructions a value (kernel_ptx.md); off by default.
APPROX_LOG1P = {**KERNEL, "kernel_approx_log1p": True}
LEVER_SCHEMES = ("fox", "stickbreaking", "cope")
# (B, N, H) of the targets, then T; in the order they run.
SHAPES = ((2, 4, 64), (4, 16, 128))
LENGTHS = (4096, 16384)
# Part "check", first: kernel = naive on this device (experiments.kernel_check), per scheme;
# then stick-breaking and CoPE with all five key tiles in one carry group (their dk / dv
# programs update the carries in place across key tiles, which the default, one group per
# tile at this length, does not reach).
CHECK_SCHEMES = ("fox", "cope", "stickbreaking", "selective", "path", "alibi", "t5", "nope")
CHECK_GROUPED = ("stickbreaking", "cope")
# And selective attention without grouped heads (its backward's other output layout: dk and dv
# in the inputs' dtype, the selecting head's dk summed with the selection's inside).
CHECK_UNGROUPED = ("selective",)
# And stick-breaking with its log1p as lg2.approx (APPROX_LOG1P's lever): a row of its own,
# which gates only that lever, not the scheme's dispatch entry.
CHECK_APPROX_LOG1P = ("stickbreaking",)
CLI_ARMS = (("rope", "auto"), ("fox", "kernel"), ("stickbreaking", "kernel"), ("cope", "kernel"))
# The CLI's own attention layer: GPT-2 small's 12 heads of 64 at batch 8, T = 2048 (issue 45's
# "Why"), the CLI schemes' kernels beside the paths auto's rules take there. The CLI target is
# met through auto, which follows a measurement only from its length up
# (copejax.model.measured_paths), and the other layer groups start at T = 4096.
CLI_LAYER = ((8, 12, 64), 2048)
CLI_LAYER_ARMS = (
    ("dpa", "dpa", {}),
    *((f"{scheme} kernel", scheme, KERNEL) for scheme, impl in CLI_ARMS if impl == "kernel"),
)
PARTS = ("check", "layer", "cli")
# A layer group (its compilations included) runs in a child stopped after at most this long.
GROUP_TIMEOUT_S = 240.0


def rule_path(scheme: str, shape: tuple[int, int, int], length: int) -> str:
    """The path ``auto``'s rules take for ``scheme``'s bfloat16 layer on a GPU at this
    shape (``copejax.model.attention_paths.rule_impl``)."""
    from copejax.model.attention_paths import rule_impl

    batch, heads, _ = shape
    with bench_measure.layer_shape(*shape):
        cfg = bench_measure.layer_config(scheme, length, {"dtype": "bfloat16"})
    return rule_impl(cfg, length, "gpu", batch * heads * length * length)


def rule_arms(arms: tuple, shape: tuple[int, int, int], length: int) -> tuple:
    """For each kernel arm, an arm on the path ``auto``'s rules take for its scheme here
    (skipped where that is cuDNN's nope itself, the ``dpa`` arm)."""
    out = []
    for _, scheme, opts in arms:
        impl = rule_path(scheme, shape, length)
        if opts == KERNEL and (scheme != "nope" or impl != "dot_product_attention"):
            out.append((f"{scheme} {impl}", scheme, {"attention_impl": impl}))
    return tuple(out)


def warps_arms() -> tuple:
    """Each kernel scheme with the default warps and with 8, the schemes with within-tile
    sums with those as tensor-core matmuls instead of prefix sums
    (``copejax.ops.kernels.triton_params.scan_for_tracing``) and those with a carry
    checkpoint per key tile (``PER_TILE_CARRIES``), nope's, ALiBi's, T5's and FoX's with
    every pair masked (``MASKED_TILES``) and stick-breaking's with its log1p as
    ``lg2.approx`` (``APPROX_LOG1P``), beside cuDNN's nope."""
    arms = [("dpa", "dpa", {})]
    for scheme in WARPS_SCHEMES:
        arms.append((f"{scheme} kernel", scheme, KERNEL))
        arms.append((f"{scheme} kernel w8", scheme, {**KERNEL, "kernel_warps": 8}))
        if scheme in SCAN_SCHEMES:
            arms.append((f"{scheme} kernel matmul sums", scheme, {**KERNEL, "kernel_scan": False}))
        if scheme in SCAN_SCHEMES:
            arms.append((f"{scheme} kernel per-tile carries", scheme, PER_TILE_CARRIES))
        if scheme in MASKED_TILES_SCHEMES:
            arms.append((f"{scheme} kernel masked tiles", scheme, MASKED_TILES))
        if scheme == "stickbreaking":
            arms.append((f"{scheme} kernel approx log1p", scheme, APPROX_LOG1P))
    return tuple(arms)


def lever_arms() -> tuple:
    """The blockwise engine with larger blocks, and each scheme's kernel beside it."""
    arms = [("dpa", "dpa", {})]
    for scheme in LEVER_SCHEMES:
        arms.append((f"{scheme} kernel", scheme, KERNEL))
        for block in LEVER_BLOCKS:
            opts = {"attention_impl": "blockwise", "attention_block": block}
            arms.append((f"{scheme} blockwise {block}", scheme, opts))
    return tuple(arms)


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
    import tempfile

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


def check_run(
    scheme: str,
    carry_groups: int | None = None,
    kv_heads: int | None = None,
    approx_log1p: bool | None = None,
) -> dict:
    """``experiments.kernel_check.check`` (``kv_heads`` None: its default), or the error that
    stopped it."""
    from experiments.kernel_check import KV_HEADS, check

    kv_heads = KV_HEADS if kv_heads is None else kv_heads
    try:
        return check(scheme, carry_groups, kv_heads, approx_log1p)
    except Exception as error:  # a kernel that fails to lower or compile is a finding
        why = f"{type(error).__name__}: {error}"[:600]
        record = {"scheme": scheme, "carry_groups": carry_groups, "kv_heads": kv_heads}
        extra = {} if approx_log1p is None else {"approx_log1p": approx_log1p}
        return {**record, **extra, "ok": False, "error": why}


def main(argv: list[str] | None = None) -> None:
    import jax

    parser = argparse.ArgumentParser(prog="python -m experiments.bench_kernels_gpu")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget_s", type=float, default=420.0)
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
        write_json(Path(out), layer_group(tuple(shape), length, arms, rounds))
        return
    if not args.smoke and jax.default_backend() != "gpu":
        raise SystemExit(f"needs a GPU backend (or --smoke), JAX has {jax.default_backend()!r}")
    start = time.perf_counter()
    tasks, rounds = plan(args.smoke, args.parts.split(","))
    variant, steps = ("smoke", 2) if args.smoke else ("paper", args.cli_steps)
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
    for kind, what in tasks:
        elapsed = time.perf_counter() - start
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
            left = max(args.budget_s + 60 - elapsed, 30)
            result["cli"].append(cli_run(*what, variant, steps, left))
        print(f"{kind} {what[:2]}: {time.perf_counter() - start:.0f} s", flush=True)
        # Written after every task: a call cut short by the device's time limit keeps them.
        result["wall_s"] = time.perf_counter() - start
        write_json(out / "bench_kernels_gpu.json", result)
        (out / "bench_kernels_gpu.md").write_text(page(result))
    result["wall_s"] = time.perf_counter() - start
    write_json(out / "bench_kernels_gpu.json", result)
    (out / "bench_kernels_gpu.md").write_text(page(result))
    print(page(result), flush=True)


def task_label(kind: str, what: tuple) -> str:
    """A task as the page names it: ``layer (2, 4, 64) T=4096: dpa, cope kernel``, ``cli
    fox kernel``, ``check cope``, ``check cope 1`` (one carry group), ``check selective
    kv_heads=4``."""
    if kind == "layer":
        shape, length, arms = what
        return f"layer {shape} T={length}: " + ", ".join(label for label, _, _ in arms)
    if kind == "check" and len(what) >= 3:  # (scheme, carry groups or None, kv heads[, approx])
        scheme, groups, kv_heads = what[:3]
        approx = " approx_log1p" if len(what) == 4 and what[3] else ""
        return (
            f"check {scheme}"
            + ("" if groups is None else f" {groups}")
            + f" kv_heads={kv_heads}{approx}"
        )
    return f"{kind} {' '.join(map(str, what))}"


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


def plan(smoke: bool, parts: list[str]) -> tuple[list[tuple[str, tuple]], int | None]:
    """The tasks in priority order (the kernels' checks against the naive path, the first
    shape's layer group, CoPE's layer group, the warps lever's group, the CLI arms, the
    engine blocks lever's group, the CLI's own layer at T = 2048 (``CLI_LAYER``), then the
    other groups), so that a time budget cuts
    the least informative ones; and the rounds (None: the command line's). Each kernel group
    also runs the path ``auto``'s rules take."""
    if smoke:
        arms = tuple(a for a in LAYER_ARMS if a[0] in ("dpa", "fox kernel"))
        shape, length = (1, 2, 16), 128
        layer = [("layer", (shape, length, arms + rule_arms(arms, shape, length)))]
        lever = [
            (
                "layer",
                (
                    shape,
                    length,
                    (
                        ("dpa", "dpa", {}),
                        (
                            "fox blockwise 32",
                            "fox",
                            {"attention_impl": "blockwise", "attention_block": 32},
                        ),
                    ),
                ),
            )
        ]
        cli = [("cli", arm) for arm in (("rope", "auto"), ("dape", "kernel"))]
        warps = []
        rounds = 1
    else:
        layer = [
            ("layer", (shape, t, arms + rule_arms(arms, shape, t)))
            for t in LENGTHS
            for shape in SHAPES
            for arms in (LAYER_ARMS, COPE_ARMS, SELECTIVE_ARMS, PATH_ARMS)
        ]
        lever = [("layer", (SHAPES[0], LENGTHS[0], lever_arms()))]
        warps = [("layer", (SHAPES[0], LENGTHS[0], warps_arms()))]
        cli = [("cli", arm) for arm in CLI_ARMS]
        shape, t = CLI_LAYER
        lever.append(("layer", (shape, t, CLI_LAYER_ARMS + rule_arms(CLI_LAYER_ARMS, shape, t))))
        rounds = None
    checks = [("check", (scheme,)) for scheme in (("fox",) if smoke else CHECK_SCHEMES)]
    checks += [("check", (scheme, 1)) for scheme in (() if smoke else CHECK_GROUPED)]
    ungrouped = () if smoke else CHECK_UNGROUPED
    checks += [("check", (scheme, None, kernel_check.HEADS)) for scheme in ungrouped]
    # the approx log1p lever's numerics on the device (its arm in the warps group: speed)
    approx = () if smoke else CHECK_APPROX_LOG1P
    checks += [("check", (scheme, None, kernel_check.KV_HEADS, True)) for scheme in approx]
    checks = checks if "check" in parts else []
    layer = layer if "layer" in parts else []
    lever = lever if "layer" in parts else []
    cli = cli if "cli" in parts else []
    warps = warps if "layer" in parts else []
    tasks = checks + layer[:2] + warps + cli + lever + layer[2:]
    return tasks, rounds


if __name__ == "__main__":
    main()
