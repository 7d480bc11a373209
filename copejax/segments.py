"""Packed documents: segment ids are the input, masks and segment starts are derived from them.

Every attention path reads the same two facts about a (query, key) pair: query t is key
``offset + t`` (``offset`` is 0 in self-attention and the cache index when decoding), and it may
see key s iff ``s <= offset + t`` (``s < offset + t`` for schemes that exclude the current
token) and both carry the same segment id. The naive path builds that as a (B, T, S) mask; the
blockwise engine builds it one (Q, K) block at a time; FoX's token shift and cumulative sums
need only where segments start. Following flax lm1b and praxis, ids are what callers pass and
everything else is computed here, in one place.

Shape letters: B batch, T queries, S keys, Q and K a query block and a key block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_mask_BTS(
    q_segment_ids_BT: jax.Array,
    k_segment_ids_BS: jax.Array,
    offset: jax.Array | int = 0,
    include_self: bool = True,
) -> jax.Array:
    """True where query t (key ``offset + t``) may see key s: causal by index, same segment.

    Args:
      q_segment_ids_BT: the queries' segment ids.
      k_segment_ids_BS: the keys' segment ids (the cache's in decoding).
      offset: the key index of query 0 (0 in self-attention; the cache index when decoding).
      include_self: False excludes the query's own key (s < offset + t).

    Returns:
      mask_BTS, bool.
    """
    return pair_allowed_BQK(
        q_segment_ids_BT, k_segment_ids_BS, jnp.asarray(offset), 0, include_self
    )


def pair_allowed_BQK(
    q_segment_ids_BQ: jax.Array,
    k_segment_ids_BK: jax.Array,
    q_start: jax.Array | int,
    k_start: jax.Array | int,
    include_self: bool = True,
) -> jax.Array:
    """The causal same-segment mask of a query block whose first query is key ``q_start``
    against a key block whose first key is key ``k_start``; (B, Q, K) bool."""
    size_q, size_k = q_segment_ids_BQ.shape[1], k_segment_ids_BK.shape[1]
    q_Q1 = q_start + jnp.arange(size_q)[:, None]
    k_1K = k_start + jnp.arange(size_k)[None, :]
    causal_QK = k_1K <= q_Q1 if include_self else k_1K < q_Q1
    return causal_QK[None] & (q_segment_ids_BQ[:, :, None] == k_segment_ids_BK[:, None, :])


def segment_starts_BT(
    q_segment_ids_BT: jax.Array,
    k_segment_ids_BS: jax.Array | None = None,
    offset: jax.Array | int = 0,
) -> jax.Array:
    """True where query t (key ``offset + t``) begins a segment: it is key 0, or the key
    before it belongs to another segment.

    Self-attention (``k_segment_ids_BS`` None): the previous token is query t - 1. Decoding:
    the previous key is read from the cache's ids, so a new token may continue a cached one.
    """
    if k_segment_ids_BS is None:
        changes_BT = q_segment_ids_BT[:, 1:] != q_segment_ids_BT[:, :-1]
        return jnp.concatenate([jnp.ones_like(changes_BT[:, :1]), changes_BT], axis=1)
    key_T = offset + jnp.arange(q_segment_ids_BT.shape[1])
    previous_BT = jnp.take(k_segment_ids_BS, jnp.maximum(key_T - 1, 0), axis=1)
    return (key_T == 0)[None] | (previous_BT != q_segment_ids_BT)


def segment_ids_from_mask(mask_BTS: jax.Array) -> jax.Array:
    """Segment ids (B, T) of a causal same-segment self-attention mask: a new segment wherever
    a token may not see the one before it. For callers that hold only a mask."""
    t_T = jnp.arange(1, mask_BTS.shape[1])
    sees_previous_BT = mask_BTS[:, t_T, t_T - 1]
    starts_BT = jnp.concatenate([jnp.ones_like(sees_previous_BT[:, :1]), ~sees_previous_BT], 1)
    return jnp.cumsum(starts_BT.astype(jnp.int32), axis=1)


def default_segment_ids(segment_ids_BT: jax.Array | None, batch: int, length: int) -> jax.Array:
    """The given ids, or one segment per row (zeros) when None."""
    if segment_ids_BT is None:
        return jnp.zeros((batch, length), jnp.int32)
    return segment_ids_BT
