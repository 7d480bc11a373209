"""Passkey retrieval (Mohtashami and Jaggi 2023, arXiv 2305.16300; TAPE 4.3, arXiv 2501.00712).

    python -m copejax.main --config=configs/passkey.py:smoke --workdir=/tmp/pk
    python -m copejax.main --config=configs/passkey.py:cpu,position=cope --workdir=workdirs/pk

Arguments: ``smoke`` (seconds: T = 72), ``cpu`` (the default; trained at T = 128 and evaluated
at 1, 2 and 4 times the training length, so ``length=96`` evaluates at 96, 192 and 384; under
15 minutes on 2 cores), ``paper`` (TAPE 4.3 fine-tunes Llama2-7B from
4096 to 8192 tokens and tests 1k to 8k; we train from scratch instead: a D = 768, 12-layer,
12-head model at T = 4096, batch 64, evaluated at 1024 to 8192 with 100 keys per length; for
accelerators, not run by us; with ``position=tape``, TAPE at its appendix sizes,
``copejax.positions.tape.PAPER_OPTIONS``). Shortcuts: ``position=<scheme>``, ``seed``, ``steps``,
``batch_size``, ``lr``, ``layers``, ``heads``, ``d_model``, ``length=<training T>``.

``model.max_len`` is the longest evaluation length, so that learned tables cover every split.
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
    "length": "task.options.train_len",
}
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg)
    variant = pop_variant(args)

    c = base_config()
    c.task.name = "passkey"
    c.task.options = ml_collections.ConfigDict(
        {
            "train_len": 4096,
            "eval_lengths": (1024, 2048, 4096, 8192),
            "depths": DEPTHS,
            "max_key": 50_000,
            "eval_size": 100,
        }
    )
    c.model.position = "rope"
    c.eval.splits = ()  # every len_<L> split

    if variant == "smoke":
        smoke(c)
        c.task.options.update(train_len=72, eval_lengths=(72, 96), depths=(0.0, 1.0))
        c.eval.max_examples = 16
    elif variant == "cpu":
        c.task.options.train_len = 128
        c.model.update(d_model=64, num_heads=4, num_layers=2)
        c.train.update(
            steps=800, batch_size=16, learning_rate=3e-3, warmup_steps=50, log_every=50,
            eval_every=400, checkpoint_every=400,
        )  # fmt: skip
        c.eval.update(batch_size=20, max_examples=100)
    else:
        c.model.update(d_model=768, num_heads=12, num_layers=12)
        c.train.update(
            steps=10_000, batch_size=64, learning_rate=2e-4, warmup_steps=500, log_every=100,
            eval_every=2000, checkpoint_every=2000,
        )  # fmt: skip
        c.eval.update(batch_size=8, max_examples=0)

    apply_shortcuts(c, args, SHORTCUTS)
    if variant == "cpu":  # 1x, 2x and 4x the training length, whatever ``length`` chose
        c.task.options.eval_lengths = tuple(k * c.task.options.train_len for k in (1, 2, 4))
    if variant == "paper" and c.model.position == "tape":
        # TAPE's appendix sizes (L = D = 2, B' = 48, psi on each head's B = 64 features).
        c.model.position_options.update(TAPE_PAPER_OPTIONS)
    c.model.max_len = max(c.task.options.train_len, *c.task.options.eval_lengths)
    return c
