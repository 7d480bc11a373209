"""Logit terms that are a per-query value plus a per-key value (issue 45).

ALiBi's ``-m (i - j)`` and FoX's ``c_i - c_j`` are ``row_i + col_j``. As a (Q, K) function
of the tile's positions or values, such a term costs the GPU kernels four float32 operations
per pair besides the content logits (the difference, the slope, the scores' log2 unit, the
add). A separable term also gives its row and column, which the plain softmax kernels
(:mod:`~copejax.ops.kernels.forward`, :mod:`~copejax.ops.kernels.backward`) take apart:

- the column, ``(K,)`` on a GPU, is scaled to the scores' unit once per key (a GPU thread
  holds 16 keys of its 32 pairs), then added to each pair's score once;
- the row is a constant of each query's softmax, so those kernels leave it out of the scores
  and the running max and add it to the log-sum-exp they write; the backward subtracts it
  from the one it reads. A pair pays nothing for it.

The other kernels (stick-breaking's normalizer, whose row does not cancel, CoPE, selective
attention, Shaw's, the TPU's) evaluate the (Q, K) tile function: written as an outer sum there,
the H100 PTX held as many instructions or more.

The pull-back is the row and column sums of the score cotangent through the row and column
(:func:`copejax.ops.kernels.pullbacks.terms_vjp`); the GPU's dk / dv programs take the
column sums on the tensor cores (:func:`copejax.ops.kernels.pullbacks.key_sums_K`).

Deviceless H100 PTX, (B, N, H) = (2, 4, 64), T = 4096, bfloat16, instructions of the
forward / dq / dk-dv kernels (``experiments/results/kernel_ptx.md``): nope 1,318 / 1,237 /
1,535; ALiBi 1,703 / 1,622 / 1,877 as a tile function, 1,603 / 1,521 / 1,750 separable; FoX
1,619 / 1,636 / 3,013, 1,580 / 1,597 / 2,374.

Precision: ``row_i + col_j`` rounds each side at its own magnitude, so both sides are taken
relative to an origin (:meth:`RowsBias.origin`): ALiBi's smallest position, FoX's largest
prefix sum, of one side of the tile. Each side then rounds at the tile's distances, not at
the positions' (at T = 16384 ``m i`` in float32 is off by up to ~5e-4). The kernels take the
origin of the side their walk holds fixed (the forward's and dq's queries, the dk / dv's
keys), once per program.

Shape letters: Q / K the tile's queries / keys, X either.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax


class RowsBias(Protocol):
    """A tile function (:data:`~copejax.ops.kernels.terms.TileBias`) that is also a row and a
    column: its bias is ``row(origin) + col(origin)`` for any origin of :meth:`origin`.

    Positions are int32, values float32, (Q,) / (K,) on a GPU and (Q, 1) / (1, K) on a TPU;
    ``params_P`` the head's parameter row or None; ``origin`` a float32 scalar.
    """

    def __call__(self, params_P: jax.Array | None, tile: Any) -> jax.Array: ...

    def origin(
        self, params_P: jax.Array | None, positions_X: jax.Array, values_X: jax.Array | None
    ) -> jax.Array:
        """A reference near one side's positions (or values), with no gradient."""
        ...

    def row(
        self,
        params_P: jax.Array | None,
        positions_Q: jax.Array,
        values_Q: jax.Array | None,
        origin: jax.Array,
    ) -> jax.Array:
        """row_Q, float32, natural units."""
        ...

    def col(
        self,
        params_P: jax.Array | None,
        positions_K: jax.Array,
        values_K: jax.Array | None,
        origin: jax.Array,
        unit: float,
    ) -> jax.Array:
        """col_K, float32, times ``unit`` (folded into the term's own multiply)."""
        ...


def is_separable(bias: Any) -> bool:
    """Whether a tile function gives its bias as a row and a column (:class:`RowsBias`)."""
    return callable(getattr(bias, "col", None))


def origins(
    biases: tuple, params: list, values: list, positions_X: jax.Array
) -> list[jax.Array | None]:
    """Each separable term's origin from one side of the tile (its positions and the terms'
    values there), None for the others: what a kernel takes once per program for the side
    its walk holds fixed."""
    return [
        b.origin(p, positions_X, v) if is_separable(b) else None
        for b, p, v in zip(biases, params, values, strict=True)
    ]


def query_rows(
    biases: tuple, params: list, q_values: list, q_positions_Q: jax.Array, at: list
) -> jax.Array | None:
    """The sum of the separable terms' rows, float32 natural units, at origins ``at``
    (:func:`origins`), or None without a separable term: what the plain softmax kernels add
    to the log-sum-exp."""
    total_Q = None
    for b, p, v, o in zip(biases, params, q_values, at, strict=True):
        if is_separable(b):
            row_Q = b.row(p, q_positions_Q, v, o)
            total_Q = row_Q if total_Q is None else total_Q + row_Q
    return total_Q


def outer_sum(row_Q: jax.Array, col_K: jax.Array) -> jax.Array:
    """``row_i + col_j``, (Q, K) float32, from (Q,) and (K,) or (Q, 1) and (1, K): a
    separable term's bias from its sides."""
    return column(row_Q, 0) + column(col_K, 1)


def column(x: jax.Array, axis: int) -> jax.Array:
    """A per-query (axis 0) or per-key (axis 1) vector as (Q, 1) or (1, K)."""
    if x.ndim == 2:
        return x
    return x[:, None] if axis == 0 else x[None, :]
