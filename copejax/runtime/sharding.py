"""Logical axis names for parameters and activations, and the default rules to mesh axes.

Every parameter and activation in copejax is annotated with these names (maxtext's recipe);
the rules in a config map them to the device mesh axes ``data``, ``fsdp`` and ``tensor``.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

BATCH = "batch"
LENGTH = "length"
KV_LENGTH = "kv_length"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"  # key/value heads of grouped-query attention (model.num_kv_heads)
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
POSITIONS = "positions"  # rows of position tables (learned, relative, CoPE's e[p], T5 buckets)
POS_EMBED = "pos_embed"  # width of position-table rows
POS_MLP = "pos_mlp"  # hidden units of position MLPs (FIRE, CoPE-MLP, TAPE's psi)
LAYERS = "layers"

# (logical name, mesh axis or axes or None). Position-scheme parameters are small: replicated.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    (BATCH, ("data", "fsdp")),
    (LENGTH, None),
    (KV_LENGTH, None),
    (EMBED, "fsdp"),
    (HEADS, "tensor"),
    (KV_HEADS, "tensor"),
    (HEAD_DIM, None),
    (MLP, "tensor"),
    (VOCAB, "tensor"),
    (POSITIONS, None),
    (POS_EMBED, None),
    (POS_MLP, None),
    (LAYERS, None),
)

MESH_AXES = ("data", "fsdp", "tensor")


def mesh_shape(data: int, fsdp: int, tensor: int, device_count: int) -> tuple[int, int, int]:
    """Resolves the (data, fsdp, tensor) sizes; ``data=-1`` takes the devices left over.

    Raises:
      ValueError: a size that is not a positive integer (or -1 for data), or a product that
        is not ``device_count``.
    """
    for name, size in (("fsdp", fsdp), ("tensor", tensor)):
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"mesh.{name} must be a positive integer, got {size!r}")
    if data == -1:
        if device_count % (fsdp * tensor):
            raise ValueError(
                f"mesh.fsdp * mesh.tensor = {fsdp * tensor} does not divide the {device_count} "
                "devices; choose axis sizes whose product divides the device count"
            )
        data = device_count // (fsdp * tensor)
    if not isinstance(data, int) or data <= 0:
        raise ValueError(f"mesh.data must be a positive integer or -1, got {data!r}")
    if data * fsdp * tensor != device_count:
        raise ValueError(
            f"mesh axes data={data} x fsdp={fsdp} x tensor={tensor} = {data * fsdp * tensor} "
            f"must equal the device count {device_count} (set mesh.data=-1 to use the rest)"
        )
    return data, fsdp, tensor


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1) -> jax.sharding.Mesh:
    """A (data, fsdp, tensor) mesh over every device, axes of type Auto.

    Enter it with ``jax.set_mesh(mesh)``; data is the outermost axis, so with several processes
    each process holds a contiguous block of the batch.
    """
    return mesh_of(mesh_shape(data, fsdp, tensor, jax.device_count()))


def mesh_of(shape: tuple[int, int, int]) -> jax.sharding.Mesh:
    """The mesh of resolved (data, fsdp, tensor) sizes (``mesh_shape``'s result) over every
    device, axes of type Auto (see ``make_mesh``)."""
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(auto,) * len(MESH_AXES))


def rules_tuple(rules: Any) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """Normalises axis rules from a config (lists become tuples) and checks their mesh axes."""
    result = []
    for rule in rules:
        if len(rule) != 2:
            raise ValueError(f"axis rule {rule!r} must be a (logical name, mesh axes) pair")
        name, target = rule
        target = tuple(target) if isinstance(target, list | tuple) else target
        for axis in target if isinstance(target, tuple) else (target,):
            if axis is not None and axis not in MESH_AXES:
                raise ValueError(
                    f"axis rule for {name!r} names mesh axis {axis!r}; allowed: {MESH_AXES}"
                )
        result.append((name, target))
    return tuple(result)


def batch_sharding(mesh: jax.sharding.Mesh, rules: Any) -> jax.sharding.NamedSharding:
    """The sharding of (B, T) input arrays: batch over the axes the rules give ``batch``."""
    spec = nn.logical_to_mesh_axes((BATCH, LENGTH), rules_tuple(rules))
    return jax.sharding.NamedSharding(mesh, spec)


def tree_shardings(abstract_tree: Any, mesh: jax.sharding.Mesh, rules: Any) -> Any:
    """Shardings for a tree of (possibly ``nn.Partitioned``-boxed) abstract arrays.

    The recipe from maxtext: ``jax.eval_shape`` of the init function, then the boxes' logical
    partition specs through the rules. Unboxed leaves (step counters, optimizer counts) are
    replicated.
    """
    specs = nn.get_partition_spec(abstract_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, rules_tuple(rules))
