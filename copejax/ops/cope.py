"""Pure-function cores of Contextual Position Encoding (Golovneva et al. 2024, arXiv 2405.18719).

Section 4 and Appendix B: gates ``g_ij = sigmoid(gate_logits_ij)`` on allowed keys, positions
``p_ij = sum_{k=j..i} g_ik`` (a suffix sum over keys, capped at p_max - 1) and a position term
added to the attention logits: interpolated ``q_i . e[p_ij]`` (eq. 7-9), ALiBi-like
``m_h p_ij`` (eq. 10) or an MLP of ``p_ij`` (CoPE-MLP, Appendix C). Everything here is float32
whatever the input dtype. No Flax: arrays in, arrays out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops.interpolate import interpolate_last_axis
from copejax.ops.scan import cumsum

__all__ = [
    "cope_alibi_term",
    "cope_gates",
    "cope_integer_logits",
    "cope_interpolated_term",
    "cope_mlp_term",
    "cope_positions",
]


def cope_gates(
    gate_logits_BNTS: jax.Array, mask_BTS: jax.Array, force_unit: bool = False
) -> jax.Array:
    """g_ij = sigmoid(gate_logits_ij) where key j is allowed for query i, exactly 0 elsewhere.

    The mask is applied before any sum, so masked (future or other-segment) keys contribute
    exactly zero and receive exactly zero gradient. ``force_unit`` sets every allowed gate to 1
    (CoPE then counts tokens: relative positions i - j + 1).

    Args:
      gate_logits_BNTS: scaled gate logits (the content logits, or q.k_sep or q.v scores).
      mask_BTS: True where query t may attend to key s.
      force_unit: use gates equal to 1 on allowed keys.

    Returns:
      gates_BNTS in [0, 1], float32.
    """
    mask_B1TS = mask_BTS[:, None]
    if force_unit:
        return jnp.broadcast_to(mask_B1TS, gate_logits_BNTS.shape).astype(jnp.float32)
    return jnp.where(mask_B1TS, jax.nn.sigmoid(gate_logits_BNTS.astype(jnp.float32)), 0.0)


def cope_positions(gates_BNTS: jax.Array, p_max: int, impl: str = "auto") -> jax.Array:
    """p_ij = min(sum_{k >= j} g_ik, p_max - 1): suffix sums over keys, float32 (eq. 4).

    With gates already zero on masked keys, the sum over k >= j equals the paper's sum over
    k = j..i. Entries of masked keys are finite (zero after the last allowed key).

    Args:
      gates_BNTS: gates, zero on masked keys.
      p_max: number of integer positions; positions are capped at p_max - 1.
      impl: scan implementation, see ``copejax.ops.scan.cumsum``.

    Returns:
      positions_BNTS in [0, p_max - 1], float32.
    """
    return jnp.minimum(cumsum(gates_BNTS, axis=-1, reverse=True, impl=impl), p_max - 1.0)


def cope_integer_logits(q_BTNH: jax.Array, pos_emb: jax.Array) -> jax.Array:
    """z_i[p] = q_i . e[p] for every integer position p (eq. 7), float32.

    Args:
      q_BTNH: queries.
      pos_emb: e, shape (P, H) shared by the heads, or (N, P, H) one table per head.

    Returns:
      z_BNTP.
    """
    q_BTNH = q_BTNH.astype(jnp.float32)
    pos_emb = pos_emb.astype(jnp.float32)
    if pos_emb.ndim == 2:
        return jnp.einsum("BTNH,PH->BNTP", q_BTNH, pos_emb)
    return jnp.einsum("BTNH,NPH->BNTP", q_BTNH, pos_emb)


def cope_interpolated_term(
    q_BTNH: jax.Array, pos_emb: jax.Array, positions_BNTS: jax.Array
) -> jax.Array:
    """z_i[p_ij] by interpolating z_i at floor and ceil of p_ij (eq. 7-8), float32 (B, N, T, S)."""
    return interpolate_last_axis(cope_integer_logits(q_BTNH, pos_emb), positions_BNTS)


def cope_alibi_term(slopes_N: jax.Array, positions_BNTS: jax.Array) -> jax.Array:
    """m_h * p_ij (eq. 10), float32 (B, N, T, S)."""
    return slopes_N.astype(jnp.float32)[None, :, None, None] * positions_BNTS


def cope_mlp_term(
    q_BTNH: jax.Array,
    positions_BNTS: jax.Array,
    w_in_F: jax.Array,
    b_in_F: jax.Array,
    w_out_FH: jax.Array,
    *,
    input_scale: float,
) -> jax.Array:
    """CoPE-MLP: q_i . MLP(p_ij) with MLP(p) = W_out^T gelu(w_in * p * input_scale + b_in).

    Computed exactly as ``sum_F (q_i W_out)[F] * hidden_ijF``: the hidden layer (B, N, T, S, F)
    is materialised, never the (B, N, T, S, H) embeddings (Appendix C reports 30-50x the memory
    of plain CoPE for this variant; F = 64 in its Table 7). An output bias would add q_i . b,
    constant over keys, which the softmax cancels; so there is none.

    Args:
      q_BTNH: queries.
      positions_BNTS: fractional positions p_ij.
      w_in_F, b_in_F: input weight and bias of the F hidden units.
      w_out_FH: output projection to the head dimension.
      input_scale: multiplies p before the MLP (1 / p_max keeps the input in [0, 1)).

    Returns:
      term_BNTS, float32.
    """
    hidden_BNTSF = jax.nn.gelu(
        positions_BNTS[..., None] * input_scale * w_in_F.astype(jnp.float32)
        + b_in_F.astype(jnp.float32),
        approximate=False,
    )
    qw_BNTF = jnp.einsum("BTNH,FH->BNTF", q_BTNH.astype(jnp.float32), w_out_FH.astype(jnp.float32))
    return jnp.einsum("BNTSF,BNTF->BNTS", hidden_BNTSF, qw_BNTF)
