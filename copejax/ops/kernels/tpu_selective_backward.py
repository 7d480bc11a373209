"""Selective attention's penalties in the TPU kernels (arXiv 2410.02703), backward.

The maths of :mod:`copejax.ops.kernels.selective_backward` (each pair's P, dS and the
selection's ``dl = G S'(l) / sqrt(H)`` from one function,
:func:`~copejax.ops.kernels.selective_backward.pair_gradients`, with ``G_kj = R[g, j] +
sum_{i in g, i > k} dF_ij``) in one Mosaic TPU kernel, grid (batch row, head, key tile, step)
with 2 count_q steps per key tile:

- the first count_q steps walk the query tiles oldest first and sum the prefix ``P[g, j]``
  (the older query tiles' selections) again, into one (1, K) float32 row per query tile in
  VMEM, (count_q, K), in the prefix kernel's order of additions
  (:func:`~copejax.ops.kernels.tpu_selective_prefix.prefix_step`, which both run), so the scores
  are the forward's; only the selecting head's q tile and the query segments move, the
  other query operands wait at the first tile of the second walk;
- the next count_q steps walk them newest first with dk, dv, the selecting head's dk, the
  terms' per-key and parameter gradients and the carry R (1, K) in VMEM scratch.

Each pair's parts of dq, of the selecting head's dq and of the terms' per-query gradients,
and each key tile's of the selecting head's dk, go to float32 arrays in HBM (``pl.ANY``,
aliased to zeros): read, added to and written back by DMA. A batch row's heads and tiles are
walked in order (all but the batch axis "arbitrary"), so no two steps touch one row at once,
and the selecting head's dq and dk sum over the heads in place, (B, T, H) each
(:mod:`copejax.ops.kernels.selective_attention` adds them to that head's dq and its
key/value head's dk). Neither P nor R leaves VMEM: the forward's P per (query tile, key)
(:mod:`~copejax.ops.kernels.tpu_selective`, per call of R query tiles) is not kept for the
backward (until 2026-12-03 it was, 1.45x the
nope kernel's temporaries at T = 16384, (2, 4, 64), on v5p), and each pair's gradients are
computed once. P in VMEM is 4 bytes per query tile and key of the tile, refused by name past
``PREFIX_VMEM_BYTES`` (:func:`prefix_rows`: 4 MiB, 8192 query tiles at K = 128). The GPU's one
backward kernel sums P again as it walks oldest first, takes R by linearity and adds dq with
atomics (:mod:`copejax.ops.kernels.selective_backward`). Speed is unmeasured (no TPU): the
first walk costs each head one more Q x K x H matmul per pair (the selecting head's S), and
each live step of the second waits for four DMAs of a (Q, H) float32 block (dq's and dq_sel's
read and write), where a two-kernel form would compute every pair twice but wait for none.
Shape letters as in :mod:`copejax.ops.kernels.tpu_forward`.
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
    ANY,
    by_query_heads,
    compiler_params,
    dma_add,
    from_query_heads,
    interpret_mode,
    read_terms,
    step_live,
    term_operands,
    tile_index,
    tpu_ints,
    tpu_terms,
)
from copejax.ops.kernels.tpu_rows import as_row, from_query_rows, load_row, query_rows, rows_shape
from copejax.ops.kernels.tpu_selective import pair_specs, selector_specs, selectors_of
from copejax.ops.kernels.tpu_selective_prefix import prefix_step

F32 = jnp.float32


PREFIX_VMEM_BYTES = 4 << 20  # the backward's P in VMEM, beside its blocks and sums


def prefix_rows(plan: Plan) -> int:
    """The rows of the backward kernel's P (count_q, K) in VMEM, one per query tile; refused,
    naming the sizes, where P would pass ``PREFIX_VMEM_BYTES``."""
    size = -(-plan.count_q // 8) * 8 * max(plan.size_k, 128) * 4  # whole (8, 128) tiles
    if size > PREFIX_VMEM_BYTES:
        raise ValueError(
            f"kernel: selective attention's TPU backward keeps its prefix in VMEM, {size} bytes "
            f"for {plan.count_q} query tiles of {plan.size_q} and key tiles of {plan.size_k}; "
            f"at most {PREFIX_VMEM_BYTES} are allowed: take longer query tiles (block_q)"
        )
    return plan.count_q


def _backward_kernel(*refs, plan: Plan, nonlinearity: str, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref = refs[:6]
    qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[6:11]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[11 : 11 + num_term_refs]), has)
    sel_refs = refs[11 + num_term_refs : 14 + num_term_refs]
    num_q = sum(h[1] for h in has)
    # inputs then: the zeros that dq, dq_sel, dk_sel and the per-query gradients alias;
    # outputs: dk, dv, the per-key and parameter gradients, then the aliased ones; scratch:
    # the sums of dk, dv, dk_sel and the block outputs after them, R, the prefix's running
    # sum and its rows P (count_q, K), (Q, H), (K, H) and (1, Q) buffers and a DMA semaphore
    outs = refs[14 + num_term_refs + 3 + num_q :]
    num_grads = 2 + sum(h[2] for h in has) + sum(h[0] for h in has)
    grad_refs, hbm_refs = outs[:num_grads], outs[num_grads : -num_grads - 8]
    dq_hbm, dqsel_hbm, dksel_hbm, *dqv_hbm = hbm_refs
    accs, (r_acc, p_acc, p_rows, q_buffer, k_buffer, row_buffer, sem) = (
        outs[-num_grads - 8 : -7],
        outs[-7:],
    )
    b, n, kj, step = (pl.program_id(axis) for axis in range(4))
    walk = step < plan.count_q  # the first walk: P, query tiles oldest first
    qi = 2 * plan.count_q - 1 - step  # then newest first: R sums the newer ones

    @pl.when(step == 0)
    def _init() -> None:
        for acc in (*accs, r_acc, p_acc):
            acc[...] = jnp.zeros(acc.shape, F32)

    @pl.when(walk)
    def _prefix() -> None:
        def store(sums_1K: jax.Array) -> None:
            p_rows[pl.ds(step, 1), :] = sums_1K

        refs = (sel_refs[0], sel_refs[1], qseg_ref, kseg_ref, sel_refs[2])
        prefix_step(plan, nonlinearity, (step, kj), refs, acc_ref=p_acc, store=store)

    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))
    live &= jnp.logical_not(walk)

    @pl.when(live)
    def _compute() -> None:
        params, q_values, k_values = read_terms(p_refs, qv_refs, kv_refs)
        q_pos, k_pos = qpos_ref[...], kpos_ref[...]

        def bias(p: list, qv: list, kv: list) -> jax.Array | None:
            return term_bias(plan, (p, qv, kv), q_pos, k_pos)

        bias_QK, pull = jax.vjp(bias, params, q_values, k_values) if plan.biases else (None, None)
        q_QH, k_KH, do_QW = q_ref[...], k_ref[...], do_ref[...]
        selectors = selectors_of(sel_refs, p_rows[pl.ds(qi, 1), :], mask_args)
        p_QK, ds_QK, dl_QK, _ = pair_gradients(
            nonlinearity,
            (q_QH, k_KH, v_ref[...], do_QW, plan.allowed_QK(*mask_args), bias_QK),
            selectors,
            (load_row(lse_ref), load_row(delta_ref), r_acc[...]),
        )
        scale = 1.0 / math.sqrt(q_QH.shape[-1])
        q_sel_QH, k_sel_KH = selectors[:2]
        ds_QK_scaled = ds_QK * scale
        accs[0][...] += dot_f32(ds_QK_scaled.T.astype(q_QH.dtype), q_QH, (1, 0))
        accs[1][...] += dot_f32(p_QK.T.astype(do_QW.dtype), do_QW, (1, 0))
        accs[2][...] += dot_f32(dl_QK.T.astype(q_sel_QH.dtype), q_sel_QH, (1, 0))
        queries = pl.ds(pl.multiple_of(qi * plan.size_q, plan.size_q), plan.size_q)
        dq_QH = dot_f32(ds_QK_scaled.astype(k_KH.dtype), k_KH, (1, 0))
        dma_add(dq_hbm.at[b, n, queries, :], q_buffer, sem, dq_QH)
        dq_sel_QH = dot_f32(dl_QK.astype(k_sel_KH.dtype), k_sel_KH, (1, 0))
        dma_add(dqsel_hbm.at[b, queries, :], q_buffer, sem, dq_sel_QH)  # summed over heads
        if plan.biases:
            g_params, g_qv, g_kv = pull(ds_QK)
            grads = [g for g in g_kv if g is not None] + [g for g in g_params if g is not None]
            for acc, g in zip(accs[3:], grads, strict=True):
                acc[...] += g
            for hbm, g in zip(dqv_hbm, [g for g in g_qv if g is not None], strict=True):
                dma_add(hbm.at[b, n, qi], row_buffer, sem, as_row(g))
        r_acc[...] -= jnp.sum(ds_QK, axis=0, keepdims=True)  # dF = -dS

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish() -> None:
        for ref, acc in zip(grad_refs, [accs[0], accs[1], *accs[3:]], strict=True):
            ref[...] = acc[...].astype(ref.dtype)
        keys = pl.ds(pl.multiple_of(kj * plan.size_k, plan.size_k), plan.size_k)
        dma_add(dksel_hbm.at[b, keys, :], k_buffer, sem, accs[2][...])  # over heads


def tpu_selective_backward_calls(
    plan: Plan,
    nonlinearity: str,
    tensors: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    *,
    stats: tuple[jax.Array, jax.Array],
    selectors: dict[str, jax.Array],
    ints: dict[str, jax.Array],
    terms: list[dict],
) -> tuple[jax.Array, jax.Array, jax.Array, list[dict], jax.Array, jax.Array]:
    """Runs the backward kernel on padded inputs.

    Args:
      tensors: (q_BTNH, k_BSGH, v_BSGW, dO_BTNW in the inputs' dtype).
      stats: the forward's log-sum-exp and ``D_i = dO_i . o_i``, both (B, N, T).
      selectors: the selecting head's "q" (B, T, H) and "k" (B, S, H).
      ints, terms: as the GPU's :func:`~copejax.ops.kernels.selective.selective_forward_call`
        takes them (the layouts change inside).

    Returns:
      (dq_BTNH float32, dk_BSNH float32 and dv_BSNW (float32, or v's dtype without grouped
      heads) per query head, the terms' gradients as
      :func:`copejax.ops.kernels.backward.backward_calls` returns them, the selecting head's
      d q (B, T, H) and d k (B, S, H) float32, summed over the heads).
    """
    q_BTNH, k_BSGH, v_BSGW, _ = tensors
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    sk = plan.size_k
    ints = {**tpu_ints(ints), "k_start": ints["k_start"][:, None, :]}
    operands = [by_query_heads(x) for x in tensors]
    operands += [query_rows(plan, stat_BNT) for stat_BNT in stats]
    operands += [ints[key] for key in ("q_pos", "q_seg", "k_pos", "k_seg", "k_rank")]
    selector_in = [selectors["q"], selectors["k"], ints["k_start"]]
    terms = tpu_terms(plan, terms)

    # grid (b, n, key tile j, step): steps [0, count_q) walk the query tiles oldest first for
    # P (only the selecting head's q and the segments move), then count_q more newest first;
    # tiles clamped to those seeing j (a skipped step refetches nothing); both tile axes in
    # order (the HBM sums).
    count = plan.count_q

    def q_tile(j: jax.Array, step: jax.Array) -> jax.Array:
        return tile_index(plan, j, 2 * count - 1 - step, keys=False)

    def walk_tile(j: jax.Array, step: jax.Array) -> jax.Array:
        return tile_index(plan, j, jnp.where(step < count, step, 2 * count - 1 - step), keys=False)

    k_tile = lambda j, step: j
    has, term_in, term_specs = term_operands(plan, terms, q_tile=q_tile, k_tile=k_tile)
    q_terms = [i for i, t in enumerate(terms) if t["q"] is not None]
    k_terms = [i for i, t in enumerate(terms) if t["k"] is not None]
    p_terms = [i for i, t in enumerate(terms) if t["params"] is not None]
    p_sizes = [terms[i]["params"].shape[-1] for i in p_terms]
    key_rows = lambda size: pl.BlockSpec((None, None, sk, size), lambda b, n, j, s: (b, n, j, 0))
    out_specs = [key_rows(dim), key_rows(width)]
    out_specs += [pl.BlockSpec((None, None, 1, sk), lambda b, n, j, s: (b, n, 0, j))] * len(k_terms)
    out_specs += [
        pl.BlockSpec((None, None, None, 1, size), lambda b, n, j, s: (b, n, j, 0, 0))
        for size in p_sizes
    ]
    per_head = lambda size, dtype: jax.ShapeDtypeStruct((batch, heads, length_k, size), dtype)
    # dv per query head: float32 to be summed over each group, else v's dtype; dk float32 (the
    # selecting head's dk joins it outside)
    dv_dtype = v_BSGW.dtype if plan.groups == 1 else F32
    out_shape = [per_head(dim, F32), per_head(width, dv_dtype)]
    out_shape += [jax.ShapeDtypeStruct((batch, heads, 1, length_k), F32)] * len(k_terms)
    out_shape += [
        jax.ShapeDtypeStruct((batch, heads, plan.count_k, 1, size), F32) for size in p_sizes
    ]
    scratch = [pltpu.VMEM((sk, dim), F32), pltpu.VMEM((sk, width), F32)]
    scratch += [pltpu.VMEM((sk, dim), F32)] + [pltpu.VMEM((1, sk), F32)] * len(k_terms)
    scratch += [pltpu.VMEM((1, size), F32) for size in p_sizes] + [pltpu.VMEM((1, sk), F32)]
    scratch += [pltpu.VMEM((1, sk), F32), pltpu.VMEM((prefix_rows(plan), sk), F32)]
    scratch += [pltpu.VMEM((plan.size_q, dim), F32), pltpu.VMEM((sk, dim), F32)]
    scratch.append(pltpu.VMEM((1, plan.size_q), F32))
    scratch.append(pltpu.SemaphoreType.DMA(()))
    # dq per query head, the selecting head's dq and dk summed over the heads, and the
    # per-query gradients: zeros in HBM that the kernel adds to (aliased to its last outputs)
    sums = [jnp.zeros((batch, heads, length_q, dim), F32)]
    sums += [jnp.zeros((batch, length_q, dim), F32), jnp.zeros((batch, length_k, dim), F32)]
    sums += [jnp.zeros(rows_shape(plan, batch, heads).shape, F32)] * len(q_terms)
    first_sum = len(operands) + len(term_in) + len(selector_in)
    aliases = {first_sum + i: len(out_shape) + i for i in range(len(sums))}
    out_specs += [ANY] * len(sums)
    out_shape += [jax.ShapeDtypeStruct(x.shape, F32) for x in sums]
    dk_BNSH, dv_BNSW, *rest = pl.pallas_call(
        functools.partial(
            _backward_kernel,
            plan=plan,
            nonlinearity=nonlinearity,
            has=has,
            num_term_refs=len(term_in),
        ),
        grid=(batch, heads, plan.count_k, 2 * count),
        in_specs=pair_specs(plan, dim, width, q_tile, k_tile, backward=True, seg_tile=walk_tile)
        + term_specs
        + selector_specs(plan, dim, walk_tile, k_tile)
        + [ANY] * len(sums),
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        input_output_aliases=aliases,
        interpret=interpret_mode(plan),
        # the heads add to one batch row's dq_sel and dk_sel: only the batch axis in parallel
        compiler_params=compiler_params(("parallel", "arbitrary", "arbitrary", "arbitrary")),
        name="copejax_selective_backward_tpu",
    )(*operands, *term_in, *selector_in, *sums)
    dkv, rest = rest[: len(k_terms)], rest[len(k_terms) :]
    dparams, (dq_BNTH, dq_sel_BTH, dk_sel_BSH, *dqv) = rest[: len(p_terms)], rest[len(p_terms) :]
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
        dq_sel_BTH,
        dk_sel_BSH,
    )
