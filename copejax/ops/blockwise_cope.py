"""Blockwise CoPE attention in O(T) memory (Golovneva et al. 2024, arXiv 2405.18719).

The same attention as logits + ``copejax.ops.cope``'s position term + masked softmax, computed
block by block (``copejax.ops.blockwise``). Walking a query block's keys from the newest block
to the oldest, the contextual position ``p_ij = sum_{k=j..i} g_ik`` is the within-block suffix
sum of the gates plus the carried count of the newer blocks' gates (eq. 4), capped at
p_max - 1. ``z_i[p] = q_i . e[p]`` (eq. 7) is computed once per query block. Once every query of
the block has counted p_max - 1 gates, all older keys sit at the cap: their position term is the
constant ``z_i[p_max - 1]`` and the gates, sums and interpolation of the block are skipped
(``lax.cond``; exact, since the capped positions carry no gradient either).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from copejax.ops import blockwise as bw
from copejax.ops import cope as cope_ops
from copejax.ops.interpolate import interpolate_last_axis
from copejax.ops.scan import cumsum

TermFn = Callable[[dict[str, jax.Array], jax.Array], jax.Array]


def _position_term_fns(
    position_term: str,
    pos_emb: jax.Array | None,
    slopes_N: jax.Array | None,
    mlp_params: tuple[jax.Array, jax.Array, jax.Array] | None,
    mlp_input_scale: float,
) -> tuple[Callable[[jax.Array], dict[str, jax.Array]], TermFn]:
    """(per-query-block precompute from q_BQNH, term from that and positions p_BNQK)."""
    if position_term == "interpolate":
        if pos_emb is None:
            raise ValueError("cope blockwise: position_term='interpolate' needs pos_emb")

        def pre(q_BQNH: jax.Array) -> dict[str, jax.Array]:
            return {"z_BNQP": cope_ops.cope_integer_logits(q_BQNH, pos_emb)}

        def term(pre_q: dict[str, jax.Array], p_BNQK: jax.Array) -> jax.Array:
            return interpolate_last_axis(pre_q["z_BNQP"], p_BNQK)

        return pre, term
    if position_term == "alibi":
        if slopes_N is None:
            raise ValueError("cope blockwise: position_term='alibi' needs slopes_N")
        return (lambda q_BQNH: {}), (
            lambda pre_q, p_BNQK: cope_ops.cope_alibi_term(slopes_N, p_BNQK)
        )
    if position_term == "mlp":
        if mlp_params is None:
            raise ValueError("cope blockwise: position_term='mlp' needs mlp_params")
        w_in_F, b_in_F, w_out_FH = mlp_params

        def pre_mlp(q_BQNH: jax.Array) -> dict[str, jax.Array]:
            return {"q_BQNH": q_BQNH}

        def term_mlp(pre_q: dict[str, jax.Array], p_BNQK: jax.Array) -> jax.Array:
            return cope_ops.cope_mlp_term(
                pre_q["q_BQNH"], p_BNQK, w_in_F, b_in_F, w_out_FH, input_scale=mlp_input_scale
            )

        return pre_mlp, term_mlp
    raise ValueError(
        f"cope blockwise: position_term must be one of ('interpolate', 'alibi', 'mlp'), "
        f"got {position_term!r}"
    )


def blockwise_cope_attention(
    q_BTNH: jax.Array,
    k_BTNH: jax.Array,
    v_BTNH: jax.Array,
    segment_ids_BT: jax.Array,
    *,
    p_max: int,
    position_term: str = "interpolate",
    pos_emb: jax.Array | None = None,
    slopes_N: jax.Array | None = None,
    mlp_params: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    mlp_input_scale: float = 1.0,
    gate_k_BTNH: jax.Array | None = None,
    force_unit_gates: bool = False,
    scale_position_term: bool = False,
    block: int = 256,
    scan_impl: str = "auto",
    skip_saturated: bool = True,
    remat: bool = True,
) -> jax.Array:
    """Causal CoPE attention y_i = sum_j softmax_j(q_i.k_j / sqrt(H) + z_i[p_ij]) v_j.

    Args:
      q_BTNH, k_BTNH, v_BTNH: queries, keys, values (after any qk transform, e.g. RoPE).
      segment_ids_BT: packed documents; a query sees earlier keys of its own segment only.
      p_max: positions are capped at p_max - 1.
      position_term: "interpolate" (needs ``pos_emb`` (P, H) or (N, P, H)), "alibi" (needs
        ``slopes_N``, signed) or "mlp" (needs ``mlp_params`` = (w_in_F, b_in_F, w_out_FH)
        and ``mlp_input_scale``).
      gate_k_BTNH: the keys of the gates, sigmoid(q . gate_k / sqrt(H)) (sep-keys: k' = W x,
        val-gates: v); None uses the content logits (the paper's default).
      force_unit_gates: every allowed gate is 1 (relative PE).
      scale_position_term: divide the position term by sqrt(H).
      block: Q = K, the query and key block length; T need not be a multiple.
      scan_impl: the within-block suffix sum (``copejax.ops.scan``).
      skip_saturated: skip gates and interpolation of key blocks whose every position is
        capped (exact; off only to measure the saving).
      remat: recompute blocks in the backward pass (O(T) memory).

    Returns:
      y_BTNH in the dtype of ``v_BTNH``.
    """
    batch, length, heads, head_dim = q_BTNH.shape
    pre_fn, term_fn = _position_term_fns(
        position_term, pos_emb, slopes_N, mlp_params, mlp_input_scale
    )
    cap = p_max - 1.0
    term_scale = 1.0 / math.sqrt(head_dim) if scale_position_term else 1.0
    q_blocks = {"q": bw.to_blocks(q_BTNH, block), "seg": bw.to_blocks(segment_ids_BT, block)}
    k_blocks = {
        "k": bw.to_blocks(k_BTNH, block),
        "v": bw.to_blocks(v_BTNH, block),
        "seg": bw.to_blocks(segment_ids_BT, block),
    }
    if gate_k_BTNH is not None:
        k_blocks["gate_k"] = bw.to_blocks(gate_k_BTNH, block)

    def init(qd: dict[str, jax.Array]) -> dict:
        return {
            "softmax": bw.softmax_init(batch, heads, block, head_dim),
            "count_BNQ": jnp.zeros((batch, heads, block), jnp.float32),
        }

    def prepare(qd: dict[str, jax.Array]) -> dict:
        return {**qd, "pre": pre_fn(qd["q"])}  # z = q . e once per query block

    def step(carry: dict, qi: jax.Array, qd: dict, kj: jax.Array, kd: dict) -> dict:
        logits_BNQK = bw.content_logits_BNQK(qd["q"], kd["k"])
        allowed_BQK = bw.block_allowed_BQK(qd["seg"], kd["seg"], qi, kj)
        count_BNQ = carry["count_BNQ"]

        def counted(count_BNQ: jax.Array) -> tuple[jax.Array, jax.Array]:
            if gate_k_BTNH is None:
                gate_logits_BNQK = logits_BNQK
            else:
                gate_logits_BNQK = bw.content_logits_BNQK(
                    qd["q"].astype(jnp.float32), kd["gate_k"].astype(jnp.float32)
                )
            gates_BNQK = cope_ops.cope_gates(gate_logits_BNQK, allowed_BQK, force_unit_gates)
            within_BNQK = cumsum(gates_BNQK, axis=-1, reverse=True, impl=scan_impl)
            p_BNQK = jnp.minimum(within_BNQK + count_BNQ[..., None], cap)
            return term_fn(qd["pre"], p_BNQK), count_BNQ + jnp.sum(gates_BNQK, axis=-1)

        def saturated(count_BNQ: jax.Array) -> tuple[jax.Array, jax.Array]:
            p_BNQ1 = jnp.full((batch, heads, block, 1), cap, jnp.float32)
            term_BNQ1 = term_fn(qd["pre"], p_BNQ1)
            return jnp.broadcast_to(term_BNQ1, logits_BNQK.shape), count_BNQ

        if skip_saturated:
            term_BNQK, count_BNQ = jax.lax.cond(
                jnp.all(count_BNQ >= cap), saturated, counted, count_BNQ
            )
        else:
            term_BNQK, count_BNQ = counted(count_BNQ)
        scores_BNQK = logits_BNQK + term_BNQK * term_scale
        softmax = bw.softmax_update(carry["softmax"], scores_BNQK, allowed_BQK, kd["v"])
        return {"softmax": softmax, "count_BNQ": count_BNQ}

    def finish(carry: dict, qd: dict) -> jax.Array:
        return bw.softmax_finish(carry["softmax"]).astype(v_BTNH.dtype)

    y_GBQNH = bw.walk_blocks(q_blocks, k_blocks, init, step, finish, remat=remat, prepare=prepare)
    return bw.from_blocks(y_GBQNH, length)
