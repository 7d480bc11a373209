"""The counting task (CoPE 5.3, Golovneva et al. 2024, arXiv 2405.18719).

    python -m copejax.main --config=configs/counting.py:smoke --workdir=/tmp/count
    python -m copejax.main --config=configs/counting.py:cpu,position=cope,vars=3 \
        --workdir=workdirs/count

Arguments: ``smoke`` (seconds: up to 8 operations), ``cpu`` (the default; up to 32 operations,
under 15 minutes on 2 cores), ``paper`` (CoPE 5.3: up to 512 operations, weights 1 : 7 : 50,
values up to 10, 10K training programs, OOD pass weights 100 and 10). The paper gives neither
the model nor the context for this task: ``paper`` uses its selective-copy model (D = 64,
2 layers, 2 heads) and a 512-token context, programs longer than that being truncated from the
left as the task documents. Shortcuts: ``position=<scheme>``, ``vars=<1, 3 or 5>``, ``seed``,
``steps``, ``batch_size``, ``lr``, ``layers``, ``heads``, ``d_model``, ``ops=<max operations>``,
``context=<max_len>``, ``train_size=<programs>``.
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
    "vars": "task.options.num_vars",
    "ops": "task.options.max_ops",
    "context": "task.options.max_len",
    "train_size": "task.options.train_size",
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg)
    variant = pop_variant(args)

    c = base_config()
    c.task.name = "counting"
    c.task.options = ml_collections.ConfigDict(
        {
            "num_vars": 1,
            "max_ops": 512,
            "max_len": 512,
            "train_size": 10_000,
            "test_size": 1000,
            "ood_long_size": 1000,
            "ood_short_size": 1000,
        }
    )
    c.model.position = "rope"
    c.model.update(d_model=64, num_heads=2, num_layers=2)
    c.eval.splits = ("test", "ood_long", "ood_short")

    if variant == "smoke":
        smoke(c)
        c.task.options.update(max_ops=8, max_len=32)
    elif variant == "cpu":
        c.task.options.update(max_ops=32, max_len=96)
        c.train.update(
            steps=1000, batch_size=32, learning_rate=3e-3, warmup_steps=100, log_every=50,
            eval_every=500, checkpoint_every=500,
        )  # fmt: skip
        c.eval.update(batch_size=64, max_examples=512)
    else:
        c.train.update(
            steps=20_000, batch_size=32, learning_rate=1e-3, warmup_steps=500, log_every=200,
            eval_every=2000, checkpoint_every=2000,
        )  # fmt: skip
        c.eval.update(batch_size=64, max_examples=0)

    apply_shortcuts(c, args, SHORTCUTS)
    return c
