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
does, and pull ``dS`` back through the other terms' tile functions as
:mod:`copejax.ops.kernels.backward` does. Shape letters as in
:mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.operands import term_operands, term_refs
from copejax.ops.kernels.pullbacks import add_present
from copejax.ops.kernels.selective import (
    keep_QK,
    newer_sum_QK,
    penalized_scores_QK,
    rows_of,
    term_bias,
)
from copejax.ops.kernels.terms import pair_grid
from copejax.ops.kernels.tiles import Plan, dot_f32
from copejax.ops.kernels.triton_params import compiler_params, gpu_scan


def pair_gradients(
    nonlinearity: str, tiles: tuple, selectors: tuple, stats: tuple, scan: bool = False
) -> tuple:
    """(P, dS, dl / sqrt(H) of the selection with the carry R) of one pair, float32 (Q, K);
    the GPU's and the TPU's (:mod:`copejax.ops.kernels.tpu_selective_backward`) kernels.

    ``tiles``: (q, k, v, dO, allowed, the other terms' bias or None); ``selectors`` as
    :func:`~copejax.ops.kernels.selective.penalized_scores_QK` takes them; ``stats``: (lse,
    D, R at the keys), as (Q,), (Q,), (K,) (GPU) or (Q, 1), (Q, 1), (1, K) (TPU); ``scan``:
    the sums over the tile's rows as prefix sums (the GPU kernels)."""
    q_QH, k_KH, v_KW, do_QW, allowed_QK, bias_QK = tiles
    lse_Q, delta_Q, r_K = stats
    (lse_Q1, r_1K), (delta_Q1, _) = pair_grid(lse_Q, r_K), pair_grid(delta_Q, r_K)
    s_QK, slope_QK = penalized_scores_QK(
        nonlinearity, q_QH, k_KH, selectors, allowed_QK, bias_QK=bias_QK, scan=scan
    )
    p_QK = jnp.where(allowed_QK, jnp.exp(s_QK - lse_Q1), 0.0)
    ds_QK = p_QK * (dot_f32(do_QW, v_KW, (1, 1)) - delta_Q1)
    g_QK = r_1K - newer_sum_QK(ds_QK, scan)  # dF = -dS
    scale = 1.0 / math.sqrt(q_QH.shape[-1])
    return p_QK, ds_QK, g_QK * slope_QK * scale


def _dkdv_kernel(*refs, plan: Plan, nonlinearity: str, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    qsel_ref, ksel_ref, kstart_ref, prefix_ref = refs[11 + num_term_refs : 15 + num_term_refs]
    dk_ref, dv_ref, dksel_ref, r_out_ref, *grad_refs = refs[15 + num_term_refs :]
    num_dkv = sum(h[2] for h in has)
    dkv_refs, dp_refs = grad_refs[:num_dkv], grad_refs[num_dkv:]
    kj = pl.program_id(2)
    k_first = kj * plan.size_k
    k_KH, v_KW, k_sel_KH, k_pos_K = k_ref[...], v_ref[...], ksel_ref[...], kpos_ref[...]
    k_seg_K, k_rank_K, k_starts_K = kseg_ref[...], krank_ref[...], kstart_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    k_values = [None if r is None else r[...] for r in kv_refs]
    scale = 1.0 / math.sqrt(k_KH.shape[-1])
    first, end = plan.query_tiles(kj)

    def pair(step: jax.Array, state: tuple) -> tuple:
        qi = end - 1 - step
        q_first = qi * plan.size_q
        queries = pl.ds(pl.multiple_of(q_first, plan.size_q), plan.size_q)
        q_seg_Q = qseg_ref[queries]

        def compute(state: tuple) -> tuple:
            dk_KH, dv_KW, dksel_KH, r_K, dkv, dparams = state
            r_out_ref[pl.ds(qi, 1), :] = r_K[None, :]
            allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            q_QH, do_QW, q_sel_QH = q_ref[queries, :], do_ref[queries, :], qsel_ref[queries, :]
            keep = keep_QK(q_first, k_first, q_seg_Q, k_seg_K, k_starts_K)
            prefix_K = prefix_ref[pl.ds(qi, 1), :][0]
            q_values = [None if r is None else r[queries] for r in qv_refs]
            q_pos_Q = qpos_ref[queries]

            def bias(p: list, kv: list) -> jax.Array | None:
                return term_bias(plan, (p, q_values, kv), q_pos_Q, k_pos_K)

            bias_QK, pull = jax.vjp(bias, params, k_values) if plan.biases else (None, None)
            p_QK, ds_QK, dl_QK = pair_gradients(
                nonlinearity,
                (q_QH, k_KH, v_KW, do_QW, allowed_QK, bias_QK),
                (q_sel_QH, k_sel_KH, keep, prefix_K),
                (lse_ref[queries], delta_ref[queries], r_K),
                gpu_scan(),
            )
            dv_KW = dv_KW + dot_f32(p_QK.astype(do_QW.dtype), do_QW, (0, 0))
            dk_KH = dk_KH + dot_f32((ds_QK * scale).astype(q_QH.dtype), q_QH, (0, 0))
            dksel_KH = dksel_KH + dot_f32(dl_QK.astype(q_sel_QH.dtype), q_sel_QH, (0, 0))
            if dkv or dparams:
                g_params, g_kv = pull(ds_QK)
                dkv, dparams = add_present(dkv, g_kv), add_present(dparams, g_params)
            return dk_KH, dv_KW, dksel_KH, r_K - jnp.sum(ds_QK, axis=0), dkv, dparams

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return jax.lax.cond(live, compute, lambda s: s, state)

    init = (
        jnp.zeros(k_KH.shape, jnp.float32),
        jnp.zeros(v_KW.shape, jnp.float32),
        jnp.zeros(k_sel_KH.shape, jnp.float32),
        jnp.zeros((plan.size_k,), jnp.float32),
        [jnp.zeros((plan.size_k,), jnp.float32) for _ in dkv_refs],
        [jnp.zeros(r.shape, jnp.float32) for r in dp_refs],
    )
    dk_KH, dv_KW, dksel_KH, _, dkv, dparams = jax.lax.fori_loop(0, end - first, pair, init)
    dk_ref[...] = dk_KH
    dv_ref[...] = dv_KW
    dksel_ref[...] = dksel_KH
    for ref, value in zip(dkv_refs + dp_refs, dkv + dparams, strict=True):
        ref[...] = value


def _dq_kernel(*refs, plan: Plan, nonlinearity: str, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    rest = refs[11 + num_term_refs :]
    qsel_ref, ksel_ref, kstart_ref, prefix_ref, r_ref, dq_ref, dqsel_ref, *dqv_refs = rest
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH, do_QW, q_sel_QH, q_seg_Q = q_ref[...], do_ref[...], qsel_ref[...], qseg_ref[...]
    lse_Q, delta_Q, q_pos_Q = lse_ref[...], delta_ref[...], qpos_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]
    scale = 1.0 / math.sqrt(q_QH.shape[-1])

    def pair(kj: jax.Array, state: tuple) -> tuple:
        k_first = kj * plan.size_k
        keys = pl.ds(pl.multiple_of(k_first, plan.size_k), plan.size_k)
        k_seg_K, k_rank_K = kseg_ref[keys], krank_ref[keys]

        def compute(state: tuple) -> tuple:
            dq_QH, dqsel_QH, dqv = state
            allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            k_KH, k_sel_KH, k_pos_K = k_ref[keys, :], ksel_ref[keys, :], kpos_ref[keys]
            keep = keep_QK(q_first, k_first, q_seg_Q, k_seg_K, kstart_ref[keys])
            k_values = [None if r is None else r[keys] for r in kv_refs]

            def bias(qv: list) -> jax.Array | None:
                return term_bias(plan, (params, qv, k_values), q_pos_Q, k_pos_K)

            bias_QK, pull = jax.vjp(bias, q_values) if plan.biases else (None, None)
            _, ds_QK, dl_QK = pair_gradients(
                nonlinearity,
                (q_QH, k_KH, v_ref[keys, :], do_QW, allowed_QK, bias_QK),
                (q_sel_QH, k_sel_KH, keep, prefix_ref[keys]),
                (lse_Q, delta_Q, r_ref[keys]),
                gpu_scan(),
            )
            dq_QH = dq_QH + dot_f32((ds_QK * scale).astype(k_KH.dtype), k_KH, (1, 0))
            dqsel_QH = dqsel_QH + dot_f32(dl_QK.astype(k_sel_KH.dtype), k_sel_KH, (1, 0))
            if dqv:
                dqv = add_present(dqv, pull(ds_QK)[0])
            return dq_QH, dqsel_QH, dqv

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return jax.lax.cond(live, compute, lambda s: s, state)

    first, end = plan.key_tiles(qi)
    init = (jnp.zeros(q_QH.shape, jnp.float32), jnp.zeros(q_sel_QH.shape, jnp.float32))
    init = (*init, [jnp.zeros((plan.size_q,), jnp.float32) for _ in dqv_refs])
    dq_QH, dqsel_QH, dqv = jax.lax.fori_loop(first, end, pair, init)
    dq_ref[...] = dq_QH
    dqsel_ref[...] = dqsel_QH
    for ref, value in zip(dqv_refs, dqv, strict=True):
        ref[...] = value


def selective_backward_calls(
    plan: Plan,
    nonlinearity: str,
    tensors: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    *,
    stats: tuple[jax.Array, jax.Array],
    selectors: dict[str, jax.Array],
    prefix: jax.Array,
    ints: dict[str, jax.Array],
    terms: list[dict],
) -> tuple[jax.Array, jax.Array, jax.Array, list[dict], jax.Array, jax.Array]:
    """Runs the dk / dv kernel, then the dq kernel, on padded inputs.

    Args:
      tensors: (q_BTNH, k_BSGH, v_BSGW, dO_BTNW in the inputs' dtype).
      stats: the forward's log-sum-exp and ``D_i = dO_i . o_i``, both (B, N, T).
      selectors, ints, terms: as :func:`copejax.ops.kernels.selective.selective_forward_call`
        takes them; prefix: the P it returned.

    Returns:
      (dq_BTNH float32, dk_BSNH and dv_BSNW float32 per query head, the terms' gradients as
      :func:`copejax.ops.kernels.backward.backward_calls` returns them, the selecting head's
      d q (B, T, H) and d k (B, S, H) float32, summed over the heads).
    """
    q_BTNH, k_BSGH, v_BSGW, do_BTNW = tensors
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    groups, sq, sk = plan.groups, plan.size_q, plan.size_k
    rows, f32 = rows_of(plan.count_q), jnp.float32
    common = [q_BTNH, k_BSGH, v_BSGW, do_BTNW, *stats]
    common += [ints[key] for key in ("q_pos", "q_seg", "k_pos", "k_seg", "k_rank")]
    selector_in = [selectors["q"], selectors["k"], ints["k_start"], prefix]
    head_tile = lambda size, n_dim: pl.BlockSpec(
        (None, size, None, n_dim), lambda b, n, t: (b, t, n, 0)
    )

    def kernel(body: Callable, has: tuple, term_in: list) -> Callable:
        return functools.partial(
            body, plan=plan, nonlinearity=nonlinearity, has=has, num_term_refs=len(term_in)
        )

    # dk, dv, dk_sel, R and the terms' per-key and parameter gradients: programs over key
    # tiles; queries and their ints whole.
    has, term_in, term_specs = term_operands(plan, terms, q_block=False, k_block=True)
    whole_q = pl.BlockSpec((None, length_q), lambda b, n, j: (b, 0))
    key_tile = pl.BlockSpec((None, sk), lambda b, n, j: (b, j))
    k_terms = [i for i, t in enumerate(terms) if t["k"] is not None]
    p_terms = [i for i, t in enumerate(terms) if t["params"] is not None]
    p_sizes = [terms[i]["params"].shape[1] for i in p_terms]
    out_specs = [
        head_tile(sk, dim),
        head_tile(sk, width),
        head_tile(sk, dim),
        pl.BlockSpec((None, None, rows, sk), lambda b, n, j: (b, n, 0, j)),
    ]
    out_specs += [pl.BlockSpec((None, None, sk), lambda b, n, j: (b, n, j)) for _ in k_terms]
    out_specs += [
        pl.BlockSpec((None, None, None, size), lambda b, n, j: (b, n, j, 0)) for size in p_sizes
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, length_k, heads, dim), f32),
        jax.ShapeDtypeStruct((batch, length_k, heads, width), f32),
        jax.ShapeDtypeStruct((batch, length_k, heads, dim), f32),
        jax.ShapeDtypeStruct((batch, heads, rows, length_k), f32),
    ]
    out_shape += [jax.ShapeDtypeStruct((batch, heads, length_k), f32) for _ in k_terms]
    out_shape += [jax.ShapeDtypeStruct((batch, heads, plan.count_k, size), f32) for size in p_sizes]
    dk_BSNH, dv_BSNW, dksel_BSNH, carry, *rest = pl.pallas_call(
        kernel(_dkdv_kernel, has, term_in),
        grid=(batch, heads, plan.count_k),
        in_specs=[
            pl.BlockSpec((None, length_q, None, dim), lambda b, n, j: (b, 0, n, 0)),
            pl.BlockSpec((None, sk, None, dim), lambda b, n, j: (b, j, n // groups, 0)),
            pl.BlockSpec((None, sk, None, width), lambda b, n, j: (b, j, n // groups, 0)),
            pl.BlockSpec((None, length_q, None, width), lambda b, n, j: (b, 0, n, 0)),
            pl.BlockSpec((None, None, length_q), lambda b, n, j: (b, n, 0)),
            pl.BlockSpec((None, None, length_q), lambda b, n, j: (b, n, 0)),
            whole_q,
            whole_q,
            key_tile,
            key_tile,
            key_tile,
            *term_specs,
            pl.BlockSpec((None, length_q, dim), lambda b, n, j: (b, 0, 0)),
            pl.BlockSpec((None, sk, dim), lambda b, n, j: (b, j, 0)),
            key_tile,
            pl.BlockSpec((None, rows, sk), lambda b, n, j: (b, 0, j)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_attention_dkdv",
    )(*common, *term_in, *selector_in)
    dkv, dparams = rest[: len(k_terms)], rest[len(k_terms) :]

    # dq, dq_sel and the terms' per-query gradients: programs over query tiles; keys, values
    # and their ints whole.
    has, term_in, term_specs = term_operands(plan, terms, q_block=True, k_block=False)
    whole_k = pl.BlockSpec((None, length_k), lambda b, n, i: (b, 0))
    query_tile = pl.BlockSpec((None, sq), lambda b, n, i: (b, i))
    query_stat = pl.BlockSpec((None, None, sq), lambda b, n, i: (b, n, i))
    q_terms = [i for i, t in enumerate(terms) if t["q"] is not None]
    dq_BTNH, dqsel_BTNH, *dqv = pl.pallas_call(
        kernel(_dq_kernel, has, term_in),
        grid=(batch, heads, plan.count_q),
        in_specs=[
            head_tile(sq, dim),
            pl.BlockSpec((None, length_k, None, dim), lambda b, n, i: (b, 0, n // groups, 0)),
            pl.BlockSpec((None, length_k, None, width), lambda b, n, i: (b, 0, n // groups, 0)),
            head_tile(sq, width),
            query_stat,
            query_stat,
            query_tile,
            query_tile,
            whole_k,
            whole_k,
            whole_k,
            *term_specs,
            pl.BlockSpec((None, sq, dim), lambda b, n, i: (b, i, 0)),
            pl.BlockSpec((None, length_k, dim), lambda b, n, i: (b, 0, 0)),
            whole_k,
            pl.BlockSpec((None, None, length_k), lambda b, n, i: (b, i, 0)),
            pl.BlockSpec((None, None, None, length_k), lambda b, n, i: (b, n, i, 0)),
        ],
        out_specs=[head_tile(sq, dim), head_tile(sq, dim)] + [query_stat for _ in q_terms],
        out_shape=[
            jax.ShapeDtypeStruct(q_BTNH.shape, f32),
            jax.ShapeDtypeStruct((batch, length_q, heads, dim), f32),
        ]
        + [jax.ShapeDtypeStruct((batch, heads, length_q), f32) for _ in q_terms],
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_attention_dq",
    )(*common, *term_in, *selector_in, carry)
    grads = [{"params": None, "q": None, "k": None} for _ in terms]
    for key, indices, values in (
        ("q", q_terms, dqv),
        ("k", k_terms, dkv),
        ("params", p_terms, dparams),
    ):
        for i, g in zip(indices, values, strict=True):
            grads[i][key] = g
    dq_sel_BTH, dk_sel_BSH = jnp.sum(dqsel_BTNH, axis=2), jnp.sum(dksel_BSNH, axis=2)
    return dq_BTNH, dk_BSNH, dv_BSNW, grads, dq_sel_BTH, dk_sel_BSH
