"""Selective attention's prefix in the TPU kernels (Leviathan et al. 2024, arXiv
2410.02703): ``P[g, j] = sum_{k < first query of g} S_kj``, the selections of the queries
before query tile g, which :mod:`copejax.ops.kernels.tpu_selective`'s forward kernel adds to
each pair's within-tile sums (the TPU side of :mod:`copejax.ops.kernels.selective_prefix`).

The prefix kernel's grid is (batch row, key tile, query tile of the call), the query tiles
walked oldest first ("arbitrary") with the column sums of S, (1, K) float32, in VMEM
scratch, started from the sums the previous call ended with; every step writes the sum
entering its query tile, P (B, R, 1, S) float32 for the call's R tiles, and the last the
sums after them (B, 1, S), which the next call starts from. The call's first query tile is
a scalar-prefetched operand (SMEM) that the block index maps and the kernel add to the grid's
tile, so the calls of a loop share one compiled kernel. :func:`prefix_step` is also the
backward's first walk (:mod:`copejax.ops.kernels.tpu_selective_backward`), in one order of
additions, so that the backward's P is the forward's. Shape letters as in
:mod:`copejax.ops.kernels.tpu_forward`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from copejax.ops.kernels.selective_prefix import tile_operand
from copejax.ops.kernels.selective_tiles import keep_QK, selection_live, selection_QK
from copejax.ops.kernels.tiles import Plan, content_logits_QK
from copejax.ops.kernels.tpu_params import interpret_mode, tile_index

F32 = jnp.float32


def prefix_step(
    plan: Plan,
    nonlinearity: str,
    tiles: tuple[jax.Array, jax.Array],
    refs: tuple,
    *,
    acc_ref: object,
    store: Callable[[jax.Array], None],
) -> None:
    """One step of the prefix's walk over the query tiles of key tile kj, oldest first:
    ``store`` takes the sums entering query tile qi ((1, K) float32, what the older tiles
    selected), then qi's selections add to ``acc_ref`` where qi may see kj. ``tiles``: (qi,
    kj); ``refs``: the selecting head's q (Q, H) and k (K, H) tiles, the segments (Q, 1) and
    (1, K) and the segment starts (1, K). The prefix kernel and the backward kernel's first
    walk (:mod:`copejax.ops.kernels.tpu_selective_backward`) both take their P from here, in
    one order of additions: the backward's P is the forward's."""
    qi, kj = tiles
    qsel_ref, ksel_ref, qseg_ref, kseg_ref, kstart_ref = refs
    q_first, k_first = qi * plan.size_q, kj * plan.size_k
    store(acc_ref[...])
    first, end = plan.query_tiles(kj)
    q_seg_Q1, k_seg_1K = qseg_ref[...], kseg_ref[...]
    live = (first <= qi) & (qi < end)
    live &= selection_live(plan, q_first, k_first, q_seg_Q1, k_seg_1K)

    @pl.when(live)
    def _compute() -> None:
        keep = keep_QK(q_first, k_first, q_seg_Q1, k_seg_1K, kstart_ref[...])
        logits_QK = content_logits_QK(qsel_ref[...], ksel_ref[...])
        s_QK = selection_QK(logits_QK, keep, nonlinearity)
        acc_ref[...] += jnp.sum(s_QK, axis=0, keepdims=True)


def _prefix_kernel(first_ref, *refs, plan: Plan, nonlinearity: str) -> None:
    start_ref, prefix_ref, end_ref, acc_ref = refs[5:]
    kj, row = pl.program_id(1), pl.program_id(2)  # the call's query tiles oldest first

    @pl.when(row == 0)
    def _init() -> None:
        acc_ref[...] = start_ref[...]

    def store(sums_1K: jax.Array) -> None:
        prefix_ref[...] = sums_1K

    tiles = (first_ref[0] + row, kj)
    prefix_step(plan, nonlinearity, tiles, refs[:5], acc_ref=acc_ref, store=store)

    @pl.when(row == pl.num_programs(2) - 1)
    def _end() -> None:
        end_ref[...] = acc_ref[...]


def tpu_prefix_call(
    plan: Plan,
    nonlinearity: str,
    selectors: dict,
    ints: dict,
    *,
    first: jax.Array | int = 0,
    rows: int | None = None,
    start_B1S: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(P (B, rows, 1, S) float32, whose row r sums S over the queries of the query tiles
    before tile ``first + r``; the sums after the last row (B, 1, S)), ``start_B1S``
    (default zeros) being the sums before tile ``first``, ``rows`` (default count_q) the
    call's query tiles. ``selectors``: the selecting head's "q" (B, T, H) and "k" (B, S, H);
    ``ints``: :func:`tpu_ints`' with "k_start" (B, 1, S)."""
    (batch, _, dim), length_k = selectors["q"].shape, selectors["k"].shape[1]
    sq, sk = plan.size_q, plan.size_k
    rows = plan.count_q if rows is None else rows
    if start_B1S is None:
        start_B1S = jnp.zeros((batch, 1, length_k), F32)
    # The call's query tile i is tile first + i, clamped to those that see key tile j: no
    # refetch.
    q_tile = lambda j, i, first_ref: tile_index(plan, j, first_ref[0] + i, keys=False)
    key_row = pl.BlockSpec((None, 1, sk), lambda b, j, i, first_ref: (b, 0, j))
    return pl.pallas_call(
        functools.partial(_prefix_kernel, plan=plan, nonlinearity=nonlinearity),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, plan.count_k, rows),
            in_specs=[
                pl.BlockSpec((None, sq, dim), lambda b, j, i, f: (b, q_tile(j, i, f), 0)),
                pl.BlockSpec((None, sk, dim), lambda b, j, i, f: (b, j, 0)),
                pl.BlockSpec((None, sq, 1), lambda b, j, i, f: (b, q_tile(j, i, f), 0)),
                key_row,
                key_row,
                key_row,
            ],
            out_specs=[
                pl.BlockSpec((None, None, 1, sk), lambda b, j, i, f: (b, i, 0, j)),
                key_row,
            ],
            scratch_shapes=[pltpu.VMEM((1, sk), F32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, rows, 1, length_k), F32),
            jax.ShapeDtypeStruct((batch, 1, length_k), F32),
        ],
        interpret=interpret_mode(plan),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        name="copejax_selective_prefix_tpu",
    )(
        tile_operand(first),
        selectors["q"],
        selectors["k"],
        ints["q_seg"],
        ints["k_seg"],
        ints["k_start"],
        start_B1S,
    )
