"""The dq kernel of the TPU softmax backward (FlashAttention-2, Dao 2023, arXiv 2307.08691),
and the pair it shares with the dk / dv kernel (:mod:`copejax.ops.kernels.tpu_backward`).

Grid (batch row, head, query tile, key tile): dq and the terms' per-query gradients in VMEM
scratch across the key tiles, written at the last. With
Shaw's term (:mod:`copejax.ops.kernels.tpu_relative`) the pair's scores add it, and the dq
kernel adds its part of dq and writes the table's gradient to its batch row's slab, so only
its batch axis runs in parallel. Shape letters as in
:mod:`copejax.ops.kernels.tpu_forward`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.terms import tile_bias_QK
from copejax.ops.kernels.tiles import Plan, scores_QK, softmax_ds
from copejax.ops.kernels.tpu_params import NT, read_terms, step_live, when_live
from copejax.ops.kernels.tpu_relative import (
    PairGeometry,
    RelativeRefs,
    TpuRelative,
    add_relative,
    relative_grads,
)
from copejax.ops.kernels.tpu_rows import load_row, store_row


def softmax_pair(
    plan: Plan,
    refs: tuple,
    allowed_QK: jax.Array | None,
    terms: tuple,
    rel: RelativeRefs | None = None,
) -> tuple[jax.Array, jax.Array, tuple, PairGeometry | None]:
    """(P, dS, term inputs, Shaw's pair geometry or None) of one step's pair, float32
    (Q, K), given its mask (None: a full pair, :func:`~copejax.ops.kernels.tpu_params.
    when_live`); ``rel``: Shaw's term's refs (with a mask)."""
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref = refs
    inputs = (*terms, qpos_ref[...], kpos_ref[...])
    s_QK, geo = scores_QK(plan, q_ref[...], k_ref[...], allowed_QK, inputs), None
    if rel is not None:
        s_QK, geo = add_relative(rel, s_QK, q_ref[...], inputs, allowed_QK)
    dp_QK = jax.lax.dot_general(do_ref[...], v_ref[...], NT, preferred_element_type=jnp.float32)
    p_QK, ds_QK = softmax_ds(s_QK, allowed_QK, load_row(lse_ref), dp_QK, load_row(delta_ref))
    return p_QK, ds_QK, inputs, geo


def dq_kernel(
    *refs, plan: Plan, has: tuple, num_term_refs: int, relative: TpuRelative | None = None
) -> None:
    """One grid step of the dq kernel. With ``relative``: ``rev`` and the zero slab after
    the terms, the slab after the outputs, the two bands and the semaphore last."""
    main = refs[:6]  # q, k, v, do, lse, delta
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    outs = list(refs[11 + num_term_refs :])
    num_q = sum(h[1] for h in has)
    rel = None
    if relative is not None:  # the slab input is aliased to the slab output
        slab = outs[3 + num_q]
        rel = RelativeRefs(relative, outs[0], outs[-3], outs[-1], slab, outs[-2])
        outs = outs[2 : 3 + num_q] + outs[4 + num_q : -3]
    dq_ref, dqv_refs = outs[0], outs[1 : 1 + num_q]
    dq_acc, dqv_accs = outs[1 + num_q], outs[2 + num_q :]
    row, qi, kj = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    last = pl.num_programs(3) - 1

    @pl.when(kj == 0)
    def _init() -> None:
        dq_acc[...] = jnp.zeros(dq_acc.shape, jnp.float32)
        for acc in dqv_accs:
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    def compute(allowed_QK: jax.Array | None) -> None:  # None: a full pair
        params, q_values, k_values = read_terms(p_refs, qv_refs, kv_refs)
        _, ds_QK, inputs, geo = softmax_pair(
            plan, (*main, qpos_ref, kpos_ref), allowed_QK, (params, q_values, k_values), rel
        )
        k_KH = main[1][...]
        scale = 1.0 / math.sqrt(k_KH.shape[-1])
        dq_acc[...] += jax.lax.dot(
            (ds_QK * scale).astype(k_KH.dtype), k_KH, preferred_element_type=jnp.float32
        )
        if rel is not None:
            dq_acc[...] += relative_grads(rel, geo, main[0][...], ds_QK, row)
        if dqv_accs:

            def bias(qv: list) -> jax.Array:
                return tile_bias_QK(plan.biases, (params, qv, k_values), *inputs[3:])

            grads = jax.vjp(bias, q_values)[1](ds_QK)[0]
            for acc, g in zip(dqv_accs, [g for g in grads if g is not None], strict=True):
                acc[...] += g

    when_live(plan, live, mask_args, compute, mask_free=rel is None)

    @pl.when(kj == last)
    def _finish() -> None:
        dq_ref[...] = dq_acc[...].astype(dq_ref.dtype)
        for ref, acc in zip(dqv_refs, dqv_accs, strict=True):
            store_row(ref, acc[...])
