"""Selective attention's penalties in the TPU kernels (arXiv 2410.02703), backward.

The maths of :mod:`copejax.ops.kernels.selective_backward` (each pair's P, dS and the
selection's ``dl = G S'(l) / sqrt(H)`` from one function,
:func:`~copejax.ops.kernels.selective_backward.pair_gradients`, with ``G_kj = R[g, j] +
sum_{i in g, i > k} dF_ij``) on the grids of :mod:`copejax.ops.kernels.tpu_backward`:

- the dk / dv kernel runs first, grid (batch row, head, key tile, query tile), the query
  tiles walked newest first ("arbitrary") with dk, dv, the selecting head's dk, the terms'
  per-key and parameter gradients and the carry R (1, K) in VMEM scratch; every step writes
  R entering its query tile, (B, N, count_q, 1, S) float32;
- the dq kernel, grid (batch row, head, query tile, key tile), reads R at its tile pair and
  sums dq, the selecting head's dq and the terms' per-query gradients in scratch.

The selecting head's gradients come out per query head, (B, N, T, H) float32, and are summed
outside (:mod:`copejax.ops.kernels.selective_attention` adds them to that head's dq and its
key/value head's dk). The GPU's one backward kernel instead sums P again as it walks, takes R
by linearity and adds dq with atomics, keeping no per-tile R, no P and no such partials
(:mod:`copejax.ops.kernels.selective_backward`); Mosaic TPU's grid runs sequentially, where
VMEM scratch could carry the same. Shape letters as in :mod:`copejax.ops.kernels.tpu_forward`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.selective_backward import pair_gradients
from copejax.ops.kernels.selective_tiles import term_bias
from copejax.ops.kernels.tiles import Plan, dot_f32
from copejax.ops.kernels.tpu_params import (
    by_query_heads,
    compiler_params,
    from_query_heads,
    interpret_mode,
    read_terms,
    step_live,
    term_operands,
    tile_index,
    tpu_ints,
    tpu_terms,
)
from copejax.ops.kernels.tpu_rows import (
    from_query_rows,
    load_row,
    query_rows,
    row_spec,
    rows_shape,
    store_row,
)
from copejax.ops.kernels.tpu_selective import pair_specs, selector_specs, selectors_of

F32 = jnp.float32


def _dkdv_kernel(*refs, plan: Plan, nonlinearity: str, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    sel_refs = refs[11 + num_term_refs : 15 + num_term_refs]
    outs = refs[15 + num_term_refs :]
    # outputs: dk, dv, dk_sel, the per-key and parameter gradients, R; scratch: the same
    # but R's running sum (1, K) in place of its per-tile output
    num_grads = 3 + sum(h[2] for h in has) + sum(h[0] for h in has)
    grad_refs, r_out = outs[:num_grads], outs[num_grads]
    accs, r_acc = outs[num_grads + 1 : -1], outs[-1]
    kj, step = pl.program_id(2), pl.program_id(3)
    qi = plan.count_q - 1 - step  # query tiles newest first: R sums the newer ones

    @pl.when(step == 0)
    def _init() -> None:
        for acc in (*accs, r_acc):
            acc[...] = jnp.zeros(acc.shape, F32)

    r_out[...] = r_acc[...]  # every step writes its query tile's (a skipped one's is unread)
    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    @pl.when(live)
    def _compute() -> None:
        params, q_values, k_values = read_terms(p_refs, qv_refs, kv_refs)
        q_pos, k_pos = qpos_ref[...], kpos_ref[...]

        def bias(p: list, kv: list) -> jax.Array | None:
            return term_bias(plan, (p, q_values, kv), q_pos, k_pos)

        bias_QK, pull = jax.vjp(bias, params, k_values) if plan.biases else (None, None)
        q_QH, do_QW = q_ref[...], do_ref[...]
        selectors = selectors_of(sel_refs, mask_args)
        p_QK, ds_QK, dl_QK, _ = pair_gradients(
            nonlinearity,
            (q_QH, k_ref[...], v_ref[...], do_QW, plan.allowed_QK(*mask_args), bias_QK),
            selectors,
            (load_row(lse_ref), load_row(delta_ref), r_acc[...]),
        )
        scale = 1.0 / math.sqrt(q_QH.shape[-1])
        q_sel_QH = selectors[0]
        accs[0][...] += dot_f32((ds_QK * scale).T.astype(q_QH.dtype), q_QH, (1, 0))
        accs[1][...] += dot_f32(p_QK.T.astype(do_QW.dtype), do_QW, (1, 0))
        accs[2][...] += dot_f32(dl_QK.T.astype(q_sel_QH.dtype), q_sel_QH, (1, 0))
        if len(accs) > 3:
            g_params, g_kv = pull(ds_QK)
            grads = [g for g in g_kv if g is not None] + [g for g in g_params if g is not None]
            for acc, g in zip(accs[3:], grads, strict=True):
                acc[...] += g
        r_acc[...] -= jnp.sum(ds_QK, axis=0, keepdims=True)  # dF = -dS

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish() -> None:
        for ref, acc in zip(grad_refs, accs, strict=True):
            ref[...] = acc[...]


def _dq_kernel(*refs, plan: Plan, nonlinearity: str, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    sel_refs = refs[11 + num_term_refs : 15 + num_term_refs]
    r_ref, *outs = refs[15 + num_term_refs :]
    num_outs = len(outs) // 2  # dq, dq_sel, the per-query gradients; their scratch
    out_refs, accs = outs[:num_outs], outs[num_outs:]
    qi, kj = pl.program_id(2), pl.program_id(3)

    @pl.when(kj == 0)
    def _init() -> None:
        for acc in accs:
            acc[...] = jnp.zeros(acc.shape, F32)

    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    @pl.when(live)
    def _compute() -> None:
        params, q_values, k_values = read_terms(p_refs, qv_refs, kv_refs)
        q_pos, k_pos = qpos_ref[...], kpos_ref[...]

        def bias(qv: list) -> jax.Array | None:
            return term_bias(plan, (params, qv, k_values), q_pos, k_pos)

        bias_QK, pull = jax.vjp(bias, q_values) if plan.biases else (None, None)
        k_KH = k_ref[...]
        selectors = selectors_of(sel_refs, mask_args)
        _, ds_QK, dl_QK, _ = pair_gradients(
            nonlinearity,
            (q_ref[...], k_KH, v_ref[...], do_ref[...], plan.allowed_QK(*mask_args), bias_QK),
            selectors,
            (load_row(lse_ref), load_row(delta_ref), r_ref[...]),
        )
        scale = 1.0 / math.sqrt(k_KH.shape[-1])
        k_sel_KH = selectors[1]
        accs[0][...] += dot_f32((ds_QK * scale).astype(k_KH.dtype), k_KH, (1, 0))
        accs[1][...] += dot_f32(dl_QK.astype(k_sel_KH.dtype), k_sel_KH, (1, 0))
        if len(accs) > 2:
            grads = [g for g in pull(ds_QK)[0] if g is not None]
            for acc, g in zip(accs[2:], grads, strict=True):
                acc[...] += g

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish() -> None:
        for ref, acc in zip(out_refs[:2], accs[:2], strict=True):
            ref[...] = acc[...]
        for ref, acc in zip(out_refs[2:], accs[2:], strict=True):  # the per-query gradients
            store_row(ref, acc[...])


def tpu_selective_backward_calls(
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
      selectors: the selecting head's "q" (B, T, H) and "k" (B, S, H).
      prefix: the P of :func:`~copejax.ops.kernels.tpu_selective.tpu_selective_forward_call`.
      ints, terms: as the GPU's :func:`~copejax.ops.kernels.selective.selective_forward_call`
        takes them (the layouts change inside).

    Returns:
      (dq_BTNH float32, dk_BSNH and dv_BSNW float32 per query head, the terms' gradients as
      :func:`copejax.ops.kernels.backward.backward_calls` returns them, the selecting head's
      d q (B, T, H) and d k (B, S, H) float32, summed over the heads).
    """
    q_BTNH, k_BSGH, v_BSGW, _ = tensors
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    sq, sk = plan.size_q, plan.size_k
    ints = {**tpu_ints(ints), "k_start": ints["k_start"][:, None, :]}
    operands = [by_query_heads(x) for x in tensors]
    operands += [query_rows(plan, stat_BNT) for stat_BNT in stats]
    operands += [ints[key] for key in ("q_pos", "q_seg", "k_pos", "k_seg", "k_rank")]
    selector_in = [selectors["q"], selectors["k"], ints["k_start"], prefix]
    terms = tpu_terms(plan, terms)
    call = functools.partial(
        pl.pallas_call, interpret=interpret_mode(plan), compiler_params=compiler_params()
    )

    def kernel(body, has: tuple, term_in: list):
        return functools.partial(
            body, plan=plan, nonlinearity=nonlinearity, has=has, num_term_refs=len(term_in)
        )

    # dk / dv: grid (b, n, key tile j, step), query tile count_q - 1 - step clamped to those
    # seeing j (a skipped step refetches nothing); R written at the step's own query tile.
    def q_tile(j: jax.Array, step: jax.Array) -> jax.Array:
        return tile_index(plan, j, plan.count_q - 1 - step, keys=False)

    k_tile = lambda j, step: j
    has, term_in, term_specs = term_operands(plan, terms, q_tile=q_tile, k_tile=k_tile)
    k_terms = [i for i, t in enumerate(terms) if t["k"] is not None]
    p_terms = [i for i, t in enumerate(terms) if t["params"] is not None]
    p_sizes = [terms[i]["params"].shape[-1] for i in p_terms]
    key_rows = lambda size: pl.BlockSpec((None, None, sk, size), lambda b, n, j, s: (b, n, j, 0))
    out_specs = [key_rows(dim), key_rows(width), key_rows(dim)]
    out_specs += [pl.BlockSpec((None, None, 1, sk), lambda b, n, j, s: (b, n, 0, j))] * len(k_terms)
    out_specs += [
        pl.BlockSpec((None, None, None, 1, size), lambda b, n, j, s: (b, n, j, 0, 0))
        for size in p_sizes
    ]
    out_specs.append(
        pl.BlockSpec(
            (None, None, None, 1, sk), lambda b, n, j, s: (b, n, plan.count_q - 1 - s, 0, j)
        )
    )
    per_head = lambda size: jax.ShapeDtypeStruct((batch, heads, length_k, size), F32)
    out_shape = [per_head(dim), per_head(width), per_head(dim)]
    out_shape += [jax.ShapeDtypeStruct((batch, heads, 1, length_k), F32)] * len(k_terms)
    out_shape += [
        jax.ShapeDtypeStruct((batch, heads, plan.count_k, 1, size), F32) for size in p_sizes
    ]
    out_shape.append(jax.ShapeDtypeStruct((batch, heads, plan.count_q, 1, length_k), F32))
    scratch = [pltpu.VMEM((sk, dim), F32), pltpu.VMEM((sk, width), F32)]
    scratch += [pltpu.VMEM((sk, dim), F32)] + [pltpu.VMEM((1, sk), F32)] * len(k_terms)
    scratch += [pltpu.VMEM((1, size), F32) for size in p_sizes] + [pltpu.VMEM((1, sk), F32)]
    dk_BNSH, dv_BNSW, dksel_BNSH, *rest = call(
        kernel(_dkdv_kernel, has, term_in),
        grid=(batch, heads, plan.count_k, plan.count_q),
        in_specs=pair_specs(plan, dim, width, q_tile, k_tile, backward=True)
        + term_specs
        + selector_specs(plan, dim, q_tile, k_tile),
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        name="copejax_selective_dkdv_tpu",
    )(*operands, *term_in, *selector_in)
    carry = rest.pop()
    dkv, dparams = rest[: len(k_terms)], rest[len(k_terms) :]

    # dq: grid (b, n, query tile i, key tile j), key tiles clamped to those i may see.
    q_tile = lambda i, j: i
    k_tile = lambda i, j: tile_index(plan, i, j, keys=True)
    has, term_in, term_specs = term_operands(plan, terms, q_tile=q_tile, k_tile=k_tile)
    q_terms = [i for i, t in enumerate(terms) if t["q"] is not None]
    query_block = lambda size: pl.BlockSpec((None, None, sq, size), lambda b, n, i, j: (b, n, i, 0))
    r_spec = pl.BlockSpec((None, None, None, 1, sk), lambda b, n, i, j: (b, n, i, 0, k_tile(i, j)))
    sizes = [dim, dim] + [1] * len(q_terms)
    q_row_shape = rows_shape(plan, batch, heads)
    dq_BNTH, dqsel_BNTH, *dqv = call(
        kernel(_dq_kernel, has, term_in),
        grid=(batch, heads, plan.count_q, plan.count_k),
        in_specs=pair_specs(plan, dim, width, q_tile, k_tile, backward=True)
        + term_specs
        + selector_specs(plan, dim, q_tile, k_tile)
        + [r_spec],
        out_specs=[query_block(dim)] * 2 + [row_spec(plan, q_tile)] * len(q_terms),
        out_shape=[jax.ShapeDtypeStruct((batch, heads, length_q, dim), F32)] * 2
        + [q_row_shape] * len(q_terms),
        scratch_shapes=[pltpu.VMEM((sq, size), F32) for size in sizes],
        name="copejax_selective_dq_tpu",
    )(*operands, *term_in, *selector_in, carry)
    grads = [{"params": None, "q": None, "k": None} for _ in terms]
    for i, g in zip(q_terms, dqv, strict=True):
        grads[i]["q"] = from_query_rows(g)
    for i, g in zip(k_terms, dkv, strict=True):
        grads[i]["k"] = g[:, :, 0, :]
    for i, g in zip(p_terms, dparams, strict=True):
        grads[i]["params"] = g[:, :, :, 0, :]
    dq_sel_BTH = jnp.sum(dqsel_BNTH, axis=1)
    dk_sel_BSH = jnp.sum(dksel_BNSH, axis=1)
    return (
        from_query_heads(dq_BNTH),
        from_query_heads(dk_BNSH),
        from_query_heads(dv_BNSW),
        grads,
        dq_sel_BTH,
        dk_sel_BSH,
    )
