"""Planning a run: a config checked in full before any compute and resolved into a Plan.

``validate`` is what ``copejax.training.train`` runs first, and its Plan is what training
uses: nothing in it is derived again. It resolves the task, the ``ModelConfig``
(``model_config``, which ``copejax.training.trained_run`` reads a finished run back with), the
optimiser, the mesh and batch sizes, the evaluation splits and the fine-tune's source, and
does the checks that need the model's parameter shapes, by tracing only. Those catch two
problems that otherwise surface deep inside JAX after compilation has started: a sharded
parameter dimension that its mesh axes do not divide (e.g. a 13-token vocabulary split over
``tensor=2``), and an evaluation split whose sequences are longer than a position table (a
learned table of ``max_len`` rows, a relative table). The shapes come from ``jax.eval_shape``
of the initialiser, the sharding recipe of maxtext; the model is the decoder-only transformer
of Vaswani et al. 2017 (arXiv 1706.03762).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from copejax.config.base import NONFINITE
from copejax.data.base import Task, make_task
from copejax.model import checks
from copejax.model.config import ModelConfig
from copejax.model.transformer import Transformer
from copejax.runtime import sharding
from copejax.training import finetune, optim
from copejax.training.trained_run import model_config


def split_length(task: Task, split: str, seed: int) -> int:
    """Sequence length T of ``split``'s examples (the task's ``split_length`` when it has one,
    else the length of the split's first example)."""
    if split == "train":
        return task.seq_len
    if hasattr(task, "split_length"):
        return int(task.split_length(split))
    source = task.source(split, seed)
    return len(source[0]["inputs"]) if len(source) else task.seq_len


def _tokens(length: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    shape = (1, length)
    return jax.ShapeDtypeStruct(shape, jnp.int32), jax.ShapeDtypeStruct(shape, jnp.int32)


def abstract_params(cfg: ModelConfig, length: int) -> Any:
    """The parameters' ShapeDtypeStructs, still boxed with their logical axis names."""
    model = Transformer(cfg)
    params_key, dropout_key, positions_key = jax.random.split(jax.random.key(0), 3)
    keys = {"params": params_key, "dropout": dropout_key, "positions": positions_key}
    tokens, positions = _tokens(length)
    try:
        return jax.eval_shape(lambda t, p: model.init(keys, t, p)["params"], tokens, positions)
    except ValueError as error:
        raise ValueError(
            f"the task's training sequences (length {length}) do not fit model.position="
            f"{cfg.position!r}: {error}. Raise model.max_len (or the table size option)"
        ) from error


def check_lengths(cfg: ModelConfig, lengths: Mapping[str, int], params: Any) -> None:
    """Traces the model at every split length longer than training; raises ValueError naming
    the split when the scheme cannot take it (e.g. a learned table shorter than the split)."""
    model = Transformer(cfg)
    # a positions rng for schemes that sample at evaluation (randomized, sample_at_eval)
    rngs = {"positions": jax.random.key(0)}
    done = {lengths["train"]}
    for split, length in sorted(lengths.items(), key=lambda item: item[1]):
        if length in done:
            continue
        done.add(length)
        tokens, positions = _tokens(length)
        try:
            jax.eval_shape(
                lambda p, t, q: model.apply({"params": p}, t, q, rngs=rngs),
                params,
                tokens,
                positions,
            )
        except ValueError as error:
            raise ValueError(
                f"eval split {split!r} has sequences of length {length}, which model.position="
                f"{cfg.position!r} cannot take: {error}. Raise model.max_len (or the table "
                "size option), or leave the split out of eval.splits"
            ) from error


def _path(path: Iterable[Any]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def check_divisible(params: Any, mesh_sizes: Mapping[str, int], rules: Any) -> None:
    """Raises ValueError for a parameter dimension that its mesh axes do not divide.

    Args:
      params: boxed abstract parameters (``nn.Partitioned`` leaves carry logical names).
      mesh_sizes: mesh axis name -> size, e.g. ``{"data": 4, "fsdp": 1, "tensor": 2}``.
      rules: logical axis rules.
    """
    is_box = lambda x: isinstance(x, nn.Partitioned)
    for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_box)[0]:
        if not is_box(leaf):
            continue
        spec = nn.logical_to_mesh_axes(leaf.names, rules)
        for dim, (name, target) in enumerate(zip(leaf.names, spec, strict=True)):
            axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
            ways = math.prod(mesh_sizes[a] for a in axes)
            size = leaf.value.shape[dim]
            if ways > 1 and size % ways:
                mesh = " x ".join(f"{a}={mesh_sizes[a]}" for a in axes)
                raise ValueError(
                    f"parameter {_path(path)} has {name!r} dimension {size}, which the mesh "
                    f"axes {mesh} (sharding {name!r} through axis_rules) do not divide; choose "
                    f"a size divisible by {ways}, a mesh with fewer ways on those axes, or an "
                    f"axis rule ({name!r}, None) to replicate it"
                )


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a validated config resolves to: everything training uses, derived once.

    Attributes:
      task: the task.
      model_config: the resolved and checked ModelConfig.
      mesh_shape: (data, fsdp, tensor) sizes for the device count validated against.
      rules: the logical axis rules.
      optimizer: the optimizer and its learning-rate schedule.
      eval_splits: the splits evaluated.
      init_source: ``train.init_from``, checked against the model (None: no fine-tune, or
        not resolved because the plan only reads a run back).
    """

    task: Task
    model_config: ModelConfig
    mesh_shape: tuple[int, int, int]
    rules: tuple[tuple[str, Any], ...]
    optimizer: optim.Optimizer
    eval_splits: tuple[str, ...]
    init_source: finetune.InitSource | None = None

    @functools.cached_property
    def mesh(self) -> jax.sharding.Mesh:
        """The device mesh of ``mesh_shape`` over this machine's devices (built on first use;
        a plan validated for another device count has none)."""
        return sharding.mesh_of(self.mesh_shape)

    @property
    def batch_ways(self) -> int:
        """The mesh ways of the batch-carrying axes data x fsdp (the dummy init batch)."""
        return self.mesh_shape[0] * self.mesh_shape[1]


def validate(
    config: ml_collections.ConfigDict,
    device_count: int | None = None,
    process_count: int = 1,
    *,
    init_source: bool = True,
) -> Plan:
    """Checks every part of a config before any compute; raises ValueError on the first problem.

    Checks the seed, the task and its options, the model (``copejax.model.checks.validate``,
    which checks the position scheme), the optimizer, the mesh against the device count, that batch
    sizes divide over the batch-sharded mesh axes and the processes, and (tracing the model,
    no compute) that the mesh axes divide every sharded parameter dimension and that the
    position scheme takes every evaluation split's sequence length. With ``init_source``,
    ``train.init_from`` (when set) is read and its architecture checked against the model;
    the tools that read a finished run back pass False (its source may be gone).
    """
    device_count = jax.device_count() if device_count is None else device_count
    if not isinstance(config.seed, int) or not 0 <= config.seed < 2**31:
        raise ValueError(f"seed must be an integer in [0, 2**31), got {config.seed!r}")
    task = make_task(config.task.name, config.task.options.to_dict())
    cfg = checks.validate(model_config(config, task))
    optim.validate(config.train)
    if config.train.nonfinite not in NONFINITE:
        raise ValueError(
            f"train.nonfinite must be one of {NONFINITE}, got {config.train.nonfinite!r}"
        )
    shape = sharding.mesh_shape(
        config.mesh.data, config.mesh.fsdp, config.mesh.tensor, device_count
    )
    rules = sharding.rules_tuple(config.axis_rules)
    batch_axes = nn.logical_to_mesh_axes((sharding.BATCH,), rules)[0] or ()
    batch_axes = batch_axes if isinstance(batch_axes, tuple) else (batch_axes,)
    ways = int(np.prod([dict(zip(sharding.MESH_AXES, shape, strict=True))[a] for a in batch_axes]))
    ways = int(np.lcm(ways, process_count))
    for key in ("train.batch_size", "eval.batch_size"):
        size = config.train.batch_size if key.startswith("train") else config.eval.batch_size
        if not isinstance(size, int) or size <= 0 or size % ways:
            raise ValueError(
                f"{key}={size!r} must be a positive multiple of {ways} (the mesh axes "
                f"{batch_axes} that shard the batch, and the {process_count} processes)"
            )
    splits = task.splits()
    eval_splits = tuple(config.eval.splits) or tuple(s for s in splits if s != "train")
    unknown = [s for s in eval_splits if s not in splits]
    if unknown:
        raise ValueError(f"eval.splits {unknown} unknown to task {task.name!r}: {sorted(splits)}")
    if not isinstance(config.eval.max_examples, int) or config.eval.max_examples < 0:
        raise ValueError(f"eval.max_examples must be >= 0, got {config.eval.max_examples!r}")
    if not isinstance(config.data.worker_count, int) or config.data.worker_count < 0:
        raise ValueError(f"data.worker_count must be >= 0, got {config.data.worker_count!r}")
    # Last, as they trace the model: shapes against the mesh, split lengths against tables.
    params = abstract_params(cfg, task.seq_len)
    check_divisible(params, dict(zip(sharding.MESH_AXES, shape, strict=True)), rules)
    lengths = {s: split_length(task, s, config.seed) for s in eval_splits}
    check_lengths(cfg, {**lengths, "train": task.seq_len}, params)
    source = None
    if init_source and config.train.get("init_from"):
        source = finetune.check_source(config.train.init_from, cfg)
    return Plan(
        task=task,
        model_config=cfg,
        mesh_shape=shape,
        rules=rules,
        optimizer=optim.optimizer(config.train, params),
        eval_splits=eval_splits,
        init_source=source,
    )
