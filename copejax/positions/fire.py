"""FIRE: functional interpolation for relative positions (Li et al. 2023, arXiv 2310.04418).

As written in the TAPE paper (seed 004) section 2.2:
``b(i, j) = f_theta(psi(i - j) / psi(max(i, L)))`` with ``psi(x) = log(c x + 1)``, c > 0
learnable, L a learnable threshold and f_theta an MLP from the scalar to one bias per head.
As in the authors' code: ``c = |c_raw|`` (init 0.1), ``L = |l_scale| * L_init`` with a learnable
l_scale (init 1) and L_init = the training length, ``psi`` of ``|i - j|`` (so masked pairs
stay finite), and ``1e-6`` added to the normaliser. f: Dense(1 -> width), ReLU, Dense(-> N).

Shifting all positions changes the bias only through the normaliser ``psi(max(i, L))``: FIRE
is translation invariant while every query position stays below L.
"""

from __future__ import annotations

import dataclasses
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

EPS = 1e-6


def fire_normalized_distance(
    q_positions_BT: jax.Array, k_positions_BS: jax.Array, c: jax.Array, threshold: jax.Array
) -> jax.Array:
    """``psi(|i - j|) / (psi(max(i, L)) + eps)`` with ``psi(x) = log(c x + 1)``; (B, T, S)."""
    i_BT = q_positions_BT.astype(jnp.float32)
    distance_BTS = jnp.abs(i_BT[:, :, None] - k_positions_BS[:, None, :].astype(jnp.float32))
    normalizer_BT = jnp.log1p(c * jnp.maximum(i_BT, threshold)) + EPS
    return jnp.log1p(c * distance_BTS) / normalizer_BT[:, :, None]


def fire_bias(
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    params: dict[str, jax.Array],
) -> jax.Array:
    """FIRE's bias from its parameters.

    Args:
      q_positions_BT, k_positions_BS: positions i and j.
      params: ``c`` (> 0), ``threshold`` (L > 0), and the MLP ``w1_1F``, ``b1_F``, ``w2_FN``,
        ``b2_N`` (F hidden units).

    Returns:
      bias_BNTS, float32, for every pair (mask it).
    """
    f32 = jnp.float32
    x_BTS = fire_normalized_distance(
        q_positions_BT, k_positions_BS, params["c"].astype(f32), params["threshold"].astype(f32)
    )
    h_BTSF = jax.nn.relu(x_BTS[..., None] * params["w1_1F"][0] + params["b1_F"])
    out_BNTS = jnp.einsum("BTSF,FN->BNTS", h_BTSF, params["w2_FN"], preferred_element_type=f32)
    return out_BNTS + params["b2_N"][None, :, None, None]


@register
@dataclasses.dataclass(frozen=True)
class Fire(PositionScheme):
    """FIRE: an MLP over the log-transformed, progressively normalised distance.

    Options:
      mlp_width: hidden units of f_theta (32 in the paper).
      c_init: initial c of psi(x) = log(c x + 1).
      threshold_init: initial L; None for the training length (dims.max_len).
    """

    name = "fire"
    sites = ("bias",)
    position_only_bias = True
    paper = "Li et al. 2023, arXiv 2310.04418"

    mlp_width: int = 32
    c_init: float = 0.1
    threshold_init: float | None = None

    def resolved_threshold(self, dims: Dims) -> float:
        return float(dims.max_len if self.threshold_init is None else self.threshold_init)

    def validate(self, dims: Dims) -> None:
        check_positive(
            self.name,
            mlp_width=self.mlp_width,
            c_init=self.c_init,
            threshold_init=self.resolved_threshold(dims),
        )
        if not isinstance(self.mlp_width, int):
            raise ValueError(f"{self.name}: mlp_width must be an integer, got {self.mlp_width!r}")

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _FireSite(dims=dims, scheme=self, name=self.name)


class _FireSite(AttentionSite):
    scheme: Fire = Fire()

    def setup(self) -> None:
        width, heads = self.scheme.mlp_width, self.dims.num_heads

        def param(name: str, init: nn.initializers.Initializer, axes: tuple, shape: tuple):
            return self.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)

        const = nn.initializers.constant
        self.c_raw = param("c", const(self.scheme.c_init), (), ())
        self.l_scale = param("threshold_scale", const(1.0), (), ())
        lecun, zeros = nn.initializers.lecun_normal(), nn.initializers.zeros
        self.w1_1F = param("mlp_in_kernel", lecun, (ax.POS_EMBED, ax.POS_MLP), (1, width))
        self.b1_F = param("mlp_in_bias", zeros, (ax.POS_MLP,), (width,))
        self.w2_FN = param("mlp_out_kernel", lecun, (ax.POS_MLP, ax.HEADS), (width, heads))
        self.b2_N = param("mlp_out_bias", zeros, (ax.HEADS,), (heads,))

    def fire_params(self) -> dict[str, jax.Array]:
        threshold = jnp.abs(self.l_scale) * self.scheme.resolved_threshold(self.dims)
        return {
            "c": jnp.abs(self.c_raw),
            "threshold": threshold,
            "w1_1F": self.w1_1F,
            "b1_F": self.b1_F,
            "w2_FN": self.w2_FN,
            "b2_N": self.b2_N,
        }

    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        bias_BNTS = fire_bias(ctx.q_positions_BT, ctx.k_positions_BS, self.fire_params())
        return jnp.where(ctx.mask_BTS[:, None], bias_BNTS, 0.0)

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        return (BlockTerm(_fire_pair, params=self.fire_params(), position_only=True),)


def _fire_pair(
    params: dict[str, jax.Array], pair: PairBlock, prepared: None, carry: Any
) -> tuple[jax.Array, Any]:
    return fire_bias(pair.q_positions_BQ, pair.k_positions_BK, params), carry
