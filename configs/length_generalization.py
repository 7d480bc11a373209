"""Length generalisation on the suite of Ruoss et al. 2023 (arXiv 2305.16843): train on input
lengths 1 to 40, test on longer ones, per-output-token accuracy averaged over test lengths.

    python -m copejax.main --config=configs/length_generalization.py:smoke --workdir=/tmp/lg
    python -m copejax.main --config=configs/length_generalization.py:reverse_string,smoke \
        --workdir=/tmp/lg_smoke
    python -m copejax.main \
        --config=configs/length_generalization.py:duplicate_string,cpu,position=randomized \
        --workdir=workdirs/lg_duplicate_randomized

The task is a bare word of the argument (one of ``TASKS``; default ``reverse_string``); the
framing of every task is :mod:`copejax.data._length_suite`. Sizes: ``smoke`` (seconds:
inputs of 1 to 8 symbols, tested at 9, 13 and 17), ``cpu`` (the default; the protocol's
training lengths 1 to 40, tested at 41 to 161 in steps of 8, a 3-layer D = 64 model, 2,000
steps of batch 32), ``paper`` (their ``experiments/example.py``: 5 layers, D = 64, 8 heads,
MLP 4 D, dropout 0.1, batch 128, 10,000 steps, constant Adam lr 1e-3 without weight decay,
gradients clipped at norm 1, 512 test sequences per length; tested at 41 to 500, the issue's
"a few hundred", where their example evaluates lengths up to 100). Shortcuts:
``position=<scheme>``, ``seed``, ``steps``, ``batch_size``, ``lr``, ``layers``, ``heads``,
``d_model``, ``train_max=<n>``, ``test_max=<n>``, ``test_step=<n>``, ``per_length=<test
sequences per length>``, ``init_std``, ``dense_init``, ``scale_embeddings``.

Their model is an encoder that emits all output tokens at once from empty queries; copejax's
is a causal decoder reading ``input <sep> output`` with teacher forcing (see the suite
module), and its block is copejax's (``model.block``, pre-norm), not their post-norm one.
The weights start as theirs do (``models/transformer.py`` of
google-deepmind/randomized_positional_encodings), for every arm: every dense kernel at haiku's
``hk.Linear`` default, a truncated normal with std 1 / sqrt(fan_in) (``model.dense_init =
"fan_in"``; copejax's default N(0, 0.02²) leaves the cpu scale's models short of learning
even the training lengths), and the token embeddings at N(0, 0.02²) times sqrt(D)
(``model.scale_embeddings``; their ``embeddings *= jnp.sqrt(embedding_dim)``): without the
sqrt(D) the sinusoidal encoding is about 35 times the token embedding and the sinusoidal and
randomized arms stay at chance even on the training lengths.
``model.max_len`` is the ``long`` split's length, so a learned table and the randomized
scheme's position range cover it (the learned rows past the training length are never
trained).
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
from copejax.data._length_suite import TASKS
from copejax.data.base import make_task

SHORTCUTS = {
    **COMMON_SHORTCUTS,
    "train_max": "task.options.max_train_length",
    "test_max": "task.options.test_max_length",
    "test_step": "task.options.test_length_step",
    "per_length": "task.options.samples_per_length",
    "init_std": "model.init_std",
    "dense_init": "model.dense_init",
    "scale_embeddings": "model.scale_embeddings",
}


def pop_task(args: dict[str, bool | int | float | str]) -> str:
    """Removes the task word from ``args`` and returns it (``reverse_string`` when none)."""
    chosen = [name for name in TASKS if args.pop(name, False)]
    if len(chosen) > 1:
        raise ValueError(f"choose at most one task of {TASKS}, got {chosen}")
    return chosen[0] if chosen else TASKS[0]


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = parse_arg(arg)
    variant = pop_variant(args)
    task = pop_task(args)

    c = base_config()
    c.task.name = task
    c.task.options = ml_collections.ConfigDict(
        {
            "min_train_length": 1,
            "max_train_length": 40,
            "test_max_length": 500,
            "test_length_step": 1,
            "samples_per_length": 64,
        }
    )
    c.model.position = "rope"
    c.model.scale_embeddings = True
    c.model.dense_init = "fan_in"
    c.train.weight_decay = 0.0
    c.eval.splits = ("test", "long")

    if variant == "smoke":
        smoke(c)
        c.task.options.update(
            max_train_length=8, test_max_length=17, test_length_step=4, samples_per_length=4
        )
    elif variant == "cpu":
        c.task.options.update(test_max_length=161, test_length_step=8, samples_per_length=16)
        c.model.update(d_model=64, num_heads=4, num_layers=3)
        c.train.update(
            steps=2000, batch_size=32, learning_rate=1e-3, warmup_steps=100, log_every=100,
            eval_every=2000, checkpoint_every=500,
        )  # fmt: skip
        # One evaluation, at the end (~40 s a run saved): the study reads only the last one.
        c.eval.update(batch_size=32, max_examples=0)
    else:
        c.task.options.update(samples_per_length=512)
        c.model.update(d_model=64, num_heads=8, num_layers=5, mlp_dim=256, dropout=0.1)
        c.train.update(b2=0.999, eps=1e-8, grad_clip=1.0)  # optax.adam defaults, clip 1
        c.train.update(
            steps=10_000, batch_size=128, learning_rate=1e-3, warmup_steps=0, schedule="constant",
            log_every=100, eval_every=2000, checkpoint_every=2000,
        )  # fmt: skip
        c.eval.update(batch_size=64, max_examples=0)

    apply_shortcuts(c, args, SHORTCUTS)
    c.model.max_len = make_task(task, c.task.options.to_dict()).split_length("long")
    return c
