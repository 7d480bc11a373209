"""What :mod:`experiments.bench_kernels_gpu` measures, and in which order: the arms of each
layer group, the checks, the CLI arms, and ``plan``, which puts them in priority order so that
the call's time budget cuts the least informative tasks (the order is stated in the script's
docstring)."""

from __future__ import annotations

from experiments import bench_measure, kernel_check

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
# Issue 45's other command-line target: the same arms at T = 8192, batch 2 (the same tokens per
# step), after those at the "Why"'s T = 2048, batch 8.
CLI_SIZES = ((2048, 8), (8192, 2))
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


def task_label(kind: str, what: tuple) -> str:
    """A task as the page names it: ``layer (2, 4, 64) T=4096: dpa, cope kernel``, ``cli
    fox kernel T=8192 batch=2``, ``check cope``, ``check cope 1`` (one carry group), ``check
    selective kv_heads=4``."""
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
    if kind == "cli" and len(what) == 4:  # (scheme, attention_impl, T, batch)
        return f"cli {what[0]} {what[1]} T={what[2]} batch={what[3]}"
    return f"{kind} {' '.join(map(str, what))}"


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
        cli = [("cli", (*arm, *size)) for size in CLI_SIZES for arm in CLI_ARMS]
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
