"""The fused attention backward kernels on TPU (FlashAttention-2, Dao 2023, arXiv 2307.08691).

The maths of :mod:`copejax.ops.kernels.backward` (``P_ij = exp(s_ij - L_i)``,
``dS_ij = P_ij (dO_i . v_j - D_i)``, the terms' inputs through ``jax.vjp`` of their tile
functions) on Pallas Mosaic TPU (:mod:`copejax.ops.kernels.tpu_params`): the dq kernel
(:mod:`copejax.ops.kernels.tpu_dq`) with grid (batch row, head, query tile, key tile) and dq
and the terms' per-query gradients in VMEM scratch across the key tiles; the dk / dv
kernel here, with grid (batch row, head, key tile, query tile) and dk, dv, the per-key
gradients and the parameter rows' partial sums in scratch across the query tiles. Each
writes its outputs at the last step of the walked axis; steps whose pair has no allowed
entry do nothing (``pl.when``). With grouped heads dk and dv come out per query head and are
summed over each group outside, as on the GPU. With stick-breaking the dq kernel is
:func:`copejax.ops.kernels.tpu_stick.stick_dq_kernel` and the dk / dv kernel walks the key
tiles newest first with every query's carries in VMEM
(:func:`~copejax.ops.kernels.tpu_stick.stick_pair`); with CoPE the dq kernel is
:func:`copejax.ops.kernels.tpu_cope.cope_dq_kernel`; with Shaw's table both kernels add its
term (:mod:`copejax.ops.kernels.tpu_relative`) and the dq kernel writes its gradient. Shape
letters as in :mod:`copejax.ops.kernels.tpu_forward`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from copejax.ops.kernels.cope_terms import split_params
from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.terms import tile_bias_QK
from copejax.ops.kernels.tiles import Plan
from copejax.ops.kernels.tpu_cope import cope_dq_kernel, cope_pair
from copejax.ops.kernels.tpu_dq import dq_kernel, softmax_pair
from copejax.ops.kernels.tpu_params import (
    ANY,
    by_query_heads,
    compiler_params,
    from_query_heads,
    interpret_mode,
    key_step,
    kv_head,
    read_terms,
    step_live,
    term_operands,
    tile_index,
    tpu_ints,
    tpu_per_head_specs,
    tpu_terms,
    when_live,
)
from copejax.ops.kernels.tpu_relative import (
    RelativeRefs,
    TpuRelative,
    relative_scratch,
)
from copejax.ops.kernels.tpu_rows import (
    add_row_at,
    from_query_rows,
    load_row_at,
    query_rows,
    row_spec,
    rows_shape,
)
from copejax.ops.kernels.tpu_stick import stick_dq_kernel, stick_pair


def _dkdv_kernel(
    *refs, plan: Plan, has: tuple, num_term_refs: int, relative: TpuRelative | None = None
) -> None:
    main = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    # CoPE's parameters, gate keys, count and its cotangent (and then the gate keys'
    # gradient after the terms'); CoPE's count and S or stick-breaking's r and u for every
    # query of the head, last in the scratch (key tiles walked newest first); Shaw's rev, its
    # band and semaphore last
    cope, gate_keys = plan.cope is not None, plan.cope is not None and plan.cope.gate_keys
    num_extra = plan.cope.num_params + gate_keys + 1 if cope else int(relative is not None)
    extra = refs[11 + num_term_refs : 11 + num_term_refs + num_extra]
    outs = refs[11 + num_term_refs + num_extra :]
    num_grads = 2 + sum(h[2] for h in has) + sum(h[0] for h in has) + gate_keys
    grad_refs, all_accs = outs[:num_grads], outs[num_grads:]
    rel = None
    if relative is not None:
        rel, all_accs = RelativeRefs(relative, extra[0], *all_accs[-2:]), all_accs[:-2]
    newest_first = plan.stick or cope  # the carries sum over newer key tiles
    carries = all_accs[-2:] if newest_first else ()
    all_accs = all_accs[:-2] if newest_first else all_accs
    accs = all_accs[: len(all_accs) - gate_keys]
    dgk_acc = all_accs[-1] if gate_keys else None
    step, qi = pl.program_id(2), pl.program_id(3)
    kj = key_step(plan, step, newest_first=newest_first)

    @pl.when(qi == 0)
    def _init() -> None:
        for acc in all_accs:
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    if carries:  # the newest key tile: nothing newer yet for any query

        @pl.when((step == 0) & (qi == 0))
        def _init_carries() -> None:
            for carry in carries:
                carry[...] = jnp.zeros(carry.shape, jnp.float32)

    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    def compute(allowed_QK: jax.Array | None) -> None:  # None: a full softmax pair
        params, q_values, k_values = read_terms(p_refs, qv_refs, kv_refs)
        terms, term_grads = (params, q_values, k_values), None
        pair_refs = (*main, qpos_ref, kpos_ref)
        entering = tuple(load_row_at(carry, qi) for carry in carries)
        if cope:  # dS here is the content logits' cotangent
            p_QK, ds_QK, term_grads, d_gk, added = cope_pair(
                plan, pair_refs, mask_args, terms, extra, entering=entering
            )
            if dgk_acc is not None:
                dgk_acc[...] += d_gk
        elif plan.stick:
            p_QK, ds_QK, inputs, added = stick_pair(plan, pair_refs, mask_args, terms, entering)
        else:
            p_QK, ds_QK, inputs, _ = softmax_pair(plan, pair_refs, allowed_QK, terms, rel)
        for carry, column_Q1 in zip(carries, added if carries else (), strict=True):
            add_row_at(carry, qi, column_Q1)
        q_QH, do_QW = main[0][...], main[3][...]
        scale = 1.0 / math.sqrt(q_QH.shape[-1])
        f32 = jnp.float32
        accs[1][...] += jax.lax.dot(p_QK.T.astype(do_QW.dtype), do_QW, preferred_element_type=f32)
        accs[0][...] += jax.lax.dot(
            (ds_QK * scale).T.astype(q_QH.dtype), q_QH, preferred_element_type=f32
        )
        if len(accs) > 2:

            def bias(p: list, kv: list) -> jax.Array:
                return tile_bias_QK(plan.biases, (p, q_values, kv), *inputs[3:])

            if term_grads is None:
                term_grads = jax.vjp(bias, params, k_values)[1](ds_QK)
            g_params, g_kv = term_grads
            grads = [g for g in g_kv if g is not None] + [g for g in g_params if g is not None]
            for acc, g in zip(accs[2:], grads, strict=True):
                acc[...] += g

    mask_free = not cope and not plan.stick and rel is None
    when_live(plan, live, mask_args, compute, mask_free=mask_free)

    @pl.when(qi == pl.num_programs(3) - 1)
    def _finish() -> None:
        for ref, acc in zip(grad_refs, all_accs, strict=True):
            ref[...] = acc[...].astype(ref.dtype)


def tpu_backward_calls(
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
    relative: tuple[TpuRelative, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, list[dict], dict | None]:
    """Runs both TPU backward kernels, with the arguments and results of
    :func:`copejax.ops.kernels.backward.backward_calls` (the layouts change inside);
    with Shaw's ``relative`` (statics, reversed table) the last result is ``{"relative":
    the reversed table's gradient (X, H)}``.
    """
    batch, _, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    groups, sq, sk, f32 = plan.groups, plan.size_q, plan.size_k, jnp.float32
    ints = tpu_ints(ints)
    operands = [by_query_heads(x) for x in (q_BTNH, k_BSGH, v_BSGW, do_BTNW)]
    operands += [query_rows(plan, lse_BNT), query_rows(plan, delta_BNT)]
    operands += [ints[key] for key in ("q_pos", "q_seg", "k_pos", "k_seg", "k_rank")]
    terms = tpu_terms(plan, terms)
    call = functools.partial(
        pl.pallas_call, interpret=interpret_mode(plan), compiler_params=compiler_params()
    )

    def specs(q_tile, k_tile) -> list[pl.BlockSpec]:
        """The main operands' specs for a grid (b, n, outer, walked)."""
        q_rows = lambda b, n, i, j: (b, n, q_tile(i, j), 0)
        kv_rows = lambda b, n, i, j: (b, kv_head(n, groups), k_tile(i, j), 0)
        return [
            pl.BlockSpec((None, None, sq, dim), q_rows),
            pl.BlockSpec((None, None, sk, dim), kv_rows),
            pl.BlockSpec((None, None, sk, width), kv_rows),
            pl.BlockSpec((None, None, sq, width), q_rows),
            row_spec(plan, q_tile),
            row_spec(plan, q_tile),
            pl.BlockSpec((None, sq, 1), lambda b, n, i, j: (b, q_tile(i, j), 0)),
            pl.BlockSpec((None, sq, 1), lambda b, n, i, j: (b, q_tile(i, j), 0)),
        ] + [pl.BlockSpec((None, 1, sk), lambda b, n, i, j: (b, 0, k_tile(i, j)))] * 3

    # dq: grid (b, n, query tile i, key tile j), key tiles clamped to those i may see.
    q_tile = lambda i, j: i
    newest_first = plan.stick or plan.cope is not None  # the carries sum over newer tiles
    k_tile = lambda i, j: tile_index(plan, i, j, keys=True, newest_first=newest_first)
    has, term_in, term_specs = term_operands(plan, terms, q_tile=q_tile, k_tile=k_tile)
    q_terms = [i for i, t in enumerate(terms) if t["q"] is not None]
    q_spec, q_shape = row_spec(plan, lambda i, j: i), rows_shape(plan, batch, heads)
    out_specs = [pl.BlockSpec((None, None, sq, dim), lambda b, n, i, j: (b, n, i, 0))]
    out_specs += [q_spec] * len(q_terms)
    out_shape = [jax.ShapeDtypeStruct(operands[0].shape, q_BTNH.dtype)]
    out_shape += [q_shape] * len(q_terms)
    scratch = [pltpu.VMEM((sq, dim), f32)] + [pltpu.VMEM((sq, 1), f32)] * len(q_terms)
    dq_body, num_outs, extra_in, extra_specs = dq_kernel, 0, [], []
    if plan.stick:  # r and u in scratch
        dq_body = stick_dq_kernel
        scratch += [pltpu.VMEM((sq, 1), f32)] * 2
    gate_k = [] if gate_k_BSGH is None else [by_query_heads(gate_k_BSGH)]
    dq_params, aliases = compiler_params(), {}
    if plan.cope is not None:  # rows' D; parameters' gradients per head (B, N, 1, ..), summed
        # over the query tiles in order (a slab per query tile was (B, N, T / Q, P, H) float32)
        dq_body, num_outs = cope_dq_kernel, 1 + len(cope)
        dq_params = compiler_params(("parallel", "parallel", "arbitrary", "arbitrary"))
        extra_in = [*cope, *gate_k]
        extra_specs = [*tpu_per_head_specs(cope), *specs(q_tile, k_tile)[1:2] * len(gate_k)]
        out_specs.append(q_spec)
        out_shape.append(q_shape)
        for x in cope:
            out_specs.append(
                pl.BlockSpec((None, None, None, *x.shape[1:]), lambda b, n, i, j: (b, n, 0, 0, 0))
            )
            out_shape.append(jax.ShapeDtypeStruct((batch, heads, 1, *x.shape[1:]), f32))
        scratch += [pltpu.VMEM((sq, 1), f32)] * 2 + [pltpu.VMEM((sq, dim), f32)]  # c, S, SM
        scratch += [pltpu.VMEM(x.shape[1:], f32) for x in cope]
        rows = split_params(plan.cope.position_term, cope)[0]
        if rows is not None:  # the queries' table and its cotangent's sum
            scratch += [pltpu.VMEM((sq, rows.shape[1]), f32)] * 2
    if relative is not None:  # rev, and the slab (B, X, H) aliased to zeros, in HBM
        dq_body, num_outs = functools.partial(dq_body, relative=relative[0]), 1
        slab = jnp.zeros((batch, *relative[1].shape), f32)
        extra_in, extra_specs = [relative[1], slab], [ANY, ANY]
        aliases = {len(operands) + len(term_in) + 1: len(out_shape)}
        out_specs.append(ANY)
        out_shape.append(jax.ShapeDtypeStruct(slab.shape, f32))
        scratch += relative_scratch(relative[0], dim, slab=True)
        dq_params = compiler_params(("parallel", "arbitrary", "arbitrary", "arbitrary"))
    dq_BNTH, *dqv = call(
        functools.partial(dq_body, plan=plan, has=has, num_term_refs=len(term_in)),
        grid=(batch, heads, plan.count_q, plan.count_k),
        in_specs=specs(q_tile, k_tile) + term_specs + extra_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=dq_params,
        input_output_aliases=aliases,
        name="copejax_attention_dq_tpu",
    )(*operands, *term_in, *extra_in)
    outs = dqv[len(dqv) - num_outs :]
    dqv = dqv[: len(dqv) - num_outs]
    d_cope, extra_in, extra_specs, dkdv_body, rows_in = None, [], [], _dkdv_kernel, []
    if relative is not None:  # the table's gradient; the dk / dv kernel reads rev
        d_cope = {"relative": jnp.sum(outs[0], axis=0)}
        extra_in, extra_specs = [relative[1]], [ANY]
        dkdv_body = functools.partial(_dkdv_kernel, relative=relative[0])
    if plan.cope is not None:  # the dk / dv kernel reads the rows' D (after the gate keys)
        d_cope = {"params": tuple(jnp.sum(g, axis=(0, 2)) for g in outs[1:]), "gate_k": None}
        rows_in = [outs[0]]
        extra_in = [*cope, *gate_k]
        extra_specs = tpu_per_head_specs(cope)

    # dk, dv: grid (b, n, key step j, query tile i), query tiles clamped to those seeing the
    # step's key tile (stick-breaking and CoPE: the key tiles newest first, their carries for
    # every query of the head in scratch).
    k_tile = lambda j, i: key_step(plan, j, newest_first=newest_first)
    q_tile = lambda j, i: tile_index(plan, k_tile(j, i), i, keys=False)
    has, term_in, term_specs = term_operands(plan, terms, q_tile=q_tile, k_tile=k_tile)
    k_terms = [i for i, t in enumerate(terms) if t["k"] is not None]
    p_terms = [i for i, t in enumerate(terms) if t["params"] is not None]
    p_sizes = [terms[i]["params"].shape[-1] for i in p_terms]
    k_spec = pl.BlockSpec((None, None, 1, sk), lambda b, n, j, i: (b, n, 0, k_tile(j, i)))
    out_specs = [
        pl.BlockSpec((None, None, sk, dim), lambda b, n, j, i: (b, n, k_tile(j, i), 0)),
        pl.BlockSpec((None, None, sk, width), lambda b, n, j, i: (b, n, k_tile(j, i), 0)),
    ] + [k_spec] * len(k_terms)
    out_specs += [
        pl.BlockSpec((None, None, None, 1, size), lambda b, n, j, i: (b, n, k_tile(j, i), 0, 0))
        for size in p_sizes
    ]
    # dk, dv per query head: float32 to be summed over each group, else k's and v's dtypes
    dk_dtype, dv_dtype = (k_BSGH.dtype, v_BSGW.dtype) if groups == 1 else (f32, f32)
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, length_k, dim), dk_dtype),
        jax.ShapeDtypeStruct((batch, heads, length_k, width), dv_dtype),
    ] + [jax.ShapeDtypeStruct((batch, heads, 1, length_k), f32)] * len(k_terms)
    out_shape += [
        jax.ShapeDtypeStruct((batch, heads, plan.count_k, 1, size), f32) for size in p_sizes
    ]
    scratch = [pltpu.VMEM((sk, dim), f32), pltpu.VMEM((sk, width), f32)]
    scratch += [pltpu.VMEM((1, sk), f32)] * len(k_terms)
    scratch += [pltpu.VMEM((1, size), f32) for size in p_sizes]
    if gate_k:  # read like k; their gradient per query head, like dk
        extra_specs = [*extra_specs, specs(q_tile, k_tile)[1]]
        out_specs.append(out_specs[0])
        out_shape.append(jax.ShapeDtypeStruct((batch, heads, length_k, dim), f32))
        scratch.append(scratch[0])
    params = compiler_params()
    if relative is not None:
        scratch += relative_scratch(relative[0], dim, slab=False)
    if newest_first:  # two carries per query of the head, across the key steps
        scratch += [pltpu.VMEM((plan.count_q, sq), f32)] * 2
        params = compiler_params(("parallel", "parallel", "arbitrary", "arbitrary"))
    rows_specs = [row_spec(plan, q_tile)] * len(rows_in)
    dk_BNSH, dv_BNSW, *rest = call(
        functools.partial(dkdv_body, plan=plan, has=has, num_term_refs=len(term_in)),
        grid=(batch, heads, plan.count_k, plan.count_q),
        in_specs=specs(q_tile, k_tile) + term_specs + extra_specs + rows_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=params,
        name="copejax_attention_dkdv_tpu",
    )(*operands, *term_in, *extra_in, *rows_in)
    if gate_k:
        d_cope["gate_k"] = from_query_heads(rest.pop())
    dkv, dparams = rest[: len(k_terms)], rest[len(k_terms) :]
    grads = [{"params": None, "q": None, "k": None} for _ in terms]
    for i, g in zip(q_terms, dqv, strict=True):
        grads[i]["q"] = from_query_rows(g)
    for i, g in zip(k_terms, dkv, strict=True):
        grads[i]["k"] = g[:, :, 0, :]
    for i, g in zip(p_terms, dparams, strict=True):
        grads[i]["params"] = g[:, :, :, 0, :]
    return (
        from_query_heads(dq_BNTH),
        from_query_heads(dk_BNSH),
        from_query_heads(dv_BNSW),
        grads,
        d_cope,
    )
