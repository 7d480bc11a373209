"""Multi-digit addition (McLeish et al. 2024, arXiv 2405.17399; TAPE 4.1, arXiv 2501.00712).

    python -m copejax.main --config=configs/addition.py:smoke --workdir=/tmp/add
    python -m copejax.main --config=configs/addition.py:cpu,position=tape --workdir=workdirs/add
    python -m copejax.plots.addition --workdir=workdirs/add --out=workdirs/add/grid.png

Arguments: ``smoke`` (seconds: operands up to 3 digits), ``cpu`` (the default; up to 5 digits
in training, the grid to 8, under 15 minutes on 2 cores), ``paper`` (TAPE 4.1 and its Table 5:
operands up to 40 digits, the grid to 50 with 100 sums per pair, 16 layers, D = 1024, MLP 2048,
16 heads, batch 512, 20k steps, AdamW lr 1e-4; with ``position=tape``, TAPE at its appendix
sizes, ``copejax.positions.tape.PAPER_OPTIONS``). Shortcuts: ``position=<scheme>``, ``seed``,
``steps``, ``batch_size``, ``lr``, ``layers``, ``heads``, ``d_model``, ``digits=<N>``,
``extra=<grid digits beyond N>``, ``per_pair=<sums per grid cell>``.

The ``grid`` split is the heatmap's: ``eval.max_examples`` = 0 evaluates all of it.
"""

from __future__ import annotations

import ml_collections

from copejax.config.base import (
    COMMON_SHORTCUTS,
    apply_shortcuts,
    base_config,
    parse_arg,
    pop_variant,
    smoke,
)
from copejax.positions.tape import PAPER_OPTIONS as TAPE_PAPER_OPTIONS

SHORTCUTS = {
    **COMMON_SHORTCUTS,
    "digits": "task.options.max_digits",
    "extra": "task.options.extra_digits",
    "per_pair": "task.options.samples_per_pair",
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg)
    variant = pop_variant(args)

    c = base_config()
    c.task.name = "addition"
    c.task.options = ml_collections.ConfigDict(
        {"max_digits": 40, "extra_digits": 10, "samples_per_pair": 100, "test_size": 1000}
    )
    c.model.position = "rope"
    c.eval.splits = ("test", "grid")

    if variant == "smoke":
        smoke(c)
        c.task.options.update(max_digits=3, extra_digits=1, samples_per_pair=2)
    elif variant == "cpu":
        c.task.options.update(max_digits=5, extra_digits=3, samples_per_pair=8)
        c.model.update(d_model=128, num_heads=4, num_layers=3)
        c.train.update(
            steps=1200, batch_size=64, learning_rate=1e-3, warmup_steps=100, log_every=50,
            eval_every=500, checkpoint_every=500,
        )  # fmt: skip
        c.eval.update(batch_size=64, max_examples=0)
    else:
        c.model.update(d_model=1024, num_heads=16, num_layers=16, mlp_dim=2048)
        c.train.update(
            steps=20_000, batch_size=512, learning_rate=1e-4, warmup_steps=500, log_every=100,
            eval_every=2000, checkpoint_every=2000,
        )  # fmt: skip
        c.eval.update(batch_size=256, max_examples=0)

    apply_shortcuts(c, args, SHORTCUTS)
    if variant == "paper" and c.model.position == "tape":
        # TAPE's appendix sizes (L = D = 2, B' = 48, psi on each head's B = 64 features).
        c.model.position_options.update(TAPE_PAPER_OPTIONS)
    o = c.task.options
    c.model.max_len = 3 * (o.max_digits + o.extra_digits) + 3  # the grid's length
    return c
