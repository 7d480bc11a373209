"""Stick-breaking attention in the TPU kernels (Tan et al. 2024, arXiv 2410.17980).

The maths of :mod:`copejax.ops.kernels.stick` (its ``stick_weights_QK`` and ``stick_dz_QK``
on (Q, 1) carries) on the grid of :mod:`copejax.ops.kernels.tpu_forward`: the forward and
dq kernels walk the key tiles newest first (:func:`~copejax.ops.kernels.tpu_params.key_step`)
with the log stick remainder ``r`` (and in dq the ``G`` total ``u``) in VMEM scratch. The
dk / dv kernel (the softmax's, :mod:`copejax.ops.kernels.tpu_backward`, with
:func:`stick_pair` for its pair) walks the key tiles newest first too, each over its query
tiles, and keeps r and u for every query of the head in VMEM, (count_q, Q) each
(:func:`~copejax.ops.kernels.tpu_rows.load_row_at`): a pair reads its query tile's carries
entering the key tile and adds its row sums for the older tiles. Nothing per (key tile,
query) goes to HBM (it did: (B, N, count_k, T) twice, 16 GiB at (B, N, H) = (2, 4, 64),
T = 16384, in TPU's padded layout), and the key axis of that grid is sequential
("arbitrary"): the head's carries cross it. VMEM: 8 bytes per query of the head, 16 with
query tiles under the 128 lanes (256 KiB at T = 16384, Q = 64). Shape letters as in
:mod:`copejax.ops.kernels.tpu_forward`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.stick import as_mixed, stick_dz_QK, stick_weights_QK
from copejax.ops.kernels.terms import tile_bias_QK
from copejax.ops.kernels.tiles import Plan, scores_QK
from copejax.ops.kernels.tpu_params import NT, key_step, read_terms, step_live
from copejax.ops.kernels.tpu_rows import load_row, store_row

F32 = jnp.float32


def stick_forward_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """One grid step of the forward (refs as ``tpu_forward._forward_kernel``'s, scratch: r
    (Q, 1) and the output accumulator); the second output is -r, unused."""
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[8 : 8 + num_term_refs]), has)
    o_ref, stat_ref, r_acc, o_acc = refs[8 + num_term_refs :]
    qi, step = pl.program_id(2), pl.program_id(3)
    kj = key_step(plan, step, newest_first=True)

    @pl.when(step == 0)
    def _init() -> None:
        r_acc[...] = jnp.zeros(r_acc.shape, F32)
        o_acc[...] = jnp.zeros(o_acc.shape, F32)

    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    @pl.when(live)
    def _compute() -> None:
        allowed_QK = plan.allowed_QK(*mask_args)
        terms = read_terms(p_refs, qv_refs, kv_refs)
        inputs = (*terms, qpos_ref[...], kpos_ref[...])
        z_QK = scores_QK(plan, q_ref[...], k_ref[...], allowed_QK, inputs)
        a_QK, softplus_QK, _ = stick_weights_QK(z_QK, allowed_QK, r_acc[...])
        v_KW = v_ref[...]
        o_acc[...] += jax.lax.dot(a_QK.astype(v_KW.dtype), v_KW, preferred_element_type=F32)
        r_acc[...] += jnp.sum(softplus_QK, axis=1, keepdims=True)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish() -> None:
        o_ref[...] = o_acc[...].astype(o_ref.dtype)
        store_row(stat_ref, -r_acc[...])


def stick_dq_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """dq and the terms' per-query gradients (outputs: dq, per-query gradients; scratch: dq,
    per-query gradients, r, u)."""
    q_ref, k_ref, v_ref, do_ref, _, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    outs = refs[11 + num_term_refs :]
    num_q = sum(h[1] for h in has)
    dq_ref, dqv_refs = outs[0], outs[1 : 1 + num_q]
    dq_acc, *dqv_accs, r_acc, u_acc = outs[1 + num_q :]
    qi, step = pl.program_id(2), pl.program_id(3)
    kj = key_step(plan, step, newest_first=True)

    @pl.when(step == 0)
    def _init() -> None:
        for acc in (dq_acc, *dqv_accs, r_acc, u_acc):
            acc[...] = jnp.zeros(acc.shape, F32)

    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    @pl.when(live)
    def _compute() -> None:
        params, q_values, k_values = read_terms(p_refs, qv_refs, kv_refs)
        allowed_QK = plan.allowed_QK(*mask_args)
        q_pos, k_pos = qpos_ref[...], kpos_ref[...]
        k_KH, v_KW = k_ref[...], v_ref[...]
        z_QK = scores_QK(
            plan, q_ref[...], k_KH, allowed_QK, (params, q_values, k_values, q_pos, k_pos)
        )
        a_QK, softplus_QK, e_QK = stick_weights_QK(z_QK, allowed_QK, r_acc[...])
        dov_QK = jax.lax.dot_general(do_ref[...], v_KW, NT, preferred_element_type=F32)
        g_QK = as_mixed(a_QK, v_KW.dtype) * dov_QK
        dz_QK = stick_dz_QK(
            z_QK, allowed_QK, e_QK=e_QK, g_QK=g_QK, delta_Q=load_row(delta_ref), u_Q=u_acc[...]
        )
        scale = 1.0 / math.sqrt(k_KH.shape[-1])
        dq_acc[...] += jax.lax.dot(
            (dz_QK * scale).astype(k_KH.dtype), k_KH, preferred_element_type=F32
        )
        if dqv_accs:

            def bias(qv: list) -> jax.Array:
                return tile_bias_QK(plan.biases, (params, qv, k_values), q_pos, k_pos)

            grads = jax.vjp(bias, q_values)[1](dz_QK)[0]
            for acc, g in zip(dqv_accs, [g for g in grads if g is not None], strict=True):
                acc[...] += g
        r_acc[...] += jnp.sum(softplus_QK, axis=1, keepdims=True)
        u_acc[...] += jnp.sum(g_QK, axis=1, keepdims=True)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish() -> None:
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
        for ref, acc in zip(dqv_refs, dqv_accs, strict=True):
            store_row(ref, acc[...])


def stick_pair(plan: Plan, refs: tuple, mask_args: tuple, terms: tuple, carries: tuple) -> tuple:
    """(A, dz, term inputs, the carries' increments) of one dk / dv step's pair: float32
    (Q, K) tiles from the (Q, 1) carries r, u entering this key tile, and the pair's row sums
    of softplus and G that the next (older) key tile's carries add; ``refs`` as
    ``tpu_backward._pair`` reads them."""
    q_ref, k_ref, v_ref, do_ref, _, delta_ref, qpos_ref, kpos_ref = refs
    r_Q1, u_Q1 = carries
    allowed_QK = plan.allowed_QK(*mask_args)
    inputs = (*terms, qpos_ref[...], kpos_ref[...])
    z_QK = scores_QK(plan, q_ref[...], k_ref[...], allowed_QK, inputs)
    a_QK, softplus_QK, e_QK = stick_weights_QK(z_QK, allowed_QK, r_Q1)
    v_KW = v_ref[...]
    dov_QK = jax.lax.dot_general(do_ref[...], v_KW, NT, preferred_element_type=F32)
    g_QK = as_mixed(a_QK, v_KW.dtype) * dov_QK
    dz_QK = stick_dz_QK(
        z_QK, allowed_QK, e_QK=e_QK, g_QK=g_QK, delta_Q=load_row(delta_ref), u_Q=u_Q1
    )
    increments = (jnp.sum(softplus_QK, axis=1, keepdims=True), jnp.sum(g_QK, axis=1, keepdims=True))
    return a_QK, dz_QK, inputs, increments
