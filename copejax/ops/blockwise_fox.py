"""Blockwise forgetting attention, FoX, in O(T) memory (Lin et al. 2025, arXiv 2503.02130).

The same attention as ``softmax(q.k / sqrt(H) + D)`` with ``D_ij = sum_{l=j+1..i} log f_l``
(paper eq. 4-6), computed block by block with an online softmax (``copejax.ops.blockwise``).
``D_ij = c_i - c_j`` with ``c`` the prefix sums of log f restarted at each segment start: a key
block's log-forget offset is its slice of ``c``, an O(T N) array computed once (the same float32
sums the full path subtracts, so both paths agree to rounding of the logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops import blockwise as bw
from copejax.ops import scan


def segment_starts_from_ids(segment_ids_BT: jax.Array) -> jax.Array:
    """True where token t begins a segment: t = 0 or its segment id differs from t - 1's."""
    changes_BT = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
    return jnp.concatenate([jnp.ones_like(changes_BT[:, :1]), changes_BT], axis=1)


def blockwise_fox_attention(
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    v_BTNH: jax.Array,
    logf_BTN: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    block: int = 256,
    scan_impl: str = "auto",
    remat: bool = True,
) -> jax.Array:
    """Causal forgetting attention y_i = sum_j softmax_j(q_i.k_j / sqrt(H) + c_i - c_j) v_j.

    Args:
      q_BTNH, k_BTNH, v_BTNH: queries, keys, values (after QK-norm and token shift).
      logf_BTN: log forget gates (float32, <= 0), one per token and head.
      segment_ids_BT: packed documents; a query sees earlier keys of its own segment only.
      block: Q = K, the query and key block length; T need not be a multiple.
      scan_impl: the prefix-sum implementation (``copejax.ops.scan.segment_cumsum``).
      remat: recompute blocks in the backward pass (O(T) memory).

    Returns:
      y_BTNH in the dtype of ``v_BTNH``; the output gate (FoX Pro) is applied by the site.
    """
    batch, length, heads, head_dim = q_BTNH.shape
    starts_BT1 = segment_starts_from_ids(segment_ids_BT)[:, :, None]
    c_BTN = scan.segment_cumsum(logf_BTN, starts_BT1, axis=1, impl=scan_impl)
    seg_blocks = bw.to_blocks(segment_ids_BT, block)
    c_blocks_GBNQ = jnp.moveaxis(bw.to_blocks(c_BTN, block), 3, 2)
    q_blocks = {"q": bw.to_blocks(q_BTNH, block), "seg": seg_blocks, "c": c_blocks_GBNQ}
    k_blocks = {
        "k": bw.to_blocks(k_BTNH, block),
        "v": bw.to_blocks(v_BTNH, block),
        "seg": seg_blocks,
        "c": c_blocks_GBNQ,
    }

    def init(qd: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return bw.softmax_init(batch, heads, block, head_dim)

    def step(state: dict, qi: jax.Array, qd: dict, kj: jax.Array, kd: dict) -> dict:
        allowed_BQK = bw.block_allowed_BQK(qd["seg"], kd["seg"], qi, kj)
        decay_BNQK = qd["c"][..., :, None] - kd["c"][..., None, :]
        decay_BNQK = jnp.where(allowed_BQK[:, None], decay_BNQK, 0.0)
        scores_BNQK = bw.content_logits_BNQK(qd["q"], kd["k"]) + decay_BNQK
        return bw.softmax_update(state, scores_BNQK, allowed_BQK, kd["v"])

    def finish(state: dict, qd: dict) -> jax.Array:
        return bw.softmax_finish(state).astype(v_BTNH.dtype)

    y_GBQNH = bw.walk_blocks(q_blocks, k_blocks, init, step, finish, remat=remat)
    return bw.from_blocks(y_GBQNH, length)
