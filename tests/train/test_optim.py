"""Learning-rate schedules against closed forms; the weight-decay mask; AdamW's decoupled decay."""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

from copejax.config.base import base_config
from copejax.runtime import sharding as ax
from copejax.training import optim


def _reference_lr(
    step: int, peak: float, warmup: int, total: int, *, end: float, kind: str
) -> float:
    if step < warmup:
        return peak * step / warmup
    if kind == "constant":
        return peak
    frac = min((step - warmup) / (total - warmup), 1.0)
    if kind == "linear":
        return peak + (end * peak - peak) * frac
    return end * peak + (peak - end * peak) * 0.5 * (1 + math.cos(math.pi * frac))


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_schedules_match_closed_form(kind: str) -> None:
    train = base_config().train
    train.update(steps=100, learning_rate=3e-3, warmup_steps=10, schedule=kind)
    train.end_learning_rate_fraction = 0.1
    schedule = optim.learning_rate_schedule(train)
    for step in (0, 1, 5, 10, 11, 50, 99, 100, 150):
        expected = _reference_lr(step, 3e-3, 10, 100, end=0.1, kind=kind)
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-5, abs=1e-9), step


def _boxed(shape: tuple[int, ...], names: tuple[str, ...]) -> nn.Partitioned:
    return nn.Partitioned(jnp.ones(shape), names=names)


def test_decay_mask_and_decoupled_weight_decay() -> None:
    params = {
        "dense": {"kernel": _boxed((3, 4), (ax.EMBED, ax.MLP))},
        "norm": {"scale": _boxed((3,), (ax.EMBED,))},
        "cope": {"table": _boxed((5, 4), (ax.POSITIONS, ax.HEAD_DIM))},
    }
    mask = optim.decay_mask(params)
    assert mask == {"dense": {"kernel": True}, "norm": {"scale": False}, "cope": {"table": False}}
    train = base_config().train
    train.update(learning_rate=0.1, warmup_steps=0, schedule="constant", weight_decay=0.5)
    train.grad_clip = 0.0
    tx = optim.make_optimizer(train, params)
    values = nn.unbox(params)
    zero_grads = {k: {n: jnp.zeros_like(v) for n, v in d.items()} for k, d in values.items()}
    updates, _ = tx.update(zero_grads, tx.init(values), values)
    # With zero gradients only the decoupled decay -lr * wd * w acts, and only where masked in.
    np.testing.assert_allclose(updates["dense"]["kernel"], -0.1 * 0.5 * np.ones((3, 4)))
    np.testing.assert_array_equal(updates["norm"]["scale"], 0.0)
    np.testing.assert_array_equal(updates["cope"]["table"], 0.0)


def test_validate_names_the_bad_key() -> None:
    train = base_config().train
    train.warmup_steps = -1
    with pytest.raises(ValueError, match=r"train\.warmup_steps"):
        optim.validate(train)
