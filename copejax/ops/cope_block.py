"""CoPE's block term for the blockwise engine (Golovneva et al. 2024, arXiv 2405.18719).

The same term as ``copejax.ops.cope``'s naive form, computed block by block by
``copejax.ops.engine``. Walking a query block's keys from the newest block
to the oldest, the contextual position ``p_ij = sum_{k=j..i} g_ik`` is the within-block suffix
sum of the gates plus the carried count of the newer blocks' gates (eq. 4), capped at
p_max - 1. ``z_i[p] = q_i . e[p]`` (eq. 7) is computed once per query block. Once every query of
the block has counted p_max - 1 gates, all older keys sit at the cap: their position term is the
constant ``z_i[p_max - 1]`` and the gates, sums and interpolation of the block are skipped
(the term's ``settled`` test, which the engine's forward and flash backward branch on; exact,
since the capped positions carry no gradient either).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from copejax.ops import cope as cope_ops
from copejax.ops.engine_blocks import BlockTerm, PairBlock, content_logits_BNQK
from copejax.ops.interpolate import interpolate_last_axis
from copejax.ops.scan import cumsum

TermFn = Callable[[Any, dict[str, jax.Array], jax.Array], jax.Array]


def _position_term_fns(
    position_term: str, mlp_input_scale: float
) -> tuple[Callable[[Any, jax.Array], dict[str, jax.Array]], TermFn]:
    """(per-query-block precompute from (params, q_BQNH), term from (params, that, p_BNQK))."""
    if position_term == "interpolate":

        def pre(pos_emb: jax.Array, q_BQNH: jax.Array) -> dict[str, jax.Array]:
            return {"z_BNQP": cope_ops.cope_integer_logits(q_BQNH, pos_emb)}

        def term(pos_emb: jax.Array, pre_q: dict, p_BNQK: jax.Array) -> jax.Array:
            return interpolate_last_axis(pre_q["z_BNQP"], p_BNQK)

        return pre, term
    if position_term == "alibi":

        def term_alibi(slopes_N: jax.Array, pre_q: dict, p_BNQK: jax.Array) -> jax.Array:
            return cope_ops.cope_alibi_term(slopes_N, p_BNQK)

        return (lambda params, q_BQNH: {}), term_alibi
    if position_term == "mlp":

        def pre_mlp(mlp_params: tuple, q_BQNH: jax.Array) -> dict[str, jax.Array]:
            return {"q_BQNH": q_BQNH}

        def term_mlp(mlp_params: tuple, pre_q: dict, p_BNQK: jax.Array) -> jax.Array:
            w_in_F, b_in_F, w_out_FH = mlp_params
            return cope_ops.cope_mlp_term(
                pre_q["q_BQNH"], p_BNQK, w_in_F, b_in_F, w_out_FH, input_scale=mlp_input_scale
            )

        return pre_mlp, term_mlp
    raise ValueError(
        f"cope blockwise: position_term must be one of ('interpolate', 'alibi', 'mlp'), "
        f"got {position_term!r}"
    )


def cope_block_term(
    *,
    p_max: int,
    position_term: str = "interpolate",
    pos_emb: jax.Array | None = None,
    slopes_N: jax.Array | None = None,
    mlp_params: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    mlp_input_scale: float = 1.0,
    gate_k_BSNH: jax.Array | None = None,
    force_unit_gates: bool = False,
    scale_position_term: bool = False,
    scan_impl: str = "auto",
    skip_saturated: bool = True,
) -> BlockTerm:
    """CoPE's position term z_i[p_ij] for the blockwise engine (``copejax.ops.engine``).

    Args:
      p_max: positions are capped at p_max - 1.
      position_term: "interpolate" (needs ``pos_emb`` (P, H) or (N, P, H)), "alibi" (needs
        ``slopes_N``, signed) or "mlp" (needs ``mlp_params`` = (w_in_F, b_in_F, w_out_FH)
        and ``mlp_input_scale``).
      gate_k_BSNH: the keys of the gates, sigmoid(q . gate_k / sqrt(H)) (sep-keys: k' = W x,
        val-gates: v); None uses the content logits (the paper's default).
      force_unit_gates: every allowed gate is 1 (relative PE).
      scale_position_term: divide the position term by sqrt(H).
      scan_impl: the within-block suffix sum (``copejax.ops.scan``).
      skip_saturated: skip gates and interpolation of key blocks whose every position is
        capped (exact; off only to measure the saving).

    Returns:
      the term; its walk carry is the count of gates of the newer key blocks (B, N, Q).
    """
    if position_term == "interpolate":
        params = pos_emb
    elif position_term == "alibi":
        params = slopes_N
    else:
        params = mlp_params
    pre_fn, term_fn = _position_term_fns(position_term, mlp_input_scale)
    cap = p_max - 1.0
    k_arrays = {} if gate_k_BSNH is None else {"gate_k": gate_k_BSNH}

    def scaled(term: jax.Array, q_BQNH: jax.Array) -> jax.Array:
        return term / math.sqrt(q_BQNH.shape[-1]) if scale_position_term else term

    def prepare(params: Any, q_BQNH: jax.Array, q_arrays: dict) -> dict[str, jax.Array]:
        """z = q . e once per query block, and the term at the cap (a settled pair's)."""
        pre = pre_fn(params, q_BQNH)
        batch, size, heads = q_BQNH.shape[:3]
        p_BNQ1 = jnp.full((batch, heads, size, 1), cap, jnp.float32)
        return {**pre, "capped_BNQ": scaled(term_fn(params, pre, p_BNQ1), q_BQNH)[..., 0]}

    def init(batch: int, heads: int, size: int) -> jax.Array:
        return jnp.zeros((batch, heads, size), jnp.float32)

    def gates_of(pair: PairBlock) -> jax.Array:
        if "gate_k" in pair.k_arrays:
            gate_logits_BNQK = content_logits_BNQK(
                pair.q_BQNH.astype(jnp.float32), pair.k_arrays["gate_k"].astype(jnp.float32)
            )
        elif pair.logits_BNQK is None:  # advance: the content logits only where counted
            gate_logits_BNQK = content_logits_BNQK(pair.q_BQNH, pair.k_BKNH)
        else:
            gate_logits_BNQK = pair.logits_BNQK
        return cope_ops.cope_gates(gate_logits_BNQK, pair.allowed_BQK, force_unit_gates)

    def advance(params: Any, pair: PairBlock, pre: dict, count_BNQ: jax.Array) -> jax.Array:
        """The count after the pair: the bias's carry without the position term."""

        def counted(count_BNQ: jax.Array) -> jax.Array:
            return count_BNQ + jnp.sum(gates_of(pair), axis=-1)

        if not skip_saturated:
            return counted(count_BNQ)
        return jax.lax.cond(jnp.all(count_BNQ >= cap), lambda c: c, counted, count_BNQ)

    def retreat(params: Any, pair: PairBlock, pre: dict, count_BNQ: jax.Array) -> jax.Array:
        """The count entering a counted pair from the one leaving it (advance's inverse)."""
        return count_BNQ - jnp.sum(gates_of(pair), axis=-1)

    def bias(
        params: Any, pair: PairBlock, pre: dict, count_BNQ: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        gates_BNQK = gates_of(pair)
        within_BNQK = cumsum(gates_BNQK, axis=-1, reverse=True, impl=scan_impl)
        p_BNQK = jnp.minimum(within_BNQK + count_BNQ[..., None], cap)
        term_BNQK = scaled(term_fn(params, pre, p_BNQK), pair.q_BQNH)
        return term_BNQK, count_BNQ + jnp.sum(gates_BNQK, axis=-1)

    def settled(params: Any, pre: dict, count_BNQ: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Every query has counted p_max - 1 gates: every older key sits at the cap."""
        return jnp.all(count_BNQ >= cap), pre["capped_BNQ"]

    return BlockTerm(
        bias,
        params=params,
        k_arrays=k_arrays,
        prepare=prepare,
        init=init,
        advance=advance,
        settled=settled if skip_saturated else None,
        retreat=retreat,
    )
