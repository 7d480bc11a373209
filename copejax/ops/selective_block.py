"""Selective attention's block form for the blockwise engine (``copejax.ops.engine``): per
(query block, key) prefix sums of F over earlier query blocks, and one pair's bias
(arXiv 2410.02703; the scheme is ``copejax.positions.selective``).

Shapes: B batch, T queries, S keys, H head dim, Q / K query / key block length, G blocks.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from copejax.ops import segments
from copejax.ops.engine_blocks import PairBlock, num_blocks, to_blocks
from copejax.ops.selective import (
    accumulated_penalty_BTS,
    evicted_bias,
    penalty_bias,
    selection_BTS,
)


def block_column_sums(
    q_BTH: jax.Array,
    k_BSH: jax.Array,
    q_ids_BT: jax.Array,
    k_ids_BS: jax.Array,
    first_BS: jax.Array,
    *,
    offset: jax.Array | int,
    size_q: int,
    nonlinearity: str,
) -> jax.Array:
    """sum over each query block's queries of S, against every key: (G, B, S) float32.

    One query block at a time (a (B, Q, S) slice), each rematerialised in the backward pass,
    so nothing of size (T, S) is kept. ``offset`` is the key index of the first query.
    """
    length_q = q_BTH.shape[1]
    q_GBQH = to_blocks(q_BTH, size_q)
    ids_GBQ = to_blocks(q_ids_BT, size_q)
    scale = 1.0 / math.sqrt(q_BTH.shape[-1])
    offset = jnp.asarray(offset, jnp.int32)
    k_index_S = jnp.arange(k_BSH.shape[1])

    @jax.checkpoint
    def one_block(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        g, q_BQH, ids_BQ = args
        logits_BQS = (
            jnp.einsum("BQH,BSH->BQS", q_BQH, k_BSH, preferred_element_type=jnp.float32) * scale
        )
        start = g * size_q
        allowed_BQS = segments.pair_allowed_BQK(ids_BQ, k_ids_BS, offset + start, 0)
        real_Q = start + jnp.arange(size_q) < length_q  # padded queries select nothing
        allowed_BQS = allowed_BQS & real_Q[None, :, None]
        s_BQS = selection_BTS(
            logits_BQS,
            allowed_BQS,
            first_BS,
            offset + start + jnp.arange(size_q),
            k_index_S,
            nonlinearity=nonlinearity,
        )
        return jnp.sum(s_BQS, axis=1)

    count = num_blocks(length_q, size_q)
    return jax.lax.map(one_block, (jnp.arange(count), q_GBQH, ids_GBQ))


def selective_pair(
    params: None,
    pair: PairBlock,
    prepared: None,
    carry: Any,
    *,
    head: int,
    nonlinearity: str,
    size_q: int,
    prune_threshold: float | None,
) -> tuple[jax.Array, Any]:
    """-(P of this query block + the within-block exclusive sum over queries), all heads."""
    size_q_pair, size_k = pair.q_BQNH.shape[1], pair.k_BKNH.shape[1]
    if size_q_pair != size_q:
        raise ValueError(
            f"selective: the engine's query block has {size_q_pair} queries but the prefix was "
            f"computed for blocks of {size_q}; the block length rule changed"
        )
    group_B = pair.q_arrays["group"][:, 0].astype(jnp.int32)
    prefix_BK = jnp.take_along_axis(pair.k_arrays["prefix"], group_B[:, None, None], axis=2)[..., 0]
    s_BQK = selection_BTS(
        pair.logits_BNQK[:, head],
        pair.allowed_BQK,
        pair.k_arrays["first"] > 0.5,
        pair.q_start + jnp.arange(size_q),
        pair.k_start + jnp.arange(size_k),
        nonlinearity=nonlinearity,
    )
    f_BQK = accumulated_penalty_BTS(s_BQK, prefix_BK)
    bias_BQK = penalty_bias(f_BQK, prune_threshold)
    if "evicted_at" in pair.k_arrays:
        q_index_Q = pair.q_start + jnp.arange(size_q)
        bias_BQK = evicted_bias(bias_BQK, q_index_Q, pair.k_arrays["evicted_at"])
    heads = pair.q_BQNH.shape[2]
    return jnp.broadcast_to(
        bias_BQK[:, None], (bias_BQK.shape[0], heads, *bias_BQK.shape[1:])
    ), carry
