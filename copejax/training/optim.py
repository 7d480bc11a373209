"""AdamW (Loshchilov & Hutter, arXiv 1711.05101) with warmup, cosine or linear decay, clipping.

Weight decay applies to matrices only: norms' scales, biases (ndim < 2) and position-scheme
parameters (any axis named ``positions``, ``pos_embed`` or ``pos_mlp``: tables, CoPE's e[p],
slopes, TAPE's and FIRE's small MLPs) are not decayed, so that a scheme's position information
is not pulled towards zero by the regulariser rather than by the data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from copejax.config.base import SCHEDULES
from copejax.runtime import sharding as ax

_NO_DECAY_AXES = frozenset({ax.POSITIONS, ax.POS_EMBED, ax.POS_MLP})


def validate(train: ml_collections.ConfigDict) -> None:
    """Raises ValueError naming the first bad optimisation setting and what is allowed."""
    for key in ("steps", "batch_size"):
        value = train[key]
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"train.{key} must be a positive integer, got {value!r}")
    for key in ("warmup_steps", "log_every", "eval_every", "checkpoint_every"):
        value = train[key]
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"train.{key} must be a non-negative integer, got {value!r}")
    if not isinstance(train.keep_checkpoints, int) or train.keep_checkpoints < 1:
        raise ValueError(f"train.keep_checkpoints must be >= 1, got {train.keep_checkpoints!r}")
    for key in ("learning_rate", "weight_decay", "grad_clip", "eps"):
        if not train[key] >= 0:
            raise ValueError(f"train.{key} must be >= 0, got {train[key]!r}")
    if not train.learning_rate > 0:
        raise ValueError(f"train.learning_rate must be > 0, got {train.learning_rate!r}")
    for key in ("b1", "b2", "end_learning_rate_fraction"):
        if not 0.0 <= train[key] <= 1.0:
            raise ValueError(f"train.{key} must be in [0, 1], got {train[key]!r}")
    if train.schedule not in SCHEDULES:
        raise ValueError(f"train.schedule must be one of {SCHEDULES}, got {train.schedule!r}")


def learning_rate_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup from 0 over ``warmup_steps``, then cosine, linear or constant.

    Decay ends at ``learning_rate * end_learning_rate_fraction`` at step ``steps``.
    """
    peak = float(train.learning_rate)
    end = peak * float(train.end_learning_rate_fraction)
    warmup = int(train.warmup_steps)
    decay_steps = max(int(train.steps) - warmup, 1)
    if train.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=end / peak)
    elif train.schedule == "linear":
        after = optax.linear_schedule(peak, end, decay_steps)
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def decay_mask(boxed_params: Any) -> Any:
    """True for the parameters that weight decay applies to (see the module docstring).

    Args:
      boxed_params: parameters (or their ``jax.eval_shape``) still wrapped in
        ``nn.Partitioned`` boxes, whose axis names identify position-scheme parameters.
    """

    def leaf_mask(leaf: Any) -> bool:
        names = leaf.names if isinstance(leaf, nn.Partitioned) else ()
        value = leaf.value if isinstance(leaf, nn.Partitioned) else leaf
        return len(value.shape) >= 2 and not (_NO_DECAY_AXES & set(names))

    return jax.tree.map(leaf_mask, boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def make_optimizer(
    train: ml_collections.ConfigDict, boxed_params: Any
) -> optax.GradientTransformation:
    """Global-norm clipping (``grad_clip`` > 0) then AdamW on the schedule."""
    adamw = optax.adamw(
        learning_rate_schedule(train),
        b1=float(train.b1),
        b2=float(train.b2),
        eps=float(train.eps),
        weight_decay=float(train.weight_decay),
        mask=decay_mask(boxed_params),
    )
    if train.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(float(train.grad_clip)), adamw)
    return adamw


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """A run's optimizer: the optax transformation and its learning-rate schedule.

    Attributes:
      tx: clipping then AdamW (:func:`make_optimizer`).
      schedule: step -> learning rate (:func:`learning_rate_schedule`), logged by the steps.
    """

    tx: optax.GradientTransformation
    schedule: optax.Schedule


def optimizer(train: ml_collections.ConfigDict, boxed_params: Any) -> Optimizer:
    """The :class:`Optimizer` of ``train`` for parameters shaped like ``boxed_params``."""
    return Optimizer(make_optimizer(train, boxed_params), learning_rate_schedule(train))


def global_norm(tree: Any) -> jax.Array:
    """The float32 global L2 norm of a tree of arrays."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))
