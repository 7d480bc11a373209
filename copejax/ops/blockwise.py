"""Blockwise causal attention in O(T) memory: the driver shared by CoPE, FoX and stick-breaking.

The contextual schemes (CoPE, Golovneva et al. 2024, arXiv 2405.18719; FoX, Lin et al. 2025,
arXiv 2503.02130; stick-breaking, Tan et al. 2024, arXiv 2410.17980) all sum something over
the keys between a key and its query. Walking the keys of a query block from the newest block
to the oldest, that sum is a within-block suffix sum plus a *carry*, the total of the newer
blocks (``copejax.ops.scan.blockwise_cumsum`` states the identity). Softmax schemes keep an
online softmax (running max, denominator and weighted values; Milakov & Gimelshein 2018,
arXiv 1805.02867) in the same carry.

Memory: queries go in blocks of Q through ``lax.map``; each query block walks the key blocks in
a ``lax.scan`` whose per-key-block body is rematerialised (``jax.checkpoint``), so the backward
pass keeps only the walks' carries, never a (B, N, Q, K) block. With more than
``REMAT_WALKS_ABOVE`` blocks the per-query-block function is rematerialised too, so that the
backward keeps the carries of one walk (G of them) at a time instead of all G * G: no
(T, S)-sized array in either pass. At or below it, the G * G carries (a few MiB per layer at
G = 8) are kept, which saves one recomputation of the forward walk.

Shape letters: B batch, T length (queries and keys: self-attention), N heads, H head dim,
Q query-block length, K key-block length (Q = K = ``block``), G number of blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Pytree = Any
# Rematerialise whole query-block walks only above this many blocks (see the module docstring).
REMAT_WALKS_ABOVE = 8


def num_blocks(length: int, block: int) -> int:
    """G = ceil(length / block); raises ValueError for a non-positive block."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block size must be a positive integer, got {block!r}")
    return -(-length // block)


def to_blocks(x_BT: jax.Array, block: int) -> jax.Array:
    """(B, T, ...) -> (G, B, block, ...), zero-padding T up to a multiple of ``block``."""
    length = x_BT.shape[1]
    pad = num_blocks(length, block) * block - length
    if pad:
        widths = [(0, 0)] * x_BT.ndim
        widths[1] = (0, pad)
        x_BT = jnp.pad(x_BT, widths, mode="edge" if x_BT.dtype.kind in "iub" else "constant")
    x_BGQ = x_BT.reshape(x_BT.shape[0], -1, block, *x_BT.shape[2:])
    return jnp.moveaxis(x_BGQ, 1, 0)


def from_blocks(x_GBQ: jax.Array, length: int) -> jax.Array:
    """(G, B, Q, ...) -> (B, T, ...), dropping the padding."""
    x_BGQ = jnp.moveaxis(x_GBQ, 0, 1)
    x_BT = x_BGQ.reshape(x_BGQ.shape[0], -1, *x_BGQ.shape[3:])
    return x_BT[:, :length]


def segment_ids_from_mask(mask_BTS: jax.Array) -> jax.Array:
    """Segment ids (B, T) of a causal same-segment self-attention mask: a new segment wherever
    a token may not see the one before it. Reads only the mask's sub-diagonal."""
    t_T = jnp.arange(1, mask_BTS.shape[1])
    sees_previous_BT = mask_BTS[:, t_T, t_T - 1]
    starts_BT = jnp.concatenate([jnp.ones_like(sees_previous_BT[:, :1]), ~sees_previous_BT], 1)
    return jnp.cumsum(starts_BT.astype(jnp.int32), axis=1)


def block_allowed_BQK(
    seg_q_BQ: jax.Array,
    seg_k_BK: jax.Array,
    q_block: jax.Array,
    k_block: jax.Array,
    include_self: bool = True,
) -> jax.Array:
    """True where query q of block ``q_block`` may use key k of block ``k_block``.

    Causal by index (key <= query, or key < query without ``include_self``) and same segment.
    """
    size_q, size_k = seg_q_BQ.shape[1], seg_k_BK.shape[1]
    q_Q1 = q_block * size_q + jnp.arange(size_q)[:, None]
    k_1K = k_block * size_k + jnp.arange(size_k)[None, :]
    causal_QK = k_1K <= q_Q1 if include_self else k_1K < q_Q1
    return causal_QK[None] & (seg_q_BQ[:, :, None] == seg_k_BK[:, None, :])


def walk_blocks(
    q_blocks: Pytree,
    k_blocks: Pytree,
    init: Callable[[Pytree], Pytree],
    step: Callable[[Pytree, jax.Array, Pytree, jax.Array, Pytree], Pytree],
    finish: Callable[[Pytree, Pytree], jax.Array],
    *,
    remat: bool = True,
    prepare: Callable[[Pytree], Pytree] | None = None,
) -> jax.Array:
    """For every query block, folds ``step`` over its key blocks from the newest to the oldest.

    Args:
      q_blocks: pytree of arrays with a leading block axis G (query-side data).
      k_blocks: pytree of arrays with a leading block axis G (key-side data).
      init: query-block data -> the initial carry of its walk.
      step: (carry, query block index, query-block data, key block index, key-block data) ->
        carry. Called for key blocks at or before the query block only (later blocks are
        skipped by ``lax.cond``: causal attention never reads them).
      finish: (final carry, query-block data) -> the query block's output (B, Q, ...).
      remat: rematerialise the walk's body in the backward pass, and whole walks when there
        are more than ``REMAT_WALKS_ABOVE`` blocks (O(T) memory).
      prepare: query-block data -> query-block data, computed once per query block before
        its walk (CoPE's z = q . e); the walk reads the result as a constant.

    Returns:
      the stacked outputs, (G, B, Q, ...).
    """
    count = jax.tree.leaves(q_blocks)[0].shape[0]
    k_rev = jax.tree.map(lambda x: x[::-1], k_blocks)
    k_index_rev = jnp.arange(count)[::-1]

    def one_query_block(q_index: jax.Array, q_data: Pytree) -> jax.Array:
        if prepare is not None:
            q_data = prepare(q_data)

        def body(carry: Pytree, k_in: tuple[jax.Array, Pytree]) -> tuple[Pytree, None]:
            k_index, k_data = k_in
            carry = jax.lax.cond(
                k_index <= q_index,
                lambda c: step(c, q_index, q_data, k_index, k_data),
                lambda c: c,
                carry,
            )
            return carry, None

        if remat:
            body = jax.checkpoint(body, prevent_cse=False)
        carry, _ = jax.lax.scan(body, init(q_data), (k_index_rev, k_rev))
        return finish(carry, q_data)

    if remat and count > REMAT_WALKS_ABOVE:
        one_query_block = jax.checkpoint(one_query_block, prevent_cse=False)
    return jax.lax.map(lambda xs: one_query_block(*xs), (jnp.arange(count), q_blocks))


# Online softmax (float32). The running max is only a shift for exp: it carries no gradient.
MASKED_LOGIT = -1e30


def softmax_init(batch: int, heads: int, size: int, head_dim: int) -> dict[str, jax.Array]:
    """Empty online-softmax state: max, denominator (B, N, Q) and weighted values (B, Q, N, H)."""
    return {
        "max_BNQ": jnp.full((batch, heads, size), MASKED_LOGIT, jnp.float32),
        "sum_BNQ": jnp.zeros((batch, heads, size), jnp.float32),
        "acc_BQNH": jnp.zeros((batch, size, heads, head_dim), jnp.float32),
    }


def softmax_update(
    state: dict[str, jax.Array],
    scores_BNQK: jax.Array,
    allowed_BQK: jax.Array,
    v_BKNH: jax.Array,
) -> dict[str, jax.Array]:
    """Adds one key block to the online softmax; disallowed keys get exactly zero weight."""
    allowed_B1QK = allowed_BQK[:, None]
    scores_BNQK = jnp.where(allowed_B1QK, scores_BNQK.astype(jnp.float32), MASKED_LOGIT)
    new_max_BNQ = jax.lax.stop_gradient(
        jnp.maximum(state["max_BNQ"], jnp.max(scores_BNQK, axis=-1))
    )
    rescale_BNQ = jnp.exp(state["max_BNQ"] - new_max_BNQ)
    exp_BNQK = jnp.where(allowed_B1QK, jnp.exp(scores_BNQK - new_max_BNQ[..., None]), 0.0)
    weighted_BQNH = jnp.einsum(
        "BNQK,BKNH->BQNH",
        exp_BNQK.astype(v_BKNH.dtype),
        v_BKNH,
        preferred_element_type=jnp.float32,
    )
    return {
        "max_BNQ": new_max_BNQ,
        "sum_BNQ": state["sum_BNQ"] * rescale_BNQ + jnp.sum(exp_BNQK, axis=-1),
        "acc_BQNH": state["acc_BQNH"] * jnp.moveaxis(rescale_BNQ, 1, 2)[..., None] + weighted_BQNH,
    }


def softmax_finish(state: dict[str, jax.Array]) -> jax.Array:
    """Weighted values / denominator, float32 (B, Q, N, H); a query with no key gets zeros."""
    sum_BQN1 = jnp.moveaxis(state["sum_BNQ"], 1, 2)[..., None]
    return state["acc_BQNH"] / jnp.where(sum_BQN1 > 0, sum_BQN1, 1.0)


def content_logits_BNQK(q_BQNH: jax.Array, k_BKNH: jax.Array) -> jax.Array:
    """q . k / sqrt(H) in float32, as the generic attention path computes them."""
    scale = 1.0 / (q_BQNH.shape[-1] ** 0.5)
    logits = jnp.einsum("BQNH,BKNH->BNQK", q_BQNH, k_BKNH, preferred_element_type=jnp.float32)
    return logits * scale


# Choosing the path. The schemes' option ``attention_impl`` takes these values.
ATTENTION_IMPLS = ("naive", "blockwise", "auto")


def check_attention_options(
    scheme: str, attention_impl: str, block_size: int, blockwise_min_len: int
) -> None:
    """Raises ValueError naming a bad ``attention_impl``, ``block_size`` or threshold."""
    if attention_impl not in ATTENTION_IMPLS:
        raise ValueError(
            f"{scheme}: attention_impl must be one of {ATTENTION_IMPLS}, got {attention_impl!r}"
        )
    for key, value in (("block_size", block_size), ("blockwise_min_len", blockwise_min_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{scheme}: {key} must be a positive integer, got {value!r}")


def use_blockwise(attention_impl: str, length: int, min_len: int, sowing: bool) -> bool:
    """ "blockwise" always; "auto" from ``min_len`` tokens on unless intermediates are being
    sown (gates, positions and weights exist only on the naive path)."""
    if attention_impl == "auto":
        return length >= min_len and not sowing
    return attention_impl == "blockwise"


def context_segment_ids(segment_ids_BT: jax.Array | None, mask_BTS: jax.Array) -> jax.Array:
    """The context's segment ids, or ids read off the mask's sub-diagonal when it has none."""
    return segment_ids_from_mask(mask_BTS) if segment_ids_BT is None else segment_ids_BT
