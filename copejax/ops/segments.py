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
    *,
    window: int | None = None,
    sink_tokens: int = 0,
    k_index_BS: jax.Array | None = None,
    k_rank_BS: jax.Array | None = None,
) -> jax.Array:
    """True where query t (key ``offset + t``) may see key s: causal by index, same segment,
    and, with a ``window``, within the window or one of the segment's first ``sink_tokens``.

    Args:
      q_segment_ids_BT: the queries' segment ids.
      k_segment_ids_BS: the keys' segment ids (the cache's in decoding).
      offset: the key index of query 0 (0 in self-attention; the cache index when decoding).
      include_self: False excludes the query's own key (s < offset + t).
      window, sink_tokens, k_index_BS, k_rank_BS: see :func:`pair_allowed_BQK`.

    Returns:
      mask_BTS, bool.
    """
    return pair_allowed_BQK(
        q_segment_ids_BT,
        k_segment_ids_BS,
        jnp.asarray(offset),
        0,
        include_self,
        window=window,
        sink_tokens=sink_tokens,
        k_index_BK=k_index_BS,
        k_rank_BK=k_rank_BS,
    )


def pair_allowed_BQK(
    q_segment_ids_BQ: jax.Array,
    k_segment_ids_BK: jax.Array,
    q_start: jax.Array | int,
    k_start: jax.Array | int,
    include_self: bool = True,
    *,
    window: int | None = None,
    sink_tokens: int = 0,
    k_index_BK: jax.Array | None = None,
    k_rank_BK: jax.Array | None = None,
) -> jax.Array:
    """The causal same-segment mask of a query block whose first query is key ``q_start``
    against a key block whose first key is key ``k_start``; (B, Q, K) bool.

    Sliding window (``window`` W, Mistral / Gemma convention): query i sees key j iff
    ``i - W < j <= i``, i.e. the last W keys of its segment, itself included. StreamingLLM's
    kept sinks (``sink_tokens`` n, arXiv 2309.17453): a key whose index within its segment
    (``k_rank_BK``) is below n stays visible to every later query of the segment.

    ``k_index_BK`` gives each key's index explicitly (a ring-buffer decode cache, whose slots
    are not in key order; empty slots carry a huge index); by default key k of the block is
    key ``k_start + k``. ``k_rank_BK`` defaults to the key index (one segment per row).
    """
    size_q, size_k = q_segment_ids_BQ.shape[1], k_segment_ids_BK.shape[1]
    q_1Q1 = (q_start + jnp.arange(size_q))[None, :, None]
    if k_index_BK is None:
        k_index_BK = (k_start + jnp.arange(size_k))[None, :]
    k_B1K = k_index_BK[:, None, :]
    allowed_BQK = k_B1K <= q_1Q1 if include_self else k_B1K < q_1Q1
    if window is not None:
        near_BQK = q_1Q1 - k_B1K < window
        if sink_tokens:
            rank_B1K = k_B1K if k_rank_BK is None else k_rank_BK[:, None, :]
            near_BQK = near_BQK | (rank_B1K < sink_tokens)
        allowed_BQK = allowed_BQK & near_BQK
    return allowed_BQK & (q_segment_ids_BQ[:, :, None] == k_segment_ids_BK[:, None, :])


def segment_rank_BS(segment_ids_BS: jax.Array) -> jax.Array:
    """Each key's index within its segment (0 at a segment's first key), keys in order."""
    index_S = jnp.arange(segment_ids_BS.shape[1])
    starts_BS = segment_starts_BT(segment_ids_BS)
    first_BS = jax.lax.cummax(jnp.where(starts_BS, index_S[None], 0), axis=1)
    return index_S[None] - first_BS


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
