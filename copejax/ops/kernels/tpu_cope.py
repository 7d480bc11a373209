"""CoPE's carried count in the TPU kernels (Golovneva et al. 2024, arXiv 2405.18719).

The maths of :mod:`copejax.ops.kernels.cope` (one function
:func:`~copejax.ops.kernels.cope.pair_scores` of (content logits, q, e, carry) per pair,
differentiated with ``jax.vjp``) on the grid of :mod:`copejax.ops.kernels.tpu_forward`. The
forward (:func:`copejax.ops.kernels.tpu_forward` with ``plan.cope``) walks the key tiles
newest first and writes the count entering each key tile, (B, N, count_k, count_q, 1, Q)
(:mod:`copejax.ops.kernels.tpu_rows`). The dq
kernel here walks them oldest first with the carry's cotangent in VMEM scratch, writes it as
it leaves each key tile, and sums the position term's parameters' gradients per query tile;
the dk / dv kernel (:mod:`copejax.ops.kernels.tpu_backward`, with :func:`cope_pair`) reads
the count and its cotangent for its query tiles and sums the gate keys' gradient (sep-keys,
val-gates) per key tile like dk. Shape letters as in :mod:`copejax.ops.kernels.tpu_forward`;
P the table rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.cope import cope_refs, pair_scores
from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.tiles import Plan, content_logits_QK
from copejax.ops.kernels.tpu_params import NT, read_refs, read_terms, step_live
from copejax.ops.kernels.tpu_rows import load_row, store_row

F32 = jnp.float32


def _softmax_ds(s_QK, allowed_QK, lse_Q1, dp_QK, delta_Q1) -> tuple[jax.Array, jax.Array]:
    p_QK = jnp.where(allowed_QK, jnp.exp(s_QK - lse_Q1), 0.0)
    return p_QK, p_QK * (dp_QK - delta_Q1)


def cope_dq_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """dq, the terms' per-query gradients, the carry's cotangent leaving each key tile and
    the position term's parameters' partial gradients (inputs: ``tpu_backward``'s, the
    parameters, the gate keys if any and the counts; outputs: dq, per-query gradients,
    d carry, d parameters; scratch: the same but d carry's (Q, 1) running sum in place of
    its per-tile output)."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    cope_p_refs, gk_ref, (c_in, *outs) = cope_refs(list(refs[11 + num_term_refs :]), plan.cope)
    num_q, count = sum(h[1] for h in has), plan.cope.num_params
    dq_ref, dqv_refs, dc_out = outs[0], outs[1 : 1 + num_q], outs[1 + num_q]
    dp_outs = outs[2 + num_q : 2 + num_q + count]
    dq_acc, *dqv_accs, dc_acc = outs[2 + num_q + count : -count]
    dp_accs = outs[-count:]
    qi, kj = pl.program_id(2), pl.program_id(3)  # key tiles oldest first

    @pl.when(kj == 0)
    def _init() -> None:
        for acc in (dq_acc, *dqv_accs, dc_acc, *dp_accs):
            acc[...] = jnp.zeros(acc.shape, F32)

    # The cotangent of the carry leaving tile kj: the older tiles' pulls on theirs.
    store_row(dc_out, dc_acc[...])
    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    @pl.when(live)
    def _compute() -> None:
        params, q_values, k_values = read_terms(p_refs, qv_refs, kv_refs)
        allowed_QK = plan.allowed_QK(*mask_args)
        q_pos, k_pos = qpos_ref[...], kpos_ref[...]
        q_QH, k_KH, v_KW = q_ref[...], k_ref[...], v_ref[...]

        gk_KH = None if gk_ref is None else gk_ref[...]

        def scores(logits_QK, q_QH, cope_params, c_Q1, qv):
            inputs = (params, qv, k_values, q_pos, k_pos)
            return pair_scores(
                plan,
                logits_QK,
                q_QH,
                cope_params,
                c_Q=c_Q1,
                allowed_QK=allowed_QK,
                inputs=inputs,
                gk_KH=gk_KH,
                backward=True,
                query_side=True,
            )

        cope_params = read_refs(cope_p_refs)
        primals = (content_logits_QK(q_QH, k_KH), q_QH, cope_params, load_row(c_in), q_values)
        (s_QK, _), pull = jax.vjp(scores, *primals)
        dp_QK = jax.lax.dot_general(do_ref[...], v_KW, NT, preferred_element_type=F32)
        _, ds_QK = _softmax_ds(s_QK, allowed_QK, load_row(lse_ref), dp_QK, load_row(delta_ref))
        d_logits, d_q, d_params, d_c, d_qv = pull((ds_QK, dc_acc[...]))
        scale = 1.0 / math.sqrt(q_QH.shape[-1])
        d_logits = (d_logits * scale).astype(k_KH.dtype)
        dq_acc[...] += d_q.astype(F32) + jax.lax.dot(d_logits, k_KH, preferred_element_type=F32)
        for acc, g in zip(dp_accs, d_params, strict=True):
            acc[...] += g
        for acc, g in zip(dqv_accs, [g for g in d_qv if g is not None], strict=True):
            acc[...] += g
        dc_acc[...] += d_c  # the carry entering this tile left the newer one

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish() -> None:
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
        for ref, acc in zip(dqv_refs, dqv_accs, strict=True):
            store_row(ref, acc[...])
        for ref, acc in zip(dp_outs, dp_accs, strict=True):
            ref[...] = acc[...]


def cope_pair(plan: Plan, refs: tuple, mask_args: tuple, terms: tuple, extra: tuple) -> tuple:
    """(P, the content logits' cotangent dS, (the terms' parameter and per-key gradients),
    the gate keys' gradient (K, H) or None) of one dk / dv step's pair; ``refs`` as
    ``tpu_backward._pair`` reads them, ``extra`` the position term's parameters, the gate
    keys if any, and this tile pair's count and carry cotangent."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref = refs
    cope_p_refs, gk_ref, (c_in, dc_in) = cope_refs(list(extra), plan.cope)
    params, q_values, k_values = terms
    allowed_QK = plan.allowed_QK(*mask_args)
    q_QH, q_pos, k_pos = q_ref[...], qpos_ref[...], kpos_ref[...]
    cope_params = read_refs(cope_p_refs)

    def scores(logits_QK, p, kv, gk_KH):
        inputs = (p, q_values, kv, q_pos, k_pos)
        return pair_scores(
            plan,
            logits_QK,
            q_QH,
            cope_params,
            c_Q=load_row(c_in),
            allowed_QK=allowed_QK,
            inputs=inputs,
            gk_KH=gk_KH,
            # with unit gates no input of the positions is differentiated here, and a
            # custom vjp (interpolation, MLP) whose inputs are not lowers nowhere
            backward=not plan.cope.unit_gates,
        )

    logits_QK = content_logits_QK(q_QH, k_ref[...])
    gk_KH = None if gk_ref is None else gk_ref[...]
    (s_QK, _), pull = jax.vjp(scores, logits_QK, params, k_values, gk_KH)
    dp_QK = jax.lax.dot_general(do_ref[...], v_ref[...], NT, preferred_element_type=F32)
    p_QK, ds_QK = _softmax_ds(s_QK, allowed_QK, load_row(lse_ref), dp_QK, load_row(delta_ref))
    d_logits, d_p, d_kv, d_gk = pull((ds_QK, load_row(dc_in)))
    return p_QK, d_logits, (d_p, d_kv), d_gk
