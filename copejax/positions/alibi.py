"""ALiBi: attention with linear biases (Press et al. 2022, arXiv 2108.12409).

Head h adds ``-m_h * (i - j)`` to the logit of query position i and key position j (section 3).
The slopes m_h are a geometric sequence; for a head count that is not a power of two the
authors' ``get_slopes`` takes the sequence of the closest power of two below and completes it
with every other slope of the sequence for twice that power.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from copejax.ops.engine_blocks import BlockTerm, PairBlock
from copejax.positions.base import AttentionContext, AttentionSite, Dims, PositionScheme
from copejax.positions.registry import register

__all__ = [
    "ALiBi",
    "alibi_bias",
    "alibi_slopes",
]


def _power_of_two_slopes(n: int) -> np.ndarray:
    """2^(-8/n), 2^(-16/n), ..., 2^(-8): start 2^(-8/n), ratio 2^(-8/n)."""
    return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """The paper's head slopes m_h for any head count, shape (N,), float64.

    For N a power of two: m_h = 2^(-8 h / N), h = 1..N. Otherwise, with n' the largest power of
    two below N: the n' slopes of n', then the first N - n' of the odd-indexed (1st, 3rd, ...)
    slopes of 2n' (the authors' ``get_slopes``).
    """
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"alibi: num_heads must be a positive integer, got {num_heads!r}")
    if num_heads & (num_heads - 1) == 0:
        return _power_of_two_slopes(num_heads)
    below = 2 ** math.floor(math.log2(num_heads))
    extra = _power_of_two_slopes(2 * below)[0::2][: num_heads - below]
    return np.concatenate([_power_of_two_slopes(below), extra])


def alibi_bias(
    q_positions_BT: jax.Array, k_positions_BS: jax.Array, slopes_N: jax.Array
) -> jax.Array:
    """The linear bias ``-m_h * (i - j)``.

    Args:
      q_positions_BT: query positions i.
      k_positions_BS: key positions j.
      slopes_N: one slope per head.

    Returns:
      bias_BNTS, float32. Not masked: for j > i the bias is positive, so apply the mask.
    """
    distance_BTS = q_positions_BT[:, :, None].astype(jnp.float32) - k_positions_BS[
        :, None, :
    ].astype(jnp.float32)
    return -jnp.asarray(slopes_N, jnp.float32)[None, :, None, None] * distance_BTS[:, None]


@register
@dataclasses.dataclass(frozen=True)
class ALiBi(PositionScheme):
    """ALiBi: a fixed per-head linear penalty on the distance to each allowed key. No options."""

    name = "alibi"
    sites = ("bias",)
    position_only_bias = True
    paper = "Press et al. 2022, arXiv 2108.12409"

    def validate(self, dims: Dims) -> None:
        alibi_slopes(dims.num_heads)

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _ALiBiSite(dims=dims, name=self.name)


class _ALiBiSite(AttentionSite):
    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        slopes_N = alibi_slopes(self.dims.num_heads)
        bias_BNTS = alibi_bias(ctx.q_positions_BT, ctx.k_positions_BS, slopes_N)
        return jnp.where(ctx.mask_BTS[:, None], bias_BNTS, 0.0)

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        slopes_N = alibi_slopes(self.dims.num_heads)
        return (BlockTerm(functools.partial(_alibi_pair, slopes_N=slopes_N), position_only=True),)


def _alibi_pair(
    params: None, pair: PairBlock, prepared: None, carry: Any, *, slopes_N: np.ndarray
) -> tuple[jax.Array, Any]:
    return alibi_bias(pair.q_positions_BQ, pair.k_positions_BK, slopes_N), carry
