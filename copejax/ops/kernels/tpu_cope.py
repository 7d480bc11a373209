"""CoPE's carried count in the TPU kernels (Golovneva et al. 2024, arXiv 2405.18719).

The maths of :mod:`copejax.ops.kernels.cope` (one function
:func:`~copejax.ops.kernels.cope.pair_scores` of (content logits, q, e, carry) per pair,
differentiated with ``jax.vjp``) and the GPU backward's bookkeeping
(:mod:`copejax.ops.kernels.cope_backward`: the count ``c`` carried newest first, the older
tiles' pull on a tile's gate total ``X = D - S - d_c``) on the grid of
:mod:`copejax.ops.kernels.tpu_forward`, keeping O(T) floats per head, not one carry per key
tile:

- the forward (:func:`copejax.ops.kernels.tpu_forward` with ``plan.cope``) walks the key
  tiles newest first with the count in VMEM scratch and writes none;
- the dq kernel here walks them newest first too, with c, the running total S of the tiles'
  pulls on their counts ``d_c`` and SM, the running sum of the gates' pull on dq
  (:func:`~copejax.ops.kernels.cope_backward.gate_pull_QH`) in scratch, and writes each
  row's total ``D``, and sums the position term's parameters' gradients over the head's
  query tiles, walked in order (the query axis "arbitrary"), into one (P, H) per head. The
  queries' table ``z = q e^T`` (:func:`~copejax.ops.kernels.cope.cope_table`) is taken at a
  query tile's first step into VMEM, with the sum of its cotangent over the walk beside it,
  pulled back to dq and the parameters at the last step
  (:func:`~copejax.ops.kernels.rows_matmul.rows_pullback`);
- the dk / dv kernel (:mod:`copejax.ops.kernels.tpu_backward`, with :func:`cope_pair`) walks
  the key tiles newest first (both tile axes "arbitrary"), with c and S for every query of the
  head in VMEM, (count_q, Q) each, as stick-breaking's carries
  (:mod:`copejax.ops.kernels.tpu_stick`): each pair adds its gate total and ``d_c`` to its
  queries' rows in the order the dq kernel did, and sums the gate keys' gradient (sep-keys,
  val-gates) per key tile like dk.

VMEM: two (Q, P) float32 tables per query tile, and 8 bytes per query of the head (256 KiB
at T = 16384 with query tiles of 64: the 16 MiB of v4 / v5e hold about T = 800K). Shape
letters as in :mod:`copejax.ops.kernels.tpu_forward`; P the table rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.cope import (
    cope_positions_QK,
    cope_refs,
    cope_term_QK,
    pair_scores,
)
from copejax.ops.kernels.cope_backward import capped_weight, gate_pull_QH
from copejax.ops.kernels.cope_terms import split_params, term_table_QR
from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.rows_matmul import rows_pullback
from copejax.ops.kernels.terms import tile_bias_QK
from copejax.ops.kernels.tiles import MASKED_LOGIT, Plan, content_logits_QK, softmax_ds
from copejax.ops.kernels.tpu_params import NT, key_step, read_refs, read_terms, step_live
from copejax.ops.kernels.tpu_rows import load_row, store_row

F32 = jnp.float32


def cope_dq_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """dq, the terms' per-query gradients and each row's ``D`` of one query tile, key tiles
    newest first, and the position term's parameters' gradients summed over the head's query
    tiles, which the grid walks in order. Inputs: ``tpu_backward``'s, the parameters and the
    gate keys if any; outputs: dq, per-query gradients, D, d parameters (one per head);
    scratch: their accumulators with c, S and SM."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    cope_p_refs, gk_ref, outs = cope_refs(list(refs[11 + num_term_refs :]), plan.cope)
    num_q, count = sum(h[1] for h in has), plan.cope.num_params
    kind = plan.cope.position_term
    rows_ref, others = split_params(kind, tuple(cope_p_refs))
    tables = 0 if rows_ref is None else 2  # the queries' table and its cotangent's sum
    dq_ref, dqv_refs, total_out = outs[0], outs[1 : 1 + num_q], outs[1 + num_q]
    dp_outs = outs[2 + num_q : 2 + num_q + count]
    outs, table_refs = outs[: len(outs) - tables], outs[len(outs) - tables :]
    dq_acc, *dqv_accs, c_acc, s_acc, sm_acc = outs[2 + num_q + count : len(outs) - count]
    dp_accs = outs[len(outs) - count :]
    rows_acc, others_accs = split_params(kind, tuple(dp_accs))
    qi, step = pl.program_id(2), pl.program_id(3)
    kj = key_step(plan, step, newest_first=True)

    @pl.when(step == 0)
    def _init() -> None:
        for acc in (dq_acc, *dqv_accs, c_acc, s_acc, sm_acc, *table_refs[1:]):
            acc[...] = jnp.zeros(acc.shape, F32)
        if table_refs:  # the term reads q only through it: once per query tile
            table_refs[0][...] = term_table_QR(q_ref[...], rows_ref[...])

    @pl.when((qi == 0) & (step == 0))  # the parameters' sums run over the head's query tiles
    def _init_params() -> None:
        for acc in dp_accs:
            acc[...] = jnp.zeros(acc.shape, F32)

    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    @pl.when(live)
    def _compute() -> None:
        params, q_values, k_values = read_terms(p_refs, qv_refs, kv_refs)
        allowed_QK = plan.allowed_QK(*mask_args)
        q_pos, k_pos = qpos_ref[...], kpos_ref[...]
        q_QH, k_KH, v_KW = q_ref[...], k_ref[...], v_ref[...]
        gk_KH = None if gk_ref is None else gk_ref[...]

        def scores(logits_QK, q_QH, term, c_Q1, qv):
            inputs = (params, qv, k_values, q_pos, k_pos)
            return pair_scores(
                plan,
                logits_QK,
                q_QH,
                term,
                c_Q=c_Q1,
                allowed_QK=allowed_QK,
                inputs=inputs,
                gk_KH=gk_KH,
                backward=True,
            )

        logits_QK = content_logits_QK(q_QH, k_KH)
        term = (table_refs[0][...] if table_refs else None, read_refs(others))
        primals = (logits_QK, q_QH, term, c_acc[...], q_values)
        (s_QK, total_Q1), pull = jax.vjp(scores, *primals)
        dp_QK = jax.lax.dot_general(do_ref[...], v_KW, NT, preferred_element_type=F32)
        _, ds_QK = softmax_ds(s_QK, allowed_QK, load_row(lse_ref), dp_QK, load_row(delta_ref))
        # the gate total's cotangent X enters by SM (cope_backward's docstring)
        d_logits, d_q, (d_table, d_others), d_c, d_qv = pull((ds_QK, jnp.zeros_like(total_Q1)))
        scale = 1.0 / math.sqrt(q_QH.shape[-1])
        d_logits = (d_logits * scale).astype(k_KH.dtype)
        d_q = d_q.astype(F32) + jax.lax.dot(d_logits, k_KH, preferred_element_type=F32)
        dq_acc[...] += d_q + d_c * sm_acc[...]
        if not plan.cope.unit_gates:
            sm_acc[...] += gate_pull_QH(logits_QK, q_QH, k_KH, gk_KH, allowed_QK)
        if table_refs:
            table_refs[1][...] += d_table
        for acc, g in zip(others_accs, d_others, strict=True):
            acc[...] += g
        for acc, g in zip(dqv_accs, [g for g in d_qv if g is not None], strict=True):
            acc[...] += g
        c_acc[...] += total_Q1
        s_acc[...] += d_c

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish() -> None:
        if table_refs:  # the table's cotangent, summed over the walk, pulled back once
            d_q, d_rows = rows_pullback(q_ref[...], rows_ref[...], table_refs[1][...])
            dq_acc[...] += d_q
            rows_acc[...] += d_rows
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
        for ref, acc in zip(dqv_refs, dqv_accs, strict=True):
            store_row(ref, acc[...])
        store_row(total_out, s_acc[...])

    @pl.when((qi == pl.num_programs(2) - 1) & (step == pl.num_programs(3) - 1))
    def _finish_params() -> None:
        for ref, acc in zip(dp_outs, dp_accs, strict=True):
            ref[...] = acc[...]


def cope_pair(
    plan: Plan, refs: tuple, mask_args: tuple, terms: tuple, extra: tuple, *, entering: tuple
) -> tuple:
    """(P, the content logits' cotangent dS, (the terms' parameter and per-key gradients),
    the gate keys' gradient (K, H) or None, (the gate total, d_c) to add to the queries'
    rows) of one dk / dv step's pair; ``refs`` as ``tpu_dq.softmax_pair`` reads them,
    ``extra`` the position term's parameters, the gate keys if any and the rows' D,
    ``entering`` the (Q, 1) count and S entering the key tile."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref = refs
    cope_p_refs, gk_ref, (total_ref,) = cope_refs(list(extra), plan.cope)
    params, q_values, k_values = terms
    static, (c_Q1, s_Q1) = plan.cope, entering
    allowed_QK = plan.allowed_QK(*mask_args)
    q_QH, q_pos, k_pos = q_ref[...], qpos_ref[...], kpos_ref[...]
    cope_params = read_refs(cope_p_refs)

    def positions(logits_QK, gk_KH):
        p_QK, total_Q1, uncapped_QK = cope_positions_QK(
            static,
            logits_QK,
            q_QH,
            c_Q=c_Q1,
            allowed_QK=allowed_QK,
            gk_KH=gk_KH,
            backward=not static.unit_gates,
        )
        return (p_QK, total_Q1), uncapped_QK

    def scores(logits_QK, p_QK, p, kv):
        # with unit gates p is no input: a custom vjp none of whose inputs is
        # differentiated lowers nowhere
        term_QK = cope_term_QK(static, q_QH, cope_params, p_QK, backward=not static.unit_gates)
        s_QK = logits_QK + term_QK
        if plan.biases:
            s_QK = s_QK + tile_bias_QK(plan.biases, (p, q_values, kv), q_pos, k_pos)
        return jnp.where(allowed_QK, s_QK, MASKED_LOGIT)

    logits_QK = content_logits_QK(q_QH, k_ref[...])
    gk_KH = None if gk_ref is None else gk_ref[...]
    (p_QK, total_Q1), pull_positions, uncapped_QK = jax.vjp(
        positions, logits_QK, gk_KH, has_aux=True
    )
    dp_QK = jax.lax.dot_general(do_ref[...], v_ref[...], NT, preferred_element_type=F32)
    lse_Q1, delta_Q1 = load_row(lse_ref), load_row(delta_ref)
    if static.unit_gates:  # constant positions: no d_c, no gates to pull back
        s_QK, pull = jax.vjp(lambda lg, p, kv: scores(lg, p_QK, p, kv), logits_QK, params, k_values)
        probs_QK, ds_QK = softmax_ds(s_QK, allowed_QK, lse_Q1, dp_QK, delta_Q1)
        d_logits, d_p, d_kv = pull(ds_QK)
        return probs_QK, d_logits, (d_p, d_kv), None, (total_Q1, jnp.zeros_like(total_Q1))
    s_QK, pull = jax.vjp(scores, logits_QK, p_QK, params, k_values)
    probs_QK, ds_QK = softmax_ds(s_QK, allowed_QK, lse_Q1, dp_QK, delta_Q1)
    d_logits, d_pos_QK, d_p, d_kv = pull(ds_QK)
    weight_QK = capped_weight(uncapped_QK, static.p_max - 1.0)
    d_c_Q1 = jnp.sum(d_pos_QK * weight_QK, axis=1, keepdims=True)
    x_Q1 = load_row(total_ref) - s_Q1 - d_c_Q1  # X: the older tiles' d_c
    d_logits_gates, d_gk = pull_positions((d_pos_QK, x_Q1))
    return probs_QK, d_logits + d_logits_gates, (d_p, d_kv), d_gk, (total_Q1, d_c_Q1)
