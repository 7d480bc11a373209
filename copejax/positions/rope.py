"""Rotary position embedding (RoFormer; Su et al. 2021, arXiv 2104.09864).

q and k are rotated pairwise by angles ``position * theta_i`` with
``theta_i = base^(-2i / d_rot)`` (RoFormer eq. 15), so that q_m . k_n depends on m - n only.
Two pair layouts: ``interleaved`` pairs (x_0, x_1), (x_2, x_3), ... as in RoFormer eq. 34;
``half`` pairs (x_i, x_{i + d/2}) ("rotate-half", GPT-NeoX / Llama).

Scaling for length extension (option ``scaling``, with ``factor`` s >= 1):

- ``linear``: position interpolation (Chen et al. 2023, arXiv 2306.15595), positions / s,
  done as theta_i / s (the same angles);
- ``ntk``: NTK-aware theta scaling (r/LocalLLaMA 2023), base' = base * s^(d / (d - 2));
- ``yarn``: YaRN (Peng et al. 2023, arXiv 2309.00071), "NTK-by-parts" per frequency:
  with r_i = L / lambda_i = L theta_i / (2 pi) (L = ``original_max_len``) and the ramp
  gamma(r) = clip((r - alpha) / (beta - alpha), 0, 1), theta'_i = (1 - gamma) theta_i / s
  + gamma theta_i; plus the attention temperature sqrt(1/t) = 0.1 ln(s) + 1 by which q and k
  are each multiplied (so the logits scale by 1/t). The ramp follows the paper's continuous
  formula (the reference code discretises it over dimension indices).
"""

from __future__ import annotations

import dataclasses
import math

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
SCALINGS = ("none", "linear", "ntk", "yarn")


def rope_inv_freq(rot_dim: int, base: float) -> jax.Array:
    """theta_i = base^(-2i / rot_dim) for i < rot_dim / 2; shape (rot_dim // 2,), float32."""
    return base ** (-jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim)


def scaled_inv_freq(
    rot_dim: int,
    base: float,
    *,
    scaling: str = "none",
    factor: float = 1.0,
    original_max_len: int | None = None,
    yarn_alpha: float = 1.0,
    yarn_beta: float = 32.0,
) -> jax.Array:
    """RoPE frequencies after a length-extension scaling; shape (rot_dim // 2,), float32.

    Args:
      rot_dim: d, the number of rotated features (even).
      base: the frequency base.
      scaling: "none", "linear" (theta / s), "ntk" (base * s^(d/(d-2))) or "yarn"
        (per-frequency ramp between theta / s and theta; see the module docstring).
      factor: s >= 1, the context extension factor.
      original_max_len: L, the training context length (YaRN only).
      yarn_alpha, yarn_beta: YaRN's ramp bounds on r = L / wavelength.
    """
    if scaling == "none":
        return rope_inv_freq(rot_dim, base)
    if scaling == "linear":
        return rope_inv_freq(rot_dim, base) / factor
    if scaling == "ntk":
        return rope_inv_freq(rot_dim, base * factor ** (rot_dim / (rot_dim - 2)))
    if scaling == "yarn":
        if original_max_len is None:
            raise ValueError("rope: scaling='yarn' needs original_max_len")
        inv_freq_F = rope_inv_freq(rot_dim, base)
        ratio_F = original_max_len * inv_freq_F / (2 * math.pi)
        ramp_F = jnp.clip((ratio_F - yarn_alpha) / (yarn_beta - yarn_alpha), 0.0, 1.0)
        return (1.0 - ramp_F) * inv_freq_F / factor + ramp_F * inv_freq_F
    raise ValueError(f"rope: scaling must be one of {SCALINGS}, got {scaling!r}")


def yarn_attention_factor(factor: float) -> float:
    """YaRN's sqrt(1/t) = 0.1 ln(s) + 1, the multiplier of q and of k."""
    return 0.1 * math.log(factor) + 1.0


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
    """RoPE with base, pair layout, partial rotary fraction and length-extension scaling.

    Options:
      base: the frequency base (10000 in RoFormer).
      layout: "half" (rotate-half) or "interleaved" (RoFormer eq. 34).
      fraction: share of each head's features that rotate (GPT-NeoX uses 0.25); the rotated
        part must be an even, positive number of features.
      scaling: "none", "linear" (position interpolation), "ntk" (theta scaling) or "yarn".
      factor: s >= 1, the context extension factor (must stay 1 with scaling="none").
      original_max_len: L for YaRN's ramp; None uses the model's ``max_len``.
      yarn_alpha, yarn_beta: YaRN's ramp bounds (1 and 32 in the paper for Llama).
    """

    name = "rope"
    sites = ("qk",)
    paper = "Su et al. 2021, arXiv 2104.09864"

    base: float = 10000.0
    layout: str = "half"
    fraction: float = 1.0
    scaling: str = "none"
    factor: float = 1.0
    original_max_len: int | None = None
    yarn_alpha: float = 1.0
    yarn_beta: float = 32.0

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
        check_choice(self.name, "scaling", self.scaling, SCALINGS)
        if not self.factor >= 1:
            raise ValueError(f"{self.name}: factor must be >= 1, got {self.factor!r}")
        if self.scaling == "none" and self.factor != 1:
            raise ValueError(
                f"{self.name}: factor={self.factor!r} needs a scaling; allowed with "
                "scaling='none': factor=1"
            )
        if self.scaling == "ntk" and rotary_dim(dims.head_dim, self.fraction) <= 2:
            raise ValueError(
                f"{self.name}: scaling='ntk' needs more than 2 rotated features (exponent "
                f"d/(d-2)), got {rotary_dim(dims.head_dim, self.fraction)}"
            )
        if self.original_max_len is not None and (
            not isinstance(self.original_max_len, int) or self.original_max_len <= 0
        ):
            raise ValueError(
                f"{self.name}: original_max_len must be a positive integer or None, "
                f"got {self.original_max_len!r}"
            )
        if not 0 <= self.yarn_alpha < self.yarn_beta:
            raise ValueError(
                f"{self.name}: need 0 <= yarn_alpha < yarn_beta, got yarn_alpha="
                f"{self.yarn_alpha!r}, yarn_beta={self.yarn_beta!r}"
            )

    def inv_freq(self, dims: Dims) -> jax.Array:
        return scaled_inv_freq(
            rotary_dim(dims.head_dim, self.fraction),
            self.base,
            scaling=self.scaling,
            factor=self.factor,
            original_max_len=(
                self.original_max_len if self.original_max_len is not None else dims.max_len
            ),
            yarn_alpha=self.yarn_alpha,
            yarn_beta=self.yarn_beta,
        )

    def attention_factor(self) -> float:
        """Multiplier of q and of k: YaRN's 0.1 ln(s) + 1, otherwise 1."""
        return yarn_attention_factor(self.factor) if self.scaling == "yarn" else 1.0

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
        mscale = self.scheme.attention_factor()
        if mscale != 1.0:
            q_BTNH = (q_BTNH.astype(jnp.float32) * mscale).astype(q_BTNH.dtype)
            k_BSNH = (k_BSNH.astype(jnp.float32) * mscale).astype(k_BSNH.dtype)
        return q_BTNH, k_BSNH, v_BSNH
