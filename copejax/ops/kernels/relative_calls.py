"""The launches of Shaw's kernels (:mod:`copejax.ops.kernels.relative`): their grids, block
specs and outputs, as :mod:`copejax.ops.kernels.forward` and
:mod:`~copejax.ops.kernels.backward` launch the plain ones (Shaw et al. 2018, arXiv
1803.02155). The table (P', H) float32 is one block every program reads whole; the dq
kernel adds the table's gradient to one (P', H) float32 array per batch row, aliased to
zeros, summed over the batch here. Shape letters as in :mod:`copejax.ops.kernels.forward`;
P' the padded table rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.dkdv_launch import dkdv_operand_specs, dkdv_outputs, term_gradients
from copejax.ops.kernels.operands import term_operands, zeros_after
from copejax.ops.kernels.relative import RelativeStatic
from copejax.ops.kernels.relative_kernels import (
    relative_dkdv_kernel,
    relative_dq_kernel,
    relative_forward_kernel,
)
from copejax.ops.kernels.tiles import Plan
from copejax.ops.kernels.triton_params import compiler_params

INT_KEYS = ("q_pos", "q_seg", "k_pos", "k_seg", "k_rank")


def relative_forward_call(
    plan: Plan,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    v_BSGW: jax.Array,
    *,
    static: RelativeStatic,
    ints: dict[str, jax.Array],
    terms: list[dict],
    table_PH: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The forward kernel on padded inputs (as ``forward_call``; ``table_PH`` padded to
    :func:`~copejax.ops.kernels.relative.padded_rows`). Returns (o_BTNW, lse_BNT) float32."""
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    groups, sq = plan.groups, plan.size_q
    in_specs = [
        pl.BlockSpec((None, sq, None, dim), lambda b, n, i: (b, i, n, 0)),
        pl.BlockSpec((None, length_k, None, dim), lambda b, n, i: (b, 0, n // groups, 0)),
        pl.BlockSpec((None, length_k, None, width), lambda b, n, i: (b, 0, n // groups, 0)),
        pl.BlockSpec((None, sq), lambda b, n, i: (b, i)),
        pl.BlockSpec((None, sq), lambda b, n, i: (b, i)),
    ] + [pl.BlockSpec((None, length_k), lambda b, n, i: (b, 0))] * 3
    has, term_in, term_specs = term_operands(plan, terms, q_block=True, k_block=False)
    table_spec = pl.BlockSpec(table_PH.shape, lambda b, n, i: (0, 0))
    body = functools.partial(relative_forward_kernel, plan=plan, static=static, has=has)
    o_BTNW, lse_BNT = pl.pallas_call(
        functools.partial(body, n=len(term_in)),
        grid=(batch, heads, plan.count_q),
        in_specs=in_specs + term_specs + [table_spec],
        out_specs=[
            pl.BlockSpec((None, sq, None, width), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, None, sq), lambda b, n, i: (b, n, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, length_q, heads, width), jnp.float32),
            jax.ShapeDtypeStruct((batch, heads, length_q), jnp.float32),
        ],
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_attention_forward",
    )(q_BTNH, k_BSGH, v_BSGW, *[ints[key] for key in INT_KEYS], *term_in, table_PH)
    return o_BTNW, lse_BNT


def relative_backward_calls(
    plan: Plan,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    v_BSGW: jax.Array,
    do_BTNW: jax.Array,
    *,
    static: RelativeStatic,
    lse_BNT: jax.Array,
    delta_BNT: jax.Array,
    ints: dict[str, jax.Array],
    terms: list[dict],
    table_PH: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, list[dict], jax.Array]:
    """Both backward kernels on padded inputs (as ``backward_calls``).

    Returns:
      (dq_BTNH in q's dtype, dk_BSNH and dv_BSNW float32 per query head, the terms'
      gradients as ``backward_calls`` gives them, the table's gradient (P', H) float32).
    """
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    groups, sq = plan.groups, plan.size_q
    ints_in = [ints[key] for key in INT_KEYS]
    residuals = (q_BTNH, k_BSGH, v_BSGW, do_BTNW, lse_BNT, delta_BNT, *ints_in)
    f32 = jnp.float32
    table_spec = pl.BlockSpec(table_PH.shape, lambda b, n, i: (0, 0))

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
    de_spec = pl.BlockSpec((None, *table_PH.shape), lambda b, n, i: (b, 0, 0))
    out_specs += [de_spec]
    out_shape = [jax.ShapeDtypeStruct(q_BTNH.shape, q_BTNH.dtype)]
    out_shape += [jax.ShapeDtypeStruct((batch, heads, length_q), f32) for _ in q_terms]
    out_shape += [jax.ShapeDtypeStruct((batch, *table_PH.shape), f32)]
    # added to with atomics from these zeros (tied to D, see zeros_after), the last input
    de_zeros = zeros_after(delta_BNT[0, 0, 0] * 0.0, (batch, *table_PH.shape))
    in_specs = specs + term_specs + [table_spec, de_spec]
    body = functools.partial(relative_dq_kernel, plan=plan, static=static, has=has)
    dq_BTNH, *dqv, de_BPH = pl.pallas_call(
        functools.partial(body, n=len(term_in)),
        grid=(batch, heads, plan.count_q),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={len(in_specs) - 1: len(out_specs) - 1},
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_attention_dq",
    )(*residuals, *term_in, table_PH, de_zeros)

    has, term_in, term_specs = term_operands(plan, terms, q_block=False, k_block=True)
    specs = dkdv_operand_specs(plan, length_q=length_q, dim=dim, width=width)
    sizes = {"batch": batch, "heads": heads, "length_k": length_k, "dim": dim, "width": width}
    out_specs, out_shape = dkdv_outputs(plan, terms, **sizes)
    body = functools.partial(relative_dkdv_kernel, plan=plan, static=static, has=has)
    dk_BSNH, dv_BSNW, *rest = pl.pallas_call(
        functools.partial(body, n=len(term_in)),
        grid=(batch, heads, plan.count_k),
        in_specs=specs + term_specs + [table_spec],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_attention_dkdv",
    )(*residuals, *term_in, table_PH)
    grads = term_gradients(terms, dqv, rest)
    return dq_BTNH, dk_BSNH, dv_BSNW, grads, jnp.sum(de_BPH, axis=0)
