"""Selective attention's penalties in the fused kernels (arXiv 2410.02703), backward.

The scores of head n are ``s^n_ij = l^n_ij - F_ij`` with ``F_ij = sum_{k < i} S_kj``
(:mod:`copejax.ops.kernels.selective`). FlashAttention-2's ``dS^n = P^n (dP^n - D)``
(:mod:`copejax.ops.kernels.backward`) gives dq, dk, dv of head n as usual, and

    dF_ij = -sum_n dS^n_ij,   G_kj = dL/dS_kj = sum_{i > k} dF_ij,
    dl_kj = G_kj S'(l_kj)  (zero where S is),   dq_sel_k = sum_j dl_kj k_sel_j / sqrt(H),
    dk_sel_j = sum_k dl_kj q_sel_k / sqrt(H)

for the selecting head's q and k. Everything after dS is linear, so each head's programs
pull back their own ``-dS^n`` and the heads' parts are summed outside the kernels (the
(B, T, N, H) partials, as the dk / dv of grouped heads are).

``G`` is a suffix sum over queries. For a selector k in query tile g and key j:
``G_kj = R^n[g, j] + sum_{i in g, i > k} dF^n_ij``, the within-tile part a matmul with the
transposed strictly lower triangular ones matrix and ``R^n[g, j]`` the column sums of
``dF^n`` over the query tiles after g. The dk / dv kernel (programs own a key tile) walks
its query tiles newest first with R as carry: it writes R entering each query tile,
(B, N, rows_of(count_q), S) float32, O(T^2 / Q) per head, and adds ``dk_sel``. It runs
first; the dq kernel (programs own a query tile) then reads R at its tile for ``dq_sel``.
Both recompute each pair's S tile and penalty from the forward's prefix P, as the forward
does. Shape letters as in :mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.selective import keep_QK, newer_sum_QK, penalized_scores_QK, rows_of
from copejax.ops.kernels.tiles import Plan, dot_f32
from copejax.ops.kernels.triton_params import compiler_params


def _pair(plan: Plan, nonlinearity: str, tiles: tuple, selectors: tuple, stats: tuple) -> tuple:
    """(P, dS, dl / sqrt(H) of the selection with the carry R) of one pair, float32 (Q, K).

    ``tiles``: (q, k, v, dO, allowed); ``stats``: (lse, D, R at the keys)."""
    q_QH, k_KH, v_KW, do_QW, allowed_QK = tiles
    lse_Q, delta_Q, r_K = stats
    s_QK, slope_QK = penalized_scores_QK(nonlinearity, q_QH, k_KH, selectors, allowed_QK)
    p_QK = jnp.where(allowed_QK, jnp.exp(s_QK - lse_Q[:, None]), 0.0)
    ds_QK = p_QK * (dot_f32(do_QW, v_KW, (1, 1)) - delta_Q[:, None])
    g_QK = r_K[None, :] - newer_sum_QK(ds_QK)  # dF = -dS
    scale = 1.0 / math.sqrt(q_QH.shape[-1])
    return p_QK, ds_QK, g_QK * slope_QK * scale


def _dkdv_kernel(*refs, plan: Plan, nonlinearity: str) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, krank_ref = refs[:9]
    qsel_ref, ksel_ref, kstart_ref, prefix_ref = refs[9:13]
    dk_ref, dv_ref, dksel_ref, r_out_ref = refs[13:]
    kj = pl.program_id(2)
    k_first = kj * plan.size_k
    k_KH, v_KW, k_sel_KH = k_ref[...], v_ref[...], ksel_ref[...]
    k_seg_K, k_rank_K, k_starts_K = kseg_ref[...], krank_ref[...], kstart_ref[...]
    scale = 1.0 / math.sqrt(k_KH.shape[-1])
    first, end = plan.query_tiles(kj)

    def pair(step: jax.Array, state: tuple) -> tuple:
        qi = end - 1 - step
        q_first = qi * plan.size_q
        queries = pl.ds(pl.multiple_of(q_first, plan.size_q), plan.size_q)
        q_seg_Q = qseg_ref[queries]

        def compute(state: tuple) -> tuple:
            dk_KH, dv_KW, dksel_KH, r_K = state
            r_out_ref[pl.ds(qi, 1), :] = r_K[None, :]
            allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            q_QH, do_QW, q_sel_QH = q_ref[queries, :], do_ref[queries, :], qsel_ref[queries, :]
            keep = keep_QK(q_first, k_first, q_seg_Q, k_seg_K, k_starts_K)
            prefix_K = prefix_ref[pl.ds(qi, 1), :][0]
            p_QK, ds_QK, dl_QK = _pair(
                plan,
                nonlinearity,
                (q_QH, k_KH, v_KW, do_QW, allowed_QK),
                (q_sel_QH, k_sel_KH, keep, prefix_K),
                (lse_ref[queries], delta_ref[queries], r_K),
            )
            dv_KW = dv_KW + dot_f32(p_QK.astype(do_QW.dtype), do_QW, (0, 0))
            dk_KH = dk_KH + dot_f32((ds_QK * scale).astype(q_QH.dtype), q_QH, (0, 0))
            dksel_KH = dksel_KH + dot_f32(dl_QK.astype(q_sel_QH.dtype), q_sel_QH, (0, 0))
            return dk_KH, dv_KW, dksel_KH, r_K - jnp.sum(ds_QK, axis=0)

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return jax.lax.cond(live, compute, lambda s: s, state)

    init = (
        jnp.zeros(k_KH.shape, jnp.float32),
        jnp.zeros(v_KW.shape, jnp.float32),
        jnp.zeros(k_sel_KH.shape, jnp.float32),
        jnp.zeros((plan.size_k,), jnp.float32),
    )
    dk_KH, dv_KW, dksel_KH, _ = jax.lax.fori_loop(0, end - first, pair, init)
    dk_ref[...] = dk_KH
    dv_ref[...] = dv_KW
    dksel_ref[...] = dksel_KH


def _dq_kernel(*refs, plan: Plan, nonlinearity: str) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, krank_ref = refs[:9]
    qsel_ref, ksel_ref, kstart_ref, prefix_ref, r_ref, dq_ref, dqsel_ref = refs[9:]
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH, do_QW, q_sel_QH, q_seg_Q = q_ref[...], do_ref[...], qsel_ref[...], qseg_ref[...]
    lse_Q, delta_Q = lse_ref[...], delta_ref[...]
    scale = 1.0 / math.sqrt(q_QH.shape[-1])

    def pair(kj: jax.Array, state: tuple) -> tuple:
        k_first = kj * plan.size_k
        keys = pl.ds(pl.multiple_of(k_first, plan.size_k), plan.size_k)
        k_seg_K, k_rank_K = kseg_ref[keys], krank_ref[keys]

        def compute(state: tuple) -> tuple:
            dq_QH, dqsel_QH = state
            allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            k_KH, k_sel_KH = k_ref[keys, :], ksel_ref[keys, :]
            keep = keep_QK(q_first, k_first, q_seg_Q, k_seg_K, kstart_ref[keys])
            _, ds_QK, dl_QK = _pair(
                plan,
                nonlinearity,
                (q_QH, k_KH, v_ref[keys, :], do_QW, allowed_QK),
                (q_sel_QH, k_sel_KH, keep, prefix_ref[keys]),
                (lse_Q, delta_Q, r_ref[keys]),
            )
            dq_QH = dq_QH + dot_f32((ds_QK * scale).astype(k_KH.dtype), k_KH, (1, 0))
            dqsel_QH = dqsel_QH + dot_f32(dl_QK.astype(k_sel_KH.dtype), k_sel_KH, (1, 0))
            return dq_QH, dqsel_QH

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return jax.lax.cond(live, compute, lambda s: s, state)

    first, end = plan.key_tiles(qi)
    init = (jnp.zeros(q_QH.shape, jnp.float32), jnp.zeros(q_sel_QH.shape, jnp.float32))
    dq_QH, dqsel_QH = jax.lax.fori_loop(first, end, pair, init)
    dq_ref[...] = dq_QH
    dqsel_ref[...] = dqsel_QH


def selective_backward_calls(
    plan: Plan,
    nonlinearity: str,
    tensors: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    *,
    lse_BNT: jax.Array,
    delta_BNT: jax.Array,
    selectors: dict[str, jax.Array],
    prefix: jax.Array,
    ints: dict[str, jax.Array],
) -> tuple[jax.Array, ...]:
    """Runs the dk / dv kernel, then the dq kernel, on padded inputs.

    Args:
      tensors: (q_BTNH, k_BSGH, v_BSGW, dO_BTNW in the inputs' dtype).
      lse_BNT, delta_BNT: the forward's log-sum-exp and ``D_i = dO_i . o_i``.
      selectors, ints: as :func:`copejax.ops.kernels.selective.selective_forward_call`
        takes them; prefix: the P it returned.

    Returns:
      (dq_BTNH float32, dk_BSNH and dv_BSNW float32 per query head, the selecting
      head's d q (B, T, H) and d k (B, S, H) float32, summed over the heads).
    """
    q_BTNH, k_BSGH, v_BSGW, do_BTNW = tensors
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    groups, sq, sk = plan.groups, plan.size_q, plan.size_k
    rows, f32 = rows_of(plan.count_q), jnp.float32
    q_sel_BTH, k_sel_BSH = selectors["q"], selectors["k"]
    kernel_args = {"plan": plan, "nonlinearity": nonlinearity}
    head_tile = lambda size, n_dim: pl.BlockSpec(
        (None, size, None, n_dim), lambda b, n, t: (b, t, n, 0)
    )

    # dk, dv, dk_sel and R: programs over key tiles; queries and their ints whole.
    whole_q = pl.BlockSpec((None, length_q), lambda b, n, j: (b, 0))
    key_tile = pl.BlockSpec((None, sk), lambda b, n, j: (b, j))
    dk_BSNH, dv_BSNW, dksel_BSNH, carry = pl.pallas_call(
        functools.partial(_dkdv_kernel, **kernel_args),
        grid=(batch, heads, plan.count_k),
        in_specs=[
            pl.BlockSpec((None, length_q, None, dim), lambda b, n, j: (b, 0, n, 0)),
            pl.BlockSpec((None, sk, None, dim), lambda b, n, j: (b, j, n // groups, 0)),
            pl.BlockSpec((None, sk, None, width), lambda b, n, j: (b, j, n // groups, 0)),
            pl.BlockSpec((None, length_q, None, width), lambda b, n, j: (b, 0, n, 0)),
            pl.BlockSpec((None, None, length_q), lambda b, n, j: (b, n, 0)),
            pl.BlockSpec((None, None, length_q), lambda b, n, j: (b, n, 0)),
            whole_q,
            key_tile,
            key_tile,
            pl.BlockSpec((None, length_q, dim), lambda b, n, j: (b, 0, 0)),
            pl.BlockSpec((None, sk, dim), lambda b, n, j: (b, j, 0)),
            key_tile,
            pl.BlockSpec((None, rows, sk), lambda b, n, j: (b, 0, j)),
        ],
        out_specs=[
            head_tile(sk, dim),
            head_tile(sk, width),
            head_tile(sk, dim),
            pl.BlockSpec((None, None, rows, sk), lambda b, n, j: (b, n, 0, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, length_k, heads, dim), f32),
            jax.ShapeDtypeStruct((batch, length_k, heads, width), f32),
            jax.ShapeDtypeStruct((batch, length_k, heads, dim), f32),
            jax.ShapeDtypeStruct((batch, heads, rows, length_k), f32),
        ],
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_attention_dkdv",
    )(
        q_BTNH,
        k_BSGH,
        v_BSGW,
        do_BTNW,
        lse_BNT,
        delta_BNT,
        ints["q_seg"],
        ints["k_seg"],
        ints["k_rank"],
        q_sel_BTH,
        k_sel_BSH,
        ints["k_start"],
        prefix,
    )

    # dq and dq_sel: programs over query tiles; keys, values and their ints whole.
    whole_k = pl.BlockSpec((None, length_k), lambda b, n, i: (b, 0))
    query_stat = pl.BlockSpec((None, None, sq), lambda b, n, i: (b, n, i))
    dq_BTNH, dqsel_BTNH = pl.pallas_call(
        functools.partial(_dq_kernel, **kernel_args),
        grid=(batch, heads, plan.count_q),
        in_specs=[
            head_tile(sq, dim),
            pl.BlockSpec((None, length_k, None, dim), lambda b, n, i: (b, 0, n // groups, 0)),
            pl.BlockSpec((None, length_k, None, width), lambda b, n, i: (b, 0, n // groups, 0)),
            head_tile(sq, width),
            query_stat,
            query_stat,
            pl.BlockSpec((None, sq), lambda b, n, i: (b, i)),
            whole_k,
            whole_k,
            pl.BlockSpec((None, sq, dim), lambda b, n, i: (b, i, 0)),
            pl.BlockSpec((None, length_k, dim), lambda b, n, i: (b, 0, 0)),
            whole_k,
            pl.BlockSpec((None, None, length_k), lambda b, n, i: (b, i, 0)),
            pl.BlockSpec((None, None, None, length_k), lambda b, n, i: (b, n, i, 0)),
        ],
        out_specs=[head_tile(sq, dim), head_tile(sq, dim)],
        out_shape=[
            jax.ShapeDtypeStruct(q_BTNH.shape, f32),
            jax.ShapeDtypeStruct((batch, length_q, heads, dim), f32),
        ],
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_attention_dq",
    )(
        q_BTNH,
        k_BSGH,
        v_BSGW,
        do_BTNW,
        lse_BNT,
        delta_BNT,
        ints["q_seg"],
        ints["k_seg"],
        ints["k_rank"],
        q_sel_BTH,
        k_sel_BSH,
        ints["k_start"],
        prefix,
        carry,
    )
    return dq_BTNH, dk_BSNH, dv_BSNW, jnp.sum(dqsel_BTNH, axis=2), jnp.sum(dksel_BSNH, axis=2)
