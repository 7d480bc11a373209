"""CoPE in the fused kernels (Golovneva et al. 2024, arXiv 2405.18719): the carried count.

Gates ``g_ij = sigmoid(q_i . k_j / sqrt(H))`` on allowed keys, positions ``p_ij = min(sum_{k
>= j} g_ik, p_max - 1)`` (eq. 4) and the term ``z_i[p_ij]``, ``z_i[p] = q_i . e[p]`` read by
linear interpolation (eq. 7-8), added to the content logits. A query tile walks its key tiles
newest first with the count of the newer tiles' gates as carry ``c_i``; within a tile the
suffix sum is a float32 prefix sum on a GPU (a matmul with a triangular ones matrix on a TPU's
MXU: :func:`copejax.ops.kernels.stick.tile_sum`), and the interpolation is
a sum over the P table rows of ``z_i[r] max(0, 1 - |p_ij - r|)``, the same value and
derivative as :func:`copejax.ops.interpolate.interpolate_last_axis` (0 at integer p), with no
gather. ``z`` (Q, P) reads only the queries (:func:`cope_table`): the forward and dq kernels
take it once per query tile (on a GPU before their walk, on a TPU at the query tile's first
step, into VMEM); the dk / dv kernels once per pair.

The paper's other variants: gates from a second key-side operand, ``sigmoid(q_i . k'_j /
sqrt(H))`` with sep-keys' ``k' = W x`` or val-gates' ``v`` (:class:`CopeTerm`'s
``gate_k_BSGH``, per key/value head like k: one more (K, H) load and float32 matmul per pair,
its gradient summed per key tile like dk), and the position terms "alibi" and "mlp" in place
of the interpolation (:mod:`copejax.ops.kernels.cope_terms`).

The pair's scores and gate total are one function :func:`cope_scores_QK` of (q, k, the
queries' table and the term's other parameters, c, and the gate keys), the composition of the
positions' stage (:func:`cope_positions_QK`) and the term's (:func:`cope_table_term_QK`;
:func:`cope_term_QK` with the table taken from q); the kernels differentiate it
with ``jax.vjp``. The forward keeps no count: the backward kernels
(:mod:`copejax.ops.kernels.cope_backward`) keep O(groups x T) floats per head, not one carry
per key tile (the TPU kernels, :mod:`copejax.ops.kernels.tpu_cope`, the same bookkeeping with
the carries of the head's queries in VMEM). Supported: every gate ("keys",
"sep_keys", "values") and position term ("interpolate" with a table shared by the heads or one
per head, "alibi", "mlp"), ``scale_position_term`` and ``force_unit_gates``. The term's
parameters' gradients come from the dq kernels: each sums the cotangent of its queries' table
over its walk and pulls it back to q and the parameters once; on a GPU it adds those to one
float32 array per batch row and head with atomic adds, on a TPU to one per head in VMEM. Shape
letters as in :mod:`copejax.ops.kernels.forward`; P the table rows (p_max).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.cope_terms import (
    CopeStatic,
    CopeTerm,
    gate_logits_QK,
    split_params,
    table_term_QK,
    term_table_QR,
)
from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.stick import tile_sum, tile_sum_vjp
from copejax.ops.kernels.terms import tile_bias_QK
from copejax.ops.kernels.tiles import (
    MASKED_LOGIT,
    Plan,
    content_logits_QK,
    dot_f32,
    exp_gpu,
    sigmoid_gpu,
)
from copejax.ops.kernels.triton_params import gpu_scan

__all__ = [  # CopeStatic and CopeTerm live with the term's maths; callers import them here
    "CopeStatic",
    "CopeTerm",
    "cope_forward_kernel",
    "cope_refs",
    "cope_scores_QK",
    "pair_scores",
]


def cope_scores_QK(
    static: CopeStatic,
    logits_QK: jax.Array,
    q_QH: jax.Array,
    term: tuple,
    *,
    c_Q: jax.Array,
    allowed_QK: jax.Array,
    gk_KH: jax.Array | None = None,
    backward: bool = False,
    scan: bool = False,
    sigmoid: Callable[[jax.Array], jax.Array] = jax.nn.sigmoid,
) -> tuple[jax.Array, jax.Array]:
    """(the content logits plus CoPE's term, the tile's gate total per query) of one pair,
    given its content logits, the term's queries' table and other parameters (``term``,
    :func:`cope_table`), the newer tiles' count ``c_Q``, (Q,) on a GPU or (Q, 1) on a TPU
    (the total takes its shape), and the gate keys (None: the gates read the content
    logits); float32. The kernels take the logits' cotangent through the content matmul
    themselves, in the inputs' dtype; ``backward``: they differentiate it (the gates among
    its inputs unless they are unit gates); ``scan``: the within-tile count by prefix sums
    (the GPU kernels, :func:`copejax.ops.kernels.triton_params.gpu_scan`); ``sigmoid``: the
    gates' (the GPU kernels: :func:`~copejax.ops.kernels.tiles.sigmoid_gpu`). The two stages
    :func:`cope_positions_QK` and :func:`cope_table_term_QK`."""
    p_QK, total_Q, _ = cope_positions_QK(
        static,
        logits_QK,
        q_QH,
        c_Q=c_Q,
        allowed_QK=allowed_QK,
        gk_KH=gk_KH,
        backward=backward,
        scan=scan,
        sigmoid=sigmoid,
    )
    term_QK = cope_table_term_QK(static, *term, p_QK, q_QH.shape[-1], backward=backward)
    return logits_QK + term_QK, total_Q


def cope_positions_QK(
    static: CopeStatic,
    logits_QK: jax.Array,
    q_QH: jax.Array,
    *,
    c_Q: jax.Array,
    allowed_QK: jax.Array,
    gk_KH: jax.Array | None = None,
    backward: bool = False,
    scan: bool = False,
    sigmoid: Callable[[jax.Array], jax.Array] = jax.nn.sigmoid,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the capped positions p, the gate total, the uncapped ``sum_{k >= j} g_ik + c_i``)
    of one pair (arguments as :func:`cope_scores_QK`'s; ``allowed_QK`` None: a full pair,
    :meth:`~copejax.ops.kernels.tiles.Plan.run_pair`)."""
    if static.unit_gates:
        gates_QK = (
            jnp.ones_like(logits_QK) if allowed_QK is None else allowed_QK.astype(jnp.float32)
        )
    else:
        gate_logits = logits_QK if gk_KH is None else gate_logits_QK(q_QH, gk_KH)
        gates_QK = sigmoid(gate_logits)
        if allowed_QK is not None:
            gates_QK = jnp.where(allowed_QK, gates_QK, 0.0)
    sum_newer = tile_sum_vjp if backward and not static.unit_gates else tile_sum
    within_QK = sum_newer(gates_QK, True, scan)
    c_Q1 = c_Q[:, None] if c_Q.ndim == 1 else c_Q
    uncapped_QK = within_QK + c_Q1
    p_QK = jnp.minimum(uncapped_QK, static.p_max - 1.0)
    return p_QK, jnp.sum(gates_QK, axis=1, keepdims=c_Q.ndim == 2), uncapped_QK


def cope_term_QK(
    static: CopeStatic,
    q_QH: jax.Array,
    params: tuple,
    p_QK: jax.Array,
    *,
    backward: bool = False,
) -> jax.Array:
    """CoPE's position term of one pair at positions ``p_QK`` (scaled by 1 / sqrt(H) with
    ``scale_position_term``), float32 (Q, K)."""
    term = cope_table(static, q_QH, params)
    return cope_table_term_QK(static, *term, p_QK, q_QH.shape[-1], backward=backward)


def cope_table(
    static: CopeStatic, q_QH: jax.Array, params: tuple
) -> tuple[jax.Array | None, tuple]:
    """(the queries' table, the parameters besides its rows): the part of the term that reads
    q (:func:`~copejax.ops.kernels.cope_terms.term_table_QR`), the same for every key tile of
    a query tile."""
    rows, others = split_params(static.position_term, params)
    return term_table_QR(q_QH, rows), others


def cope_table_term_QK(
    static: CopeStatic,
    table_QR: jax.Array | None,
    others: tuple,
    p_QK: jax.Array,
    dim: int,
    *,
    backward: bool = False,
) -> jax.Array:
    """:func:`cope_term_QK` from the queries' table and the other parameters
    (:func:`~copejax.ops.kernels.cope_terms.split_params`); ``dim`` the head dim H."""
    term_QK = table_term_QK(
        static.position_term,
        table_QR,
        others,
        p_QK,
        units=static.mlp_units,
        input_scale=static.mlp_scale,
        backward=backward,
    )
    if static.scale_term:
        term_QK = term_QK / math.sqrt(dim)
    return term_QK


def pair_scores(
    plan: Plan,
    logits_QK,
    q_QH,
    term,
    *,
    c_Q,
    allowed_QK,
    inputs,
    gk_KH=None,
    backward=False,
) -> tuple:
    """The pair's masked scores (CoPE's and the other terms') and gate total; ``term`` as
    :func:`cope_scores_QK` takes it."""
    s_QK, total_Q = cope_scores_QK(
        plan.cope,
        logits_QK,
        q_QH,
        term,
        c_Q=c_Q,
        allowed_QK=allowed_QK,
        gk_KH=gk_KH,
        backward=backward,
        scan=gpu_scan() and plan.backend == "triton",
        sigmoid=sigmoid_gpu if plan.backend == "triton" else jax.nn.sigmoid,
    )
    if plan.biases:
        s_QK = s_QK + tile_bias_QK(plan.biases, inputs[:3], *inputs[3:])
    if allowed_QK is None:  # a full pair
        return s_QK, total_Q
    return jnp.where(allowed_QK, s_QK, MASKED_LOGIT), total_Q


def cope_refs(refs: list, static: CopeStatic) -> tuple[list, Any, list]:
    """(the term's parameter refs, the gate keys' ref or None, the refs after them)."""
    count = static.num_params
    gk_ref = refs[count] if static.gate_keys else None
    return refs[:count], gk_ref, refs[count + static.gate_keys :]


def cope_forward_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """The forward program of one query tile (the backward's dq kernel replays the count)."""
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[8 : 8 + num_term_refs]), has)
    cope_p_refs, gk_ref, (o_ref, lse_ref) = cope_refs(list(refs[8 + num_term_refs :]), plan.cope)
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH, q_pos_Q, q_seg_Q = q_ref[...], qpos_ref[...], qseg_ref[...]
    # the term's queries' table, once for every key tile
    term = cope_table(plan.cope, q_QH, tuple(r[...] for r in cope_p_refs))
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]
    first, end = plan.key_tiles(qi)

    def pair(step: jax.Array, state: tuple) -> tuple:
        kj = end - 1 - step
        k_first, keys, k_seg_K, k_rank_K = plan.key_tile(kj, kseg_ref, krank_ref)

        def compute(state: tuple, allowed_QK: jax.Array | None) -> tuple:
            max_Q, sum_Q, acc_QW, c_Q = state
            k_values = [None if r is None else r[keys] for r in kv_refs]
            inputs = (params, q_values, k_values, q_pos_Q, kpos_ref[keys])
            logits_QK = content_logits_QK(q_QH, k_ref[keys, :])
            s_QK, total_Q = pair_scores(
                plan,
                logits_QK,
                q_QH,
                term,
                c_Q=c_Q,
                allowed_QK=allowed_QK,
                inputs=inputs,
                gk_KH=None if gk_ref is None else gk_ref[keys, :],
            )
            new_max_Q = jnp.maximum(max_Q, jnp.max(s_QK, axis=1))
            p_QK = exp_gpu(s_QK - new_max_Q[:, None])
            if allowed_QK is not None:
                p_QK = jnp.where(allowed_QK, p_QK, 0.0)
            rescale_Q = exp_gpu(max_Q - new_max_Q)
            v_KW = v_ref[keys, :]
            acc_QW = acc_QW * rescale_Q[:, None] + dot_f32(p_QK.astype(v_KW.dtype), v_KW, (1, 0))
            sum_Q = sum_Q * rescale_Q + jnp.sum(p_QK, axis=1)
            return new_max_Q, sum_Q, acc_QW, c_Q + total_Q

        mask_args = (q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return plan.run_pair(mask_args, compute, state)

    zeros_Q = jnp.zeros((plan.size_q,), jnp.float32)
    init = (zeros_Q - 1e30, zeros_Q, jnp.zeros((plan.size_q, v_ref.shape[-1]), jnp.float32))
    max_Q, sum_Q, acc_QW, _ = jax.lax.fori_loop(0, end - first, pair, (*init, zeros_Q))
    seen_Q = sum_Q > 0
    safe_sum_Q = jnp.where(seen_Q, sum_Q, 1.0)
    o_ref[...] = (acc_QW / safe_sum_Q[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen_Q, max_Q + jnp.log(safe_sum_Q), 0.0)
