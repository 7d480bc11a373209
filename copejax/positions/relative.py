"""Relative position embeddings on the keys (Shaw et al. 2018, arXiv 1803.02155).

As written in the CoPE paper (Golovneva et al. 2024, arXiv 2405.18719) eq. 1:
``a_ij = softmax(q_i . (k_j + e[i - j]))`` with a learned vector e[d] per distance, shared by
the heads of a layer. The position term ``q_i . e[i - j]`` is scaled by 1/sqrt(H) like the
content term, so the logit is ``q_i . (k_j + e[i - j]) / sqrt(H)``. It is computed as
``z = q . E^T`` for every table row and then gathered by distance; e is never built per pair.

Two schemes differ only beyond the table (CoPE paper section 5.4):

- ``relative``: a table of ``max_distance + 1`` rows. A sequence longer than the table is a
  ValueError; a larger distance that cannot be seen from the shapes (positions offset at run
  time) gets no position term at all, as the paper describes unseen positions.
- ``relative_capped``: distances beyond ``max_distance`` (default: training length - 1) use the
  last row e[max_distance], a "far away" embedding, so longer contexts are allowed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.ops.engine_blocks import BlockTerm, PairBlock
from copejax.positions.base import AttentionContext, AttentionSite, Dims, PositionScheme
from copejax.positions.registry import register
from copejax.runtime import sharding as ax


def relative_logits(
    q_BTNH: jax.Array,
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    table_PH: jax.Array,
    capped: bool,
) -> jax.Array:
    """The position term ``q_i . e[i - j] / sqrt(H)`` for causal attention.

    Distances are clipped below at 0 (keys after the query are masked anyway). Above, a
    distance past the last row ``P - 1`` uses the last row when ``capped``, else adds zero.

    Args:
      q_BTNH: queries.
      q_positions_BT, k_positions_BS: integer positions.
      table_PH: e[0], ..., e[P - 1], shared by all heads.
      capped: whether distances beyond the table use its last row.

    Returns:
      bias_BNTS, float32.
    """
    z_BNTP = relative_row_logits(q_BTNH, table_PH)
    return relative_gather(z_BNTP, q_positions_BT, k_positions_BS, capped)


def relative_row_logits(q_BTNH: jax.Array, table_PH: jax.Array) -> jax.Array:
    """``z_i[d] = q_i . e[d] / sqrt(H)`` for every table row d: z_BNTP, float32."""
    z_BNTP = jnp.einsum(
        "BTNH,PH->BNTP",
        q_BTNH.astype(jnp.float32),
        table_PH.astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )
    return z_BNTP / jnp.sqrt(jnp.float32(table_PH.shape[1]))


def relative_gather(
    z_BNTP: jax.Array, q_positions_BT: jax.Array, k_positions_BS: jax.Array, capped: bool
) -> jax.Array:
    """Each pair's ``z_i[i - j]`` (see :func:`relative_logits`): bias_BNTS, float32."""
    num_rows = z_BNTP.shape[-1]
    distance_BTS = jnp.maximum(q_positions_BT[:, :, None] - k_positions_BS[:, None, :], 0)
    row_BTS = jnp.minimum(distance_BTS, num_rows - 1)
    row_BNTS = jnp.broadcast_to(row_BTS[:, None], (*z_BNTP.shape[:3], row_BTS.shape[-1]))
    bias_BNTS = jnp.take_along_axis(z_BNTP, row_BNTS, axis=-1)
    if capped:
        return bias_BNTS
    return jnp.where((distance_BTS < num_rows)[:, None], bias_BNTS, 0.0)


@register
@dataclasses.dataclass(frozen=True)
class Relative(PositionScheme):
    """Shaw et al. relative PE: learned e[i - j] added to the keys, one table per layer.

    Options:
      max_distance: the largest distance with its own embedding (table of max_distance + 1
        rows); defaults to the training length - 1. A sequence longer than max_distance + 1
        raises a ValueError.
    """

    name = "relative"
    sites = ("bias",)
    paper = "Shaw et al. 2018, arXiv 1803.02155 (CoPE paper eq. 1)"
    capped: ClassVar[bool] = False

    max_distance: int | None = None

    def resolved_max_distance(self, dims: Dims) -> int:
        return dims.max_len - 1 if self.max_distance is None else self.max_distance

    def validate(self, dims: Dims) -> None:
        max_distance = self.resolved_max_distance(dims)
        if not isinstance(max_distance, int) or max_distance < 0:
            raise ValueError(
                f"{self.name}: max_distance must be an integer >= 0 (or None for max_len - 1), "
                f"got {self.max_distance!r}"
            )

    def check_decode(self, dims: Dims, cache_length: int) -> None:
        max_distance = self.resolved_max_distance(dims)
        if not self.capped and cache_length > max_distance + 1:
            raise ValueError(
                f"{self.name}: a decode cache of {cache_length} tokens needs distances up to "
                f"{cache_length - 1}, beyond max_distance={max_distance}; allowed: max_len <= "
                f"{max_distance + 1} (or relative_capped)"
            )

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _RelativeSite(dims=dims, scheme=self, name=self.name)


@register
@dataclasses.dataclass(frozen=True)
class RelativeCapped(Relative):
    """CoPE paper's relative-capped: distances beyond max_distance reuse the last embedding.

    Options:
      max_distance: the largest distance with its own embedding; defaults to the training
        length - 1. Longer sequences are allowed: their far keys share e[max_distance].
    """

    name = "relative_capped"
    paper = "Golovneva et al. 2024, arXiv 2405.18719 (section 5.4)"
    capped: ClassVar[bool] = True


class _RelativeSite(AttentionSite):
    scheme: Relative = Relative()

    def setup(self) -> None:
        rows = self.scheme.resolved_max_distance(self.dims) + 1
        self.table_PH = self.param(
            "relative_embedding",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (ax.POSITIONS, ax.HEAD_DIM)),
            (rows, self.dims.head_dim),
            jnp.float32,
        )

    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        self._check_length(q_BTNH, k_BSNH)
        bias_BNTS = relative_logits(
            q_BTNH, ctx.q_positions_BT, ctx.k_positions_BS, self.table_PH, self.scheme.capped
        )
        return jnp.where(ctx.mask_BTS[:, None], bias_BNTS, 0.0)

    def _check_length(self, q_BTNH: jax.Array, k_BSNH: jax.Array) -> None:
        rows = self.table_PH.shape[0]
        length = max(q_BTNH.shape[1], k_BSNH.shape[1])
        if not self.scheme.capped and length > rows:
            raise ValueError(
                f"{self.scheme.name}: sequence length {length} needs distances up to "
                f"{length - 1}, beyond max_distance={rows - 1}; allowed: length <= {rows} "
                "(use relative_capped to reuse the last embedding for longer sequences)"
            )

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        """z = q . e for every row once per query block, gathered by distance per pair."""
        self._check_length(q_BTNH, k_BSNH)
        bias = functools.partial(_relative_pair, capped=self.scheme.capped)
        return (BlockTerm(bias, params=self.table_PH, prepare=_relative_prepare),)


def _relative_prepare(table_PH: jax.Array, q_BQNH: jax.Array, q_arrays: dict) -> jax.Array:
    return relative_row_logits(q_BQNH, table_PH)


def _relative_pair(
    table_PH: jax.Array, pair: PairBlock, z_BNQP: jax.Array, carry: Any, *, capped: bool
) -> tuple[jax.Array, Any]:
    return relative_gather(z_BNQP, pair.q_positions_BQ, pair.k_positions_BK, capped), carry
