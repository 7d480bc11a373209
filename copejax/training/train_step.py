"""The sharded train state, its initialisation and the jitted train and eval steps.

The sharding recipe follows maxtext: ``jax.eval_shape`` of the initialiser gives parameters and
optimizer state still boxed with their logical axis names, the config's rules turn those into
``NamedSharding``s, and ``jax.jit`` with ``out_shardings`` creates the state already sharded.
Loss is the masked mean next-token cross-entropy (Vaswani et al. 2017, arXiv 1706.03762).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from copejax.model.transformer import Transformer
from copejax.training import optim

Batch = dict[str, jax.Array]


@flax.struct.dataclass
class TrainState:
    """Everything a checkpoint restores: step, parameters, optimizer state, skipped steps."""

    step: jax.Array
    params: Any
    opt_state: Any
    nonfinite_count: jax.Array


def rngs_for_step(seed: int, step: jax.Array) -> dict[str, jax.Array]:
    """The training rngs of a step, a pure function of (seed, step): resuming replays them."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    dropout_key, positions_key = jax.random.split(key)
    return {"dropout": dropout_key, "positions": positions_key}


EVAL_STREAM = 2**31 - 1  # fold_in data of the evaluation rngs (a step no run reaches)


def eval_rngs(seed: int) -> dict[str, jax.Array]:
    """The evaluation rngs: a fixed ``positions`` key of the seed, for schemes that sample at
    evaluation too (``randomized`` with ``sample_at_eval=True``, as Ruoss et al. 2023 do);
    every evaluation batch draws with it, so evaluations are reproducible."""
    return {"positions": jax.random.fold_in(jax.random.key(seed), EVAL_STREAM)}


def masked_loss_sums(
    logits_BTV: jax.Array, targets_BT: jax.Array, loss_mask_BT: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(sum of cross-entropy over scored tokens, number of scored tokens), both float32."""
    logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
    nll_BT = -jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
    mask_BT = loss_mask_BT.astype(jnp.float32)
    return jnp.sum(nll_BT * mask_BT), jnp.sum(mask_BT)


@dataclasses.dataclass(frozen=True)
class Steps:
    """The model, optimizer and shardings of a run, and its jitted functions.

    Attributes:
      model: the Transformer.
      tx: the optimizer.
      seed: the run's seed (init and per-step rngs).
      state_shardings: a TrainState of NamedShardings.
      batch_sharding: the sharding of every (B, T) input array.
      abstract_state: a TrainState of ShapeDtypeStructs with shardings (for restoring).
    """

    model: Transformer
    tx: optax.GradientTransformation
    seed: int
    state_shardings: Any
    batch_sharding: jax.sharding.NamedSharding
    abstract_state: Any
    init: Callable[[], TrainState]
    train: Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]
    evaluate: Callable[[Any, Batch], dict[str, jax.Array]]


def _boxed_init(model: Transformer, seed: int, init_shape: tuple[int, int]) -> Any:
    # Step keys fold in the step (>= 0); the init key folds in a value no step reaches.
    key = jax.random.fold_in(jax.random.key(seed), 2**31 - 1)
    params_key, dropout_key, positions_key = jax.random.split(key, 3)
    tokens_BT = jnp.zeros(init_shape, jnp.int32)
    positions_BT = jnp.broadcast_to(jnp.arange(init_shape[1], dtype=jnp.int32), init_shape)
    rngs = {"params": params_key, "dropout": dropout_key, "positions": positions_key}
    return model.init(rngs, tokens_BT, positions_BT)["params"]


def _strip_boxes(tree: Any) -> Any:
    """The values inside the logical-partitioning boxes, without applying constraints (nn.unbox
    under ``jax.set_mesh`` would constrain abstract arrays outside any trace, which fails)."""
    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )


def make_steps(
    model: Transformer,
    train_config: Any,
    seed: int,
    init_shape: tuple[int, int],
    *,
    mesh: jax.sharding.Mesh,
    rules: Any,
    optimizer: optim.Optimizer | None = None,
) -> Steps:
    """Builds the sharded initialiser and the jitted steps; call them inside ``jax.set_mesh``
    and ``nn.logical_axis_rules(rules)``.

    Args:
      model: the Transformer.
      train_config: ``config.train``.
      seed: the run's seed.
      init_shape: (B, T) of the dummy batch used to create parameters.
      mesh: the device mesh.
      rules: logical axis rules.
      optimizer: the run's optimizer (``Plan.optimizer``); None builds it from
        ``train_config``.
    """
    from copejax.runtime import sharding

    if optimizer is None:
        boxed_abstract = jax.eval_shape(lambda: _boxed_init(model, seed, init_shape))
        optimizer = optim.optimizer(train_config, boxed_abstract)
    tx, schedule = optimizer.tx, optimizer.schedule

    def boxed_state() -> TrainState:
        params = _boxed_init(model, seed, init_shape)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            nonfinite_count=jnp.zeros((), jnp.int32),
        )

    abstract_boxed_state = jax.eval_shape(boxed_state)
    state_shardings = sharding.tree_shardings(abstract_boxed_state, mesh, rules)
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        _strip_boxes(abstract_boxed_state),
        state_shardings,
    )
    batch_sharding = sharding.batch_sharding(mesh, rules)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    init = jax.jit(lambda: nn.unbox(boxed_state()), out_shardings=state_shardings)

    def loss_fn(params: Any, batch: Batch, rngs: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
        logits_BTV = model.apply(
            {"params": params},
            batch["inputs"],
            batch["positions"],
            batch["segment_ids"],
            deterministic=False,
            rngs=rngs,
        )
        loss_sum, scored = masked_loss_sums(logits_BTV, batch["targets"], batch["loss_mask"])
        return loss_sum / jnp.maximum(scored, 1.0), scored

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        rngs = rngs_for_step(seed, state.step)
        (loss, scored), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, batch, rngs)
        grad_norm = optim.global_norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # A non-finite step changes nothing but the step counter: the loop stops or skips it.
        keep = lambda new, old: jnp.where(finite, new, old)
        new_state = TrainState(
            step=state.step + 1,
            params=jax.tree.map(keep, params, state.params),
            opt_state=jax.tree.map(keep, opt_state, state.opt_state),
            nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
        )
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "finite": finite,
            "scored": scored,
            "learning_rate": schedule(state.step),
        }
        return new_state, metrics

    def eval_step(params: Any, batch: Batch) -> dict[str, jax.Array]:
        logits_BTV = model.apply(
            {"params": params},
            batch["inputs"],
            batch["positions"],
            batch["segment_ids"],
            deterministic=True,
            rngs=eval_rngs(seed),
        )
        loss_sum, scored = masked_loss_sums(logits_BTV, batch["targets"], batch["loss_mask"])
        predictions_BT = jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
        return {"loss_sum": loss_sum, "scored": scored, "predictions": predictions_BT}

    train = jax.jit(
        train_step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    evaluate = jax.jit(
        eval_step,
        in_shardings=(state_shardings.params, batch_sharding),
        out_shardings={"loss_sum": replicated, "scored": replicated, "predictions": batch_sharding},
    )
    return Steps(
        model=model,
        tx=tx,
        seed=seed,
        state_shardings=state_shardings,
        batch_sharding=batch_sharding,
        abstract_state=abstract_state,
        init=init,
        train=train,
        evaluate=evaluate,
    )
