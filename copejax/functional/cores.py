"""The schemes' pure cores under one naming convention: ``<scheme>_bias`` returns an additive
float32 logit term (B, N, T, S), masked to 0 where the query may not see the key; a qk
transform is named after its scheme (``rope``). Arrays in, arrays out, no Flax.

Each is the function the scheme's Linen site calls (or a composition of those), not a second
implementation: ALiBi (Press et al. 2022, arXiv 2108.12409) from ``copejax.positions.alibi``,
RoPE (Su et al. 2021, arXiv 2104.09864) from ``copejax.positions.rope``, CoPE (Golovneva et
al. 2024, arXiv 2405.18719) from ``copejax.ops.cope``, FoX (Lin et al. 2025, arXiv
2503.02130) from ``copejax.ops.fox_core``. The block forms for the O(T) engine are
``copejax.terms`` (``terms.fox`` takes the same log forget gates as :func:`fox_bias`).

Positions may be (T,) or (B, T); segment ids (B, T) or None (one document per row).
Shape letters: B batch, T queries, S keys, N heads, H head dim, D model dim, P positions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from copejax.ops import segments
from copejax.ops.cope import cope_gates, cope_interpolated_term, cope_positions
from copejax.ops.fox_core import fox_decay_bias, fox_log_forget_gates
from copejax.positions.alibi import alibi_bias as _alibi_bias
from copejax.positions.alibi import alibi_slopes
from copejax.positions.rope import apply_rope, rotary_dim
from copejax.positions.rope_frequencies import rope_inv_freq

__all__ = [
    "alibi_bias",
    "alibi_slopes",
    "causal_mask",
    "cope_bias",
    "fox_bias",
    "fox_log_forget_gates",
    "rope",
]


def _batched(positions: jax.Array, batch: int) -> jax.Array:
    positions = jnp.asarray(positions)
    return (
        jnp.broadcast_to(positions, (batch, positions.shape[-1]))
        if positions.ndim == 1
        else positions
    )


def causal_mask(batch: int, length: int, segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """mask_BTS of causal self-attention within packed documents (``copejax.ops.segments``)."""
    ids_BT = segments.default_segment_ids(segment_ids_BT, batch, length)
    return segments.causal_mask_BTS(ids_BT, ids_BT)


def alibi_bias(
    q_positions: jax.Array,
    k_positions: jax.Array | None = None,
    *,
    num_heads: int,
    segment_ids_BT: jax.Array | None = None,
) -> jax.Array:
    """ALiBi's ``-m_h (i - j)`` with the paper's slopes, masked to causal self-attention.

    Args:
      q_positions: query positions i, (T,) or (B, T).
      k_positions: key positions j (S,) or (B, S); None: the queries' (self-attention).
      num_heads: N (the slopes, :func:`alibi_slopes`).
      segment_ids_BT: packed documents; used (with T == S) for the mask.

    Returns:
      bias_BNTS float32, 0 where a key is not visible (B = 1 for (T,) positions without ids).
    """
    batch = 1 if segment_ids_BT is None else segment_ids_BT.shape[0]
    q_BT = _batched(q_positions, batch)
    k_BS = q_BT if k_positions is None else _batched(k_positions, batch)
    bias_BNTS = _alibi_bias(q_BT, k_BS, alibi_slopes(num_heads))
    if q_BT.shape[1] != k_BS.shape[1]:
        return bias_BNTS
    mask_BTS = causal_mask(q_BT.shape[0], q_BT.shape[1], segment_ids_BT)
    return jnp.where(mask_BTS[:, None], bias_BNTS, 0.0)


def rope(
    x_BTNH: jax.Array,
    positions: jax.Array,
    *,
    base: float = 10000.0,
    layout: str = "half",
    fraction: float = 1.0,
) -> jax.Array:
    """Rotary position embedding of queries or keys (no scaling; the ``rope`` scheme's
    ``scaling`` options are its site's): the first ``fraction * H`` features rotated by
    ``position * base^(-2i / d_rot)``.

    Args:
      x_BTNH: queries or keys.
      positions: (T,) or (B, T).
      base, layout ("half" or "interleaved"), fraction: as the scheme's options.

    Returns:
      the rotated array, x's shape and dtype.
    """
    inv_freq_F = rope_inv_freq(rotary_dim(x_BTNH.shape[-1], fraction), base)
    return apply_rope(x_BTNH, _batched(positions, x_BTNH.shape[0]), inv_freq_F, layout)


def cope_bias(
    q_BTNH: jax.Array,
    k_BSNH: jax.Array,
    pos_emb: jax.Array,
    *,
    segment_ids_BT: jax.Array | None = None,
    scan_impl: str = "auto",
) -> jax.Array:
    """CoPE's position term with the paper's defaults (gates from the keys, interpolated
    position embeddings; eq. 3-9): ``g_ij = sigmoid(q_i . k_j / sqrt(H))`` on visible keys,
    ``p_ij = min(sum_{k=j..i} g_ik, P - 1)`` and ``z_i[p_ij]`` interpolated between
    ``q_i . e[floor p]`` and ``q_i . e[ceil p]``.

    Args:
      q_BTNH, k_BSNH: queries and keys of causal self-attention (T == S, N heads each).
      pos_emb: e, (P, H) shared by the heads or (N, P, H); P is CoPE's p_max.
      segment_ids_BT: packed documents (None: one per row).
      scan_impl: the suffix sum's implementation (``copejax.ops.scan``).

    Returns:
      bias_BNTS float32, 0 where a key is not visible.
    """
    batch, length = q_BTNH.shape[:2]
    mask_BTS = causal_mask(batch, length, segment_ids_BT)
    logits_BNTS = jnp.einsum(
        "BTNH,BSNH->BNTS", q_BTNH, k_BSNH, preferred_element_type=jnp.float32
    ) / math.sqrt(q_BTNH.shape[-1])
    gates_BNTS = cope_gates(logits_BNTS, mask_BTS)
    p_BNTS = cope_positions(gates_BNTS, pos_emb.shape[-2], scan_impl)
    term_BNTS = cope_interpolated_term(q_BTNH, pos_emb, p_BNTS)
    return jnp.where(mask_BTS[:, None], term_BNTS, 0.0)


def fox_bias(
    logf_BTN: jax.Array, segment_ids_BT: jax.Array | None = None, scan_impl: str = "auto"
) -> jax.Array:
    """FoX's decay ``D_ij = sum_{l=j+1..i} log f_l`` (eq. 4-6), restarting at each packed
    document; 0 where a key is not visible.

    Args:
      logf_BTN: log forget gates, float32 <= 0 (:func:`fox_log_forget_gates` of the layer
        input); the same input as ``copejax.terms.fox``.
      segment_ids_BT: packed documents (None: one per row).
      scan_impl: the prefix sum's implementation.

    Returns:
      bias_BNTS float32.
    """
    batch, length = logf_BTN.shape[:2]
    return fox_decay_bias(logf_BTN, causal_mask(batch, length, segment_ids_BT), scan_impl)
