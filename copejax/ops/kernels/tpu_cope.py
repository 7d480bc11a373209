"""CoPE's carried count in the TPU kernels (Golovneva et al. 2024, arXiv 2405.18719).

The maths of :mod:`copejax.ops.kernels.cope` (one function
:func:`~copejax.ops.kernels.cope.pair_scores` of (content logits, q, e, carry) per pair,
differentiated with ``jax.vjp``) on the grid of :mod:`copejax.ops.kernels.tpu_forward`. The
forward (:func:`copejax.ops.kernels.tpu_forward` with ``plan.cope``) walks the key tiles
newest first and writes the count entering each key tile, (B, N, count_k, T, 1). The dq
kernel here walks them oldest first with the carry's cotangent in VMEM scratch, writes it as
it leaves each key tile, and sums the table's gradient per query tile; the dk / dv kernel
(:mod:`copejax.ops.kernels.tpu_backward`, with :func:`cope_pair`) reads the count and its
cotangent for its query tiles. Shape letters as in :mod:`copejax.ops.kernels.tpu_forward`;
P the table rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.cope import pair_scores
from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.tiles import Plan, content_logits_QK
from copejax.ops.kernels.tpu_params import NT, read_refs, step_live

F32 = jnp.float32


def _softmax_ds(s_QK, allowed_QK, lse_Q1, dp_QK, delta_Q1) -> tuple[jax.Array, jax.Array]:
    p_QK = jnp.where(allowed_QK, jnp.exp(s_QK - lse_Q1), 0.0)
    return p_QK, p_QK * (dp_QK - delta_Q1)


def cope_dq_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """dq, the terms' per-query gradients, the carry's cotangent leaving each key tile and
    the table's partial gradient (inputs: ``tpu_backward``'s, the table and the counts;
    outputs: dq, per-query gradients, d carry, d table; scratch: the same but d carry's
    (Q, 1) running sum in place of its per-tile output)."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    e_ref, c_in, *outs = refs[11 + num_term_refs :]
    num_q = sum(h[1] for h in has)
    dq_ref, dqv_refs, dc_out, de_out = outs[0], outs[1 : 1 + num_q], *outs[1 + num_q : 3 + num_q]
    dq_acc, *dqv_accs, dc_acc, de_acc = outs[3 + num_q :]
    qi, kj = pl.program_id(2), pl.program_id(3)  # key tiles oldest first

    @pl.when(kj == 0)
    def _init() -> None:
        for acc in (dq_acc, *dqv_accs, dc_acc, de_acc):
            acc[...] = jnp.zeros(acc.shape, F32)

    # The cotangent of the carry leaving tile kj: the older tiles' pulls on theirs.
    dc_out[...] = dc_acc[...]
    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    @pl.when(live)
    def _compute() -> None:
        params, q_values, k_values = read_refs(p_refs), read_refs(qv_refs), read_refs(kv_refs)
        allowed_QK = plan.allowed_QK(*mask_args)
        q_pos, k_pos = qpos_ref[...], kpos_ref[...]
        q_QH, k_KH, v_KW = q_ref[...], k_ref[...], v_ref[...]

        def scores(logits_QK, q_QH, e_PH, c_Q1, qv):
            inputs = (params, qv, k_values, q_pos, k_pos)
            return pair_scores(
                plan, logits_QK, q_QH, e_PH, c_Q=c_Q1, allowed_QK=allowed_QK, inputs=inputs
            )

        primals = (content_logits_QK(q_QH, k_KH), q_QH, e_ref[...], c_in[...], q_values)
        (s_QK, _), pull = jax.vjp(scores, *primals)
        dp_QK = jax.lax.dot_general(do_ref[...], v_KW, NT, preferred_element_type=F32)
        _, ds_QK = _softmax_ds(s_QK, allowed_QK, lse_ref[...], dp_QK, delta_ref[...])
        d_logits, d_q, d_e, d_c, d_qv = pull((ds_QK, dc_acc[...]))
        scale = 1.0 / math.sqrt(q_QH.shape[-1])
        d_logits = (d_logits * scale).astype(k_KH.dtype)
        dq_acc[...] += d_q.astype(F32) + jax.lax.dot(d_logits, k_KH, preferred_element_type=F32)
        de_acc[...] += d_e
        for acc, g in zip(dqv_accs, [g for g in d_qv if g is not None], strict=True):
            acc[...] += g
        dc_acc[...] += d_c  # the carry entering this tile left the newer one

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish() -> None:
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
        de_out[...] = de_acc[...]
        for ref, acc in zip(dqv_refs, dqv_accs, strict=True):
            ref[...] = acc[...]


def cope_pair(plan: Plan, refs: tuple, mask_args: tuple, terms: tuple, extra: tuple) -> tuple:
    """(P, the content logits' cotangent dS, (the terms' parameter and per-key gradients))
    of one dk / dv step's pair; ``refs`` as ``tpu_backward._pair`` reads them, ``extra``
    the table and this tile pair's count and carry cotangent."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref = refs
    e_ref, c_in, dc_in = extra
    params, q_values, k_values = terms
    allowed_QK = plan.allowed_QK(*mask_args)
    q_QH, q_pos, k_pos = q_ref[...], qpos_ref[...], kpos_ref[...]

    def scores(logits_QK, p, kv):
        inputs = (p, q_values, kv, q_pos, k_pos)
        return pair_scores(
            plan, logits_QK, q_QH, e_ref[...], c_Q=c_in[...], allowed_QK=allowed_QK, inputs=inputs
        )

    (s_QK, _), pull = jax.vjp(scores, content_logits_QK(q_QH, k_ref[...]), params, k_values)
    dp_QK = jax.lax.dot_general(do_ref[...], v_ref[...], NT, preferred_element_type=F32)
    p_QK, ds_QK = _softmax_ds(s_QK, allowed_QK, lse_ref[...], dp_QK, delta_ref[...])
    d_logits, d_p, d_kv = pull((ds_QK, dc_in[...]))
    return p_QK, d_logits, (d_p, d_kv)
