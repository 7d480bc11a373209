"""A finished (or running) training run read back from its workdir: config, task, parameters.

Used by the tools that look at a trained model (``copejax.extrapolate``, ``copejax.sample``,
``copejax.plots.maps``). Parameters are restored with ``copejax.checkpoint.Checkpointer`` into
the state shapes the run's own config builds, on this machine's devices.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import ml_collections

from copejax import sharding, train, workdir
from copejax.checkpoint import Checkpointer
from copejax.data.base import Task
from copejax.model import Transformer
from copejax.model_config import ModelConfig
from copejax.train_step import make_steps


@dataclasses.dataclass(frozen=True)
class TrainedRun:
    """What a workdir holds.

    Attributes:
      workdir: the run's directory.
      config: its resolved config.
      task: the task it trained on.
      model_config: its model.
      params: the parameters of checkpoint ``step`` (unboxed arrays).
      step: the checkpoint's step.
    """

    workdir: Path
    config: ml_collections.ConfigDict
    task: Task
    model_config: ModelConfig
    params: Any
    step: int

    @property
    def label(self) -> str:
        """The run's position scheme (the name plots use)."""
        return self.model_config.position


def load_run(path: str | os.PathLike, step: int | None = None) -> TrainedRun:
    """Reads ``<path>/config.json`` and restores checkpoint ``step`` (default: the latest).

    Raises:
      ValueError: no config.json, or no checkpoint (or not ``step``) in ``<path>/checkpoints``.
    """
    root = Path(path)
    saved = workdir.read_config(root)
    if saved is None:
        raise ValueError(f"{root} has no {workdir.CONFIG_FILE}: not a copejax workdir")
    config = ml_collections.ConfigDict(saved)
    plan = train.validate(config)
    ckpt = Checkpointer(root / "checkpoints", config.train.keep_checkpoints, asynchronous=False)
    try:
        steps = ckpt.all_steps()
        chosen = max(steps) if step is None and steps else step
        if chosen is None or chosen not in steps:
            raise ValueError(f"no checkpoint {step if step is not None else ''} in {ckpt.directory}"
                             f" (saved steps: {sorted(steps)})")  # fmt: skip
        rules = sharding.rules_tuple(config.axis_rules)
        mesh = sharding.make_mesh(*plan.mesh_shape)
        model = Transformer(plan.model_config)
        with nn.logical_axis_rules(rules):
            built = make_steps(
                model, config.train, config.seed, (plan.mesh_shape[0], plan.task.seq_len), mesh,
                rules,
            )  # fmt: skip
            state = ckpt.restore(chosen, built.abstract_state, None)
    finally:
        ckpt.close()
    params = jax.device_get(state.params)
    return TrainedRun(root, config, plan.task, plan.model_config, params, int(chosen))
