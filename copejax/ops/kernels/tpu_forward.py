"""The fused attention forward kernel on TPU (FlashAttention-2, Dao 2023, arXiv 2307.08691).

Pallas Mosaic TPU (:mod:`copejax.ops.kernels.tpu_params` says why its layout and grid differ
from the GPU kernel's, :mod:`copejax.ops.kernels.forward`): one grid step per (batch row,
head, query tile, key tile), the key tiles walked in order ("arbitrary") with the online
softmax's running max, sum and output accumulator in VMEM scratch (Milakov & Gimelshein 2018,
arXiv 1805.02867). A step whose pair has no allowed (query, key), or whose key tile lies
outside :meth:`~copejax.ops.kernels.tiles.Plan.key_tiles`, does nothing (``pl.when``). The
masks, the skip test and the scores (content logits plus the terms' tile biases, float32)
are the GPU kernel's (:mod:`copejax.ops.kernels.tiles`). The last step writes the output
(float32) and each query's log-sum-exp ``L_i = m_i + log l_i``. With stick-breaking the
program body is :func:`copejax.ops.kernels.tpu_stick.stick_forward_kernel`.

Shape letters: B batch, T queries, S keys, N query heads, G key/value heads (N = G x
groups), H head dim, W value width, Q / K tile lengths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from copejax.ops.kernels.cope import cope_refs, pair_scores
from copejax.ops.kernels.cope_terms import split_params, term_table_QR
from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.tiles import Plan, content_logits_QK, scores_QK
from copejax.ops.kernels.tpu_params import (
    ANY,
    by_query_heads,
    compiler_params,
    from_query_heads,
    interpret_mode,
    key_step,
    kv_head,
    read_refs,
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
    add_relative,
    relative_scratch,
)
from copejax.ops.kernels.tpu_rows import (
    from_query_rows,
    row_spec,
    rows_shape,
)
from copejax.ops.kernels.tpu_softmax import finish_softmax, init_softmax, softmax_step
from copejax.ops.kernels.tpu_stick import stick_forward_kernel


def _forward_kernel(
    *refs, plan: Plan, has: tuple, num_term_refs: int, relative: TpuRelative | None = None
) -> None:
    """One grid step of the softmax forward; with CoPE (``plan.cope``) the key tiles are
    walked newest first, the count of the newer tiles' gates is carried in scratch (and not
    kept: the backward replays it, :mod:`copejax.ops.kernels.tpu_cope`), and the scores are
    CoPE's (:func:`copejax.ops.kernels.cope.pair_scores`, the queries' table taken at the
    first step into scratch); with Shaw's term (``relative``) the
    scores add it (:mod:`copejax.ops.kernels.tpu_relative`: ``rev`` after the terms, its
    band and semaphore last in the scratch)."""
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[8 : 8 + num_term_refs]), has)
    rest = list(refs[8 + num_term_refs :])
    rel = None
    if relative is not None:
        rel = RelativeRefs(relative, rest[0], rest[-2], rest[-1])
        rest = rest[1:-2]
    cope = plan.cope is not None
    cope_p_refs, gk_ref, rest = cope_refs(rest, plan.cope) if cope else ([], None, rest)
    o_ref, lse_ref, max_ref, sum_ref, acc_ref, *cope_scratch = rest
    c_acc, table_ref = [*cope_scratch, None, None][:2]  # the count; the queries' table
    if cope:
        rows_ref, others = split_params(plan.cope.position_term, tuple(cope_p_refs))
    qi, step = pl.program_id(2), pl.program_id(3)
    kj = key_step(plan, step, newest_first=cope)

    @pl.when(step == 0)
    def _init() -> None:
        init_softmax((max_ref, sum_ref, acc_ref))
        if cope:
            c_acc[...] = jnp.zeros(c_acc.shape, jnp.float32)
        if table_ref is not None:  # the term reads q only through it: once per query tile
            table_ref[...] = term_table_QR(q_ref[...], rows_ref[...])

    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    def compute(allowed_QK: jax.Array | None) -> None:  # None: a full pair
        terms = read_terms(p_refs, qv_refs, kv_refs)
        inputs = (*terms, qpos_ref[...], kpos_ref[...])
        q_QH, k_KH = q_ref[...], k_ref[...]
        if cope:
            s_QK, total_Q1 = pair_scores(
                plan,
                content_logits_QK(q_QH, k_KH),
                q_QH,
                (None if table_ref is None else table_ref[...], read_refs(others)),
                c_Q=c_acc[...],
                allowed_QK=allowed_QK,
                inputs=inputs,
                gk_KH=None if gk_ref is None else gk_ref[...],
            )
            c_acc[...] += total_Q1
        else:
            s_QK = scores_QK(plan, q_QH, k_KH, allowed_QK, inputs)
        if rel is not None:
            s_QK = add_relative(rel, s_QK, q_QH, inputs, allowed_QK)[0]
        softmax_step(s_QK, allowed_QK, v_ref[...], (max_ref, sum_ref, acc_ref))

    when_live(plan, live, mask_args, compute, mask_free=not cope and rel is None)

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish() -> None:
        finish_softmax(plan, o_ref, lse_ref, (max_ref, sum_ref, acc_ref))


def tpu_forward_call(
    plan: Plan,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    v_BSGW: jax.Array,
    *,
    ints: dict[str, jax.Array],
    terms: list[dict],
    cope: tuple | None = None,
    gate_k_BSGH: jax.Array | None = None,
    relative: tuple[TpuRelative, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Runs the TPU forward kernel on padded inputs, with the arguments and results of
    :func:`copejax.ops.kernels.forward.forward_call` (the layouts change inside);
    ``relative``: Shaw's statics and reversed table (:mod:`~copejax.ops.kernels.tpu_relative`).

    Returns:
      (o_BTNW float32, lse_BNT float32 (with stick-breaking minus the log remainder)).
    """
    batch, length_q, heads, dim = q_BTNH.shape
    width, groups = v_BSGW.shape[-1], plan.groups
    sq, sk = plan.size_q, plan.size_k
    newest_first = plan.stick or plan.cope is not None  # the carries sum over newer tiles

    def k_tile(i: jax.Array, j: jax.Array) -> jax.Array:
        return tile_index(plan, i, j, keys=True, newest_first=newest_first)

    ints = tpu_ints(ints)
    specs = [
        pl.BlockSpec((None, None, sq, dim), lambda b, n, i, j: (b, n, i, 0)),
        pl.BlockSpec(
            (None, None, sk, dim), lambda b, n, i, j: (b, kv_head(n, groups), k_tile(i, j), 0)
        ),
        pl.BlockSpec(
            (None, None, sk, width), lambda b, n, i, j: (b, kv_head(n, groups), k_tile(i, j), 0)
        ),
        pl.BlockSpec((None, sq, 1), lambda b, n, i, j: (b, i, 0)),
        pl.BlockSpec((None, sq, 1), lambda b, n, i, j: (b, i, 0)),
    ] + [pl.BlockSpec((None, 1, sk), lambda b, n, i, j: (b, 0, k_tile(i, j)))] * 3
    has, term_in, term_specs = term_operands(
        plan, tpu_terms(plan, terms), q_tile=lambda i, j: i, k_tile=k_tile
    )
    body = stick_forward_kernel if plan.stick else _forward_kernel
    kernel = functools.partial(body, plan=plan, has=has, num_term_refs=len(term_in))
    if relative is not None:
        kernel = functools.partial(kernel, relative=relative[0])
    column = pltpu.VMEM((sq, 1), jnp.float32)
    stats = [column] * (1 if plan.stick else 2)  # r, or max and sum
    out_specs = [
        pl.BlockSpec((None, None, sq, width), lambda b, n, i, j: (b, n, i, 0)),
        row_spec(plan, lambda i, j: i),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, heads, length_q, width), jnp.float32),
        rows_shape(plan, batch, heads),
    ]
    scratch, extra = [*stats, pltpu.VMEM((sq, width), jnp.float32)], []
    if plan.cope is not None:  # parameters, gate keys (like k); the count in scratch
        extra = list(cope)
        term_specs = [*term_specs, *tpu_per_head_specs(cope)]
        if plan.cope.gate_keys:
            extra.append(by_query_heads(gate_k_BSGH))
            term_specs.append(specs[1])
        scratch.append(column)
        rows = split_params(plan.cope.position_term, cope)[0]
        if rows is not None:  # the queries' table
            scratch.append(pltpu.VMEM((sq, rows.shape[1]), jnp.float32))
    if relative is not None:  # rev in HBM after the terms; its band and semaphore
        extra, term_specs = [relative[1]], [*term_specs, ANY]
        scratch += relative_scratch(relative[0], dim, slab=False)
    o_BNTW, lse_BNC1Q = pl.pallas_call(
        kernel,
        grid=(batch, heads, plan.count_q, plan.count_k),
        in_specs=specs + term_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        interpret=interpret_mode(plan),
        compiler_params=compiler_params(),
        name="copejax_attention_forward_tpu",
    )(
        by_query_heads(q_BTNH),
        by_query_heads(k_BSGH),
        by_query_heads(v_BSGW),
        ints["q_pos"],
        ints["q_seg"],
        ints["k_pos"],
        ints["k_seg"],
        ints["k_rank"],
        *term_in,
        *extra,
    )
    return from_query_heads(o_BNTW), from_query_rows(lse_BNC1Q)
