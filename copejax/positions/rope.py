"""Rotary position embedding (RoFormer; Su et al. 2021, arXiv 2104.09864).

q and k are rotated pairwise by angles ``position * theta_i`` with
``theta_i = base^(-2i / d_rot)`` (RoFormer eq. 15), so that q_m . k_n depends on m - n only.
Two pair layouts: ``interleaved`` pairs (x_0, x_1), (x_2, x_3), ... as in RoFormer eq. 34;
``half`` pairs (x_i, x_{i + d/2}) ("rotate-half", GPT-NeoX / Llama).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Dims,
    PositionScheme,
    check_choice,
    check_positive,
)
from copejax.positions.registry import register

LAYOUTS = ("half", "interleaved")


def rope_inv_freq(rot_dim: int, base: float) -> jax.Array:
    """theta_i = base^(-2i / rot_dim) for i < rot_dim / 2; shape (rot_dim // 2,), float32."""
    return base ** (-jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim)


def apply_rope(
    x_BTNH: jax.Array,
    positions_BT: jax.Array,
    inv_freq_F: jax.Array,
    layout: str = "half",
    scale_BTF: jax.Array | None = None,
) -> jax.Array:
    """Rotates the first ``2 F`` features of each head by ``positions * inv_freq``.

    Args:
      x_BTNH: queries or keys.
      positions_BT: positions (int or float).
      inv_freq_F: one frequency per rotated pair (F pairs, 2F <= H).
      layout: "half" (pairs i, i + F) or "interleaved" (pairs 2i, 2i + 1).
      scale_BTF: optional per-pair multiplier (xPos), broadcast over heads.

    Returns:
      Rotated array, same shape and dtype as ``x_BTNH``; features past 2F pass through.
    """
    num_pairs = inv_freq_F.shape[0]
    rot_dim = 2 * num_pairs
    x_rot, x_pass = x_BTNH[..., :rot_dim], x_BTNH[..., rot_dim:]
    angle_BTF = positions_BT.astype(jnp.float32)[..., None] * inv_freq_F
    cos_BT1F = jnp.cos(angle_BTF)[:, :, None, :]
    sin_BT1F = jnp.sin(angle_BTF)[:, :, None, :]
    if scale_BTF is not None:
        cos_BT1F = cos_BT1F * scale_BTF[:, :, None, :]
        sin_BT1F = sin_BT1F * scale_BTF[:, :, None, :]
    x_rot = x_rot.astype(jnp.float32)
    if layout == "half":
        x1, x2 = x_rot[..., :num_pairs], x_rot[..., num_pairs:]
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    y1 = x1 * cos_BT1F - x2 * sin_BT1F
    y2 = x2 * cos_BT1F + x1 * sin_BT1F
    if layout == "half":
        y_rot = jnp.concatenate([y1, y2], axis=-1)
    else:
        y_rot = jnp.stack([y1, y2], axis=-1).reshape(x_rot.shape)
    return jnp.concatenate([y_rot.astype(x_BTNH.dtype), x_pass], axis=-1)


def rotary_dim(head_dim: int, fraction: float) -> int:
    """Number of rotated features: ``fraction * head_dim`` rounded down to an even number."""
    return int(head_dim * fraction) // 2 * 2


@register
@dataclasses.dataclass(frozen=True)
class RoPE(PositionScheme):
    """RoPE with base, pair layout and partial rotary fraction.

    Options:
      base: the frequency base (10000 in RoFormer).
      layout: "half" (rotate-half) or "interleaved" (RoFormer eq. 34).
      fraction: share of each head's features that rotate (GPT-NeoX uses 0.25); the rotated
        part must be an even, positive number of features.
    """

    name = "rope"
    sites = ("qk",)
    paper = "Su et al. 2021, arXiv 2104.09864"

    base: float = 10000.0
    layout: str = "half"
    fraction: float = 1.0

    def validate(self, dims: Dims) -> None:
        check_positive(self.name, base=self.base, fraction=self.fraction)
        check_choice(self.name, "layout", self.layout, LAYOUTS)
        if self.fraction > 1:
            raise ValueError(f"{self.name}: fraction must be in (0, 1], got {self.fraction!r}")
        if self.fraction == 1 and dims.head_dim % 2:
            raise ValueError(
                f"{self.name}: head_dim must be even to rotate pairs, got head_dim={dims.head_dim}"
            )
        if rotary_dim(dims.head_dim, self.fraction) == 0:
            raise ValueError(
                f"{self.name}: fraction={self.fraction} of head_dim={dims.head_dim} rotates no "
                "pair; allowed: fraction * head_dim >= 2"
            )

    def inv_freq(self, dims: Dims) -> jax.Array:
        return rope_inv_freq(rotary_dim(dims.head_dim, self.fraction), self.base)

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _RoPESite(dims=dims, scheme=self)


class _RoPESite(AttentionSite):
    scheme: RoPE = RoPE()

    def qk(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        inv_freq_F = self.scheme.inv_freq(self.dims)
        q_BTNH = apply_rope(q_BTNH, ctx.q_positions_BT, inv_freq_F, self.scheme.layout)
        k_BSNH = apply_rope(k_BSNH, ctx.k_positions_BS, inv_freq_F, self.scheme.layout)
        return q_BTNH, k_BSNH, v_BSNH
