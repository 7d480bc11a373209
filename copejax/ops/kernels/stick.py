"""Stick-breaking attention in the fused kernels (Tan et al. 2024, arXiv 2410.17980).

Key j breaks off ``beta_ij = sigmoid(z_ij)`` of what the nearer keys left:
``A_ij = exp(log_sigmoid(z_ij) - sum_{j < k, k allowed} softplus(z_ik))`` and ``y_i = sum_j
A_ij v_j``, no normaliser. A query tile walks its key tiles newest first with the carry
``r_i``, the softplus total of the newer tiles (the log stick remainder); within a tile the
newer keys' sum is, on a GPU, the row total minus a float32 prefix sum (:func:`tile_sum`'s
scan), and on a TPU a matmul with a strictly triangular ones matrix on the MXU (three
bfloat16 matmuls of the float32 terms' pieces; one float32 matmul at full precision lowers
to an FMA loop in Triton, with which these kernels measured 22.7x the nope kernel on an
H100). The scores ``z`` are the content logits plus the terms' biases, as for softmax.

Backward, with ``G_ij = A_ij (dY_i . v_j)`` and ``D_i = dY_i . y_i = sum_k G_ik``
(:mod:`copejax.ops.stick_flash` derives it):

    dv_j  = sum_i A_ij dY_i
    dz_ij = G_ij sigmoid(-z_ij) - sigmoid(z_ij) (D_i - u_i - sum_{k >= j in the tile} G_ik)

with ``u_i`` the ``G`` total of the newer tiles. The dq kernel walks newest first as the
forward does, replaying ``r`` and accumulating ``u``, and writes both as they enter each
carry group of consecutive key tiles (:mod:`copejax.ops.kernels.carry_groups`; (B, N, rows,
T), the groups' rows and a spare one that takes the other live tiles' stores:
:meth:`~copejax.ops.kernels.tiles.Plan.entry_row`). The dk / dv
kernel's programs own a group: each walks its key tiles newest first, looping over the query
tiles for each, and adds each pair's softplus and G row totals to the carries in place (the
carry inputs are aliased to two outputs), so that they hold ``r`` and ``u`` entering the next
tile. That is O(groups x T) floats per head, within twice the queries' bytes, instead of
O(T^2 / K) with one checkpoint per key tile (the layout ``carry_groups_for_tracing`` can still
force).
Shape letters as in :mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from copejax.ops.kernels.exact_dots import highest_dot, pieces_dot
from copejax.ops.kernels.key_tile import QueryTile, key_tile_program
from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.pullbacks import (
    pull_query_values,
)
from copejax.ops.kernels.tiles import Plan, dot_f32, exp_gpu, scan_sum, scores_QK
from copejax.ops.kernels.triton_params import approx_log1p, gpu_scan, program_barrier

LN2 = math.log(2.0)


def newer_ones_KK(size: int, inclusive: bool) -> jax.Array:
    """M[k, j] = 1 where key k is newer than key j (or is j, ``inclusive``), bfloat16 (exact):
    ``x @ M`` sums each row's entries over the newer keys of the tile."""
    k_K1 = jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0)
    j_1K = jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)
    newer = k_K1 >= j_1K if inclusive else k_K1 > j_1K
    return newer.astype(jnp.float32).astype(jnp.bfloat16)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def tile_sum(x_QK: jax.Array, inclusive: bool, scan: bool = False) -> jax.Array:
    """Each row's sum over the newer keys of the tile (``inclusive``: and the key itself),
    ``x @ newer_ones_KK``, to float32's precision: on the tensor cores
    (:func:`~copejax.ops.kernels.exact_dots.dot_exact_f32`, sums of logs: no TF32), or with
    ``scan`` as a float32 prefix sum along the keys (``jnp.cumsum``, Triton's scan: no
    matmul, fewer live registers; Mosaic TPU lowers no cumsum), the row total minus the
    prefix. Its derivative (for CoPE's autodiff backward) is one float32 matmul at
    ``Precision.HIGHEST``."""
    return _newer_sum(x_QK, inclusive, scan)


def _newer_sum(x_QK: jax.Array, inclusive: bool, scan: bool) -> jax.Array:
    """:func:`tile_sum` without a custom derivative."""
    if scan:
        return scan_sum(x_QK, 1, newer=True, inclusive=inclusive)
    return pieces_dot(x_QK, newer_ones_KK(x_QK.shape[1], inclusive), (1, 0), False)


def _older_sum(ct_QK: jax.Array, inclusive: bool, scan: bool) -> jax.Array:
    """The pull-back of :func:`_newer_sum`, ``ct @ ones^T``: each key's sum over the older
    keys of the tile (``inclusive``: and itself)."""
    if scan:
        return scan_sum(ct_QK, 1, newer=False, inclusive=inclusive)
    return pieces_dot(ct_QK, newer_ones_KK(ct_QK.shape[1], inclusive), (1, 1), False)


def _tile_sum_jvp(inclusive: bool, scan: bool, primals: tuple, tangents: tuple) -> tuple:
    (x_QK,), (x_dot_QK,) = primals, tangents
    ones_KK = newer_ones_KK(x_QK.shape[1], inclusive)
    return _newer_sum(x_QK, inclusive, scan), highest_dot(x_dot_QK, ones_KK, (1, 0), False)


tile_sum.defjvp(_tile_sum_jvp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def tile_sum_vjp(x_QK: jax.Array, inclusive: bool, scan: bool = False) -> jax.Array:
    """:func:`tile_sum` whose pull-back ``ct @ ones^T`` is float32-exact on the tensor cores
    (or, ``scan``, a prefix sum) too (:func:`tile_sum`'s JVP transposes to a float32 FMA
    matmul). A custom vjp lowers only where its input is differentiated: for CoPE's backward
    kernels, whose gates are."""
    return _newer_sum(x_QK, inclusive, scan)


def _tile_sum_forward(x_QK: jax.Array, inclusive: bool, scan: bool) -> tuple[jax.Array, None]:
    return _newer_sum(x_QK, inclusive, scan), None


def _tile_sum_backward(inclusive: bool, scan: bool, _: None, ct_QK: jax.Array) -> tuple:
    return (_older_sum(ct_QK, inclusive, scan),)


tile_sum_vjp.defvjp(_tile_sum_forward, _tile_sum_backward)


def as_mixed(a_QK: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The weights as the forward's value matmul took them (rounded to the values' dtype):
    with them ``sum_k G_ik`` is ``dO_i . y_i = D_i`` up to float32 order, and ``D_i - u_i -
    ...`` cancels exactly; with unrounded weights a bfloat16 rounding error would remain in
    every row's ``older`` sum and add up over the keys (a term parameter's gradient then
    drifts by tens of percent)."""
    return a_QK.astype(dtype).astype(jnp.float32)


def _column(x_Q: jax.Array) -> jax.Array:
    """A per-query array as (Q, 1): the GPU kernels hold (Q,), the TPU kernels (Q, 1)."""
    return x_Q[:, None] if x_Q.ndim == 1 else x_Q


def _on_allowed(allowed_QK: jax.Array | None, x_QK: jax.Array, fill: float) -> jax.Array:
    """``x`` on the allowed entries, ``fill`` elsewhere; ``x`` itself on a full pair (None)."""
    return x_QK if allowed_QK is None else jnp.where(allowed_QK, x_QK, fill)


def log1p_gpu(u: jax.Array, interpret: bool) -> jax.Array:
    """``log(1 + u)`` for u in [0, 1] as stick-breaking's GPU kernels take it: libdevice's
    log1pf (``jnp.log1p``), or with :func:`~copejax.ops.kernels.triton_params.approx_log1p`
    ``lg2.approx(1 + u) ln 2``, one instruction and two multiplies (in interpret mode the
    same form with an exact log2, so that the CPU tests run its rounding of 1 + u)."""
    if not approx_log1p():
        return jnp.log1p(u)
    w_QK = 1.0 + u
    if interpret:
        return jnp.log2(w_QK) * LN2
    (log2_QK,) = pltriton.elementwise_inline_asm(
        "lg2.approx.f32 $0, $1;",
        args=[w_QK],
        constraints="=r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(w_QK.shape, jnp.float32)],
    )
    return log2_QK * LN2


def stick_weights_QK(
    z_QK: jax.Array,
    allowed_QK: jax.Array | None,
    r_Q: jax.Array,
    scan: bool = False,
    *,
    exp: Callable[[jax.Array], jax.Array] = jnp.exp,
    log1p: Callable[[jax.Array], jax.Array] = jnp.log1p,
) -> tuple:
    """(A, softplus(z), exp(-|z|)) of one pair given the newer tiles' softplus total r,
    (Q,) or (Q, 1) (``copejax.ops.engine_blocks.stick_terms``' stable forms); ``scan``: the
    within-tile sums as :func:`tile_sum`'s prefix sums, ``exp``
    :func:`~copejax.ops.kernels.tiles.exp_gpu` and ``log1p`` :func:`log1p_gpu` (the GPU
    kernels); ``allowed_QK`` None: a full pair
    (:meth:`~copejax.ops.kernels.tiles.Plan.run_pair`)."""
    z_QK = _on_allowed(allowed_QK, z_QK, 0.0)
    e_QK = exp(-jnp.abs(z_QK))
    log1p_QK = log1p(e_QK)
    softplus_QK = _on_allowed(allowed_QK, jnp.maximum(z_QK, 0.0) + log1p_QK, 0.0)
    log_sigmoid_QK = jnp.minimum(z_QK, 0.0) - log1p_QK
    after_QK = tile_sum(softplus_QK, False, scan)
    a_QK = _on_allowed(allowed_QK, exp(log_sigmoid_QK - after_QK - _column(r_Q)), 0.0)
    return a_QK, softplus_QK, e_QK


def _log1p(plan: Plan) -> Callable[[jax.Array], jax.Array]:
    return functools.partial(log1p_gpu, interpret=bool(plan.interpret))


def stick_dz_QK(
    z_QK: jax.Array,
    allowed_QK: jax.Array | None,
    *,
    e_QK: jax.Array,
    g_QK: jax.Array,
    delta_Q: jax.Array,
    u_Q: jax.Array,
    scan: bool = False,
) -> jax.Array:
    """The score gradient of one pair (module docstring), from exp(-|z|) and G;
    ``allowed_QK`` None: a full pair."""
    z_QK = _on_allowed(allowed_QK, z_QK, 0.0)
    within_QK = tile_sum(g_QK, True, scan)
    older_QK = _column(delta_Q) - _column(u_Q) - within_QK
    sigmoid_QK = jnp.where(z_QK >= 0, 1.0, e_QK) / (1.0 + e_QK)
    sigmoid_neg_QK = jnp.where(z_QK >= 0, e_QK, 1.0) / (1.0 + e_QK)
    return _on_allowed(allowed_QK, g_QK * sigmoid_neg_QK - sigmoid_QK * older_QK, 0.0)


def stick_forward_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """The forward program of one query tile (refs as ``forward._forward_kernel``'s; the
    second output is minus the final log remainder, kept for symmetry, unused)."""
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[8 : 8 + num_term_refs]), has)
    o_ref, stat_ref = refs[8 + num_term_refs :]
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH, q_pos_Q, q_seg_Q = q_ref[...], qpos_ref[...], qseg_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]
    first, end = plan.key_tiles(qi)

    def pair(step: jax.Array, state: tuple) -> tuple:
        kj = end - 1 - step
        k_first, keys, k_seg_K, k_rank_K = plan.key_tile(kj, kseg_ref, krank_ref)

        def compute(state: tuple, allowed_QK: jax.Array | None) -> tuple:
            r_Q, acc_QW = state
            k_values = [None if r is None else r[keys] for r in kv_refs]
            inputs = (params, q_values, k_values, q_pos_Q, kpos_ref[keys])
            z_QK = scores_QK(plan, q_QH, k_ref[keys, :], allowed_QK, inputs)
            a_QK, softplus_QK, _ = stick_weights_QK(
                z_QK, allowed_QK, r_Q, gpu_scan(), exp=exp_gpu, log1p=_log1p(plan)
            )
            v_KW = v_ref[keys, :]
            acc_QW = acc_QW + dot_f32(a_QK.astype(v_KW.dtype), v_KW, (1, 0))
            return r_Q + jnp.sum(softplus_QK, axis=1), acc_QW

        mask_args = (q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return plan.run_pair(mask_args, compute, state)

    init = (
        jnp.zeros((plan.size_q,), jnp.float32),
        jnp.zeros((plan.size_q, v_ref.shape[-1]), jnp.float32),
    )
    r_Q, acc_QW = jax.lax.fori_loop(0, end - first, pair, init)
    o_ref[...] = acc_QW.astype(o_ref.dtype)
    stat_ref[...] = -r_Q


def stick_dq_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """dq, the terms' per-query gradients, and the carries entering each carry group."""
    q_ref, k_ref, v_ref, do_ref, _, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    dq_ref, *rest = refs[11 + num_term_refs :]
    dqv_refs, r_out_ref, u_out_ref = rest[:-2], rest[-2], rest[-1]
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH, do_QW, delta_Q = q_ref[...], do_ref[...], delta_ref[...]
    q_pos_Q, q_seg_Q = qpos_ref[...], qseg_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]
    scale = 1.0 / math.sqrt(q_QH.shape[-1])
    first, end = plan.key_tiles(qi)

    def pair(step: jax.Array, state: tuple) -> tuple:
        kj = end - 1 - step
        k_first, keys, k_seg_K, k_rank_K = plan.key_tile(kj, kseg_ref, krank_ref)

        def compute(state: tuple, allowed_QK: jax.Array | None) -> tuple:
            r_Q, u_Q, dq_QH, dqv, last = state
            row, group = plan.entry_row(kj, last)  # the carries entering the group
            r_out_ref[row, :] = r_Q[None, :]
            u_out_ref[row, :] = u_Q[None, :]
            k_KH, k_pos_K = k_ref[keys, :], kpos_ref[keys]
            k_values = [None if r is None else r[keys] for r in kv_refs]
            inputs = (params, q_values, k_values, q_pos_Q, k_pos_K)
            z_QK = scores_QK(plan, q_QH, k_KH, allowed_QK, inputs)
            a_QK, softplus_QK, e_QK = stick_weights_QK(
                z_QK, allowed_QK, r_Q, gpu_scan(), exp=exp_gpu, log1p=_log1p(plan)
            )
            v_KW = v_ref[keys, :]
            g_QK = as_mixed(a_QK, v_KW.dtype) * dot_f32(do_QW, v_KW, (1, 1))
            dz_QK = stick_dz_QK(
                z_QK, allowed_QK, e_QK=e_QK, g_QK=g_QK, delta_Q=delta_Q, u_Q=u_Q, scan=gpu_scan()
            )
            dq_QH = dq_QH + dot_f32((dz_QK * scale).astype(k_KH.dtype), k_KH, (1, 0))
            dqv = pull_query_values(plan, dz_QK, inputs, dqv)
            r_Q = r_Q + jnp.sum(softplus_QK, axis=1)
            return r_Q, u_Q + jnp.sum(g_QK, axis=1), dq_QH, dqv, group

        mask_args = (q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return plan.run_pair(mask_args, compute, state)

    zeros_Q = jnp.zeros((plan.size_q,), jnp.float32)
    zeros_QH = jnp.zeros(q_QH.shape, jnp.float32)
    init = (zeros_Q, zeros_Q, zeros_QH, [zeros_Q for _ in dqv_refs], jnp.int32(-1))
    _, _, dq_QH, dqv, _ = jax.lax.fori_loop(0, end - first, pair, init)
    dq_ref[...] = dq_QH.astype(dq_ref.dtype)
    for ref, value in zip(dqv_refs, dqv, strict=True):
        ref[...] = value


def stick_dkdv_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    """dk, dv, the terms' per-key gradients and parameters of one carry group's key tiles,
    newest first (refs as :func:`key_tile_program`'s with whole rows, the carries entering
    the group as two extra inputs, aliased to the last two outputs, where the carries are
    kept up to date: each pair adds its rows' softplus and G totals as it leaves)."""
    delta_ref = refs[5]
    r_ref, u_ref = refs[-2:]  # the aliased outputs: read and written in place
    first, end = plan.group_tiles(pl.program_id(2))

    def grads(tile: QueryTile, k_KH: jax.Array, v_KW: jax.Array) -> tuple:
        z_QK = scores_QK(plan, tile.q_QH, k_KH, tile.allowed_QK, tile.inputs)
        r_Q, u_Q = r_ref[tile.rows], u_ref[tile.rows]
        a_QK, softplus_QK, e_QK = stick_weights_QK(
            z_QK, tile.allowed_QK, r_Q, gpu_scan(), exp=exp_gpu, log1p=_log1p(plan)
        )
        g_QK = as_mixed(a_QK, v_KW.dtype) * dot_f32(tile.do_QW, v_KW, (1, 1))
        dz_QK = stick_dz_QK(
            z_QK,
            tile.allowed_QK,
            e_QK=e_QK,
            g_QK=g_QK,
            delta_Q=delta_ref[tile.rows],
            u_Q=u_Q,
            scan=gpu_scan(),
        )
        r_ref[tile.rows] = r_Q + jnp.sum(softplus_QK, axis=1)
        u_ref[tile.rows] = u_Q + jnp.sum(g_QK, axis=1)
        return a_QK, dz_QK

    def key_tile(step: jax.Array, carry: None) -> None:
        program_barrier(plan.interpret)  # the previous key tile's carry stores, visible
        key_tile_program(
            refs[:-2],
            plan=plan,
            has=has,
            num_term_refs=num_term_refs,
            num_extra=2,
            grads=grads,
            kj=end - 1 - step,
        )
        return carry

    jax.lax.fori_loop(0, end - first, key_tile, None)
