"""Selective attention's penalties in the fused kernels (Leviathan et al. 2024, arXiv
2410.02703), forward: the prefix kernel and the forward kernel.

The selecting head's scaled content logits ``l_kj`` give the selection
``S_kj = relu(l_kj)`` (or ``sigmoid``) where ``j < k``, j and k share a segment and j is not
its segment's first key, else 0; every head's scores are ``q . k / sqrt(H) - F_ij`` (plus
the other terms' biases) with
``F_ij = sum_{k < i} S_kj`` (:mod:`copejax.positions.selective`, whose naive path this
matches). The window plays no part in S: on a pair (i, j) the window allows, every k in
(j, i) also sees j, so the naive path's windowed S gives the same F there.

Query tile g holds the selectors k of its own queries, so

    F_QK = P[g, keys] + L_QQ @ S_QK,   L[i, k] = 1 where k < i (strictly lower triangular)

with ``P[g, j] = sum_{k < first query of g} S_kj``, the engine's prefix
(:mod:`copejax.ops.selective_block`). The prefix kernel writes P: one program per (batch
row, key tile) walks the query tiles oldest first, accumulating the column sums of S, and
writes the sum entering each tile, (B, count_q, S) float32 (count_q padded to a power of
two): O(T^2 / Q), no (T, S) buffer. The forward kernel is FlashAttention-2's
(:mod:`copejax.ops.kernels.forward`) with the penalty added per pair: each program
recomputes the selecting head's S tile from its q and k tiles (one more Q x K x H matmul)
and ``L @ S``: three Q x Q x K bfloat16 matmuls of S split in bfloat16 pieces, exact to
float32 (:func:`~copejax.ops.kernels.tiles.dot_exact_f32`), on a GPU's tensor cores; one
bfloat16 or TF32 matmul would round the penalties to 3 digits. The backward is
:mod:`copejax.ops.kernels.selective_backward`.

Cost: each head's program recomputes the S tile of a pair, so a pair takes, besides
FlashAttention-2's two matmuls, one Q x K x H and three Q x Q x K (bfloat16) more in the
forward, and about as many again in each backward kernel. Memory: P (B, count_q, S) float32
is kept for the backward; the backward adds R (B, N, count_q, S) float32 and the selecting
head's per-head gradient partials (B, T, N, H) float32 twice. No (T, S) array.

The kernels add the other logit terms (:mod:`copejax.ops.kernels.terms`) as the generic ones
do, with the softmax only (no CoPE, Shaw table or stick-breaking beside the penalties);
pruning (``prune_threshold``, ``prune_budget``) is refused by the model layer
(:mod:`copejax.model.kernel_terms`).
Shape letters as in :mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.operands import term_operands, term_refs
from copejax.ops.kernels.terms import pair_grid, tile_bias_QK
from copejax.ops.kernels.tiles import (
    MASKED_LOGIT,
    Plan,
    content_logits_QK,
    dot_exact_f32,
    dot_f32,
    scan_sum,
)
from copejax.ops.kernels.triton_params import compiler_params, gpu_scan

NONLINEARITIES = ("relu", "sigmoid")  # copejax.ops.selective's


@dataclasses.dataclass(frozen=True)
class SelectiveTerm:
    """Selective attention in the kernels: the selecting query head (its key/value head is
    ``head // (N / G)``) and the nonlinearity of S."""

    head: int
    nonlinearity: str = "relu"


def rows_of(count: int) -> int:
    """Rows of a per-tile buffer: ``count`` padded to a power of two (Triton's blocks)."""
    return 1 << max(count - 1, 0).bit_length()


def keep_QK(
    q_first: jax.Array,
    k_first: jax.Array,
    q_segments_Q: jax.Array,
    k_segments_K: jax.Array,
    k_starts_K: jax.Array,
) -> jax.Array:
    """Where selector k (a query of the tile) may select key j: ``j < k``, one segment, j
    not its segment's first key (``k_starts_K`` 1 there). (Q, K) bool; the per-query and
    per-key arrays as (Q,) and (K,) (GPU) or (Q, 1) and (1, K) (TPU)."""
    q_segments_Q1, k_segments_1K = pair_grid(q_segments_Q, k_segments_K)
    size_q, size_k = q_segments_Q1.shape[0], k_segments_1K.shape[1]
    k_index_Q1 = q_first + jax.lax.broadcasted_iota(jnp.int32, (size_q, 1), 0)
    j_index_1K = k_first + jax.lax.broadcasted_iota(jnp.int32, (1, size_k), 1)
    keep_QK = (j_index_1K < k_index_Q1) & (q_segments_Q1 == k_segments_1K)
    return keep_QK & (pair_grid(q_segments_Q, k_starts_K)[1] == 0)


def selection_live(
    plan: Plan,
    q_first: jax.Array,
    k_first: jax.Array,
    q_segments_Q: jax.Array,
    k_segments_K: jax.Array,
) -> jax.Array:
    """Whether the pair of tiles may hold a nonzero S (some key before some selector, the
    segment ranges meet): the prefix kernel skips the others."""
    live = k_first < q_first + plan.size_q - 1
    live &= jnp.min(k_segments_K) <= jnp.max(q_segments_Q)
    return live & (jnp.max(k_segments_K) >= jnp.min(q_segments_Q))


def selection_QK(
    logits_QK: jax.Array, keep_QK: jax.Array, nonlinearity: str
) -> tuple[jax.Array, jax.Array]:
    """(S, dS/dl) of a tile from the selecting head's scaled logits, float32, both zero off
    ``keep``; the derivatives ``jax.nn.relu`` (0 at 0) and ``jax.nn.sigmoid`` take."""
    if nonlinearity == "relu":
        s_QK = jnp.maximum(logits_QK, 0.0)
        slope_QK = (logits_QK > 0).astype(jnp.float32)
    else:
        s_QK = jax.nn.sigmoid(logits_QK)
        slope_QK = s_QK * (1.0 - s_QK)
    return jnp.where(keep_QK, s_QK, 0.0), jnp.where(keep_QK, slope_QK, 0.0)


def _triangular_sum_QK(x_QK: jax.Array, newer: bool) -> jax.Array:
    """``L @ x`` or (``newer``) ``L^T @ x``, L[i, k] = 1 where k < i, as three bfloat16
    matmuls with float32 accumulation (tensor cores on a GPU, where a float32 matmul at full
    precision would not run on them, and TF32 would keep 10 bits of x; the TPU's MXU, where
    one at full precision takes more passes, :mod:`copejax.ops.kernels.tpu_selective`): L is
    exact in bfloat16, so the result is float32's. Both are plain (M, K) x (K, N) matmuls,
    the triangle built transposed for ``L^T``, which every backend lowers."""
    size = x_QK.shape[0]
    row_Q1 = jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0)
    column_1Q = jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)
    ones_QQ = (column_1Q > row_Q1) if newer else (column_1Q < row_Q1)
    return dot_exact_f32(x_QK, ones_QQ.astype(jnp.float32), (0, 1), exact_left=True)


def older_sum_QK(x_QK: jax.Array, scan: bool = False) -> jax.Array:
    """``sum_{k < i} x_kj`` over the tile's rows (``L @ x``), float32; ``scan``: as a
    prefix sum down the rows (the GPU kernels, :func:`~copejax.ops.kernels.triton_params.
    gpu_scan`), not matmuls."""
    if scan:
        return scan_sum(x_QK, 0, newer=False, inclusive=False)
    return _triangular_sum_QK(x_QK, newer=False)


def newer_sum_QK(x_QK: jax.Array, scan: bool = False) -> jax.Array:
    """``sum_{i > k} x_ij`` over the tile's rows (``L^T @ x``), float32; ``scan``: the
    column total minus a prefix sum."""
    if scan:
        return scan_sum(x_QK, 0, newer=True, inclusive=False)
    return _triangular_sum_QK(x_QK, newer=True)


def penalized_scores_QK(
    nonlinearity: str,
    q_QH: jax.Array,
    k_KH: jax.Array,
    selectors: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    allowed_QK: jax.Array,
    *,
    bias_QK: jax.Array | None = None,
    scan: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(the masked scores ``q . k / sqrt(H) + bias - F``, dS/dl of the selection) of one
    pair; ``bias_QK``: the other terms' (:func:`term_bias`), or None; ``scan``: F's sum over
    the older selectors as :func:`older_sum_QK`'s prefix sum.

    ``selectors``: (the selecting head's q tile (Q, H) and k tile (K, H), keep (Q, K), the
    prefix P of this query tile at the keys, (K,) on a GPU or (1, K) on a TPU)."""
    q_sel_QH, k_sel_KH, keep_QK, prefix_K = selectors
    s_QK, slope_QK = selection_QK(content_logits_QK(q_sel_QH, k_sel_KH), keep_QK, nonlinearity)
    f_QK = (prefix_K[None, :] if prefix_K.ndim == 1 else prefix_K) + older_sum_QK(s_QK, scan)
    scores_QK = content_logits_QK(q_QH, k_KH) - f_QK
    if bias_QK is not None:
        scores_QK = scores_QK + bias_QK
    return jnp.where(allowed_QK, scores_QK, MASKED_LOGIT), slope_QK


def term_bias(plan: Plan, arrays: tuple[list, list, list], q_pos_Q, k_pos_K) -> jax.Array | None:
    """The other terms' tile bias (:func:`copejax.ops.kernels.terms.tile_bias_QK`) from
    (params, q values, k values), or None without terms."""
    if not plan.biases:
        return None
    return tile_bias_QK(plan.biases, arrays, q_pos_Q, k_pos_K)


def _prefix_kernel(*refs, plan: Plan, nonlinearity: str) -> None:
    qsel_ref, ksel_ref, qseg_ref, kseg_ref, kstart_ref, prefix_ref = refs
    kj = pl.program_id(1)
    k_first = kj * plan.size_k
    k_sel_KH, k_seg_K, k_starts_K = ksel_ref[...], kseg_ref[...], kstart_ref[...]
    first, end = plan.query_tiles(kj)  # with a window and no sinks, the tiles that see kj

    def step(qi: jax.Array, acc_K: jax.Array) -> jax.Array:
        # Every row is written once (no other store to race with on a GPU): what the older
        # query tiles selected; rows past the tiles that see kj are never read.
        prefix_ref[pl.ds(qi, 1), :] = acc_K[None, :]
        q_first = qi * plan.size_q
        queries = pl.ds(pl.multiple_of(q_first, plan.size_q), plan.size_q)

        def compute(acc_K: jax.Array) -> jax.Array:
            keep = keep_QK(q_first, k_first, qseg_ref[queries], k_seg_K, k_starts_K)
            logits_QK = content_logits_QK(qsel_ref[queries, :], k_sel_KH)
            return acc_K + jnp.sum(selection_QK(logits_QK, keep, nonlinearity)[0], axis=0)

        def band(acc_K: jax.Array) -> jax.Array:  # a query tile (qi < count_q) that sees kj
            live = selection_live(plan, q_first, k_first, qseg_ref[queries], k_seg_K)
            return jax.lax.cond(live, compute, lambda a: a, acc_K)

        return jax.lax.cond((first <= qi) & (qi < end), band, lambda a: a, acc_K)

    rows = prefix_ref.shape[0]
    jax.lax.fori_loop(0, rows, step, jnp.zeros((plan.size_k,), jnp.float32))


def _forward_kernel(*refs, plan: Plan, nonlinearity: str, has: tuple, num_term_refs: int) -> None:
    q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, krank_ref = refs[:8]
    p_refs, qv_refs, kv_refs = term_refs(list(refs[8 : 8 + num_term_refs]), has)
    qsel_ref, ksel_ref, kstart_ref, prefix_ref, o_ref, lse_ref = refs[8 + num_term_refs :]
    qi = pl.program_id(2)
    q_first = qi * plan.size_q
    q_QH, q_pos_Q, q_seg_Q, q_sel_QH = q_ref[...], qpos_ref[...], qseg_ref[...], qsel_ref[...]
    params = [None if r is None else r[...] for r in p_refs]
    q_values = [None if r is None else r[...] for r in qv_refs]

    def pair(kj: jax.Array, state: tuple) -> tuple:
        k_first = kj * plan.size_k
        keys = pl.ds(pl.multiple_of(k_first, plan.size_k), plan.size_k)
        k_seg_K, k_rank_K = kseg_ref[keys], krank_ref[keys]

        def compute(state: tuple) -> tuple:
            max_Q, sum_Q, acc_QW = state
            allowed_QK = plan.allowed_QK(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
            keep = keep_QK(q_first, k_first, q_seg_Q, k_seg_K, kstart_ref[keys])
            selectors = (q_sel_QH, ksel_ref[keys, :], keep, prefix_ref[keys])
            k_values = [None if r is None else r[keys] for r in kv_refs]
            bias_QK = term_bias(plan, (params, q_values, k_values), q_pos_Q, kpos_ref[keys])
            s_QK, _ = penalized_scores_QK(
                nonlinearity,
                q_QH,
                k_ref[keys, :],
                selectors,
                allowed_QK,
                bias_QK=bias_QK,
                scan=gpu_scan(),
            )
            new_max_Q = jnp.maximum(max_Q, jnp.max(s_QK, axis=1))
            p_QK = jnp.where(allowed_QK, jnp.exp(s_QK - new_max_Q[:, None]), 0.0)
            rescale_Q = jnp.exp(max_Q - new_max_Q)
            v_KW = v_ref[keys, :]
            acc_QW = acc_QW * rescale_Q[:, None] + dot_f32(p_QK.astype(v_KW.dtype), v_KW, (1, 0))
            return new_max_Q, sum_Q * rescale_Q + jnp.sum(p_QK, axis=1), acc_QW

        live = plan.live(q_first, k_first, q_seg_Q, k_seg_K, k_rank_K)
        return jax.lax.cond(live, compute, lambda s: s, state)

    first, end = plan.key_tiles(qi)
    init = (
        jnp.full((plan.size_q,), -1e30, jnp.float32),
        jnp.zeros((plan.size_q,), jnp.float32),
        jnp.zeros((plan.size_q, v_ref.shape[-1]), jnp.float32),
    )
    max_Q, sum_Q, acc_QW = jax.lax.fori_loop(first, end, pair, init)
    seen_Q = sum_Q > 0
    safe_sum_Q = jnp.where(seen_Q, sum_Q, 1.0)
    o_ref[...] = (acc_QW / safe_sum_Q[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen_Q, max_Q + jnp.log(safe_sum_Q), 0.0)


def prefix_call(
    plan: Plan, nonlinearity: str, q_sel_BTH: jax.Array, k_sel_BSH: jax.Array, ints: dict
) -> jax.Array:
    """The prefix P (B, rows_of(count_q), S) float32: row g sums S over the queries of the
    query tiles before g (rows g >= count_q, and with a window those past the tiles that see
    the key, hold sums no pair reads)."""
    batch, length_q, dim = q_sel_BTH.shape
    length_k, sk = k_sel_BSH.shape[1], plan.size_k
    rows = rows_of(plan.count_q)
    return pl.pallas_call(
        functools.partial(_prefix_kernel, plan=plan, nonlinearity=nonlinearity),
        grid=(batch, plan.count_k),
        in_specs=[
            pl.BlockSpec((None, length_q, dim), lambda b, j: (b, 0, 0)),
            pl.BlockSpec((None, sk, dim), lambda b, j: (b, j, 0)),
            pl.BlockSpec((None, length_q), lambda b, j: (b, 0)),
            pl.BlockSpec((None, sk), lambda b, j: (b, j)),
            pl.BlockSpec((None, sk), lambda b, j: (b, j)),
        ],
        out_specs=pl.BlockSpec((None, rows, sk), lambda b, j: (b, 0, j)),
        out_shape=jax.ShapeDtypeStruct((batch, rows, length_k), jnp.float32),
        interpret=plan.interpret,
        compiler_params=compiler_params(dim),
        name="copejax_selective_prefix",
    )(q_sel_BTH, k_sel_BSH, ints["q_seg"], ints["k_seg"], ints["k_start"])


def selective_forward_call(
    plan: Plan,
    nonlinearity: str,
    q_BTNH: jax.Array,
    k_BSGH: jax.Array,
    v_BSGW: jax.Array,
    *,
    selectors: dict[str, jax.Array],
    ints: dict[str, jax.Array],
    terms: list[dict],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The prefix and forward kernels on padded inputs.

    Args:
      q_BTNH, k_BSGH, v_BSGW: queries, keys and values (T, S multiples of the tiles).
      selectors: the selecting head's "q" (B, T, H) and "k" (B, S, H).
      ints: int32 (B, T) "q_pos", "q_seg" and (B, S) "k_pos", "k_seg", "k_rank", "k_start"
        (1 at a segment's first key).
      terms: the other terms' arrays, as :func:`copejax.ops.kernels.forward.forward_call`
        takes them.

    Returns:
      (o_BTNW float32, lse_BNT float32, the prefix P (B, rows_of(count_q), S) float32).
    """
    batch, length_q, heads, dim = q_BTNH.shape
    length_k, width = k_BSGH.shape[1], v_BSGW.shape[-1]
    groups, sq = plan.groups, plan.size_q
    prefix = prefix_call(plan, nonlinearity, selectors["q"], selectors["k"], ints)
    whole = pl.BlockSpec((None, length_k), lambda b, n, i: (b, 0))
    query_tile = pl.BlockSpec((None, sq), lambda b, n, i: (b, i))
    has, term_inputs, term_specs = term_operands(plan, terms, q_block=True, k_block=False)
    kernel = functools.partial(
        _forward_kernel,
        plan=plan,
        nonlinearity=nonlinearity,
        has=has,
        num_term_refs=len(term_inputs),
    )
    o_BTNW, lse_BNT = pl.pallas_call(
        kernel,
        grid=(batch, heads, plan.count_q),
        in_specs=[
            pl.BlockSpec((None, sq, None, dim), lambda b, n, i: (b, i, n, 0)),
            pl.BlockSpec((None, length_k, None, dim), lambda b, n, i: (b, 0, n // groups, 0)),
            pl.BlockSpec((None, length_k, None, width), lambda b, n, i: (b, 0, n // groups, 0)),
            query_tile,
            query_tile,
            whole,
            whole,
            whole,
            *term_specs,
            pl.BlockSpec((None, sq, dim), lambda b, n, i: (b, i, 0)),
            pl.BlockSpec((None, length_k, dim), lambda b, n, i: (b, 0, 0)),
            whole,
            pl.BlockSpec((None, None, length_k), lambda b, n, i: (b, i, 0)),
        ],
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
    )(
        q_BTNH,
        k_BSGH,
        v_BSGW,
        ints["q_pos"],
        ints["q_seg"],
        ints["k_pos"],
        ints["k_seg"],
        ints["k_rank"],
        *term_inputs,
        selectors["q"],
        selectors["k"],
        ints["k_start"],
        prefix,
    )
    return o_BTNW, lse_BNT, prefix
