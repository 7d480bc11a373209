"""Learned absolute position embeddings (Vaswani et al. 2017, arXiv 1706.03762; GPT-2).

A table ``E`` of ``P`` rows is learned end to end and row ``E[p]`` is added to the token
embedding at position ``p``. The table cannot extrapolate: positions must lie in ``[0, P)``.

Checks: the static length ``T`` is compared with ``P`` at trace time (a ValueError names both);
positions themselves are traced values, so they are checked only when they are concrete
(eager calls). Under ``jit`` an out-of-range position yields NaN embeddings (gather in "fill"
mode) rather than a silently clamped row.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from copejax.positions.base import Dims, EmbedOutput, EmbedSite, PositionScheme, check_positive
from copejax.positions.registry import register
from copejax.runtime import sharding as ax


def check_positions_fit(scheme: str, positions_BT: jax.Array, table_size: int) -> None:
    """Raises a ValueError when positions cannot index a table of ``table_size`` rows.

    The static length T must not exceed the table; concrete (non-traced) positions must lie in
    ``[0, table_size)``. Traced positions are assumed to (checked only by their length).
    """
    length = positions_BT.shape[-1]
    if length > table_size:
        raise ValueError(
            f"{scheme}: sequence length T={length} exceeds table_size={table_size}; "
            f"allowed: T <= {table_size} (positions in [0, {table_size}))"
        )
    if not isinstance(positions_BT, jax.core.Tracer):
        values = np.asarray(positions_BT)
        if values.size and (values.min() < 0 or values.max() >= table_size):
            raise ValueError(
                f"{scheme}: positions range over [{values.min()}, {values.max()}] but the "
                f"table has table_size={table_size} rows; allowed: positions in "
                f"[0, {table_size})"
            )


def lookup_rows_BTD(table_PD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """Rows ``table_PD[positions_BT]``; any position outside ``[0, P)`` gives a NaN row.

    Args:
      table_PD: the embedding table, P rows of width D.
      positions_BT: integer positions.

    Returns:
      (B, T, D) rows in the table's dtype.
    """
    num_rows = table_PD.shape[0]
    # Negative indices would wrap around in numpy style: send them out of range instead.
    index_BT = jnp.where(positions_BT < 0, num_rows, positions_BT)
    return jnp.take(table_PD, index_BT, axis=0, mode="fill", fill_value=jnp.nan)


@register
@dataclasses.dataclass(frozen=True)
class Learned(PositionScheme):
    """A learned table of absolute position embeddings added to the token embeddings.

    Options:
      table_size: rows P of the table; None uses the model's ``max_len``. Sequences longer
        than P raise a ValueError.
      init_std: standard deviation of the table's normal initialiser.
    """

    name = "learned"
    sites = ("embed",)
    paper = "Vaswani et al. 2017, arXiv 1706.03762 (learned variant, as in GPT-2)"

    table_size: int | None = None
    init_std: float = 0.02

    def resolved_table_size(self, dims: Dims) -> int:
        return self.table_size if self.table_size is not None else dims.max_len

    def validate(self, dims: Dims) -> None:
        if self.table_size is not None and (
            not isinstance(self.table_size, int) or self.table_size <= 0
        ):
            raise ValueError(
                f"{self.name}: table_size must be a positive integer or None, "
                f"got {self.table_size!r}"
            )
        check_positive(self.name, init_std=self.init_std)

    def check_decode(self, dims: Dims, cache_length: int) -> None:
        table_size = self.resolved_table_size(dims)
        if cache_length > table_size:
            raise ValueError(
                f"{self.name}: a decode cache of {cache_length} tokens needs positions up to "
                f"{cache_length - 1}, beyond table_size={table_size}; allowed: max_len <= "
                f"{table_size}"
            )

    def embed_module(self, dims: Dims) -> EmbedSite:
        return LearnedEmbed(
            dims=dims,
            table_size=self.resolved_table_size(dims),
            std=self.init_std,
            name=self.name,
        )


class LearnedEmbed(EmbedSite):
    """Adds ``table[positions]`` to x_BTD. Parameter ``table`` of shape (P, D), float32."""

    table_size: int = 1
    std: float = 0.02

    def setup(self) -> None:
        self.table = self.param(
            "table",
            nn.with_logical_partitioning(
                nn.initializers.normal(self.std), (ax.POSITIONS, ax.EMBED)
            ),
            (self.table_size, self.dims.d_model),
            jnp.float32,
        )

    def __call__(
        self, x_BTD: jax.Array, positions_BT: jax.Array, deterministic: bool = True
    ) -> EmbedOutput:
        check_positions_fit("learned", positions_BT, self.table_size)
        pos_BTD = lookup_rows_BTD(self.table, positions_BT)
        return EmbedOutput(x_BTD=x_BTD + pos_BTD.astype(x_BTD.dtype), positions_BT=positions_BT)
