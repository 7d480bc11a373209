"""Shaw relative positions in the fused kernels (Shaw et al. 2018, arXiv 1803.02155).

As the CoPE paper writes it (arXiv 2405.18719 eq. 1) and
:mod:`copejax.positions.relative` computes it: the logit ``q_i . (k_j + e[d_ij]) / sqrt(H)``
with ``d_ij = max(pos_i - pos_j, 0)`` and a table e of P = max_distance + 1 rows shared by
the heads. ``relative`` adds no term for ``d_ij >= P``; ``relative_capped`` reads the last
row there. The term reads the queries, so it is no
:class:`~copejax.ops.kernels.terms.KernelTerm` (those read per-query scalars); it is CoPE's
``q . e[p]`` with an integer p and no carry.

The band. P is the training length by default (thousands of rows), so a one-hot pass over
every row (CoPE's <= 256) does not scale. A pair of tiles reads the rows between the least
and the largest row of its allowed pairs; with positions that count up within a segment
(packed or not) those span at most Q + K - 1 rows, the ``band`` R (a power of two >= Q + K
- 1). The pair reads the band as one dynamic slice of the table, computes ``z = q . band^T /
sqrt(H)`` as a (Q, H) x (H, R) matmul with float32 accumulation (q in its dtype; for 16-bit
inputs the float32 band as two 16-bit pieces, :func:`band_pieces`: two matmuls on tensor
cores), and places ``z[i, d_ij - start]`` into the (Q, K) tile by a loop over the band's R
rows (a compare, a masked row sum and a select per row; no gather, which Triton does not
lower, nor a slice of a register tile). A ``lax.fori_loop``, not an unrolled one: on the CPU
XLA compiled the interpret-mode kernels 3x faster, and Triton gets a loop it may unroll.
Positions that jump within a segment widen the span: the pair then walks as many bands as it
needs (a loop with a dynamic trip count), so the term is exact for any positions. A pair
whose allowed pairs all read one row (every distance beyond a capped table) takes one matvec
instead; pairs all beyond an uncapped table add nothing and cost nothing.

Backward: with ``dS`` of the pair, ``dz[i, r] = sum_{j: d_ij = start + r} dS_ij / sqrt(H)``
(the same loop, transposed), then, with dz rounded to the inputs' dtype as the content
gradients round dS, ``dq += dz . band`` and ``d band = dz^T . q`` (matmuls). The dq kernel
adds the table's gradient, band by band, to one (P', H) float32 array per batch row with
atomic adds (``jax.experimental.pallas.triton.atomic_add``; the heads and query tiles of a
row share it), summed over the batch outside: O(P H) per batch row, O(T H) for the default
P = T. The order of the additions varies between runs on a GPU, so the table gradient's last
bits are not deterministic, as selective attention's dq (interpret mode runs the programs in
order). Every other buffer is O(T).
:mod:`copejax.ops.kernels.relative_kernels` holds the kernel bodies (the content logits, the
other terms and the mask of :mod:`copejax.ops.kernels.forward`, softmax only) and
:mod:`copejax.ops.kernels.relative_calls` launches them. Shape letters as in
:mod:`copejax.ops.kernels.forward`; P table rows, R the band's rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from copejax.ops.kernels.tiles import dot_f32

Ref = Any  # a Pallas ref (a tile of an operand or output, read and written in place)


@dataclasses.dataclass(frozen=True)
class RelativeStatic:
    """The static facts of Shaw's term in the kernels: the table's ``rows`` (P =
    max_distance + 1), whether distances beyond it read its last row (``capped``), and the
    ``band`` of rows one pair reads at a time (set by ``fused_attention`` from the tiles)."""

    rows: int
    capped: bool
    band: int = 0


@dataclasses.dataclass(frozen=True)
class RelativeTerm:
    """Shaw's term in the kernels: its table e (P, H), shared by the heads, and whether
    distances beyond the table read its last row (``relative_capped``) or add nothing."""

    table: jax.Array
    capped: bool


class PairRows:
    """Which table row each pair of a tile pair reads, and the bands that cover them.

    Attributes:
      row_QK: the row ``min(max(pos_i - pos_j, 0), P - 1)`` (capped) or ``max(., 0)``.
      ok_QK: allowed pairs that read a row (all allowed ones when capped).
      lo: the least row read (P when none is); the first band starts there.
      bands: how many bands of ``static.band`` rows from ``lo`` cover every row read.
      single: whether every pair reads row ``lo`` (one matvec instead of a band).
      allowed_QK: the pair's mask.
    """

    def __init__(
        self, static: RelativeStatic, q_pos_Q: jax.Array, k_pos_K: jax.Array, allowed_QK: jax.Array
    ) -> None:
        distance_QK = jnp.maximum(q_pos_Q[:, None] - k_pos_K[None, :], 0)
        if static.capped:
            self.row_QK = jnp.minimum(distance_QK, static.rows - 1)
            self.ok_QK = allowed_QK
        else:
            self.row_QK = distance_QK
            self.ok_QK = allowed_QK & (distance_QK < static.rows)
        self.lo = jnp.min(jnp.where(self.ok_QK, self.row_QK, static.rows))
        hi = jnp.max(jnp.where(self.ok_QK, self.row_QK, -1))
        self.bands = jnp.where(hi >= self.lo, (hi - self.lo) // static.band + 1, 0)
        self.single = hi == self.lo
        self.allowed_QK = allowed_QK


def band_pieces(band_RH: jax.Array, dtype: jnp.dtype) -> list[jax.Array]:
    """The float32 band as the matmuls' operands: itself for float32 inputs; for 16-bit
    inputs two pieces in their dtype, ``hi + lo`` (16 bits of mantissa for bfloat16, finer
    than the TF32 of a float32 matmul), so that the products run on tensor cores."""
    if dtype == jnp.float32:
        return [band_RH]
    hi_RH = band_RH.astype(dtype)
    return [hi_RH, (band_RH - hi_RH.astype(jnp.float32)).astype(dtype)]


def band_dot(a: jax.Array, band_RH: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """``a`` (in the inputs' dtype) times the band, through :func:`band_pieces`."""
    pieces = band_pieces(band_RH, a.dtype)
    return sum(
        (dot_f32(a, piece, contract) for piece in pieces[1:]), dot_f32(a, pieces[0], contract)
    )


def relative_term_QK(
    static: RelativeStatic, q_QH: jax.Array, table_ref: Ref, rows: PairRows
) -> jax.Array:
    """``q_i . e[row_ij] / sqrt(H)`` on the pairs that read a row, 0 elsewhere; float32.
    The band's z is one matmul (two for 16-bit inputs) with q in its dtype."""
    scale = 1.0 / math.sqrt(q_QH.shape[-1])
    zeros_QK = jnp.zeros(rows.row_QK.shape, jnp.float32)

    def one_row(_: None) -> jax.Array:
        e_1H = table_ref[pl.ds(rows.lo, 1), :]
        z_Q = jnp.sum(q_QH.astype(jnp.float32) * e_1H, axis=1) * scale
        return jnp.where(rows.ok_QK, z_Q[:, None], 0.0)

    def bands(_: None) -> jax.Array:
        index_QR = jax.lax.broadcasted_iota(jnp.int32, (q_QH.shape[0], static.band), 1)

        def band(b: jax.Array, term_QK: jax.Array) -> jax.Array:
            start = rows.lo + b * static.band
            z_QR = band_dot(q_QH, table_ref[pl.ds(start, static.band), :], (1, 1)) * scale
            offset_QK = jnp.where(rows.ok_QK, rows.row_QK - start, -1)

            def place(r: jax.Array, term_QK: jax.Array) -> jax.Array:
                z_Q = jnp.sum(jnp.where(index_QR == r, z_QR, 0.0), axis=1)
                return term_QK + jnp.where(offset_QK == r, z_Q[:, None], 0.0)

            return jax.lax.fori_loop(0, static.band, place, term_QK)

        return jax.lax.fori_loop(0, rows.bands, band, zeros_QK)

    return jax.lax.cond(rows.single, one_row, bands, None)


def relative_grads(
    static: RelativeStatic,
    q_QH: jax.Array,
    table_ref: Ref,
    rows: PairRows,
    *,
    de_ref: Ref,
    ds_QK: jax.Array,
) -> jax.Array:
    """The term's part of dq (float32 (Q, H)), given the pair's ``ds_QK``; adds the table's
    gradient to the rows of ``de_ref`` (the batch row's (P', H) float32) the pair read, with
    atomic adds. As for the content matmuls, dz is rounded to the inputs' dtype for
    ``dz . band`` and ``dz^T . q``."""
    scale = 1.0 / math.sqrt(q_QH.shape[-1])
    ds_QK = jnp.where(rows.ok_QK, ds_QK, 0.0)

    def one_row(_: None) -> jax.Array:
        rows_1 = pl.ds(rows.lo, 1)
        dz_Q1 = jnp.sum(ds_QK, axis=1, keepdims=True) * scale
        de_1H = jnp.sum(dz_Q1 * q_QH.astype(jnp.float32), axis=0, keepdims=True)
        pltriton.atomic_add(de_ref, (rows_1, slice(None)), de_1H)
        return dz_Q1 * table_ref[rows_1, :]

    def bands(_: None) -> jax.Array:
        index_QR = jax.lax.broadcasted_iota(jnp.int32, (q_QH.shape[0], static.band), 1)

        def band(b: jax.Array, dq_QH: jax.Array) -> jax.Array:
            start = rows.lo + b * static.band
            offset_QK = jnp.where(rows.ok_QK, rows.row_QK - start, -1)
            dz_QR = jnp.zeros(index_QR.shape, jnp.float32)

            def gather(r: jax.Array, dz_QR: jax.Array) -> jax.Array:
                dz_Q = jnp.sum(jnp.where(offset_QK == r, ds_QK, 0.0), axis=1)
                return dz_QR + jnp.where(index_QR == r, dz_Q[:, None], 0.0)

            dz_QR = jax.lax.fori_loop(0, static.band, gather, dz_QR) * scale
            dz_QR = dz_QR.astype(q_QH.dtype)
            window = pl.ds(start, static.band)
            pltriton.atomic_add(de_ref, (window, slice(None)), dot_f32(dz_QR, q_QH, (0, 0)))
            return dq_QH + band_dot(dz_QR, table_ref[window, :], (1, 0))

        return jax.lax.fori_loop(0, rows.bands, band, jnp.zeros(q_QH.shape, jnp.float32))

    return jax.lax.cond(rows.single, one_row, bands, None)


def padded_rows(static: RelativeStatic) -> int:
    """The table's rows in the kernels: P plus a band of zeros (a band starting at the last
    row stays inside), rounded up to whole bands."""
    return (-(-static.rows // static.band) + 1) * static.band
