"""Config checks that need the model's parameter shapes, done by tracing only (no compute).

Two problems that otherwise surface deep inside JAX after compilation has started: a sharded
parameter dimension that its mesh axes do not divide (e.g. a 13-token vocabulary split over
``tensor=2``), and an evaluation split whose sequences are longer than a position table
(a learned table of ``max_len`` rows, a relative table). The shapes come from
``jax.eval_shape`` of the initialiser, the sharding recipe of maxtext; the model is the
decoder-only transformer of Vaswani et al. 2017 (arXiv 1706.03762).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.data.base import Task
from copejax.model import Transformer
from copejax.model_config import ModelConfig


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
    done = {lengths["train"]}
    for split, length in sorted(lengths.items(), key=lambda item: item[1]):
        if length in done:
            continue
        done.add(length)
        tokens, positions = _tokens(length)
        try:
            jax.eval_shape(
                lambda p, t, q: model.apply({"params": p}, t, q), params, tokens, positions
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
