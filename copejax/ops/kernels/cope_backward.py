"""CoPE's backward kernels on a GPU (arXiv 2405.18719), with carry groups (issue 45).

The count ``c`` of a key tile sums the gates of the newer tiles; a tile's own pull on its
entering count, ``d_c(t) = sum_j dL/dp_ij`` (the positions' cotangent where uncapped), flows
into the gates of every older tile: the gate total of tile t gets the cotangent
``X(t) = sum_{m < t} d_c(m)``. Counts are carried newest first, X oldest first, and keeping
either per key tile costs O(T^2 / K) floats per head. Neither kernel does:

- The dq kernel walks newest first, carrying c exactly as the forward does (which keeps none).
  X(t) reaches dq only through the gates, as ``X(t) M(t)`` with ``M(t) = sum_j g'_ij d(gate
  logit_ij)/dq_i`` (:func:`gate_pull_QH`), and ``sum_t X(t) M(t) = sum_m d_c(m) SM(m)``,
  ``SM(m)`` the sum of M over the tiles newer than m: a (Q, H) running sum beside dq. It
  writes the count and the total of ``d_c`` over the newer tiles (``S``) as it enters each
  carry group, and each row's total ``D = sum_t d_c(t)``.
- The dk / dv kernel's programs own a carry group (:mod:`copejax.ops.kernels.carry_groups`) and
  walk its key tiles newest first from the count and S at the group's entry, adding each
  pair's gate total and ``d_c`` to them in place (aliased outputs). A pair's score function
  is cut in two so that ``d_c`` is known before the gates are pulled back: the positions'
  stage (:func:`~copejax.ops.kernels.cope.cope_positions_QK`) and the term's
  (:func:`~copejax.ops.kernels.cope.cope_term_QK`); then ``X = D - S - d_c``.

The position term's parameters are the dq kernel's: the term reads q only through the
queries' table (``z = q e^T``, :func:`~copejax.ops.kernels.cope.cope_table`), which the dq
kernel computes once before its walk; it sums the table's cotangent over the walk and
pulls that back to dq and the parameters once, adding the parameters' gradients to a
float32 (R, C) array per batch row and head with atomic adds (their order, and so the last
bits of the sums, vary from run to run). Per pair that leaves the dq kernel four matmuls and
the dk / dv kernel seven, with no (P, H) sum across its walk.

O(groups x T) floats per head. Shape letters as in :mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from copejax.ops.kernels.cope import (
    cope_positions_QK,
    cope_refs,
    cope_term_QK,
    pair_scores,
)
from copejax.ops.kernels.cope_terms import (
    gate_logits_QK,
    join_params,
    split_params,
    term_table_QR,
)
from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.pullbacks import (
    add_present,
    key_tile_sums,
    terms_vjp,
    write_key_tile_sums,
)
from copejax.ops.kernels.rows_matmul import rows_pullback
from copejax.ops.kernels.tiles import (
    MASKED_LOGIT,
    Plan,
    content_logits_QK,
    dot_f32,
    exp_gpu,
    sigmoid_gpu,
    softmax_ds,
)
from copejax.ops.kernels.triton_params import gpu_scan, program_barrier


def gate_pull_QH(
    logits_QK: jax.Array,
    q_QH: jax.Array,
    k_KH: jax.Array,
    gk_KH: jax.Array | None,
    allowed_QK: jax.Array,
    *,
    sigmoid: Callable[[jax.Array], jax.Array] = jax.nn.sigmoid,
) -> jax.Array:
    """M: what a unit cotangent of each query's gate total gives its dq, float32 (Q, H):
    ``sum_j g_ij (1 - g_ij)`` times the gate logit's gradient in q (``k_j / sqrt(H)``, or the
    gate keys'), rounded as the dq kernel rounds the logits' cotangent; ``sigmoid``: the
    gates' (the GPU kernels: :func:`~copejax.ops.kernels.tiles.sigmoid_gpu`)."""
    if gk_KH is None:
        g_QK = jnp.where(allowed_QK, sigmoid(logits_QK), 0.0)
        scale = 1.0 / math.sqrt(q_QH.shape[-1])
        return dot_f32((g_QK * (1.0 - g_QK) * scale).astype(k_KH.dtype), k_KH, (1, 0))
    gate_logits_QK_, pull = jax.vjp(lambda q: gate_logits_QK(q, gk_KH), q_QH)
    g_QK = jnp.where(allowed_QK, sigmoid(gate_logits_QK_), 0.0)
    return pull(g_QK * (1.0 - g_QK))[0].astype(jnp.float32)


def cope_dq_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """dq and the terms' per-query gradients of one query tile, key tiles newest first;
    writes the count and ``S`` entering each carry group and the rows' ``D`` (module
    docstring), and adds the position term's parameters' gradients to the (b, n) row of
    float32 outputs with atomic adds: the cotangent of the queries' table, summed over the
    walk, is pulled back to q and the rows once
    (:func:`~copejax.ops.kernels.rows_matmul.rows_pullback`)."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    static = plan.cope
    cope_p_refs, gk_ref, rest = cope_refs(list(refs[11 + num_term_refs :]), static)
    count = static.num_params
    dq_ref, *outs = rest[count:]  # past the zeros aliased to the parameters' gradients
    dqv_refs, (c_out_ref, s_out_ref, total_ref) = outs[: -3 - count], outs[-3 - count : -count]
    dcope_refs = outs[-count:]
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH, do_QW, lse_Q, delta_Q = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos_Q, q_seg_Q = qpos_ref[...], qseg_ref[...]
    kind, dim = static.position_term, q_QH.shape[-1]
    rows_RH, others = split_params(kind, tuple(r[...] for r in cope_p_refs))
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]
    scale = 1.0 / math.sqrt(dim)
    first, end = plan.key_tiles(qi)
    table_QR = term_table_QR(q_QH, rows_RH)  # the queries': the same for every pair

    def pair(step: jax.Array, state: tuple) -> tuple:
        kj = end - 1 - step
        k_first, keys, k_seg_K, k_rank_K = plan.key_tile(kj, kseg_ref, krank_ref)

        def compute(state: tuple) -> tuple:
            dq_QH, dqv, c_Q, s_Q, sm_QH, table_sums, last = state
            row, group = plan.entry_row(kj, last)  # c and S entering the group
            c_out_ref[row, :] = c_Q[None, :]
            s_out_ref[row, :] = s_Q[None, :]
            allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            k_KH, k_pos_K, v_KW = k_ref[keys, :], kpos_ref[keys], v_ref[keys, :]
            k_values = [None if r is None else r[keys] for r in kv_refs]
            gk_KH = None if gk_ref is None else gk_ref[keys, :]

            def scores(logits_QK, q_QH, c_Q, qv, term):
                inputs = (params, qv, k_values, q_pos_Q, k_pos_K)
                return pair_scores(
                    plan,
                    logits_QK,
                    q_QH,
                    term,
                    c_Q=c_Q,
                    allowed_QK=allowed_QK,
                    inputs=inputs,
                    gk_KH=gk_KH,
                    backward=True,
                )

            logits_QK = content_logits_QK(q_QH, k_KH)
            primals = (logits_QK, q_QH, c_Q, q_values, (table_QR, others))
            (s_QK, total_Q), pull = jax.vjp(scores, *primals)
            dp_QK = dot_f32(do_QW, v_KW, (1, 1))
            _, ds_QK = softmax_ds(s_QK, allowed_QK, lse_Q, dp_QK, delta_Q, exp=exp_gpu)
            # the gate total's cotangent X enters below, by SM (module docstring)
            d_logits, d_q, d_c, d_qv, d_term = pull((ds_QK, jnp.zeros_like(total_Q)))
            d_logits = (d_logits * scale).astype(k_KH.dtype)
            d_q = d_q.astype(jnp.float32) + dot_f32(d_logits, k_KH, (1, 0))
            d_q = d_q + d_c[:, None] * sm_QH
            if not static.unit_gates:
                sm_QH = sm_QH + gate_pull_QH(
                    logits_QK, q_QH, k_KH, gk_KH, allowed_QK, sigmoid=sigmoid_gpu
                )
            dqv = add_present(dqv, d_qv)
            table_sums = jax.tree.map(jnp.add, table_sums, d_term)
            return dq_QH + d_q, dqv, c_Q + total_Q, s_Q + d_c, sm_QH, table_sums, group

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return jax.lax.cond(live, compute, lambda s: s, state)

    zeros_Q = jnp.zeros((plan.size_q,), jnp.float32)
    zeros_QH = jnp.zeros(q_QH.shape, jnp.float32)
    # the cotangents of the table and of the other parameters, summed over the walk
    table_sums = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (table_QR, others))
    init = (zeros_QH, [zeros_Q for _ in dqv_refs], zeros_Q, zeros_Q, zeros_QH, table_sums)
    dq_QH, dqv, _, s_Q, _, (d_table_QR, d_others), _ = jax.lax.fori_loop(
        0, end - first, pair, (*init, jnp.int32(-1))
    )
    d_rows_RH = None
    if d_table_QR is not None:
        d_q_QH, d_rows_RH = rows_pullback(q_QH, rows_RH, d_table_QR)
        dq_QH = dq_QH + d_q_QH
    dq_ref[...] = dq_QH.astype(dq_ref.dtype)
    total_ref[...] = s_Q
    for ref, value in zip(dqv_refs, dqv, strict=True):
        ref[...] = value
    grads = join_params(kind, d_rows_RH, d_others)
    for ref, value in zip(dcope_refs, grads, strict=True):
        pltriton.atomic_add(ref, (slice(None), slice(None)), value)


def capped_weight(uncapped_QK: jax.Array, cap: float) -> jax.Array:
    """d p / d c of ``p = min(uncapped, cap)``: 1 below the cap, 0 above, 1/2 at it (as
    ``jnp.minimum``'s derivative, which the dq kernel's ``d_c`` takes)."""
    return jnp.where(uncapped_QK < cap, 1.0, jnp.where(uncapped_QK == cap, 0.5, 0.0))


def cope_dkdv_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """dk, dv, the gate keys' gradient, the terms' per-key gradients and parameters of one
    carry group's key tiles, newest first (module docstring; the position term's
    parameters' gradients are the dq kernel's): whole-row refs, the counts and S entering
    the group as inputs aliased to the last two outputs, D an input."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    cope_p_refs, gk_ref, rest = cope_refs(list(refs[11 + num_term_refs :]), plan.cope)
    _, _, total_ref, dk_ref, dv_ref, *grad_refs = rest
    c_ref, s_ref = grad_refs[-2:]  # read and written in place
    grad_refs = grad_refs[:-2]
    dgk_ref = grad_refs.pop() if gk_ref is not None else None
    num_dkv = sum(h[2] for h in has)
    dkv_refs, dp_refs = grad_refs[:num_dkv], grad_refs[num_dkv:]
    cope_params = tuple(r[...] for r in cope_p_refs)
    params = [None if r is None else r[...] for r in p_refs]
    static = plan.cope
    scale = 1.0 / math.sqrt(k_ref.shape[-1])
    scan = gpu_scan()

    def key_tile(step: jax.Array, first: jax.Array, end: jax.Array) -> None:
        program_barrier(plan.interpret)  # the previous key tile's carry stores, visible
        kj = end - 1 - step
        k_first, keys, k_seg_K, k_rank_K = plan.key_tile(kj, kseg_ref, krank_ref)
        k_KH, v_KW = k_ref[keys, :], v_ref[keys, :]
        gk_KH = None if gk_ref is None else gk_ref[keys, :]
        k_pos_K = kpos_ref[keys]
        k_values = [None if r is None else r[keys] for r in kv_refs]

        def pair(qi: jax.Array, state: tuple) -> tuple:
            q_first = qi * plan.size_q
            queries = pl.ds(pl.multiple_of(q_first, plan.size_q), plan.size_q)
            q_seg_Q = qseg_ref[queries]

            def compute(state: tuple) -> tuple:
                (dk_KH, dv_KW, dkv, dparams), dgk_KH = state
                allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
                q_QH, do_QW, q_pos_Q = q_ref[queries, :], do_ref[queries, :], qpos_ref[queries]
                q_values = [None if r is None else r[queries] for r in qv_refs]
                c_Q = c_ref[queries]
                unit = static.unit_gates

                def positions(logits_QK, gk_KH):
                    p_QK, total_Q, uncapped_QK = cope_positions_QK(
                        static,
                        logits_QK,
                        q_QH,
                        c_Q=c_Q,
                        allowed_QK=allowed_QK,
                        gk_KH=gk_KH,
                        backward=not unit,
                        scan=scan,
                        sigmoid=sigmoid_gpu,
                    )
                    return (p_QK, total_Q), uncapped_QK

                # the other terms' bias, pulled back apart (terms_vjp: by hand where a term
                # brings its pull-back)
                bias_QK, pull_terms = (
                    terms_vjp(plan.biases, (params, q_values, k_values), q_pos_Q, k_pos_K)
                    if plan.biases
                    else (None, None)
                )

                def scores(logits_QK, p_QK, b_QK):
                    # with unit gates p is no input: a custom vjp none of whose inputs is
                    # differentiated lowers nowhere
                    term_QK = cope_term_QK(static, q_QH, cope_params, p_QK, backward=not unit)
                    s_QK = logits_QK + term_QK
                    if b_QK is not None:
                        s_QK = s_QK + b_QK
                    return jnp.where(allowed_QK, s_QK, MASKED_LOGIT)

                logits_QK = content_logits_QK(q_QH, k_KH)
                (p_QK, total_Q), pull_positions, uncapped_QK = jax.vjp(
                    positions, logits_QK, gk_KH, has_aux=True
                )
                lse_Q, delta_Q = lse_ref[queries], delta_ref[queries]
                dp_QK = dot_f32(do_QW, v_KW, (1, 1))
                d_gk = None
                if unit:  # constant positions: no d_c, no gates to pull back
                    s_QK, pull_scores = jax.vjp(
                        lambda lg, b: scores(lg, p_QK, b), logits_QK, bias_QK
                    )
                    probs_QK, ds_QK = softmax_ds(
                        s_QK, allowed_QK, lse_Q, dp_QK, delta_Q, exp=exp_gpu
                    )
                    d_logits, d_bias_QK = pull_scores(ds_QK)
                else:
                    s_QK, pull_scores = jax.vjp(scores, logits_QK, p_QK, bias_QK)
                    probs_QK, ds_QK = softmax_ds(
                        s_QK, allowed_QK, lse_Q, dp_QK, delta_Q, exp=exp_gpu
                    )
                    d_logits, d_pos_QK, d_bias_QK = pull_scores(ds_QK)
                    cap = static.p_max - 1.0
                    d_c_Q = jnp.sum(d_pos_QK * capped_weight(uncapped_QK, cap), axis=1)
                    s_Q = s_ref[queries]
                    x_Q = total_ref[queries] - s_Q - d_c_Q  # X: the older tiles' d_c
                    d_logits_gates, d_gk = pull_positions((d_pos_QK, x_Q))
                    d_logits = d_logits + d_logits_gates
                    s_ref[queries] = s_Q + d_c_Q
                c_ref[queries] = c_Q + total_Q
                d_logits = (d_logits * scale).astype(q_QH.dtype)
                dk_KH = dk_KH + dot_f32(d_logits, q_QH, (0, 0))
                dv_KW = dv_KW + dot_f32(probs_QK.astype(do_QW.dtype), do_QW, (0, 0))
                if pull_terms is not None:
                    d_p, _, d_kv = pull_terms(d_bias_QK)
                    dkv, dparams = add_present(dkv, d_kv), add_present(dparams, d_p)
                if d_gk is not None:
                    dgk_KH = dgk_KH + d_gk
                return (dk_KH, dv_KW, dkv, dparams), dgk_KH

            live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            return jax.lax.cond(live, compute, lambda s: s, state)

        sum_refs = (dkv_refs, [r.at[0] for r in dp_refs])
        dgk_KH = None if gk_KH is None else jnp.zeros(gk_KH.shape, jnp.float32)
        init = (key_tile_sums(plan, k_KH, v_KW, sum_refs), dgk_KH)
        q_first_tile, q_end_tile = plan.query_tiles(kj)
        sums, dgk_KH = jax.lax.fori_loop(q_first_tile, q_end_tile, pair, init)
        write_key_tile_sums(sums, dk_ref, dv_ref, (dkv_refs, dp_refs), (keys, pl.ds(kj, 1)))
        if dgk_ref is not None:
            dgk_ref[keys, :] = dgk_KH.astype(dgk_ref.dtype)

    first, end = plan.group_tiles(pl.program_id(2))

    def walk(step: jax.Array, carry: tuple) -> tuple:
        key_tile(step, first, end)
        return carry

    jax.lax.fori_loop(0, end - first, walk, ())
