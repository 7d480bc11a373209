"""The kernel bodies of Shaw's term (Shaw et al. 2018, arXiv 1803.02155): the forward, dq
and dk / dv programs of :mod:`copejax.ops.kernels.forward` and
:mod:`~copejax.ops.kernels.backward` with :mod:`copejax.ops.kernels.relative`'s term in the
scores and its gradients in the dq program (which also adds the table's gradient).
Launched by :mod:`copejax.ops.kernels.relative_calls`. Shape letters as in
:mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.key_tile import QueryTile, key_tile_program
from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.pullbacks import (
    pull_query_values,
)
from copejax.ops.kernels.relative import (
    PairRows,
    Ref,
    RelativeStatic,
    relative_grads,
    relative_term_QK,
)
from copejax.ops.kernels.terms import tile_bias_QK
from copejax.ops.kernels.tiles import (
    MASKED_LOGIT,
    Plan,
    content_logits_QK,
    dot_f32,
    exp_gpu,
    softmax_ds,
)


def _scores_QK(
    plan: Plan,
    static: RelativeStatic,
    q_QH: jax.Array,
    k_KH: jax.Array,
    *,
    table_ref: Ref,
    rows: PairRows,
    inputs: tuple,
) -> jax.Array:
    """The pair's masked scores: content logits, Shaw's term and the other terms."""
    s_QK = content_logits_QK(q_QH, k_KH) + relative_term_QK(static, q_QH, table_ref, rows)
    if plan.biases:
        s_QK = s_QK + tile_bias_QK(plan.biases, inputs[:3], *inputs[3:])
    return jnp.where(rows.allowed_QK, s_QK, MASKED_LOGIT)


def relative_forward_kernel(*refs, plan: Plan, static: RelativeStatic, has: tuple, n: int) -> None:
    """The forward program of one query tile (``n`` term refs)."""
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[8 : 8 + n]), has)
    table_ref, o_ref, lse_ref = refs[8 + n :]
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH, q_pos_Q, q_seg_Q = q_ref[...], qpos_ref[...], qseg_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]

    def pair(kj: jax.Array, state: tuple) -> tuple:
        k_first, keys, k_seg_K, k_rank_K = plan.key_tile(kj, kseg_ref, krank_ref)

        def compute(state: tuple) -> tuple:
            max_Q, sum_Q, acc_QW = state
            allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            k_pos_K = kpos_ref[keys]
            rows = PairRows(static, q_pos_Q, k_pos_K, allowed_QK)
            k_values = [None if r is None else r[keys] for r in kv_refs]
            inputs = (params, q_values, k_values, q_pos_Q, k_pos_K)
            s_QK = _scores_QK(
                plan, static, q_QH, k_ref[keys, :], table_ref=table_ref, rows=rows, inputs=inputs
            )
            new_max_Q = jnp.maximum(max_Q, jnp.max(s_QK, axis=1))
            p_QK = jnp.where(allowed_QK, exp_gpu(s_QK - new_max_Q[:, None]), 0.0)
            rescale_Q = exp_gpu(max_Q - new_max_Q)
            v_KW = v_ref[keys, :]
            acc_QW = acc_QW * rescale_Q[:, None] + dot_f32(p_QK.astype(v_KW.dtype), v_KW, (1, 0))
            return new_max_Q, sum_Q * rescale_Q + jnp.sum(p_QK, axis=1), acc_QW

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return jax.lax.cond(live, compute, lambda s: s, state)

    first, end = plan.key_tiles(qi)
    zeros_Q = jnp.zeros((plan.size_q,), jnp.float32)
    init = (zeros_Q - 1e30, zeros_Q, jnp.zeros((plan.size_q, v_ref.shape[-1]), jnp.float32))
    max_Q, sum_Q, acc_QW = jax.lax.fori_loop(first, end, pair, init)
    seen_Q = sum_Q > 0
    safe_sum_Q = jnp.where(seen_Q, sum_Q, 1.0)
    o_ref[...] = (acc_QW / safe_sum_Q[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen_Q, max_Q + jnp.log(safe_sum_Q), 0.0)


def relative_dq_kernel(*refs, plan: Plan, static: RelativeStatic, has: tuple, n: int) -> None:
    """dq, the terms' per-query gradients, and this query tile's part of the table's
    gradient added to the batch row's (``de_ref``, aliased to zeros: the last input)."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + n]), has)
    table_ref, _, dq_ref, *dqv_refs, de_ref = refs[11 + n :]
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH, do_QW, lse_Q, delta_Q = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos_Q, q_seg_Q = qpos_ref[...], qseg_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]
    scale = 1.0 / math.sqrt(q_QH.shape[-1])

    def pair(kj: jax.Array, state: tuple) -> tuple:
        k_first, keys, k_seg_K, k_rank_K = plan.key_tile(kj, kseg_ref, krank_ref)

        def compute(state: tuple) -> tuple:
            dq_QH, dqv = state
            allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            k_KH, k_pos_K, v_KW = k_ref[keys, :], kpos_ref[keys], v_ref[keys, :]
            rows = PairRows(static, q_pos_Q, k_pos_K, allowed_QK)
            k_values = [None if r is None else r[keys] for r in kv_refs]
            inputs = (params, q_values, k_values, q_pos_Q, k_pos_K)
            s_QK = _scores_QK(
                plan, static, q_QH, k_KH, table_ref=table_ref, rows=rows, inputs=inputs
            )
            dp_QK = dot_f32(do_QW, v_KW, (1, 1))
            _, ds_QK = softmax_ds(s_QK, allowed_QK, lse_Q, dp_QK, delta_Q, exp=exp_gpu)
            dq_QH = dq_QH + dot_f32((ds_QK * scale).astype(k_KH.dtype), k_KH, (1, 0))
            dq_QH = dq_QH + relative_grads(
                static, q_QH, table_ref, rows, de_ref=de_ref, ds_QK=ds_QK
            )
            return dq_QH, pull_query_values(plan, ds_QK, inputs, dqv)

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return jax.lax.cond(live, compute, lambda s: s, state)

    first, end = plan.key_tiles(qi)
    init = (
        jnp.zeros(q_QH.shape, jnp.float32),
        [jnp.zeros((plan.size_q,), jnp.float32) for _ in dqv_refs],
    )
    dq_QH, dqv = jax.lax.fori_loop(first, end, pair, init)
    dq_ref[...] = dq_QH.astype(dq_ref.dtype)
    for ref, value in zip(dqv_refs, dqv, strict=True):
        ref[...] = value


def relative_dkdv_kernel(*refs, plan: Plan, static: RelativeStatic, has: tuple, n: int) -> None:
    """dk, dv and the terms' per-key gradients and parameters of one key tile."""
    lse_ref, delta_ref = refs[4:6]
    table_ref = refs[11 + n]

    def grads(tile: QueryTile, k_KH: jax.Array, v_KW: jax.Array) -> tuple:
        q_pos_Q, k_pos_K = tile.inputs[3:]
        rows = PairRows(static, q_pos_Q, k_pos_K, tile.allowed_QK)
        s_QK = _scores_QK(
            plan, static, tile.q_QH, k_KH, table_ref=table_ref, rows=rows, inputs=tile.inputs
        )
        dp_QK = dot_f32(tile.do_QW, v_KW, (1, 1))
        lse_Q, delta_Q = lse_ref[tile.rows], delta_ref[tile.rows]
        return softmax_ds(s_QK, tile.allowed_QK, lse_Q, dp_QK, delta_Q, exp=exp_gpu)

    key_tile_program(refs, plan=plan, has=has, num_term_refs=n, num_extra=1, grads=grads)
