"""xPos: rotary embedding with an exponential decay (Sun et al. 2022, arXiv 2212.10554).

Each rotated pair i gets zeta_i = (2i/d + gamma) / (1 + gamma) (gamma = 0.4); the query at
position n is scaled by zeta_i^(n / scale_base) and the key at position m by
zeta_i^(-m / scale_base), so pair i of q_n . k_m carries zeta_i^((n - m) / scale_base) times
its RoPE value: a decay in the relative distance that keeps translation invariance.

Centring: the powers grow with |position| (zeta_0 = 0.29; at n = 4096 and scale_base 512 the
key factor is zeta^-8 ~ 2e4, overflowing float32 around n ~ 35000). Both exponents therefore
use ``position - center`` with one fixed constant ``center`` (default ``max_len // 2``): it
cancels exactly in q . k, keeps the factors within zeta^(+-|T/2|/512) around the training
range, and, unlike a per-call centre, stays valid for keys cached during incremental decoding.
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
from copejax.positions.rope import LAYOUTS, apply_rope, rope_inv_freq


def xpos_zeta(num_pairs: int, gamma: float) -> jax.Array:
    """zeta_i = (2i/d + gamma) / (1 + gamma) for i < F, with d = 2F; shape (F,), float32."""
    rot_dim = 2 * num_pairs
    return (jnp.arange(0, rot_dim, 2, dtype=jnp.float32) / rot_dim + gamma) / (1.0 + gamma)


def xpos_scale_BTF(
    positions_BT: jax.Array, zeta_F: jax.Array, scale_base: float, center: float, sign: float
) -> jax.Array:
    """zeta^(sign * (position - center) / scale_base), float32, shape (B, T, F)."""
    exponent_BT = sign * (positions_BT.astype(jnp.float32) - center) / scale_base
    return jnp.exp(exponent_BT[..., None] * jnp.log(zeta_F))


def apply_xpos(
    q_BTNH: jax.Array,
    k_BSNH: jax.Array,
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    *,
    base: float = 10000.0,
    gamma: float = 0.4,
    scale_base: float = 512.0,
    center: float = 0.0,
    layout: str = "half",
) -> tuple[jax.Array, jax.Array]:
    """Rotates q and k as RoPE and scales pair i by zeta_i^(+-(position - center)/scale_base).

    Args:
      q_BTNH, k_BSNH: queries and keys (every feature rotates; H even).
      q_positions_BT, k_positions_BS: their positions.
      base: RoPE frequency base.
      gamma: xPos's gamma in zeta_i.
      scale_base: the decay length scale.
      center: constant subtracted from every position (cancels in q . k).
      layout: "half" (rotate-half) or "interleaved".

    Returns:
      (q, k) with the shapes and dtypes of the inputs.
    """
    num_pairs = q_BTNH.shape[-1] // 2
    inv_freq_F = rope_inv_freq(2 * num_pairs, base)
    zeta_F = xpos_zeta(num_pairs, gamma)
    q_scale_BTF = xpos_scale_BTF(q_positions_BT, zeta_F, scale_base, center, 1.0)
    k_scale_BSF = xpos_scale_BTF(k_positions_BS, zeta_F, scale_base, center, -1.0)
    q_BTNH = apply_rope(q_BTNH, q_positions_BT, inv_freq_F, layout, q_scale_BTF)
    k_BSNH = apply_rope(k_BSNH, k_positions_BS, inv_freq_F, layout, k_scale_BSF)
    return q_BTNH, k_BSNH


@register
@dataclasses.dataclass(frozen=True)
class XPos(PositionScheme):
    """Rotate-half RoPE with xPos's per-pair exponential decay of q . k in the distance.

    Options:
      base: RoPE frequency base.
      gamma: zeta_i = (2i/d + gamma) / (1 + gamma) (0.4 in the paper).
      scale_base: the decay length scale (512 in the paper).
      center: constant subtracted from positions before the powers; None uses max_len // 2.
      layout: "half" (the paper's choice here) or "interleaved".
    """

    name = "xpos"
    sites = ("qk",)
    paper = "Sun et al. 2022, arXiv 2212.10554"

    base: float = 10000.0
    gamma: float = 0.4
    scale_base: float = 512.0
    center: int | None = None
    layout: str = "half"

    def validate(self, dims: Dims) -> None:
        check_positive(self.name, base=self.base, gamma=self.gamma, scale_base=self.scale_base)
        check_choice(self.name, "layout", self.layout, LAYOUTS)
        if dims.head_dim % 2:
            raise ValueError(
                f"{self.name}: head_dim must be even to rotate pairs, got head_dim={dims.head_dim}"
            )

    def resolved_center(self, dims: Dims) -> float:
        return float(self.center if self.center is not None else dims.max_len // 2)

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _XPosSite(dims=dims, scheme=self, name=self.name)


class _XPosSite(AttentionSite):
    scheme: XPos = XPos()

    def qk(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        q_BTNH, k_BSNH = apply_xpos(
            q_BTNH,
            k_BSNH,
            ctx.q_positions_BT,
            ctx.k_positions_BS,
            base=self.scheme.base,
            gamma=self.scheme.gamma,
            scale_base=self.scheme.scale_base,
            center=self.scheme.resolved_center(self.dims),
            layout=self.scheme.layout,
        )
        return q_BTNH, k_BSNH, v_BSNH
