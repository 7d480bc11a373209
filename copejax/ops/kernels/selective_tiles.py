"""Selective attention's tile maths in the fused kernels (arXiv 2410.02703): the selection
S of one pair of tiles, its sums over the tile's selectors, and the penalized scores, for the
GPU's kernels (:mod:`copejax.ops.kernels.selective`,
:mod:`~copejax.ops.kernels.selective_backward`) and the TPU's
(:mod:`copejax.ops.kernels.tpu_selective`). Per-query and per-key arrays come as (Q,) and (K,)
on a GPU, (Q, 1) and (1, K) on a TPU. Shape letters as in :mod:`copejax.ops.kernels.forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from copejax.ops.kernels.exact_dots import dot_exact_f32
from copejax.ops.kernels.terms import pair_grid, tile_bias_QK
from copejax.ops.kernels.tiles import MASKED_LOGIT, Plan, content_logits_QK, scan_sum


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
    logits_QK: jax.Array,
    keep_QK: jax.Array,
    nonlinearity: str,
    sigmoid: Callable[[jax.Array], jax.Array] = jax.nn.sigmoid,
) -> jax.Array:
    """S of a tile from the selecting head's scaled logits, float32, zero off ``keep``;
    ``sigmoid``: the GPU kernels take :func:`~copejax.ops.kernels.tiles.sigmoid_gpu`."""
    if nonlinearity == "relu":
        s_QK = jnp.maximum(logits_QK, 0.0)
    else:
        s_QK = sigmoid(logits_QK)
    return jnp.where(keep_QK, s_QK, 0.0)


def selection_slope_QK(s_QK: jax.Array, nonlinearity: str) -> jax.Array:
    """dS/dl from S (:func:`selection_QK`'s), zero where S is masked: the derivatives
    ``jax.nn.relu`` (0 at 0) and ``jax.nn.sigmoid`` take. From S rather than the logits, so
    that a backward kernel holds no second (Q, K) tile from the penalty to the pull-back."""
    if nonlinearity == "relu":
        return (s_QK > 0).astype(jnp.float32)
    return s_QK * (1.0 - s_QK)  # 0 where keep masked S to 0


def _triangular_sum_QK(x_QK: jax.Array, newer: bool) -> jax.Array:
    """``L @ x`` or (``newer``) ``L^T @ x``, L[i, k] = 1 where k < i (strictly lower
    triangular), as three bfloat16
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
    sigmoid: Callable[[jax.Array], jax.Array] = jax.nn.sigmoid,
) -> tuple[jax.Array, jax.Array]:
    """(the masked scores ``q . k / sqrt(H) + bias - F``, the selection S) of one pair,
    float32 (Q, K); ``bias_QK``: the other terms' (:func:`term_bias`), or None;
    ``scan``: F's sums over the tile's selectors as prefix sums (:func:`older_sum_QK`);
    ``sigmoid`` as :func:`selection_QK` takes it.

    ``selectors``: (the selecting head's q tile (Q, H) and k tile (K, H), keep (Q, K), the
    prefix P of this query tile at the keys, the sum over the older query tiles' selectors,
    (K,) on a GPU or (1, K) on a TPU), with ``F = P + L @ S``."""
    q_sel_QH, k_sel_KH, keep_QK, prefix_K = selectors
    s_QK = selection_QK(content_logits_QK(q_sel_QH, k_sel_KH), keep_QK, nonlinearity, sigmoid)
    prefix = prefix_K[None, :] if prefix_K.ndim == 1 else prefix_K
    f_QK = prefix + older_sum_QK(s_QK, scan)
    scores_QK = content_logits_QK(q_QH, k_KH) - f_QK
    if bias_QK is not None:
        scores_QK = scores_QK + bias_QK
    return jnp.where(allowed_QK, scores_QK, MASKED_LOGIT), s_QK


def term_bias(plan: Plan, arrays: tuple[list, list, list], q_pos_Q, k_pos_K) -> jax.Array | None:
    """The other terms' tile bias (:func:`copejax.ops.kernels.terms.tile_bias_QK`) from
    (params, q values, k values), or None without terms."""
    if not plan.biases:
        return None
    return tile_bias_QK(plan.biases, arrays, q_pos_Q, k_pos_K)
