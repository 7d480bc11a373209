"""Blockwise stick-breaking attention in O(T) memory (Tan et al. 2024, arXiv 2410.17980).

The same weights as ``copejax.positions.stickbreaking.stickbreaking_weights``,
``log A_ij = log_sigmoid(z_ij) - sum_{k in (j, i)} softplus(z_ik)``, computed block by block:
walking a query block's keys from the newest block to the oldest, the sum over keys after j is
the within-block suffix sum (shifted by one key) plus the carried log stick remainder, the
softplus total of the newer blocks. No normalisation: y_i = sum_j A_ij v_j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops import blockwise as bw
from copejax.ops.scan import cumsum


def blockwise_stickbreaking_attention(
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    v_BTNH: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    include_self: bool = False,
    block: int = 256,
    scan_impl: str = "auto",
    remat: bool = True,
    return_remainder: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal stick-breaking attention with logits z = q.k / sqrt(H).

    Args:
      q_BTNH, k_BTNH, v_BTNH: queries, keys, values.
      segment_ids_BT: packed documents; a query breaks sticks over earlier keys of its own
        segment only.
      include_self: the query's own key takes part (keys j <= i instead of j < i).
      block: Q = K, the query and key block length; T need not be a multiple.
      scan_impl: the within-block suffix sum (``copejax.ops.scan``).
      remat: recompute blocks in the backward pass (O(T) memory).
      return_remainder: also return each query's leftover weight (the authors' ``rem``).

    Returns:
      y_BTNH in the dtype of ``v_BTNH``; with ``return_remainder``, the pair (y_BTNH,
      leftover_BTN), ``leftover_i = prod_j (1 - beta_ij)`` over the allowed keys (float32, 1
      for a query with no key), so that the weights sum to ``1 - leftover``.
    """
    batch, length, heads, head_dim = q_BTNH.shape
    seg_blocks = bw.to_blocks(segment_ids_BT, block)
    q_blocks = {"q": bw.to_blocks(q_BTNH, block), "seg": seg_blocks}
    k_blocks = {"k": bw.to_blocks(k_BTNH, block), "v": bw.to_blocks(v_BTNH, block)}
    k_blocks["seg"] = seg_blocks

    def init(qd: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {
            "acc_BQNH": jnp.zeros((batch, block, heads, head_dim), jnp.float32),
            "remainder_BNQ": jnp.zeros((batch, heads, block), jnp.float32),
        }

    def step(carry: dict, qi: jax.Array, qd: dict, kj: jax.Array, kd: dict) -> dict:
        allowed_B1QK = bw.block_allowed_BQK(qd["seg"], kd["seg"], qi, kj, include_self)[:, None]
        z_BNQK = jnp.where(allowed_B1QK, bw.content_logits_BNQK(qd["q"], kd["k"]), 0.0)
        softplus_BNQK = jnp.where(allowed_B1QK, jax.nn.softplus(z_BNQK), 0.0)
        suffix_BNQK = cumsum(softplus_BNQK, axis=-1, reverse=True, impl=scan_impl)
        after_BNQK = jnp.pad(suffix_BNQK[..., 1:], ((0, 0), (0, 0), (0, 0), (0, 1)))
        after_BNQK = after_BNQK + carry["remainder_BNQ"][..., None]
        log_weights_BNQK = jax.nn.log_sigmoid(z_BNQK) - after_BNQK
        weights_BNQK = jnp.where(allowed_B1QK, jnp.exp(log_weights_BNQK), 0.0)
        weighted_BQNH = jnp.einsum(
            "BNQK,BKNH->BQNH",
            weights_BNQK.astype(kd["v"].dtype),
            kd["v"],
            preferred_element_type=jnp.float32,
        )
        return {
            "acc_BQNH": carry["acc_BQNH"] + weighted_BQNH,
            "remainder_BNQ": carry["remainder_BNQ"] + suffix_BNQK[..., 0],
        }

    def finish(carry: dict, qd: dict) -> jax.Array | tuple[jax.Array, jax.Array]:
        y_BQNH = carry["acc_BQNH"].astype(v_BTNH.dtype)
        if not return_remainder:
            return y_BQNH
        # The carried remainder is the softplus total over every allowed key: -log leftover.
        return y_BQNH, jnp.moveaxis(jnp.exp(-carry["remainder_BNQ"]), 1, 2)

    out = bw.walk_blocks(q_blocks, k_blocks, init, step, finish, remat=remat)
    if not return_remainder:
        return bw.from_blocks(out, length)
    y_GBQNH, leftover_GBQN = out
    return bw.from_blocks(y_GBQNH, length), bw.from_blocks(leftover_GBQN, length)
