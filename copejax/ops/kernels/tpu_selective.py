"""Selective attention's penalties in the TPU kernels (Leviathan et al. 2024, arXiv
2410.02703), forward: the prefix kernel and the forward kernel.

The maths of :mod:`copejax.ops.kernels.selective` (the selection of a tile, ``keep_QK`` and
``selection_QK``; ``F_QK = P[g, keys] + L_QQ @ S_QK`` in ``penalized_scores_QK``) on the
grid of :mod:`copejax.ops.kernels.tpu_forward`, in the layouts of
:mod:`copejax.ops.kernels.tpu_params`:

- the prefix kernel's grid is (batch row, key tile, query tile), the query tiles walked
  oldest first ("arbitrary") with the column sums of S, (1, K) float32, in VMEM scratch;
  every step writes the sum entering its query tile: P (B, count_q, 1, S) float32, read as
  (1, K) tiles, O(T^2 / Q) per batch row through the forward (the backward sums it again in
  VMEM, :func:`prefix_step`, not kept). Only the query tiles that may see the key tile add to it
  (:meth:`~copejax.ops.kernels.tiles.Plan.query_tiles`; the others select nothing a query
  seeing the key reads, as on the GPU);
- the forward kernel is the softmax's (grid (batch row, head, query tile, key tile), running
  max, sum and output in scratch) with each pair's scores penalized: four more operands, the
  selecting head's q tile (from (B, T, H)), its k tile (from (B, S, H)), the keys' segment
  starts (B, 1, S) and P at the tile pair, recompute the selecting head's S tile.

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

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from copejax.ops.kernels.operands import term_refs
from copejax.ops.kernels.selective_tiles import (
    keep_QK,
    penalized_scores_QK,
    selection_live,
    selection_QK,
    term_bias,
)
from copejax.ops.kernels.tiles import Plan, content_logits_QK
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


def selector_specs(
    plan: Plan, dim: int, q_tile: TileMap, k_tile: TileMap, *, prefix: bool = True
) -> list[pl.BlockSpec]:
    """Specs of the selecting head's q (B, T, H) and k (B, S, H), the segment starts
    (B, 1, S) and (with ``prefix``) P (B, count_q, 1, S) at a grid (b, n, outer, walked)'s
    tile pair."""
    specs = [
        pl.BlockSpec((None, plan.size_q, dim), lambda b, n, i, j: (b, q_tile(i, j), 0)),
        pl.BlockSpec((None, plan.size_k, dim), lambda b, n, i, j: (b, k_tile(i, j), 0)),
        pl.BlockSpec((None, 1, plan.size_k), lambda b, n, i, j: (b, 0, k_tile(i, j))),
    ]
    if prefix:
        specs.append(
            pl.BlockSpec(
                (None, None, 1, plan.size_k), lambda b, n, i, j: (b, q_tile(i, j), 0, k_tile(i, j))
            )
        )
    return specs


def selectors_of(refs: tuple, prefix_1K: jax.Array, mask_args: tuple) -> tuple:
    """The ``selectors`` of :func:`~copejax.ops.kernels.selective_tiles.penalized_scores_QK` from
    the (q_sel, k_sel, k_start) refs, the pair's P (1, K) and a step's mask arguments (first
    query, first key, segments (Q, 1) and (1, K), ranks)."""
    qsel_ref, ksel_ref, kstart_ref = refs
    q_first, k_first, q_seg_Q1, k_seg_1K, _ = mask_args
    keep = keep_QK(q_first, k_first, q_seg_Q1, k_seg_1K, kstart_ref[...])
    return qsel_ref[...], ksel_ref[...], keep, prefix_1K


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


def _prefix_kernel(*refs, plan: Plan, nonlinearity: str) -> None:
    prefix_ref, acc_ref = refs[5:]
    kj, qi = pl.program_id(1), pl.program_id(2)  # query tiles oldest first

    @pl.when(qi == 0)
    def _init() -> None:
        acc_ref[...] = jnp.zeros(acc_ref.shape, F32)

    def store(sums_1K: jax.Array) -> None:
        prefix_ref[...] = sums_1K

    prefix_step(plan, nonlinearity, (qi, kj), refs[:5], acc_ref=acc_ref, store=store)


def tpu_prefix_call(plan: Plan, nonlinearity: str, selectors: dict, ints: dict) -> jax.Array:
    """P (B, count_q, 1, S) float32: row g sums S over the queries of the query tiles
    before g. ``selectors``: the selecting head's "q" (B, T, H) and "k" (B, S, H); ``ints``:
    :func:`tpu_ints`' with "k_start" (B, 1, S)."""
    (batch, _, dim), length_k = selectors["q"].shape, selectors["k"].shape[1]
    sq, sk = plan.size_q, plan.size_k
    q_tile = lambda j, i: tile_index(plan, j, i, keys=False)  # clamped: no refetch
    return pl.pallas_call(
        functools.partial(_prefix_kernel, plan=plan, nonlinearity=nonlinearity),
        grid=(batch, plan.count_k, plan.count_q),
        in_specs=[
            pl.BlockSpec((None, sq, dim), lambda b, j, i: (b, q_tile(j, i), 0)),
            pl.BlockSpec((None, sk, dim), lambda b, j, i: (b, j, 0)),
            pl.BlockSpec((None, sq, 1), lambda b, j, i: (b, q_tile(j, i), 0)),
            pl.BlockSpec((None, 1, sk), lambda b, j, i: (b, 0, j)),
            pl.BlockSpec((None, 1, sk), lambda b, j, i: (b, 0, j)),
        ],
        out_specs=pl.BlockSpec((None, None, 1, sk), lambda b, j, i: (b, i, 0, j)),
        out_shape=jax.ShapeDtypeStruct((batch, plan.count_q, 1, length_k), F32),
        scratch_shapes=[pltpu.VMEM((1, sk), F32)],
        interpret=interpret_mode(plan),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        name="copejax_selective_prefix_tpu",
    )(selectors["q"], selectors["k"], ints["q_seg"], ints["k_seg"], ints["k_start"])


def _forward_kernel(*refs, plan: Plan, nonlinearity: str, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[8 : 8 + num_term_refs]), has)
    sel_refs = refs[8 + num_term_refs : 12 + num_term_refs]
    o_ref, lse_ref, max_ref, sum_ref, acc_ref = refs[12 + num_term_refs :]
    qi, kj = pl.program_id(2), pl.program_id(3)  # key tiles oldest first

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
    ``selectors`` "q" (B, T, H) and "k" (B, S, H) (the layouts change inside).

    Returns:
      (o_BTNW float32, lse_BNT float32): the backward sums P again
      (:mod:`copejax.ops.kernels.tpu_selective_backward`).
    """
    batch, length_q, heads, dim = q_BTNH.shape
    width = v_BSGW.shape[-1]
    ints = {**tpu_ints(ints), "k_start": ints["k_start"][:, None, :]}
    prefix = tpu_prefix_call(plan, nonlinearity, selectors, ints)
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
    o_BNTW, lse_BNC1Q = pl.pallas_call(
        kernel,
        grid=(batch, heads, plan.count_q, plan.count_k),
        in_specs=pair_specs(plan, dim, width, q_tile, k_tile, backward=False)
        + term_specs
        + selector_specs(plan, dim, q_tile, k_tile),
        out_specs=[
            pl.BlockSpec((None, None, plan.size_q, width), lambda b, n, i, j: (b, n, i, 0)),
            row_spec(plan, lambda i, j: i),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, heads, length_q, width), F32),
            rows_shape(plan, batch, heads),
        ],
        scratch_shapes=[column, column, pltpu.VMEM((plan.size_q, width), F32)],
        interpret=interpret_mode(plan),
        compiler_params=compiler_params(),
        name="copejax_selective_forward_tpu",
    )(
        by_query_heads(q_BTNH),
        by_query_heads(k_BSGH),
        by_query_heads(v_BSGW),
        *(ints[key] for key in ("q_pos", "q_seg", "k_pos", "k_seg", "k_rank")),
        *term_in,
        selectors["q"],
        selectors["k"],
        ints["k_start"],
        prefix,
    )
    return from_query_heads(o_BNTW), from_query_rows(lse_BNC1Q)
