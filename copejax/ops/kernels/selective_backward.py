"""Selective attention's penalties in the fused kernels (arXiv 2410.02703), backward.

The scores of head n are ``s^n_ij = l^n_ij - F_ij`` with ``F_ij = sum_{k < i} S_kj``
(:mod:`copejax.ops.kernels.selective`). FlashAttention-2's ``dS^n = P^n (dP^n - D)``
(:mod:`copejax.ops.kernels.backward`) gives dq, dk, dv of head n as usual, and

    dF_ij = -sum_n dS^n_ij,   G_kj = dL/dS_kj = sum_{i > k} dF_ij,
    dl_kj = G_kj S'(l_kj)  (zero where S is),   dq_sel_k = sum_j dl_kj k_sel_j / sqrt(H),
    dk_sel_j = sum_k dl_kj q_sel_k / sqrt(H)

for the selecting head's q and k. Everything after dS is linear, so each head's program
pulls back its own ``-dS^n`` and the heads' parts add up.

On a GPU one kernel does it all (:func:`selective_backward_calls`), programs over (batch row,
head, key tile), each walking the query tiles that see its keys oldest first, as
FlashAttention-2's own backward first did, and keeping nothing from the forward but the
log-sum-exps:

- ``F`` needs the prefix ``P[g, j]``, the sum over the older query tiles' selections: the walk
  sums it again from zero, in the prefix kernel's order, so the scores are the forward's
  (``F = P + L @ S``; tiles outside the attention's mask but with selections, a window with
  sinks, are walked for S alone).
- ``G`` is a suffix sum over queries: for a selector k in query tile g, ``G_kj = R[g, j] +
  W_kj``, with W the tile's own part (``sum_{i in g, i > k} dF_ij``) and ``R[g, j] =
  sum_{m > g} c_m[j]`` the newer tiles' column sums of ``dF``, which an oldest-first walk has
  not seen. By linearity it needs none of them in order: dk_sel's part is
  ``sum_m c_m[j] U_m[j]`` with ``U_m = sum_{g < m} S'(g)^T q_sel(g)``, a (K, H) carry; dq_sel's
  is ``S'(g) (R_total - csum_g)`` with ``csum_g`` the walk's running sum (this tile's
  included), added during the walk, and ``S'(g) R_total`` added by a second walk over the
  same tiles once ``R_total`` is known (one Q x K x H matmul for S and one for the product per
  pair). The split is a cotangent's (a difference of dF sums, of float32's error times
  ``sum |dF|``, the error of the sum itself); F is never a difference.
- dk, dv, the selecting head's dk and the terms' per-key and parameter gradients sum in
  registers; dq (the selecting head's with the selection's) and the terms' per-query
  gradients are added to float32 outputs with atomic adds
  (``jax.experimental.pallas.triton.atomic_add``), one (Q, H) tile per pair. Their order of
  addition varies between runs on a GPU: dq's last bits are not deterministic (interpret
  mode runs the programs in order).

So no buffer grows as T^2: the forward's per-tile prefix (B, count_q, S) is not kept for the
backward, nor any per-tile R, nor per-head partials of the selecting head's gradients; the
extra memory is dq in float32 (B, T, N, H) and the selecting head's dk, (B, S, H) float32.
The selecting head's q and k are read from q and k by the block specs, not copied. Without
grouped heads dk and dv come out in the keys' and values' dtypes; the selecting head's dk is
summed in float32 with the selection's and rounded once.

The TPU's kernel (:mod:`copejax.ops.kernels.tpu_selective_backward`) shares
:func:`pair_gradients`, sums P again in a first walk over the query tiles, oldest first, into
VMEM, then walks them newest first with R in VMEM. Shape letters as in
:mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from copejax.ops.kernels.dkdv_launch import dkdv_operand_specs, dkdv_outputs, term_gradients
from copejax.ops.kernels.operands import term_operands, term_refs, zeros_after
from copejax.ops.kernels.pullbacks import add_present, terms_vjp
from copejax.ops.kernels.selective_tiles import (
    keep_QK,
    newer_sum_QK,
    penalized_scores_QK,
    selection_live,
    selection_QK,
    selection_slope_QK,
    term_bias,
)
from copejax.ops.kernels.terms import pair_grid
from copejax.ops.kernels.tiles import (
    Plan,
    content_logits_QK,
    dot_f32,
    exp_gpu,
    sigmoid_gpu,
    softmax_ds,
)
from copejax.ops.kernels.triton_params import compiler_params, gpu_scan


def pair_gradients(
    nonlinearity: str,
    tiles: tuple,
    selectors: tuple,
    stats: tuple,
    *,
    scan: bool = False,
) -> tuple:
    """(P, dS, dl / sqrt(H) of the selection with the carry R, S) of one pair, float32
    (Q, K); the GPU's and the TPU's (:mod:`copejax.ops.kernels.tpu_selective_backward`)
    kernels.

    ``tiles``: (q, k, v, dO, allowed, the other terms' bias or None); ``selectors`` as
    :func:`~copejax.ops.kernels.selective_tiles.penalized_scores_QK` takes them; ``stats``:
    (lse, D, R at the keys; the GPU's zeros, for the tile's own part of G), as (Q,), (Q,),
    (K,) (GPU) or (Q, 1), (Q, 1), (1, K) (TPU); ``scan``: the sums over the tile's rows as
    prefix sums (the GPU kernels)."""
    q_QH, k_KH, v_KW, do_QW, allowed_QK, bias_QK = tiles
    lse_Q, delta_Q, r_K = stats
    (lse_Q1, r_1K), (delta_Q1, _) = pair_grid(lse_Q, r_K), pair_grid(delta_Q, r_K)
    scores_QK, s_QK = penalized_scores_QK(
        nonlinearity,
        q_QH,
        k_KH,
        selectors,
        allowed_QK,
        bias_QK=bias_QK,
        scan=scan,
        sigmoid=sigmoid_gpu,
    )
    dp_QK = dot_f32(do_QW, v_KW, (1, 1))
    p_QK, ds_QK = softmax_ds(scores_QK, allowed_QK, lse_Q1, dp_QK, delta_Q1, exp=exp_gpu)
    g_QK = r_1K - newer_sum_QK(ds_QK, scan)  # dF = -dS
    scale = 1.0 / math.sqrt(q_QH.shape[-1])
    return p_QK, ds_QK, g_QK * selection_slope_QK(s_QK, nonlinearity) * scale, s_QK


def _backward_kernel(
    *refs, plan: Plan, nonlinearity: str, has: tuple, num_term_refs: int, head: int, own_dk: bool
) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    rest = refs[11 + num_term_refs :]
    qsel_ref, ksel_ref, kstart_ref = rest[:3]
    num_dqv, num_dkv = sum(h[1] for h in has), sum(h[2] for h in has)
    outs = rest[3 + 2 + num_dqv :]  # past the zeros aliased to the atomic outputs
    dk_ref, dv_ref = outs[:2]
    dkv_refs = outs[2 : 2 + num_dkv]
    dp_refs = outs[2 + num_dkv : len(outs) - 2 - num_dqv]
    dq_ref, dksel_ref, *dqv_refs = outs[len(outs) - 2 - num_dqv :]
    n, kj = pl.program_id(1), pl.program_id(2)
    k_first = kj * plan.size_k
    k_KH, v_KW, k_sel_KH, k_pos_K = k_ref[...], v_ref[...], ksel_ref[...], kpos_ref[...]
    k_seg_K, k_rank_K, k_starts_K = kseg_ref[...], krank_ref[...], kstart_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    k_values = [None if r is None else r[...] for r in kv_refs]
    scale = 1.0 / math.sqrt(k_KH.shape[-1])
    first, end = plan.query_tiles(kj)

    zeros_K = jnp.zeros((plan.size_k,), jnp.float32)
    selecting = jnp.int32(head)  # an array index (the interpreter's rule wants one)

    def tile(qi: jax.Array) -> tuple:
        q_first = qi * plan.size_q
        queries = pl.ds(pl.multiple_of(q_first, plan.size_q), plan.size_q)
        return q_first, queries, qseg_ref[queries]

    def pair(qi: jax.Array, state: tuple) -> tuple:  # oldest first
        q_first, queries, q_seg_Q = tile(qi)

        def compute(state: tuple) -> tuple:
            dk_KH, dv_KW, dksel_KH, p_K, csum_K, u_KH, dkv, dparams = state
            allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            q_QH, do_QW, q_sel_QH = q_ref[queries, :], do_ref[queries, :], qsel_ref[queries, :]
            keep = keep_QK(q_first, k_first, q_seg_Q, k_seg_K, k_starts_K)
            q_values = [None if r is None else r[queries] for r in qv_refs]
            q_pos_Q = qpos_ref[queries]

            def bias(p: list, qv: list, kv: list) -> jax.Array | None:
                return term_bias(plan, (p, qv, kv), q_pos_Q, k_pos_K)

            pulled = plan.biases and (dkv or dparams or dqv_refs)
            bias_QK, pull = (
                terms_vjp(plan.biases, (params, q_values, k_values), q_pos_Q, k_pos_K)
                if pulled
                else (None, None)
            )
            if plan.biases and not pulled:
                bias_QK = bias(params, q_values, k_values)
            p_QK, ds_QK, dl_QK, s_QK = pair_gradients(  # dl: the tile's own part of G
                nonlinearity,
                (q_QH, k_KH, v_KW, do_QW, allowed_QK, bias_QK),
                (q_sel_QH, k_sel_KH, keep, p_K),
                (lse_ref[queries], delta_ref[queries], zeros_K),
                scan=gpu_scan(),
            )
            # This tile's column sums of S and of dF = -dS; the older tiles' part of dk_sel
            # (sum_m c_m U_m, U_m the older tiles' S'^T q_sel), then U takes this tile's.
            c_K = -jnp.sum(ds_QK, axis=0)
            p_K, csum_K = p_K + jnp.sum(s_QK, axis=0), csum_K + c_K
            slope_QK = selection_slope_QK(s_QK, nonlinearity)  # exact in bfloat16 for relu
            dksel_KH = dksel_KH + c_K[:, None] * u_KH
            u_KH = u_KH + dot_f32(slope_QK.astype(q_sel_QH.dtype), q_sel_QH, (0, 0)) * scale
            if pulled:
                g_params, g_qv, g_kv = pull(ds_QK)
                dkv, dparams = add_present(dkv, g_kv), add_present(dparams, g_params)
                for ref, g in zip(dqv_refs, [g for g in g_qv if g is not None], strict=True):
                    pltriton.atomic_add(ref, (queries,), g)
            dv_KW = dv_KW + dot_f32(p_QK.astype(do_QW.dtype), do_QW, (0, 0))
            ds_QK = (ds_QK * scale).astype(q_QH.dtype)
            dk_KH = dk_KH + dot_f32(ds_QK, q_QH, (0, 0))
            pltriton.atomic_add(
                dq_ref, (queries, n, slice(None)), dot_f32(ds_QK.astype(k_KH.dtype), k_KH, (1, 0))
            )
            dksel_KH = dksel_KH + dot_f32(dl_QK.astype(q_sel_QH.dtype), q_sel_QH, (0, 0))
            # dq_sel's G less the total of the newer tiles' dF (the second walk adds it):
            # R[g] = R_total - csum (this tile's included)
            dl_QK = (dl_QK - slope_QK * (csum_K * scale)[None, :]).astype(k_sel_KH.dtype)
            dqsel_QH = dot_f32(dl_QK, k_sel_KH, (1, 0))
            pltriton.atomic_add(dq_ref, (queries, selecting, slice(None)), dqsel_QH)
            return dk_KH, dv_KW, dksel_KH, p_K, csum_K, u_KH, dkv, dparams

        def selections(state: tuple) -> tuple:  # no allowed pair, but selections: P's part
            keep = keep_QK(q_first, k_first, q_seg_Q, k_seg_K, k_starts_K)
            logits_QK = content_logits_QK(qsel_ref[queries, :], k_sel_KH)
            s_QK = selection_QK(logits_QK, keep, nonlinearity, sigmoid_gpu)
            return (*state[:3], state[3] + jnp.sum(s_QK, axis=0), *state[4:])

        def masked(state: tuple) -> tuple:
            selects = selection_live(plan, q_first, k_first, q_seg_Q, k_seg_K)
            return jax.lax.cond(selects, selections, lambda s: s, state)

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return jax.lax.cond(live, compute, masked, state)

    init = (
        jnp.zeros(k_KH.shape, jnp.float32),
        jnp.zeros(v_KW.shape, jnp.float32),
        jnp.zeros(k_sel_KH.shape, jnp.float32),
        zeros_K,
        zeros_K,
        jnp.zeros(k_sel_KH.shape, jnp.float32),
        [jnp.zeros((plan.size_k,), jnp.float32) for _ in dkv_refs],
        [jnp.zeros(r.shape, jnp.float32) for r in dp_refs],
    )
    dk_KH, dv_KW, dksel_KH, _, total_K, _, dkv, dparams = jax.lax.fori_loop(first, end, pair, init)
    # The second walk: dq_sel's share of R_total, the column sums of dF over every tile.
    total_KH = (total_K[:, None] * k_sel_KH.astype(jnp.float32)).astype(k_sel_KH.dtype)

    def share(qi: jax.Array, carry: jax.Array) -> jax.Array:
        q_first, queries, q_seg_Q = tile(qi)

        def add(carry: jax.Array) -> jax.Array:
            keep = keep_QK(q_first, k_first, q_seg_Q, k_seg_K, k_starts_K)
            logits_QK = content_logits_QK(qsel_ref[queries, :], k_sel_KH)
            slope_QK = selection_slope_QK(
                selection_QK(logits_QK, keep, nonlinearity, sigmoid_gpu), nonlinearity
            )
            dqsel_QH = dot_f32(slope_QK.astype(total_KH.dtype), total_KH, (1, 0)) * scale
            pltriton.atomic_add(dq_ref, (queries, selecting, slice(None)), dqsel_QH)
            return carry

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        live &= selection_live(plan, q_first, k_first, q_seg_Q, k_seg_K)
        return jax.lax.cond(live, add, lambda c: c, carry)

    jax.lax.fori_loop(first, end, share, kj * 0)
    dk_ref[...] = dk_KH.astype(dk_ref.dtype)
    dv_ref[...] = dv_KW.astype(dv_ref.dtype)
    if own_dk:  # without grouped heads: the selecting head's dk, summed in float32 with
        # the selection's (its dk_ref, in k's dtype, is not read)
        dksel_KH = dksel_KH + jnp.where(n == head, dk_KH, 0.0)
    pltriton.atomic_add(dksel_ref, (slice(None), slice(None)), dksel_KH)
    for ref, value in zip(dkv_refs + dp_refs, dkv + dparams, strict=True):
        ref[...] = value


def selective_backward_calls(
    plan: Plan,
    nonlinearity: str,
    tensors: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    *,
    head: int,
    stats: tuple[jax.Array, jax.Array],
    ints: dict[str, jax.Array],
    terms: list[dict],
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], list[dict]]:
    """Runs the backward kernel on padded inputs.

    Args:
      tensors: (q_BTNH, k_BSGH, v_BSGW, dO_BTNW in the inputs' dtype).
      head: the selecting query head.
      stats: the forward's log-sum-exp and ``D_i = dO_i . o_i``, both (B, N, T).
      ints, terms: as :func:`copejax.ops.kernels.selective.selective_forward_call`
        takes them.

    Returns:
      ((dq_BTNH, dk_BSGH, dv_BSGW) in the inputs' dtypes, the selection's gradients added to
      the selecting head's q and its key/value head's k; the terms' gradients as
      :func:`copejax.ops.kernels.backward.backward_calls` returns them).
    """
    q_BTNH, k_BSGH, v_BSGW, do_BTNW = tensors
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width, kv_heads = k_BSGH.shape[1], v_BSGW.shape[-1], k_BSGH.shape[2]
    f32, sk = jnp.float32, plan.size_k
    grouped = plan.groups > 1
    has, term_in, term_specs = term_operands(plan, terms, q_block=False, k_block=True)
    q_terms = [t for t in terms if t["q"] is not None]
    specs = dkdv_operand_specs(plan, length_q=length_q, dim=dim, width=width)
    specs += term_specs
    kv_head = head // plan.groups
    specs += [  # the selecting head's q and k, the keys' segment starts
        pl.BlockSpec((None, length_q, None, dim), lambda b, n, j: (b, 0, head, 0)),
        pl.BlockSpec((None, sk, None, dim), lambda b, n, j: (b, j, kv_head, 0)),
        pl.BlockSpec((None, sk), lambda b, n, j: (b, j)),
    ]
    sizes = {"batch": batch, "heads": heads, "length_k": length_k, "dim": dim, "width": width}
    dtypes = (f32, f32) if grouped else (k_BSGH.dtype, v_BSGW.dtype)
    out_specs, out_shape = dkdv_outputs(plan, terms, **sizes, dtypes=dtypes)
    # Added to with atomics, from zeros aliased to them: dq, the selecting head's dq and dk,
    # the terms' per-query gradients.
    atomic_specs = [
        pl.BlockSpec((None, length_q, heads, dim), lambda b, n, j: (b, 0, 0, 0)),
        pl.BlockSpec((None, sk, dim), lambda b, n, j: (b, j, 0)),
    ] + [pl.BlockSpec((None, None, length_q), lambda b, n, j: (b, n, 0)) for _ in q_terms]
    zero = stats[1][0, 0, 0] * 0.0  # tied to the backward's D (see zeros_after)
    zeros = [zeros_after(zero, q_BTNH.shape), zeros_after(zero, (batch, length_k, dim))]
    zeros += [zeros_after(zero, (batch, heads, length_q)) for _ in q_terms]
    first = len(specs)
    aliases = {first + i: len(out_specs) + i for i in range(len(zeros))}
    kernel = functools.partial(
        _backward_kernel,
        plan=plan,
        nonlinearity=nonlinearity,
        has=has,
        num_term_refs=len(term_in),
        head=head,
        own_dk=not grouped,
    )
    dk_BSNH, dv_BSNW, *rest = pl.pallas_call(
        kernel,
        grid=(batch, heads, plan.count_k),
        in_specs=specs + atomic_specs,
        out_specs=out_specs + atomic_specs,
        out_shape=out_shape + [jax.ShapeDtypeStruct(z.shape, f32) for z in zeros],
        input_output_aliases=aliases,
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_selective_backward",
    )(
        q_BTNH,
        k_BSGH,
        v_BSGW,
        do_BTNW,
        *stats,
        *[ints[key] for key in ("q_pos", "q_seg", "k_pos", "k_seg", "k_rank")],
        *term_in,
        q_BTNH,
        k_BSGH,
        ints["k_start"],
        *zeros,
    )
    per_key, (dq_BTNH, dksel_BSH, *dqv) = rest[: -len(zeros)], rest[-len(zeros) :]
    dq_BTNH = dq_BTNH.astype(q_BTNH.dtype)
    if grouped:  # per query head, float32: summed over each group, then the selection's

        def per_kv_head(x_BSNW: jax.Array) -> jax.Array:
            x = x_BSNW.reshape(batch, length_k, kv_heads, plan.groups, -1)
            return jnp.sum(x, axis=3)

        dk_BSGH = per_kv_head(dk_BSNH).at[:, :, kv_head].add(dksel_BSH).astype(k_BSGH.dtype)
        dv_BSGW = per_kv_head(dv_BSNW).astype(v_BSGW.dtype)
    else:  # dksel holds the selecting head's dk too
        dk_BSGH = dk_BSNH.at[:, :, kv_head].set(dksel_BSH.astype(k_BSGH.dtype))
        dv_BSGW = dv_BSNW
    return (dq_BTNH, dk_BSGH, dv_BSGW), term_gradients(terms, dqv, per_key)
