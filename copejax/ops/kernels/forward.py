"""The fused attention forward kernel (FlashAttention-2, Dao 2023, arXiv 2307.08691).

One program per (batch row, head, query tile). It walks the key tiles its queries may see
(:meth:`~copejax.ops.kernels.tiles.Plan.key_tiles`), skips those with no allowed pair
(``lax.cond`` on :meth:`~copejax.ops.kernels.tiles.Plan.live`), and folds each pair's
scores (content logits plus the terms' tile biases) into an online softmax in float32
(Milakov & Gimelshein 2018, arXiv 1805.02867). It writes the output and each query's
log-sum-exp ``L_i = m_i + log l_i``, which the backward kernels read. A separable term's
row (:mod:`copejax.ops.kernels.separable`), a constant of each query's softmax, stays out of
the scores and the max: it is added to L once.

Shape letters: B batch, T queries, S keys, N query heads, G key/value heads (N = G x
groups), H head dim, W value width, Q / K tile lengths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.cope import cope_forward_kernel
from copejax.ops.kernels.operands import (
    per_head_specs,
    term_operands,
    term_refs,
)
from copejax.ops.kernels.separable import origins, query_rows
from copejax.ops.kernels.stick import stick_forward_kernel
from copejax.ops.kernels.tiles import LOG2E, Plan, dot_f32, scores_QK
from copejax.ops.kernels.triton_params import compiler_params


def _forward_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    term = refs[8 : 8 + num_term_refs]
    o_ref, lse_ref = refs[8 + num_term_refs :]
    p_refs, qv_refs, kv_refs = term_refs(list(term), has)
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH = q_ref[...]
    q_pos_Q, q_seg_Q = qpos_ref[...], qseg_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]
    width = v_ref.shape[-1]
    at = origins(plan.biases, params, q_values, q_pos_Q)  # separable terms': once per program

    def pair(kj: jax.Array, state: tuple) -> tuple:
        k_first, keys, k_seg_K, k_rank_K = plan.key_tile(kj, kseg_ref, krank_ref)

        def compute(state: tuple, allowed_QK: jax.Array | None) -> tuple:
            max_Q, sum_Q, acc_QW = state
            k_values = [None if r is None else r[keys] for r in kv_refs]
            inputs = (params, q_values, k_values, q_pos_Q, kpos_ref[keys])
            # without the separable terms' rows, constants of each query's softmax
            s_QK, _ = scores_QK(
                plan, q_QH, k_ref[keys, :], allowed_QK, inputs, unit=LOG2E, at=at, split_rows=True
            )
            new_max_Q = jnp.maximum(max_Q, jnp.max(s_QK, axis=1))
            p_QK = jnp.exp2(s_QK - new_max_Q[:, None])
            if allowed_QK is not None:
                p_QK = jnp.where(allowed_QK, p_QK, 0.0)
            rescale_Q = jnp.exp2(max_Q - new_max_Q)
            v_KW = v_ref[keys, :]
            acc_QW = acc_QW * rescale_Q[:, None] + dot_f32(p_QK.astype(v_KW.dtype), v_KW, (1, 0))
            return new_max_Q, sum_Q * rescale_Q + jnp.sum(p_QK, axis=1), acc_QW

        mask_args = (q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return plan.run_pair(mask_args, compute, state)

    first, end = plan.key_tiles(qi)
    init = (
        jnp.full((plan.size_q,), -1e30, jnp.float32),
        jnp.zeros((plan.size_q,), jnp.float32),
        jnp.zeros((plan.size_q, width), jnp.float32),
    )
    max_Q, sum_Q, acc_QW = jax.lax.fori_loop(first, end, pair, init)
    seen_Q = sum_Q > 0
    safe_sum_Q = jnp.where(seen_Q, sum_Q, 1.0)
    o_ref[...] = (acc_QW / safe_sum_Q[:, None]).astype(o_ref.dtype)
    # A query with no allowed key (padding) gets 0 (or with a query offset MASKED_LOGIT): the
    # backward's weights there are 0.
    lse_Q = max_Q * (1.0 / LOG2E) + jnp.log(safe_sum_Q)  # the max in log2 units
    rows_Q = query_rows(plan.biases, params, q_values, q_pos_Q, at)
    if rows_Q is not None:
        lse_Q = lse_Q + rows_Q
    lse_ref[...] = jnp.where(seen_Q, lse_Q, plan.unseen_lse)


def forward_call(
    plan: Plan,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    v_BSGW: jax.Array,
    *,
    ints: dict[str, jax.Array],
    terms: list[dict],
    cope: tuple | None = None,
    gate_k_BSGH: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, list[jax.Array]]:
    """Runs the forward kernel on padded inputs.

    Args:
      q_BTNH, k_BSGH, v_BSGW: queries, keys and values (T, S multiples of the tiles).
      ints: int32 (B, T) "q_pos", "q_seg" and (B, S) "k_pos", "k_seg", "k_rank".
      terms: per term {"params": (N, P) | None, "q": (B, N, T) | None, "k": (B, N, S) | None}.
      cope: CoPE's parameters per head, (N, R, C) each, with ``plan.cope``
        (:meth:`copejax.ops.kernels.cope_terms.CopeTerm.per_head`).
      gate_k_BSGH: CoPE's gate keys (sep-keys, val-gates) with ``plan.cope.gate_keys``.

    Returns:
      (o_BTNW float32, lse_BNT float32 (with stick-breaking minus the log remainder); no
      carry: the backward's dq kernels replay them). The output stays
      float32 for the backward's ``D_i = dO_i . o_i`` (stick-breaking's gradient subtracts
      from D, where a bfloat16 output's rounding would show).
    """
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    grid = (batch, heads, plan.count_q)
    groups = plan.groups
    in_specs = [
        pl.BlockSpec((None, plan.size_q, None, dim), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, length_k, None, dim), lambda b, n, i: (b, 0, n // groups, 0)),
        pl.BlockSpec((None, length_k, None, width), lambda b, n, i: (b, 0, n // groups, 0)),
        pl.BlockSpec((None, plan.size_q), lambda b, n, i: (b, i)),
        pl.BlockSpec((None, plan.size_q), lambda b, n, i: (b, i)),
        pl.BlockSpec((None, length_k), lambda b, n, i: (b, 0)),
        pl.BlockSpec((None, length_k), lambda b, n, i: (b, 0)),
        pl.BlockSpec((None, length_k), lambda b, n, i: (b, 0)),
    ]
    inputs = [q_BTNH, k_BSGH, v_BSGW, ints["q_pos"], ints["q_seg"]]
    inputs += [ints["k_pos"], ints["k_seg"], ints["k_rank"]]
    has, term_inputs, term_specs = term_operands(plan, terms, q_block=True, k_block=False)
    body = stick_forward_kernel if plan.stick else _forward_kernel
    out_specs = [
        pl.BlockSpec((None, plan.size_q, None, width), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, None, plan.size_q), lambda b, n, i: (b, n, i)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, length_q, heads, width), jnp.float32),
        jax.ShapeDtypeStruct((batch, heads, length_q), jnp.float32),
    ]
    extra = []
    if plan.cope is not None:  # the term's parameters, the gate keys (whole, like k)
        body = cope_forward_kernel
        extra = list(cope)
        term_specs = [*term_specs, *per_head_specs(cope)]
        if plan.cope.gate_keys:
            extra.append(gate_k_BSGH)
            term_specs.append(in_specs[1])
    kernel = functools.partial(body, plan=plan, has=has, num_term_refs=len(term_inputs))
    o_BTNW, lse_BNT = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs + term_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_attention_forward",
    )(*inputs, *term_inputs, *extra)
    return o_BTNW, lse_BNT
