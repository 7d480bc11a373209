"""Transformer-XL relative attention (Dai et al. 2019, arXiv 1901.02860, section 3.3).

``A_ij = q_i . k_j + q_i . W_R r_{i-j} + u . k_j + v . W_R r_{i-j}`` with r the sinusoid of
the distance (``[sin(d w_f), cos(d w_f)]``, w_f = base^(-2f / D_r)), W_R a learned projection
to each head and u, v learned per head. The content term q.k stays in attention.py; this
module adds the other three, scaled by 1/sqrt(H) like it:
``bias_ij = (u . k_j + (q_i + v) . W_R r_{i-j}) / sqrt(H)``.

``r_{i-j}`` is never built per pair: with ``p = (q_i + v) W_R = [a, b]`` (sin and cos halves),
``a . sin((i-j)w) + b . cos((i-j)w)`` expands by the angle-difference identities into
``(a sin(iw) + b cos(iw)) . cos(jw) + (b sin(iw) - a cos(iw)) . sin(jw)``: two einsums over
the F = D_r / 2 frequencies. This is exact for any positions (offsets, packing, longer
contexts), at about D_r / H times the cost of the content logits. In float32 the angles
i w lose precision for positions in the tens of thousands, as in RoPE.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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


def xl_inv_freq(r_dim: int, base: float) -> jax.Array:
    """w_f = base^(-2f / r_dim) for f < r_dim / 2; shape (F,), float32."""
    return base ** (-jnp.arange(0, r_dim, 2, dtype=jnp.float32) / r_dim)


def xl_bias(
    q_BTNH: jax.Array,
    k_BSNH: jax.Array,
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    params: dict[str, jax.Array],
    *,
    inv_freq_F: jax.Array,
) -> jax.Array:
    """The terms (b), (c), (d) of Transformer-XL's score, over sqrt(H).

    Args:
      q_BTNH, k_BSNH: queries and keys.
      q_positions_BT, k_positions_BS: positions i and j (int or float).
      params: ``w_r_RNH`` (R = 2F sinusoid features: F sines then F cosines), ``u_NH``,
        ``v_NH``.
      inv_freq_F: the sinusoid frequencies.

    Returns:
      bias_BNTS, float32, for every pair (mask it).
    """
    p_BTNR = xl_query_features(q_BTNH, params)
    return xl_pair_bias(
        p_BTNR, k_BSNH, q_positions_BT, k_positions_BS, params, inv_freq_F=inv_freq_F
    )


def xl_query_features(q_BTNH: jax.Array, params: dict[str, jax.Array]) -> jax.Array:
    """``(q_i + v) W_R`` per sinusoid feature (the query side of terms (b) and (d)): p_BTNR."""
    f32 = jnp.float32
    v_NH, w_r_RNH = params["v_NH"].astype(f32), params["w_r_RNH"].astype(f32)
    return jnp.einsum(
        "BTNH,RNH->BTNR", q_BTNH.astype(f32) + v_NH, w_r_RNH, preferred_element_type=f32
    )


def xl_pair_bias(
    p_BTNR: jax.Array,
    k_BSNH: jax.Array,
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    params: dict[str, jax.Array],
    *,
    inv_freq_F: jax.Array,
) -> jax.Array:
    """Terms (b) + (d) from :func:`xl_query_features`, plus term (c), over sqrt(H): bias_BNTS."""
    f32 = jnp.float32
    k_BSNH, u_NH = k_BSNH.astype(f32), params["u_NH"].astype(f32)
    num_freq = inv_freq_F.shape[0]
    a_BTNF, b_BTNF = p_BTNR[..., :num_freq], p_BTNR[..., num_freq:]
    angle_q_BTF = q_positions_BT.astype(f32)[..., None] * inv_freq_F
    angle_k_BSF = k_positions_BS.astype(f32)[..., None] * inv_freq_F
    sin_q_BT1F, cos_q_BT1F = jnp.sin(angle_q_BTF)[:, :, None], jnp.cos(angle_q_BTF)[:, :, None]
    on_cos_BTNF = a_BTNF * sin_q_BT1F + b_BTNF * cos_q_BT1F
    on_sin_BTNF = b_BTNF * sin_q_BT1F - a_BTNF * cos_q_BT1F
    position_BNTS = jnp.einsum(
        "BTNF,BSF->BNTS", on_cos_BTNF, jnp.cos(angle_k_BSF), preferred_element_type=f32
    ) + jnp.einsum("BTNF,BSF->BNTS", on_sin_BTNF, jnp.sin(angle_k_BSF), preferred_element_type=f32)
    content_bias_BN1S = jnp.einsum("NH,BSNH->BNS", u_NH, k_BSNH, preferred_element_type=f32)
    scale = 1.0 / jnp.sqrt(f32(k_BSNH.shape[-1]))
    return (position_BNTS + content_bias_BN1S[:, :, None, :]) * scale


@register
@dataclasses.dataclass(frozen=True)
class TransformerXL(PositionScheme):
    """Transformer-XL: sinusoidal r_{i-j} projected by W_R, global biases u and v per head.

    Options:
      base: the sinusoid base (10000).
      r_dim: width of r_{i-j}, even; None for d_model as in the paper.
    """

    name = "transformer_xl"
    sites = ("bias",)
    paper = "Dai et al. 2019, arXiv 1901.02860"

    base: float = 10000.0
    r_dim: int | None = None

    def resolved_r_dim(self, dims: Dims) -> int:
        return dims.d_model if self.r_dim is None else self.r_dim

    def validate(self, dims: Dims) -> None:
        check_positive(self.name, base=self.base)
        r_dim = self.resolved_r_dim(dims)
        if not isinstance(r_dim, int) or r_dim <= 0 or r_dim % 2:
            raise ValueError(
                f"{self.name}: r_dim must be a positive even integer (None for d_model), "
                f"got r_dim={r_dim!r}"
            )

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _TransformerXLSite(dims=dims, scheme=self, name=self.name)


class _TransformerXLSite(AttentionSite):
    scheme: TransformerXL = TransformerXL()

    def setup(self) -> None:
        dims = self.dims
        r_dim = self.scheme.resolved_r_dim(dims)
        heads = (dims.num_heads, dims.head_dim)
        # Normal(0.02) for W_R, u and v, as the paper's code initialises them.
        init = nn.initializers.normal(0.02)
        self.w_r_RNH = self.param(
            "w_r",
            nn.with_logical_partitioning(init, (ax.POS_EMBED, ax.HEADS, ax.HEAD_DIM)),
            (r_dim, *heads),
            jnp.float32,
        )
        axes = (ax.HEADS, ax.HEAD_DIM)
        self.u_NH = self.param("u", nn.with_logical_partitioning(init, axes), heads, jnp.float32)
        self.v_NH = self.param("v", nn.with_logical_partitioning(init, axes), heads, jnp.float32)

    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        params = {"w_r_RNH": self.w_r_RNH, "u_NH": self.u_NH, "v_NH": self.v_NH}
        inv_freq_F = xl_inv_freq(self.w_r_RNH.shape[0], self.scheme.base)
        bias_BNTS = xl_bias(
            q_BTNH, k_BSNH, ctx.q_positions_BT, ctx.k_positions_BS, params, inv_freq_F=inv_freq_F
        )
        return jnp.where(ctx.mask_BTS[:, None], bias_BNTS, 0.0)

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        """(q + v) W_R once per query block; the sinusoids and u . k per pair."""
        params = {"w_r_RNH": self.w_r_RNH, "u_NH": self.u_NH, "v_NH": self.v_NH}
        r_dim = self.w_r_RNH.shape[0]  # numpy: a static constant of the pair function
        inv_freq_F = self.scheme.base ** (-np.arange(0, r_dim, 2, dtype=np.float32) / r_dim)
        bias = functools.partial(_xl_pair, inv_freq_F=inv_freq_F)
        return (BlockTerm(bias, params=params, prepare=_xl_prepare),)


def _xl_prepare(params: dict[str, jax.Array], q_BQNH: jax.Array, q_arrays: dict) -> jax.Array:
    return xl_query_features(q_BQNH, params)


def _xl_pair(
    params: dict[str, jax.Array],
    pair: PairBlock,
    p_BQNR: jax.Array,
    carry: Any,
    *,
    inv_freq_F: np.ndarray,
) -> tuple[jax.Array, Any]:
    bias_BNQK = xl_pair_bias(
        p_BQNR, pair.k_BKNH, pair.q_positions_BQ, pair.k_positions_BK, params, inv_freq_F=inv_freq_F
    )
    return bias_BNQK, carry
