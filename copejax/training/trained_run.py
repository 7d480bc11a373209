"""A finished (or running) training run read back from its workdir: config, task, parameters.

Used by the tools that look at a trained model (``copejax.evaluation.extrapolate``,
``copejax.evaluation.sample``,
``copejax.plots.maps``). The parameters of a checkpoint written by
``copejax.runtime.checkpoint.Checkpointer`` are read back as saved, onto this machine's default
device, with the parameter paths of runs saved before 0.2.0 renamed to today's
(``copejax.model.param_paths``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from copejax.data.base import Task, make_task
from copejax.model import checks, param_paths
from copejax.model.config import ModelConfig
from copejax.runtime import workdir
from copejax.runtime.checkpoint import Checkpointer


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


def model_config(config: ml_collections.ConfigDict, task: Task) -> ModelConfig:
    """The ModelConfig of ``config.model`` (``ModelConfig.from_config``): the vocabulary and
    the default ``max_len`` come from the task."""
    return ModelConfig.from_config(
        config.model.to_dict(), vocab_size=len(task.vocab), default_max_len=task.seq_len
    )


def run_model(config: ml_collections.ConfigDict) -> tuple[Task, ModelConfig]:
    """The task and the checked ModelConfig of a run's resolved config: what reading the run
    back needs (``copejax.training.plan.validate`` checks the rest, for training it)."""
    task = make_task(config.task.name, config.task.options.to_dict())
    return task, checks.validate(model_config(config, task))


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
    # The task and model only: a run trained on another mesh or device count reads back here.
    task, cfg = run_model(config)
    ckpt = Checkpointer(root / "checkpoints", config.train.keep_checkpoints, asynchronous=False)
    try:
        steps = ckpt.all_steps()
        chosen = max(steps) if step is None and steps else step
        if chosen is None or chosen not in steps:
            raise ValueError(f"no checkpoint {step if step is not None else ''} in {ckpt.directory}"
                             f" (saved steps: {sorted(steps)})")  # fmt: skip
        # Only the parameters are needed: restoring the saved tree as it is (no target built
        # from the current optimizer) keeps old runs readable when the optimizer state changes.
        restored = ckpt.manager.restore(
            chosen, args=ocp.args.Composite(state=ocp.args.StandardRestore())
        )
    finally:
        ckpt.close()
    params = param_paths.upgrade(jax.device_get(restored["state"]["params"]), cfg)
    return TrainedRun(root, config, task, cfg, params, int(chosen))
