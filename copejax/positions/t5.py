"""T5 bucketed relative position bias (Raffel et al. 2020, arXiv 1910.10683).

Each head adds a learned scalar per bucket of the relative position (section 2.1). Half of the
buckets hold exact distances 0, 1, ...; the rest grow logarithmically up to ``max_distance``,
beyond which everything shares the last bucket. As in T5, one table serves every layer.

Scaling: T5 computes ``softmax(q . k + b)`` with no 1/sqrt(H); its initialisation of the
query projection absorbs the factor. copejax scales the content logits of every scheme by
1/sqrt(H) (``copejax/model/attention.py``) and adds this bias unscaled, i.e.
``softmax(q . k / sqrt(H) + b)``. Both are the same family of functions (a query kernel
multiplied by sqrt(H) turns one into the other), but the bias is weighed against content logits
that are sqrt(H) times smaller than T5's for the same q and k: to run a T5 checkpoint here,
multiply its query kernel by sqrt(H).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.ops.engine_blocks import BlockTerm, PairBlock
from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Dims,
    PositionScheme,
    check_positive,
)
from copejax.positions.registry import register
from copejax.runtime import sharding as ax


def t5_bucket(
    relative_position: jax.Array,
    bidirectional: bool = False,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> jax.Array:
    """T5's bucket of a relative position ``key_position - query_position`` (T5's sign).

    Unidirectional (causal): future keys (relative_position > 0) fall in bucket 0 with the
    present. Bidirectional: half the buckets for keys before, half for keys after the query.
    Within a half of ``n`` buckets, distances below ``n // 2`` are exact; larger distances d go
    to ``n // 2 + floor(log(d / (n // 2)) / log(max_distance / (n // 2)) * (n - n // 2))``,
    capped at ``n - 1``.

    Args:
      relative_position: integer array of any shape.

    Returns:
      int32 buckets in [0, num_buckets), same shape.
    """
    relative_position = jnp.asarray(relative_position).astype(jnp.int32)
    buckets = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).astype(jnp.int32) * num_buckets
        distance = jnp.abs(relative_position)
    else:
        distance = jnp.maximum(-relative_position, 0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # log of at least max_exact (the large branch only): no log(0) even where unused.
    ratio = jnp.maximum(distance, max_exact).astype(jnp.float32) / max_exact
    large = max_exact + (
        jnp.log(ratio) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return buckets + jnp.where(is_small, distance, large)


def t5_bias(
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    table_PN: jax.Array,
    bidirectional: bool,
    max_distance: int,
) -> jax.Array:
    """Looks up the learned bias of each (query, key) pair's bucket.

    Args:
      q_positions_BT, k_positions_BS: integer positions.
      table_PN: one learned scalar per bucket (P = num_buckets) and head.

    Returns:
      bias_BNTS in the table's dtype.
    """
    relative_BTS = k_positions_BS[:, None, :] - q_positions_BT[:, :, None]
    bucket_BTS = t5_bucket(relative_BTS, bidirectional, table_PN.shape[0], max_distance)
    return jnp.transpose(table_PN[bucket_BTS], (0, 3, 1, 2))


@register
@dataclasses.dataclass(frozen=True)
class T5Bias(PositionScheme):
    """T5 relative bias: a learned scalar per (bucket, head), one table shared by all layers.

    Options:
      num_buckets: table rows (32 in T5); at least 2 (4 when bidirectional).
      max_distance: distance from which all keys share the last bucket (128 in T5).
      bidirectional: separate buckets for keys after the query (False for a causal decoder).
    """

    name = "t5"
    sites = ("bias",)
    position_only_bias = True
    paper = "Raffel et al. 2020, arXiv 1910.10683"
    share_across_layers = True

    num_buckets: int = 32
    max_distance: int = 128
    bidirectional: bool = False

    def validate(self, dims: Dims) -> None:
        check_positive(self.name, num_buckets=self.num_buckets, max_distance=self.max_distance)
        smallest = 4 if self.bidirectional else 2
        if not isinstance(self.num_buckets, int) or self.num_buckets < smallest:
            raise ValueError(
                f"{self.name}: num_buckets must be an integer >= {smallest} "
                f"(bidirectional={self.bidirectional}), got {self.num_buckets!r}"
            )
        exact = (self.num_buckets // 2 if self.bidirectional else self.num_buckets) // 2
        if self.max_distance <= exact:
            raise ValueError(
                f"{self.name}: max_distance must exceed the {exact} exact buckets, "
                f"got {self.max_distance!r}"
            )

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _T5Site(dims=dims, scheme=self, name=self.name)


class _T5Site(AttentionSite):
    scheme: T5Bias = T5Bias()

    def setup(self) -> None:
        # A small normal (std 0.02, like the other weights): the bias starts near zero next to
        # the content logits. T5 implementations differ here (HF: std d_model^-0.5).
        self.table_PN = self.param(
            "relative_bias",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), (ax.POSITIONS, ax.HEADS)),
            (self.scheme.num_buckets, self.dims.num_heads),
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
        bias_BNTS = t5_bias(
            ctx.q_positions_BT,
            ctx.k_positions_BS,
            self.table_PN,
            self.scheme.bidirectional,
            self.scheme.max_distance,
        )
        return jnp.where(ctx.mask_BTS[:, None], bias_BNTS, 0.0)

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        s = self.scheme
        bias = functools.partial(
            _t5_pair, bidirectional=s.bidirectional, max_distance=s.max_distance
        )
        return (BlockTerm(bias, params=self.table_PN, position_only=True),)


def _t5_pair(
    table_PN: jax.Array,
    pair: PairBlock,
    prepared: None,
    carry: Any,
    *,
    bidirectional: bool,
    max_distance: int,
) -> tuple[jax.Array, Any]:
    bias_BNQK = t5_bias(
        pair.q_positions_BQ, pair.k_positions_BK, table_PN, bidirectional, max_distance
    )
    return bias_BNQK, carry
