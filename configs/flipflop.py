"""Flip-Flop language modelling (Liu et al. 2023, arXiv 2306.00946; CoPE paper appendix C).

    python -m copejax.main --config=configs/flipflop.py:smoke --workdir=/tmp/ff
    python -m copejax.main --config=configs/flipflop.py:cpu,position=cope --workdir=workdirs/ff

Arguments: ``smoke`` (seconds: tiny model, 31-token sequences), ``cpu`` (a few minutes on 2
cores), ``paper`` (the CoPE paper's setting: 4 layers, 4 heads, D=256, AdamW lr 3e-4 with
linear decay, 10,000 steps, batch 16, 512-token sequences); the default is ``cpu``. Shortcuts:
``position=<scheme>``, ``seed=<int>``, ``steps=<int>``, ``batch_size=<int>``, ``lr=<float>``,
``layers=<int>``, ``heads=<int>``, ``d_model=<int>``, ``instructions=<int>`` (sequence length
is ``2 * instructions - 1``), ``long=<int>`` (instructions of the length-generalisation splits
``long_test`` and ``long_sparse``, 4x training by default; 0 leaves them out).

``model.max_len`` is the longest evaluation length, so that a learned table covers every split
(its rows past the training length are never trained).
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

SHORTCUTS = {
    **COMMON_SHORTCUTS,
    "instructions": "task.options.num_instructions",
    "long": "task.options.long_instructions",
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg)
    variant = pop_variant(args)

    c = base_config()
    c.task.name = "flipflop"
    c.task.options = ml_collections.ConfigDict(
        {
            "num_instructions": 256,
            "test_size": 1000,
            "ood_sparse_size": 1000,
            "ood_dense_size": 1000,
            "long_instructions": 1024,
            "long_size": 1000,
        }
    )
    c.model.position = "rope"
    c.train.schedule = "linear"
    c.train.end_learning_rate_fraction = 0.0
    c.train.b2 = 0.999
    c.train.eps = 1e-8
    c.train.weight_decay = 0.0
    c.eval.splits = ("test", "ood_sparse", "ood_dense", "long_test", "long_sparse")

    if variant == "smoke":
        smoke(c)
        c.task.options.update(num_instructions=16, long_instructions=32)
    elif variant == "cpu":
        c.task.options.update(num_instructions=32, long_instructions=128)
        c.model.update(d_model=64, num_heads=4, num_layers=2)
        c.train.update(
            steps=600, batch_size=32, learning_rate=3e-3, warmup_steps=40, log_every=25,
            eval_every=100, checkpoint_every=100,
        )  # fmt: skip
        c.eval.update(batch_size=64, max_examples=256)
    else:
        c.model.update(d_model=256, num_heads=4, num_layers=4)
        c.train.update(
            steps=10_000, batch_size=16, learning_rate=3e-4, warmup_steps=0, log_every=100,
            eval_every=1000, checkpoint_every=1000,
        )  # fmt: skip
        c.eval.update(batch_size=64, max_examples=0)

    apply_shortcuts(c, args, SHORTCUTS)
    options = c.task.options
    if not options.long_instructions:
        c.eval.splits = tuple(s for s in c.eval.splits if not s.startswith("long_"))
    c.model.max_len = 2 * max(options.num_instructions, options.long_instructions) - 1
    return c
