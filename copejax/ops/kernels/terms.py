"""The contract a logit term implements to run inside the fused kernels (issue 45).

A :class:`KernelTerm` is a bias computed tile by tile inside the kernel, never as a
(B, N, T, S) array: a function of one head's parameter row, the tile's query and key
positions and one float per query and per key of that head. The kernels differentiate
it themselves (``jax.vjp`` of the tile function, traced into the kernel body), so adding
a term is writing that function with ops every backend lowers (elementwise maths,
comparisons, ``jnp.where``; no gathers: a table is read by :func:`table_lookup`).

The gradient contract: the kernels return the score gradient ``dS`` pulled back through
the tile function, summed over what each input is shared by:

- ``params_NP``: summed over every allowed pair of every batch row (per head);
- ``q_values_BTN``: summed over each query's keys (FoX: the row sums of dS);
- ``k_values_BSN``: summed over each key's queries (FoX: minus the column sums of dS).

Whatever produced these arrays outside the kernel (a softplus of raw parameters, FoX's
prefix sums of log forget gates) is differentiated by JAX around the kernel, so the reverse
cumulative sum of FoX's gradient runs outside it, as issue 45 asks.

Shape letters: B batch, T queries, S keys, N heads, P a term's parameters per head, Q / K
the tile's queries / keys.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from copejax.ops.kernels.separable import column, is_separable


class TermTile(NamedTuple):
    """What a term's tile function reads besides its parameter row (one head).

    Attributes:
      q_positions_Q, k_positions_K: int32 positions of the tile's queries and keys.
      q_values_Q, k_values_K: the term's float32 value per query / key (None if it has none).
    """

    q_positions_Q: jax.Array
    k_positions_K: jax.Array
    q_values_Q: jax.Array | None
    k_values_K: jax.Array | None


# (params_P of one head or None, tile) -> bias_QK float32. Off the allowed pairs the value
# may be anything finite (the kernel masks the scores, and their gradient there is 0).
TileBias = Callable[[jax.Array | None, TermTile], jax.Array]


@dataclasses.dataclass(frozen=True)
class KernelTerm:
    """A logit term of the fused kernels: a tile function plus the arrays it reads.

    Attributes:
      name: what error messages and docs call it ("alibi", "t5", "fox", ...).
      bias: the tile function (:data:`TileBias`); it closes over static values only.
      params_NP: one float32 row of parameters per head (slopes, a bucket table, r1 and r2),
        differentiable; None for none.
      q_values_BTN: one float32 per query and head (FoX's prefix sums at the queries).
      k_values_BSN: one float32 per key and head (FoX's prefix sums at the keys).
    """

    name: str
    bias: TileBias
    params_NP: jax.Array | None = None
    q_values_BTN: jax.Array | None = None
    k_values_BSN: jax.Array | None = None

    def arrays(self) -> dict[str, jax.Array | None]:
        """The differentiable arrays, by the names the kernels use."""
        return {"params": self.params_NP, "q": self.q_values_BTN, "k": self.k_values_BSN}


def tile_bias_QK(
    biases: tuple[TileBias, ...],
    arrays: tuple[list, list, list],
    q_positions_Q: jax.Array,
    k_positions_K: jax.Array,
    unit: float = 1.0,
    *,
    at: list | None = None,
    split_rows: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array | None]:
    """The sum of every term's tile bias, float32 (Q, K), times ``unit`` (the GPU's log2
    units); what the kernels differentiate with respect to ``arrays`` = (params, q values,
    k values), a list entry per term (None where the term has no such array).

    ``split_rows``: (the bias without the separable terms' rows (:mod:`copejax.ops.kernels.
    separable`), those rows' sum (Q,) in natural units or None), for the plain softmax
    kernels, which add the rows to the log-sum-exp instead; each term's column is scaled once
    per key, at origins ``at`` (a list entry per term, None: the queries' origin). Without
    it, every term's (Q, K) tile function.
    """
    params, q_values, k_values = arrays
    at = at or [None] * len(biases)
    total_QK = None  # not zeros plus the first: the GPU code keeps an add of 0.0 (x + 0 is
    # not x for x = -0)
    row_Q = col_K = None
    for bias, p, qv, kv, given in zip(biases, params, q_values, k_values, at, strict=True):
        if split_rows and is_separable(bias):
            origin = bias.origin(p, q_positions_Q, qv) if given is None else given
            row, col = (
                bias.row(p, q_positions_Q, qv, origin),
                bias.col(p, k_positions_K, kv, origin, unit),
            )
            row_Q = row if row_Q is None else row_Q + row
            col_K = col if col_K is None else col_K + col
            continue
        tile = TermTile(q_positions_Q, k_positions_K, qv, kv)
        bias_QK = jnp.broadcast_to(bias(p, tile).astype(jnp.float32), tile_shape(tile))
        total_QK = bias_QK if total_QK is None else total_QK + bias_QK
    if total_QK is not None and unit != 1.0:
        total_QK = total_QK * unit
    shape = (q_positions_Q.shape[0], k_positions_K.shape[-1])
    if col_K is not None:
        col_QK = jnp.broadcast_to(column(col_K, 1), shape)
        total_QK = col_QK if total_QK is None else total_QK + col_QK
    if total_QK is None:
        total_QK = jnp.zeros(shape, jnp.float32)
    return (total_QK, row_Q) if split_rows else total_QK


def pair_grid(q_x: jax.Array, k_x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A tile's per-query and per-key arrays as (Q, 1) and (1, K), which broadcast to the
    tile's (Q, K). The GPU kernels hold them as (Q,) and (K,); the TPU kernels
    (:mod:`copejax.ops.kernels.tpu_forward`) as (Q, 1) and (1, K) already, Mosaic's 2-D
    layouts."""
    return (q_x[:, None] if q_x.ndim == 1 else q_x), (k_x[None, :] if k_x.ndim == 1 else k_x)


def batch_rows(tile: TermTile) -> tuple[jax.Array, jax.Array]:
    """The tile's positions as the (B, T) and (B, S) arguments of a scheme's pure function
    (``alibi_bias(q_BT, k_BS, ...)``): one row (1, Q) and (1, K) from the GPU's (Q,) and
    (K,), or from the TPU's (Q, 1) and (1, K) Q rows of one query that broadcast against one
    row of K keys. Either way the function's (B, [N,] T, S) result holds Q x K values in
    query-major order, so ``reshape(tile_shape(tile))`` gives the (Q, K) bias."""
    q_x, k_x = tile.q_positions_Q, tile.k_positions_K
    return (q_x[None] if q_x.ndim == 1 else q_x), (k_x[None] if k_x.ndim == 1 else k_x)


def tile_shape(tile: TermTile) -> tuple[int, int]:
    """(Q, K) of the tile, in either layout."""
    return tile.q_positions_Q.shape[0], tile.k_positions_K.shape[-1]


def table_lookup(index_QK: jax.Array, table_P: jax.Array) -> jax.Array:
    """``table_P[index_QK]`` as a one-hot sum over the rows (a loop of compares and selects),
    which every Pallas backend lowers, unlike a gather; its derivative sums the cotangent of
    the pairs of each row, ``d table[p] = sum_{index = p} g``. Cost: an elementwise pass over
    the tile per row between the index's min and max over the tile, so meant for small
    tables; a tile whose pairs all read one row reads that row once
    (:func:`indexed_lookup`)."""
    # float indices (small integers): an integer input would get a float0 tangent, which
    # no Pallas backend lowers; and Mosaic reduces floats
    return indexed_lookup(_given, _min_max, (index_QK.astype(jnp.float32),), table_P)


def _given(index_QK: jax.Array) -> jax.Array:
    return index_QK


def _min_max(index_QK: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.min(index_QK), jnp.max(index_QK)


# (float arrays of the tile) -> the (Q, K) float row index of each pair.
IndexFn = Callable[..., jax.Array]
# (the same arrays) -> float scalars (low, high): every pair's index lies in [low, high], and
# they are equal when every pair reads row low. Cheap bounds (T5's from the positions'
# extremes, copejax.model.kernel_t5) skip the index on such tiles altogether; the other tiles
# loop over the rows between them only.
BoundsFn = Callable[..., tuple[jax.Array, jax.Array]]


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def indexed_lookup(
    index_fn: IndexFn, bounds_fn: BoundsFn, inputs: tuple, table_P: jax.Array
) -> jax.Array:
    """``table_P[index_fn(*inputs)]`` (Q, K): one row's value where ``bounds_fn`` says every
    pair reads it, else :func:`table_lookup`'s one-hot sum. ``index_fn`` and ``bounds_fn``
    are static (hashable) and ``inputs`` float arrays. The branch is taken in the value only:
    the JVP is the one-hot sum of the tangent table, since autodiff through a ``cond`` leaves
    placeholders that no Pallas backend lowers (the GPU's dk / dv pull the table back by
    hand, :func:`indexed_lookup_pull`)."""
    low, high = bounds_fn(*inputs)
    rows_P = jax.lax.broadcasted_iota(jnp.int32, table_P.shape, table_P.ndim - 1)
    # the row's value before the branch; in the other branch one masked sum of the table per
    # row the loop reads, with the iota made out here (no new constant array in a branch)
    value = jnp.sum(jnp.where(rows_P.astype(jnp.float32) == low, table_P, 0.0))

    def rows_between() -> jax.Array:
        index_QK = index_fn(*inputs)

        def row(r: jax.Array, out_QK: jax.Array) -> jax.Array:
            value = jnp.sum(jnp.where(rows_P == r, table_P, 0.0))
            return out_QK + jnp.where(index_QK == r.astype(jnp.float32), value, 0.0)

        return jax.lax.fori_loop(*_row_range(low, high), row, index_QK * 0.0)

    return jax.lax.cond(low == high, lambda: _tile_zeros(inputs) + value, rows_between)


def _row_range(low: jax.Array, high: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[first, end) of the rows a tile reads, from its float bounds."""
    return low.astype(jnp.int32), high.astype(jnp.int32) + 1


def _tile_zeros(inputs: tuple) -> jax.Array:
    """Zeros of the tile's (Q, K) shape from its inputs: one (Q, K) array, or per-query and
    per-key arrays that broadcast to it (:func:`pair_grid`)."""
    if len(inputs) == 1:
        return inputs[0] * 0.0
    q_x, k_x = pair_grid(inputs[0], inputs[1])
    return q_x * 0.0 + k_x * 0.0


def _every_row(index_QK: jax.Array, values: list[jax.Array]) -> jax.Array:
    out_QK = index_QK * 0.0
    for p, value in enumerate(values):
        out_QK = out_QK + jnp.where(index_QK == p, value, 0.0)
    return out_QK


@indexed_lookup.defjvp
def _lookup_jvp(
    index_fn: IndexFn, bounds_fn: BoundsFn, primals: tuple, tangents: tuple
) -> tuple[jax.Array, jax.Array]:
    inputs, table_P = primals
    _, table_dot_P = tangents
    out = indexed_lookup(index_fn, bounds_fn, inputs, table_P)
    return out, _every_row(index_fn(*inputs), param_scalars(table_dot_P))


def table_lookup_pull(index_QK: jax.Array, table_P: jax.Array, g_QK: jax.Array) -> jax.Array:
    """:func:`table_lookup`'s pull-back: :func:`indexed_lookup_pull` of the given index."""
    inputs = (index_QK.astype(jnp.float32),)
    return indexed_lookup_pull(_given, _min_max, inputs, table_P, g_QK)


def indexed_lookup_pull(
    index_fn: IndexFn, bounds_fn: BoundsFn, inputs: tuple, table_P: jax.Array, g_QK: jax.Array
) -> jax.Array:
    """:func:`indexed_lookup`'s pull-back, ``d table[p] = sum_{index = p} g``, shaped as
    ``table_P``: one sum where every pair reads one row, else one masked sum per row. For a
    term's ``pull_params`` (see :func:`pulled_by_hand`): its own ``cond``, which autodiff of
    the lookup cannot take."""
    low, high = bounds_fn(*inputs)
    rows_P = jax.lax.broadcasted_iota(jnp.int32, table_P.shape, table_P.ndim - 1)
    rows_P = rows_P.astype(jnp.float32)
    total = jnp.sum(g_QK)

    def rows_between() -> jax.Array:
        index_QK = index_fn(*inputs)

        def row(r: jax.Array, d_P: jax.Array) -> jax.Array:
            row_sum = jnp.sum(jnp.where(index_QK == r.astype(jnp.float32), g_QK, 0.0))
            return d_P + jnp.where(rows_P == r.astype(jnp.float32), row_sum, 0.0)

        return jax.lax.fori_loop(*_row_range(low, high), row, table_P * 0.0)

    return jax.lax.cond(low == high, lambda: jnp.where(rows_P == low, total, 0.0), rows_between)


def pulled_by_hand(bias: TileBias) -> bool:
    """Whether a tile function brings its parameters' pull-back, ``bias.pull_params(params,
    tile, g_QK)``, which the dk / dv programs and selective attention's backward call
    instead of autodiff (:func:`copejax.ops.kernels.pullbacks.terms_vjp`): a lookup's
    ``cond`` that autodiff cannot take (:class:`copejax.model.kernel_t5.T5Tile`), or a loop
    whose autodiff would keep every iteration's residuals
    (:class:`copejax.model.kernel_fire.FireTile`)."""
    return callable(getattr(bias, "pull_params", None))


def param_scalars(params_P: jax.Array, rows_P: jax.Array | None = None) -> list[jax.Array]:
    """The entries of a head's parameter row, (P,) or (1, P), as scalars, each a masked sum
    (Triton lowers no slice of a register tile; see :func:`table_lookup`); ``rows_P``: the
    row's iota, made by the caller (outside a ``cond`` branch, which takes no new constant
    array), or None."""
    if rows_P is None:
        rows_P = jax.lax.broadcasted_iota(jnp.int32, params_P.shape, params_P.ndim - 1)
    size = params_P.shape[-1]  # (P,) on a GPU, (1, P) on a TPU
    return [jnp.sum(jnp.where(rows_P == row, params_P, 0.0)) for row in range(size)]
