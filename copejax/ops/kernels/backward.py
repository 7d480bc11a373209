"""The fused attention backward kernels (FlashAttention-2, Dao 2023, arXiv 2307.08691).

With ``P_ij = exp(s_ij - L_i)`` on allowed pairs (``L`` the forward's log-sum-exp) and
``D_i = sum_w dO_iw O_iw`` (computed before the kernels):

    dV_j  = sum_i P_ij dO_i
    dP_ij = dO_i . v_j
    dS_ij = P_ij (dP_ij - D_i)
    dq_i  = sum_j dS_ij k_j / sqrt(H),   dk_j = sum_i dS_ij q_i / sqrt(H)

and the terms' inputs get ``dS`` pulled back through their tile functions (``jax.vjp``
traced into the kernel; :mod:`copejax.ops.kernels.terms` states the contract). Two kernels,
so that no program writes another's output: one program per (batch row, head, query tile)
walks the key tiles for dq and the terms' per-query values; one per (batch row, head, key
tile) walks the query tiles for dk, dv, the terms' per-key values and their parameters
(one partial sum per key tile, added up outside). Both skip pairs with no allowed entry.
With grouped heads, dk and dv come out per query head and are summed over each group
outside. Stick-breaking's and CoPE's dk / dv programs own a carry group of key tiles instead
(:mod:`copejax.ops.kernels.carry_groups`). Shape letters as in
:mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.cope_backward import cope_dkdv_kernel, cope_dq_kernel
from copejax.ops.kernels.dkdv_launch import dkdv_operand_specs, dkdv_outputs, term_gradients
from copejax.ops.kernels.key_tile import QueryTile, key_tile_program
from copejax.ops.kernels.operands import (
    per_head_specs,
    term_operands,
    term_refs,
    zeros_after,
)
from copejax.ops.kernels.pullbacks import (
    pull_query_values,
)
from copejax.ops.kernels.separable import origins
from copejax.ops.kernels.stick import stick_dkdv_kernel, stick_dq_kernel
from copejax.ops.kernels.tiles import LOG2E, Plan, dot_f32, scores_QK, softmax_ds
from copejax.ops.kernels.triton_params import compiler_params


def _pair_grads(plan: Plan, q_QH, k_KH, v_KW, *, do_QW, lse_Q, delta_Q, allowed_QK, inputs, at):
    """(P, dS) of one pair, float32 (Q, K); ``inputs`` as :func:`scores_QK` reads them, ``at``
    the separable terms' origins: their rows stay out of the scores and come off L instead,
    as in the forward (:mod:`copejax.ops.kernels.separable`)."""
    s_QK, rows_Q = scores_QK(
        plan, q_QH, k_KH, allowed_QK, inputs, unit=LOG2E, at=at, split_rows=True
    )
    if rows_Q is not None:
        lse_Q = lse_Q - rows_Q
    dp_QK = dot_f32(do_QW, v_KW, (1, 1))
    return softmax_ds(s_QK, allowed_QK, lse_Q, dp_QK, delta_Q, log2=True)


def _dq_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    dq_ref, *dqv_refs = refs[11 + num_term_refs :]
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH, do_QW = q_ref[...], do_ref[...]
    lse_Q, delta_Q = lse_ref[...], delta_ref[...]
    q_pos_Q, q_seg_Q = qpos_ref[...], qseg_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]
    scale = 1.0 / math.sqrt(q_ref.shape[-1])
    at = origins(plan.biases, params, q_values, q_pos_Q)  # separable terms': once per program

    def pair(kj: jax.Array, state: tuple) -> tuple:
        k_first, keys, k_seg_K, k_rank_K = plan.key_tile(kj, kseg_ref, krank_ref)

        def compute(state: tuple, allowed_QK: jax.Array | None) -> tuple:
            dq_QH, dqv = state
            k_KH, k_pos_K = k_ref[keys, :], kpos_ref[keys]
            k_values = [None if r is None else r[keys] for r in kv_refs]
            inputs = (params, q_values, k_values, q_pos_Q, k_pos_K)
            _, ds_QK = _pair_grads(
                plan,
                q_QH,
                k_KH,
                v_ref[keys, :],
                do_QW=do_QW,
                lse_Q=lse_Q,
                delta_Q=delta_Q,
                allowed_QK=allowed_QK,
                inputs=inputs,
                at=at,
            )
            dq_QH = dq_QH + dot_f32((ds_QK * scale).astype(k_KH.dtype), k_KH, (1, 0))
            return dq_QH, pull_query_values(plan, ds_QK, inputs, dqv)

        mask_args = (q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return plan.run_pair(mask_args, compute, state)

    first, end = plan.key_tiles(qi)
    dqv = [jnp.zeros((plan.size_q,), jnp.float32) for _ in dqv_refs]
    zeros_QH = jnp.zeros((plan.size_q, q_ref.shape[-1]), jnp.float32)
    dq_QH, dqv = jax.lax.fori_loop(first, end, pair, (zeros_QH, dqv))
    dq_ref[...] = dq_QH.astype(dq_ref.dtype)
    for ref, value in zip(dqv_refs, dqv, strict=True):
        ref[...] = value


def _dkdv_kernel(*refs, plan: Plan, has: tuple, num_term_refs: int) -> None:
    lse_ref, delta_ref, kpos_ref = refs[4], refs[5], refs[8]
    p_refs, _, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    params = [None if r is None else r[...] for r in p_refs]
    k_values = [None if r is None else r[...] for r in kv_refs]
    # the separable terms' origins from the key tile, which the walk holds fixed
    at = origins(plan.biases, params, k_values, kpos_ref[...])

    def grads(tile: QueryTile, k_KH: jax.Array, v_KW: jax.Array) -> tuple:
        return _pair_grads(
            plan,
            tile.q_QH,
            k_KH,
            v_KW,
            do_QW=tile.do_QW,
            lse_Q=lse_ref[tile.rows],
            delta_Q=delta_ref[tile.rows],
            allowed_QK=tile.allowed_QK,
            inputs=tile.inputs,
            at=at,
        )

    key_tile_program(
        refs,
        plan=plan,
        has=has,
        num_term_refs=num_term_refs,
        num_extra=0,
        grads=grads,
        mask_free=True,
    )


def backward_calls(
    plan: Plan,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    v_BSGW: jax.Array,
    do_BTNW: jax.Array,
    *,
    lse_BNT: jax.Array,
    delta_BNT: jax.Array,
    ints: dict[str, jax.Array],
    terms: list[dict],
    cope: tuple | None = None,
    gate_k_BSGH: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, list[dict], dict | None]:
    """Runs both backward kernels on padded inputs (see :func:`forward_call`'s arguments).

    Returns:
      (dq_BTNH in q's dtype, dk_BSNH and dv_BSNW per query head (float32 with grouped heads,
      else k's and v's dtypes), the terms'
      gradients {"params": (B, N, count_k, P) partial sums, "q": (B, N, T), "k": (B, N, S)},
      CoPE's gradients {"params": per parameter (N, R, C), "gate_k": (B, S, N, H) float32
      per query head or None}, or None without CoPE).
    """
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    groups, sq = plan.groups, plan.size_q
    ints_in = [ints[key] for key in ("q_pos", "q_seg", "k_pos", "k_seg", "k_rank")]
    f32 = jnp.float32

    # dq: programs over query tiles; keys, values and key ints whole.
    has, term_in, term_specs = term_operands(plan, terms, q_block=True, k_block=False)
    specs = [
        pl.BlockSpec((None, sq, None, dim), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, length_k, None, dim), lambda b, n, i: (b, 0, n // groups, 0)),
        pl.BlockSpec((None, length_k, None, width), lambda b, n, i: (b, 0, n // groups, 0)),
        pl.BlockSpec((None, sq, None, width), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, None, sq), lambda b, n, i: (b, n, i)),
        pl.BlockSpec((None, None, sq), lambda b, n, i: (b, n, i)),
        pl.BlockSpec((None, sq), lambda b, n, i: (b, i)),
        pl.BlockSpec((None, sq), lambda b, n, i: (b, i)),
    ] + [pl.BlockSpec((None, length_k), lambda b, n, i: (b, 0))] * 3
    q_terms = [i for i, t in enumerate(terms) if t["q"] is not None]
    out_specs = [pl.BlockSpec((None, sq, None, dim), lambda b, n, i: (b, i, n, 0))]
    out_specs += [pl.BlockSpec((None, None, sq), lambda b, n, i: (b, n, i)) for _ in q_terms]
    out_shape = [jax.ShapeDtypeStruct(q_BTNH.shape, q_BTNH.dtype)]
    out_shape += [jax.ShapeDtypeStruct((batch, heads, length_q), f32) for _ in q_terms]
    # Per carry group (rows padded to a power of two, with a spare): the carries entering it
    # (stick-breaking's r and u, CoPE's count and S).
    rows = plan.carry_rows
    carry_spec = pl.BlockSpec((None, None, rows, sq), lambda b, n, i: (b, n, 0, i))
    carry_shape = jax.ShapeDtypeStruct((batch, heads, rows, length_q), f32)
    dq_body, extra_in, aliases = _dq_kernel, [], {}
    if plan.stick:
        dq_body = stick_dq_kernel
        out_specs += [carry_spec, carry_spec]
        out_shape += [carry_shape] * 2
    if plan.cope is not None:  # the count and S entering each group, and D; the term's
        # parameters' gradients per batch row and head, added to with atomics from zeros
        # (tied to D, see zeros_after) aliased to them
        gate_k = [gate_k_BSGH] if plan.cope.gate_keys else []
        zero = delta_BNT[0, 0, 0] * 0.0
        zeros = [zeros_after(zero, (batch, *x.shape)) for x in cope]
        dq_body, extra_in = cope_dq_kernel, [*cope, *gate_k, *zeros]
        param_specs = [
            pl.BlockSpec((None, None, *x.shape[1:]), lambda b, n, i: (b, n, 0, 0)) for x in cope
        ]
        term_specs = [*term_specs, *per_head_specs(cope), *specs[1:2] * len(gate_k)]
        first = len(specs) + len(term_specs)
        term_specs += param_specs
        out_specs += [carry_spec] * 2 + [pl.BlockSpec((None, None, sq), lambda b, n, i: (b, n, i))]
        out_shape += [carry_shape] * 2 + [jax.ShapeDtypeStruct((batch, heads, length_q), f32)]
        aliases = {first + i: len(out_specs) + i for i in range(len(cope))}
        out_specs += param_specs
        out_shape += [jax.ShapeDtypeStruct(x.shape, f32) for x in zeros]
    dq_BTNH, *dqv = pl.pallas_call(
        functools.partial(dq_body, plan=plan, has=has, num_term_refs=len(term_in)),
        grid=(batch, heads, plan.count_q),
        in_specs=specs + term_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_attention_dq",
    )(q_BTNH, k_BSGH, v_BSGW, do_BTNW, lse_BNT, delta_BNT, *ints_in, *term_in, *extra_in)
    carries = dqv[len(q_terms) :]
    dqv = dqv[: len(q_terms)]
    d_cope, after = None, []
    if plan.cope is not None:  # the dk / dv kernel reads the counts, S and D
        d_cope = {"params": tuple(jnp.sum(g, axis=0) for g in carries[3:]), "gate_k": None}
        carries, after = carries[:2], [carries[2]]

    # dk, dv: programs over key tiles; queries, output cotangents and query ints whole.
    whole = plan.stick or plan.cope is not None  # one program per carry group (whole rows)
    has, term_in, term_specs = term_operands(plan, terms, q_block=False, k_block=not whole)
    specs = dkdv_operand_specs(plan, length_q=length_q, dim=dim, width=width, whole_keys=whole)
    sizes = {"batch": batch, "heads": heads, "length_k": length_k, "dim": dim, "width": width}
    out_specs, out_shape = dkdv_outputs(
        plan, terms, **sizes, dtypes=(k_BSGH.dtype, v_BSGW.dtype), whole_keys=whole
    )
    carry_specs = [pl.BlockSpec((None, None, None, length_q), lambda b, n, j: (b, n, j, 0))]
    dkdv_body, grid_k = (stick_dkdv_kernel if plan.stick else _dkdv_kernel), plan.count_k
    extra_in, extra_specs = [], []
    if plan.cope is not None:  # the gate keys' gradient per query head, like dk
        dkdv_body, extra_in = cope_dkdv_kernel, [*cope]
        extra_specs = per_head_specs(cope)
        if plan.cope.gate_keys:
            extra_in.append(gate_k_BSGH)
            extra_specs.append(specs[1])
            out_specs.append(out_specs[0])
            out_shape.append(out_shape[0])
    aliases, after_specs = {}, []
    if whole:  # the carries, updated in place: aliased to two more outputs
        grid_k = plan.carry_groups
        first = len(specs) + len(term_in) + len(extra_in)
        aliases = {first: len(out_specs), first + 1: len(out_specs) + 1}
        out_specs += carry_specs * 2
        out_shape += [carry_shape] * 2
        after_specs = [pl.BlockSpec((None, None, length_q), lambda b, n, j: (b, n, 0))] * len(after)
    dk_BSNH, dv_BSNW, *rest = pl.pallas_call(
        functools.partial(dkdv_body, plan=plan, has=has, num_term_refs=len(term_in)),
        grid=(batch, heads, grid_k),
        in_specs=specs + term_specs + extra_specs + carry_specs * len(carries) + after_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
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
        *ints_in,
        *term_in,
        *extra_in,
        *carries,
        *after,
    )
    if whole:  # the carries, spent
        rest = rest[:-2]
    if plan.cope is not None and plan.cope.gate_keys:
        d_cope["gate_k"] = rest.pop()
    return dq_BTNH, dk_BSNH, dv_BSNW, term_gradients(terms, dqv, rest), d_cope
