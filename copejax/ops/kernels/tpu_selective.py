"""Selective attention's penalties in the TPU kernels (Leviathan et al. 2024, arXiv
2410.02703), forward: the prefix kernel and the forward kernel.

The maths of :mod:`copejax.ops.kernels.selective` (the selection of a tile, ``keep_QK`` and
``selection_QK``; ``F_QK = P[g, keys] + L_QQ @ S_QK`` in ``penalized_scores_QK``) on the
grid of :mod:`copejax.ops.kernels.tpu_forward`, in the layouts of
:mod:`copejax.ops.kernels.tpu_params`:

- the prefix kernel (:mod:`copejax.ops.kernels.tpu_selective_prefix`) writes P (B, R, 1, S)
  float32, the sums entering each of R query tiles, read as (1, K) tiles (the backward sums
  it again in VMEM, not kept);
- the forward kernel is the softmax's (grid (batch row, head, query tile, key tile), running
  max, sum and output in scratch) with each pair's scores penalized: four more operands, the
  selecting head's q tile (from (B, T, H)), its k tile (from (B, S, H)), the keys' segment
  starts (B, 1, S) and P at the tile pair, recompute the selecting head's S tile;
- both run on R query tiles from a first tile, a scalar-prefetched operand (SMEM) that the
  block index maps and the kernels add to the grid's query tile, so that the calls of a loop
  share one compiled kernel. R is the GPU's (:func:`~copejax.ops.kernels.selective_prefix.
  call_tiles`): every query tile in one call where P fits in the queries' bytes, else calls
  of R tiles in sequence, the prefix kernel starting from the sums the previous call ended
  with, (B, 1, S): P is O(T N H) at every length instead of O(T^2 / Q) per batch row.

``L @ S`` stays three bfloat16 matmuls of S split in bfloat16 pieces
(:func:`~copejax.ops.kernels.exact_dots.bf16_pieces`), as on the GPU: L (0 / 1) is exact in
bfloat16, so three single MXU passes give float32's sum. One float32 matmul at
``Precision.HIGHEST`` (Mosaic's ``contract_precision<fp32>``) would be as exact, but the MXU
multiplies bfloat16, so it splits both operands and takes more passes (six for XLA's
HIGHEST), and a float32 matmul at the default precision may round S to bfloat16's 8 bits,
penalties to 3 digits. The backward is :mod:`copejax.ops.kernels.tpu_selective_backward`.
Shape letters as in :mod:`copejax.ops.kernels.tpu_forward`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.selective import per_query
from copejax.ops.kernels.selective_prefix import call_tiles, tile_operand
from copejax.ops.kernels.selective_tiles import (
    keep_QK,
    penalized_scores_QK,
    term_bias,
)
from copejax.ops.kernels.tiles import Plan
from copejax.ops.kernels.tpu_params import (
    by_query_heads,
    compiler_params,
    from_query_heads,
    interpret_mode,
    kv_head,
    read_terms,
    step_live,
    term_operands,
    tile_index,
    tpu_ints,
    tpu_terms,
)
from copejax.ops.kernels.tpu_rows import from_query_rows, row_spec, rows_shape
from copejax.ops.kernels.tpu_selective_prefix import tpu_prefix_call
from copejax.ops.kernels.tpu_softmax import finish_softmax, init_softmax, softmax_step

F32 = jnp.float32
TileMap = Callable[[jax.Array, jax.Array], jax.Array]  # (outer, walked) -> tile


def pair_specs(
    plan: Plan,
    dim: int,
    width: int,
    q_tile: TileMap,
    k_tile: TileMap,
    *,
    backward: bool,
    seg_tile: TileMap | None = None,
) -> list[pl.BlockSpec]:
    """The specs of a grid (b, n, outer, walked)'s main operands: q, k, v (with
    ``backward`` dO, the log-sum-exp and D), the query positions and segments, the key
    positions, segments and ranks, in the TPU layouts (:func:`tpu_ints`). ``seg_tile``
    (default ``q_tile``): the query segments' tile, which the backward's prefix walk reads."""
    q_rows = lambda b, n, i, j: (b, n, q_tile(i, j), 0)
    kv_rows = lambda b, n, i, j: (b, kv_head(n, plan.groups), k_tile(i, j), 0)
    specs = [
        pl.BlockSpec((None, None, plan.size_q, dim), q_rows),
        pl.BlockSpec((None, None, plan.size_k, dim), kv_rows),
        pl.BlockSpec((None, None, plan.size_k, width), kv_rows),
    ]
    if backward:
        specs.append(pl.BlockSpec((None, None, plan.size_q, width), q_rows))
        specs += [row_spec(plan, q_tile)] * 2
    column = lambda tile: pl.BlockSpec(
        (None, plan.size_q, 1), lambda b, n, i, j: (b, tile(i, j), 0)
    )
    specs += [column(q_tile), column(seg_tile or q_tile)]
    return (
        specs + [pl.BlockSpec((None, 1, plan.size_k), lambda b, n, i, j: (b, 0, k_tile(i, j)))] * 3
    )


def selector_specs(plan: Plan, dim: int, q_tile: TileMap, k_tile: TileMap) -> list[pl.BlockSpec]:
    """Specs of the selecting head's q (B, T, H) and k (B, S, H) and the segment starts
    (B, 1, S) at a grid (b, n, outer, walked)'s tile pair (the forward's P per call:
    :func:`_forward_tiles`)."""
    return [
        pl.BlockSpec((None, plan.size_q, dim), lambda b, n, i, j: (b, q_tile(i, j), 0)),
        pl.BlockSpec((None, plan.size_k, dim), lambda b, n, i, j: (b, k_tile(i, j), 0)),
        pl.BlockSpec((None, 1, plan.size_k), lambda b, n, i, j: (b, 0, k_tile(i, j))),
    ]


def selectors_of(refs: tuple, prefix_1K: jax.Array, mask_args: tuple) -> tuple:
    """The ``selectors`` of :func:`~copejax.ops.kernels.selective_tiles.penalized_scores_QK` from
    the (q_sel, k_sel, k_start) refs, the pair's P (1, K) and a step's mask arguments (first
    query, first key, segments (Q, 1) and (1, K), ranks)."""
    qsel_ref, ksel_ref, kstart_ref = refs
    q_first, k_first, q_seg_Q1, k_seg_1K, _ = mask_args
    keep = keep_QK(q_first, k_first, q_seg_Q1, k_seg_1K, kstart_ref[...])
    return qsel_ref[...], ksel_ref[...], keep, prefix_1K


def _forward_kernel(
    first_ref,
    *refs,
    plan: Plan,
    nonlinearity: str,
    has: tuple,
    num_term_refs: int,
) -> None:
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[8 : 8 + num_term_refs]), has)
    sel_refs = refs[8 + num_term_refs : 12 + num_term_refs]
    o_ref, lse_ref, max_ref, sum_ref, acc_ref = refs[12 + num_term_refs :]
    # The call's query tile, counted from the first of the call; key tiles oldest first.
    qi, kj = first_ref[0] + pl.program_id(2), pl.program_id(3)

    @pl.when(kj == 0)
    def _init() -> None:
        init_softmax((max_ref, sum_ref, acc_ref))

    live, mask_args = step_live(plan, qi, kj, (qseg_ref, kseg_ref, krank_ref))

    @pl.when(live)
    def _compute() -> None:
        allowed_QK = plan.allowed_QK(*mask_args)
        terms = read_terms(p_refs, qv_refs, kv_refs)
        bias_QK = term_bias(plan, terms, qpos_ref[...], kpos_ref[...])
        s_QK, _ = penalized_scores_QK(
            nonlinearity,
            q_ref[...],
            k_ref[...],
            selectors_of(sel_refs[:3], sel_refs[3][...], mask_args),
            allowed_QK,
            bias_QK=bias_QK,
        )
        softmax_step(s_QK, allowed_QK, v_ref[...], (max_ref, sum_ref, acc_ref))

    @pl.when(kj == pl.num_programs(3) - 1)
    def _finish() -> None:
        finish_softmax(plan, o_ref, lse_ref, (max_ref, sum_ref, acc_ref))


def tpu_selective_forward_call(
    plan: Plan,
    nonlinearity: str,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    v_BSGW: jax.Array,
    *,
    selectors: dict[str, jax.Array],
    ints: dict[str, jax.Array],
    terms: list[dict],
) -> tuple[jax.Array, jax.Array]:
    """The prefix and forward kernels on padded inputs, with the arguments of
    :func:`copejax.ops.kernels.selective.selective_forward_call` but the selecting head's
    ``selectors`` "q" (B, T, H) and "k" (B, S, H) (the layouts change inside): one call of
    each, or where the prefix would pass the queries' bytes (:func:`~copejax.ops.kernels.
    selective_prefix.call_tiles`, the GPU's rule) a loop over calls of R query tiles, the
    prefix's sums carried from one call to the next.

    Returns:
      (o_BTNW float32, lse_BNT float32): the backward sums P again
      (:mod:`copejax.ops.kernels.tpu_selective_backward`).
    """
    length_q, heads, dim = q_BTNH.shape[1:]
    tiles = call_tiles(plan.count_q, heads, dim, q_BTNH.dtype.itemsize)
    if tiles >= plan.count_q:
        tensors = (q_BTNH, k_BSGH, v_BSGW)
        return _forward_tiles(
            plan, nonlinearity, tensors, selectors=selectors, ints=ints, terms=terms
        )
    # Calls of R query tiles: the queries padded to whole calls, in tiles after every real
    # one (their selections reach only later padded tiles, their outputs are cut off).
    calls = -(-plan.count_q // tiles)
    padded = dataclasses.replace(plan, count_q=calls * tiles)
    extra = calls * tiles * plan.size_q - length_q

    def pad(x: jax.Array, axis: int) -> jax.Array:
        return jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)]) if extra else x

    q_BTNH, ints, terms = per_query(pad, q_BTNH, ints, terms)
    selectors = {**selectors, "q": pad(selectors["q"], 1)}
    tensors = (q_BTNH, k_BSGH, v_BSGW)
    o_BTNW, lse_BNT = _forward_tiles(
        padded, nonlinearity, tensors, selectors=selectors, ints=ints, terms=terms, tiles=tiles
    )
    return o_BTNW[:, :length_q], lse_BNT[:, :, :length_q]


def _forward_tiles(
    plan: Plan,
    nonlinearity: str,
    tensors: tuple[jax.Array, jax.Array, jax.Array],
    *,
    selectors: dict[str, jax.Array],
    ints: dict[str, jax.Array],
    terms: list[dict],
    tiles: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The prefix and forward kernels in calls of ``tiles`` query tiles (default: one call
    of count_q), in sequence: (o_BTNW float32, lse_BNT float32) of every query."""
    q_BTNH, k_BSGH, v_BSGW = tensors
    batch, length_q, heads, dim = q_BTNH.shape
    width = v_BSGW.shape[-1]
    tiles = plan.count_q if tiles is None else tiles
    ints = {**tpu_ints(ints), "k_start": ints["k_start"][:, None, :]}
    q_tile = lambda i, j: i
    k_tile = lambda i, j: tile_index(plan, i, j, keys=True)
    has, term_in, term_specs = term_operands(
        plan, tpu_terms(plan, terms), q_tile=q_tile, k_tile=k_tile
    )
    kernel = functools.partial(
        _forward_kernel,
        plan=plan,
        nonlinearity=nonlinearity,
        has=has,
        num_term_refs=len(term_in),
    )
    column = pltpu.VMEM((plan.size_q, 1), F32)
    inputs = (
        by_query_heads(q_BTNH),
        by_query_heads(k_BSGH),
        by_query_heads(v_BSGW),
        *(ints[key] for key in ("q_pos", "q_seg", "k_pos", "k_seg", "k_rank")),
        *term_in,
        selectors["q"],
        selectors["k"],
        ints["k_start"],
    )
    # The inputs' specs read the call's query tile i as tile first + i.
    in_specs = [
        _from_first(spec)
        for spec in pair_specs(plan, dim, width, q_tile, k_tile, backward=False)
        + term_specs
        + selector_specs(plan, dim, q_tile, k_tile)
    ]
    # The call's prefix: its own tile i, at the key tile that tile first + i reads.
    in_specs.append(
        pl.BlockSpec(
            (None, None, 1, plan.size_k),
            lambda b, n, i, j, first_ref: (b, i, 0, k_tile(first_ref[0] + i, j)),
        )
    )
    # The outputs: the call's own tiles.
    out_specs = [
        pl.BlockSpec((None, None, plan.size_q, width), lambda b, n, i, j: (b, n, i, 0)),
        row_spec(plan, lambda i, j: i),
    ]
    forward = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, heads, tiles, plan.count_k),
            in_specs=in_specs,
            out_specs=[_in_call(spec) for spec in out_specs],
            scratch_shapes=[column, column, pltpu.VMEM((plan.size_q, width), F32)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, heads, tiles * plan.size_q, width), F32),
            rows_shape(dataclasses.replace(plan, count_q=tiles), batch, heads),
        ],
        interpret=interpret_mode(plan),
        compiler_params=compiler_params(),
        name="copejax_selective_forward_tpu",
    )

    def call(first: jax.Array | int, start_B1S: jax.Array | None) -> tuple:
        prefix, end_B1S = tpu_prefix_call(
            plan, nonlinearity, selectors, ints, first=first, rows=tiles, start_B1S=start_B1S
        )
        return end_B1S, *forward(tile_operand(first), *inputs, prefix)

    if tiles == plan.count_q:  # one call
        _, o_BNTW, lse_BNC1Q = call(0, None)
        return from_query_heads(o_BNTW), from_query_rows(lse_BNC1Q)

    def step(c: jax.Array, carry: tuple) -> tuple:
        start_B1S, o_BNTW, lse_BNC1Q = carry
        end_B1S, o_c, lse_c = call(c * tiles, start_B1S)
        o_BNTW = jax.lax.dynamic_update_slice_in_dim(o_BNTW, o_c, c * tiles * plan.size_q, 2)
        lse_BNC1Q = jax.lax.dynamic_update_slice_in_dim(lse_BNC1Q, lse_c, c * tiles, 2)
        return end_B1S, o_BNTW, lse_BNC1Q

    init = (
        jnp.zeros((batch, 1, k_BSGH.shape[1]), F32),
        jnp.zeros((batch, heads, length_q, width), F32),
        jnp.zeros(rows_shape(plan, batch, heads).shape, F32),
    )
    _, o_BNTW, lse_BNC1Q = jax.lax.fori_loop(0, plan.count_q // tiles, step, init)
    return from_query_heads(o_BNTW), from_query_rows(lse_BNC1Q)


def _from_first(spec: pl.BlockSpec) -> pl.BlockSpec:
    """``spec`` (an index map of a grid step (b, n, i, j)) on a call's grid, whose query tile
    i is tile ``first + i`` (``first``: the scalar-prefetched operand)."""
    index_map = spec.index_map
    return dataclasses.replace(
        spec, index_map=lambda b, n, i, j, first_ref: index_map(b, n, first_ref[0] + i, j)
    )


def _in_call(spec: pl.BlockSpec) -> pl.BlockSpec:
    """``spec`` (an index map of a grid step (b, n, i, j)) on a call's grid, indexing the
    call's own query tiles (its outputs)."""
    index_map = spec.index_map
    return dataclasses.replace(spec, index_map=lambda b, n, i, j, first_ref: index_map(b, n, i, j))
