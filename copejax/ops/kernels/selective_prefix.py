"""Selective attention's prefix in the fused GPU kernels (Leviathan et al. 2024, arXiv
2410.02703): ``P[g, j] = sum_{k < first query of g} S_kj``, the selections of the queries
before query tile g, which :mod:`copejax.ops.kernels.selective`'s forward kernel adds to
each pair's within-tile sums.

The prefix kernel: one program per (batch row, key tile) walks query tiles oldest first,
accumulating the column sums of S, and writes the sum entering each tile. All the query
tiles in one call, (B, count_q, S) float32, O(T^2 / Q); or, where that would pass the
queries' own bytes (:func:`call_tiles`), R tiles per call from a first tile (an operand, not
a static), the sums entering it read and those after it written, (B, S), so that calls in
sequence carry them: (B, R, S) per call, O(T N H) at every length.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.selective_tiles import keep_QK, selection_live, selection_QK
from copejax.ops.kernels.tiles import Plan, content_logits_QK, sigmoid_gpu
from copejax.ops.kernels.triton_params import compiler_params


def rows_of(count: int) -> int:
    """Rows of a per-tile buffer: ``count`` padded to a power of two (Triton's blocks)."""
    return 1 << max(count - 1, 0).bit_length()


def tile_operand(tile: jax.Array | int) -> jax.Array:
    """A call's first query tile as the kernels read it: int32 (1,), an operand, so that the
    calls of a loop share one compiled kernel."""
    return jnp.reshape(jnp.asarray(tile, jnp.int32), (1,))


def _prefix_kernel(*refs, plan: Plan, nonlinearity: str) -> None:
    tile_ref, qsel_ref, ksel_ref, qseg_ref, kseg_ref, kstart_ref, start_ref = refs[:7]
    prefix_ref, end_ref = refs[7:]
    kj = pl.program_id(1)
    k_first = kj * plan.size_k
    k_sel_KH, k_seg_K, k_starts_K = ksel_ref[...], kseg_ref[...], kstart_ref[...]
    first, end = plan.query_tiles(kj)  # with a window and no sinks, the tiles that see kj
    chunk_first = tile_ref[0]  # the call's first query tile

    def step(row: jax.Array, acc_K: jax.Array) -> jax.Array:
        # Every row is written once (no other store to race with on a GPU): what the older
        # query tiles selected; rows past the tiles that see kj are never read.
        prefix_ref[pl.ds(row, 1), :] = acc_K[None, :]
        qi = chunk_first + row
        q_first = qi * plan.size_q
        queries = pl.ds(pl.multiple_of(q_first, plan.size_q), plan.size_q)

        def compute(acc_K: jax.Array) -> jax.Array:
            keep = keep_QK(q_first, k_first, qseg_ref[queries], k_seg_K, k_starts_K)
            logits_QK = content_logits_QK(qsel_ref[queries, :], k_sel_KH)
            return acc_K + jnp.sum(selection_QK(logits_QK, keep, nonlinearity, sigmoid_gpu), axis=0)

        def band(acc_K: jax.Array) -> jax.Array:  # a query tile (qi < count_q) that sees kj
            live = selection_live(plan, q_first, k_first, qseg_ref[queries], k_seg_K)
            return jax.lax.cond(live, compute, lambda a: a, acc_K)

        return jax.lax.cond((first <= qi) & (qi < end), band, lambda a: a, acc_K)

    rows = prefix_ref.shape[0]
    end_ref[...] = jax.lax.fori_loop(0, rows, step, start_ref[...])


def call_tiles(count_q: int, heads: int, dim: int, itemsize: int) -> int:
    """Query tiles per forward call: all of them (``rows_of(count_q)``: one call) where the
    prefix P fits, else R, a power of two with P's (B, R, S) float32 at most the queries'
    (B, T, N, H) bytes (at least ``MIN_CALL_TILES``), the calls in sequence: O(T N H) memory
    at every length instead of O(T^2 / Q). ``MAX_CALL_TILES`` caps R (tests)."""
    budget = max(heads * dim * itemsize // 4, MIN_CALL_TILES)
    tiles = min(rows_of(count_q), 1 << (budget.bit_length() - 1))
    return tiles if MAX_CALL_TILES is None else min(tiles, rows_of(MAX_CALL_TILES))


MIN_CALL_TILES = 16  # query tiles: B x N x 16 programs per call at the least
MAX_CALL_TILES: int | None = None


def prefix_call(
    plan: Plan,
    nonlinearity: str,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    *,
    head: int,
    ints: dict,
    tile: jax.Array | int = 0,
    rows: int | None = None,
    start_BS: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The prefix of ``rows`` query tiles from tile ``tile`` (default: all, ``rows_of(count_q)``
    from 0): (P (B, rows, S) float32, whose row r sums S over the queries before query tile
    ``tile + r``; its sums after the last row (B, S)), ``start_BS`` (default zeros) being the
    sums before tile ``tile``. Rows of tiles >= count_q, and with a window those past the tiles
    that see the key, hold sums no pair reads. The GPU's backward sums it again as it walks,
    in the same order."""
    batch, length_q, _, dim = q_BTNH.shape
    length_k, sk, kv_head = k_BSGH.shape[1], plan.size_k, head // plan.groups
    rows = rows_of(plan.count_q) if rows is None else rows
    if start_BS is None:
        start_BS = jnp.zeros((batch, length_k), jnp.float32)
    key_tile = pl.BlockSpec((None, sk), lambda b, j: (b, j))
    return pl.pallas_call(
        functools.partial(_prefix_kernel, plan=plan, nonlinearity=nonlinearity),
        grid=(batch, plan.count_k),
        in_specs=[
            pl.BlockSpec((1,), lambda b, j: (0,)),
            pl.BlockSpec((None, length_q, None, dim), lambda b, j: (b, 0, head, 0)),
            pl.BlockSpec((None, sk, None, dim), lambda b, j: (b, j, kv_head, 0)),
            pl.BlockSpec((None, length_q), lambda b, j: (b, 0)),
            key_tile,
            key_tile,
            key_tile,
        ],
        out_specs=[pl.BlockSpec((None, rows, sk), lambda b, j: (b, 0, j)), key_tile],
        out_shape=[
            jax.ShapeDtypeStruct((batch, rows, length_k), jnp.float32),
            jax.ShapeDtypeStruct((batch, length_k), jnp.float32),
        ],
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_selective_prefix",
    )(
        tile_operand(tile),
        q_BTNH,
        k_BSGH,
        ints["q_seg"],
        ints["k_seg"],
        ints["k_start"],
        start_BS,
    )
