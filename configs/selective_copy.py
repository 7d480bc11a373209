"""Selective copy (Gu and Dao 2023, arXiv 2312.00752; CoPE 5.2, arXiv 2405.18719).

    python -m copejax.main --config=configs/selective_copy.py:smoke --workdir=/tmp/sc
    python -m copejax.main --config=configs/selective_copy.py:cpu,position=cope \
        --workdir=workdirs/sc

Arguments: ``smoke`` (seconds: 4 tokens, 4 blanks), ``cpu`` (the default; 16 tokens with 16
blanks, 8 dense and 32 sparse, under 15 minutes on 2 cores), ``paper`` (CoPE 5.2: vocabulary
16, 256 tokens, 256 blanks, 128 dense and 512 sparse, D = 64, 2 layers, 2 heads, 100k steps;
the paper gives neither batch size nor learning rate: ours are 32 and 1e-3 with cosine decay).
Shortcuts: ``position=<scheme>``, ``seed``, ``steps``, ``batch_size``, ``lr``, ``layers``,
``heads``, ``d_model``, ``tokens=<data tokens>``, ``blanks=<blanks in train and test>``.

``model.max_len`` is the longest split (``ood_sparse``), so that learned absolute tables
cover every evaluation.
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
    "tokens": "task.options.num_tokens",
    "blanks": "task.options.num_blanks",
}
SIZES = {  # num_tokens, num_blanks, num_blanks_dense, num_blanks_sparse
    "smoke": (4, 4, 2, 8),
    "cpu": (16, 16, 8, 32),
    "paper": (256, 256, 128, 512),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg)
    variant = pop_variant(args)

    c = base_config()
    c.task.name = "selective_copy"
    tokens, blanks, dense, sparse = SIZES[variant]
    c.task.options = ml_collections.ConfigDict(
        {
            "vocab_size": 16,
            "num_tokens": tokens,
            "num_blanks": blanks,
            "num_blanks_dense": dense,
            "num_blanks_sparse": sparse,
            "test_size": 1000,
            "ood_dense_size": 1000,
            "ood_sparse_size": 1000,
        }
    )
    c.model.position = "rope"
    c.model.update(d_model=64, num_heads=2, num_layers=2)
    c.eval.splits = ("test", "ood_dense", "ood_sparse")

    if variant == "smoke":
        smoke(c)
    elif variant == "cpu":
        c.train.update(
            steps=2000, batch_size=32, learning_rate=3e-3, warmup_steps=100, log_every=50,
            eval_every=500, checkpoint_every=500,
        )  # fmt: skip
        c.eval.update(batch_size=64, max_examples=256)
    else:
        c.train.update(
            steps=100_000, batch_size=32, learning_rate=1e-3, warmup_steps=1000, log_every=200,
            eval_every=5000, checkpoint_every=5000,
        )  # fmt: skip
        c.eval.update(batch_size=64, max_examples=0)

    apply_shortcuts(c, args, SHORTCUTS)
    o = c.task.options
    c.model.max_len = 2 * o.num_tokens + max(o.num_blanks, o.num_blanks_dense, o.num_blanks_sparse)
    return c
