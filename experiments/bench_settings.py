"""What the benchmark (``experiments.bench``) measures: its modes, side-by-side arms, the
layer's sizes and the time and memory caps, shared by the driver, its measurements
(``bench_measure``), its page (``bench_page``) and the GPU run (``bench_gpu``)."""

from __future__ import annotations

from pathlib import Path

# The repository: workers run ``-m experiments.bench`` and ``-m copejax.main`` from it.
ROOT = Path(__file__).resolve().parents[1]
MODES = {
    # layer: one attention layer's forward+backward for every scheme, one subprocess per scheme
    # with lengths ascending; long: the 32K run of LONG_SCHEMES, one subprocess each;
    # cli_step: one training step through ``python -m copejax.main`` (configs/lm.py, batch 1);
    # side_by_side: {length: arm groups} timed in interleaved rounds in one process.
    "quick": {
        "layer": [64],
        "long": [],
        "cli_step": [],
        "side_by_side": {64: ("core",)},
        "rounds": 2,
        "repeats": 1,
        "cap_s": 120,
    },
    "full": {
        "layer": [2048, 4096, 16384],
        "long": [32768],
        "cli_step": [16384],
        "side_by_side": {
            1024: ("core",),
            2048: ("since_cope",),
            4096: ("core", "every"),
            16384: ("long",),
        },
        "rounds": 3,
        "repeats": 2,
        "cap_s": 900,
    },
}
# The side-by-side timing: every arm compiled in one process, then ``rounds`` rounds that each
# time every arm once, in an order that rotates between rounds, so that a change of machine
# load hits all arms alike; ratios are taken within a round. (label, scheme, options.) An arm
# named after a scheme alone is its default (model.attention_impl="auto").
CORE_ARMS = (
    ("nope", "nope", {}),
    ("nope naive", "nope", {"attention_impl": "naive"}),
    ("nope blockwise", "nope", {"attention_impl": "blockwise"}),
    ("dpa", "dpa", {}),
    ("cope", "cope", {}),
    ("cope naive", "cope", {"attention_impl": "naive"}),
    ("cope remat", "cope", {"attention_impl": "blockwise", "attention_backward": "remat"}),
    ("fox", "fox", {}),
    ("fox naive", "fox", {"attention_impl": "naive"}),
    ("fox remat", "fox", {"attention_impl": "blockwise", "attention_backward": "remat"}),
    ("stickbreaking", "stickbreaking", {}),
    ("stickbreaking naive", "stickbreaking", {"attention_impl": "naive"}),
    (
        "stickbreaking remat",
        "stickbreaking",
        {"attention_impl": "blockwise", "attention_backward": "remat"},
    ),
)
# Every nope path the codebase has: a ratio is taken against the fastest of them in each
# round (on an H100 the fused Triton kernel, "nope kernel", beat cuDNN's "dpa" at one shape).
NOPE_ARMS = ("nope", "nope naive", "nope blockwise", "dpa", "nope kernel")
# At 16K only the defaults run (the naive paths exceed the memory cap; auto is blockwise).
LONG_ARMS = ("nope", "cope", "fox", "stickbreaking")
# The schemes the 32K target names (issue 13).
LONG_SCHEMES = ("nope", "rope", "alibi", "t5", "kerple", "cope", "fox", "stickbreaking")
# Keys of an arm's options that are model options, not the scheme's.
MODEL_KEYS = ("attention_impl", "attention_block", "attention_backward", "scan_impl", "dtype")
QUICK_SCHEMES = ("nope", "cope")
# The "since_cope" side-by-side group: the schemes since CoPE (issue 15), default and naive,
# beside the nope arms that every ratio is taken against.
SINCE_COPE = ("path", "path+fox", "selective", "dape")
# What a run measures (--parts): the side-by-side rounds, the per-scheme layer series, the 32K
# layer runs, the CLI training step, and experiments.bench_scan.
PARTS = ("side_by_side", "layer", "long", "cli_step", "scan")
BATCH, HEADS, HEAD_DIM = 2, 4, 64  # B x N = 8, H = 64
STEP_MODEL = {"d_model": 256, "num_heads": 4, "num_layers": 2, "vocab_size": 256}
LONG_RUN_S = 5.0
MEMORY_CAP_BYTES = 10 * 2**30  # the machine is shared: never start a run predicted above this
