"""Transformer-XL's relative attention on the fused kernels, as wider queries and keys (Dai
et al. 2019, arXiv 1901.02860, section 3.3).

The score ``q_i . k_j + u . k_j + (q_i + v) . W_R r_{i-j}`` (over sqrt(H)) is one dot product
of wider vectors: with ``p_i = (q_i + v) W_R = [a_i, b_i]`` (sine and cosine halves, F
frequencies) the angle-difference identities of :mod:`copejax.positions.transformer_xl` give
``p_i . r_{i-j} = c_i . cos(j w) + s_i . sin(j w)``, ``c_i = a_i sin(i w) + b_i cos(i w)``,
``s_i = b_i sin(i w) - a_i cos(i w)``. So the kernels run XL as content attention on

    q'_i = [q_i + u, c_i, s_i, 0...] x sqrt(H' / H),   k'_j = [k_j, cos(j w), sin(j w), 0...]

of width H' (H + R padded to a power of two, Triton's block shapes), whose ``q' . k' /
sqrt(H')`` is XL's score over sqrt(H): the term is computed inside the kernels' content
matmul, no (T, S) array exists, and JAX differentiates q, k, u, v and W_R through q' and k'
outside the kernels. Exact for any positions (packing, offsets), as the naive path is. The
cost is the content matmul at width H' instead of H (the naive path's position term costs
R / H times the content logits too). The widened logits are what CoPE's gates, selective
attention's selection and Shaw's ``q . e`` would read, so XL with those is refused.
Shape letters: B batch, T queries, S keys, N query heads, G key/value heads, H head dim,
R = 2F sinusoid features, H' the widened head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from copejax.ops.engine_blocks import BlockTerm
from copejax.positions.base import PositionScheme
from copejax.positions.transformer_xl import xl_inv_freq, xl_query_features

XL = "transformer_xl"
MIN_WIDTH = 16  # Triton's smallest matmul tile


def xl_widened_qk(
    scheme: PositionScheme,
    term: BlockTerm,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    *,
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """q' (B, T, N, H') and k' (B, S, G, H') in the inputs' dtypes, from XL's block term
    (its ``w_r_RNH``, ``u_NH``, ``v_NH``) and base."""
    f32 = jnp.float32
    params = term.params
    head_dim = q_BTNH.shape[-1]
    features = params["w_r_RNH"].shape[0]
    num_freq = features // 2
    width = max(MIN_WIDTH, 1 << (head_dim + features - 1).bit_length())
    inv_freq_F = xl_inv_freq(features, scheme.base)
    p_BTNR = xl_query_features(q_BTNH, params)
    a_BTNF, b_BTNF = p_BTNR[..., :num_freq], p_BTNR[..., num_freq:]
    angle_q_BT1F = (q_positions_BT.astype(f32)[..., None] * inv_freq_F)[:, :, None]
    sin_q_BT1F, cos_q_BT1F = jnp.sin(angle_q_BT1F), jnp.cos(angle_q_BT1F)
    q_parts = [
        q_BTNH.astype(f32) + params["u_NH"].astype(f32),
        a_BTNF * sin_q_BT1F + b_BTNF * cos_q_BT1F,
        b_BTNF * sin_q_BT1F - a_BTNF * cos_q_BT1F,
    ]
    q_wide_BTNH = _pad_last(jnp.concatenate(q_parts, axis=-1), width)
    q_wide_BTNH = (q_wide_BTNH * math.sqrt(width / head_dim)).astype(q_BTNH.dtype)
    angle_k_BS1F = (k_positions_BS.astype(f32)[..., None] * inv_freq_F)[:, :, None]
    k_parts = [
        k_BSGH.astype(f32),
        jnp.broadcast_to(jnp.cos(angle_k_BS1F), (*k_BSGH.shape[:3], num_freq)),
        jnp.broadcast_to(jnp.sin(angle_k_BS1F), (*k_BSGH.shape[:3], num_freq)),
    ]
    k_wide_BSGH = _pad_last(jnp.concatenate(k_parts, axis=-1), width).astype(k_BSGH.dtype)
    return q_wide_BTNH, k_wide_BSGH


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def xl_refusal(names: list[str]) -> str | None:
    """Why the kernels cannot run XL with the other parts ``names``, or None."""
    readers = sorted({"cope", "selective", "relative", "relative_capped"} & set(names))
    if readers:
        return (
            f"its widened queries and keys with {readers} (they read the content logits or "
            "the queries, which carry XL's features on the kernels)"
        )
    return None
