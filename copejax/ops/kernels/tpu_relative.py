"""Shaw relative positions in the TPU kernels (Shaw et al. 2018, arXiv 1803.02155; issue 45).

The term of :mod:`copejax.ops.kernels.relative`, ``q_i . e[d_ij] / sqrt(H)`` with ``d_ij =
max(pos_i - pos_j, 0)`` and a table e of P rows (``relative`` adds nothing from P on,
``relative_capped`` reads the last row), in the Mosaic TPU kernels of
:mod:`copejax.ops.kernels.tpu_forward` and :mod:`~copejax.ops.kernels.tpu_backward`. The
GPU's band kernels do not port: Mosaic has no gather and the whole table, P = T rows by
default, does not fit VMEM twice (8 MiB at T = 16384, H = 128). Here:

- The table stays in HBM (``pl.ANY``) as the *reversed extended table* ``rev`` (P + 2R, H)
  float32, ``rev[t] = ext(E - t)`` with E = P + R - 1, ``ext(d)`` the row distance d reads
  (``e[clip(d, 0, P - 1)]``, or 0 from P on when uncapped), built in XLA by
  :func:`reversed_table` (JAX differentiates it). A band of R rows (a power of two, at least
  Q + K - 1 and 128 lanes) holds the distances ``top, top - 1, .., top - R + 1``; a step
  copies its band into VMEM by DMA.
- Positions that count up within each segment (packed or not; the common case): along a
  row's allowed keys ``d_ij + j`` (j the key's index in its tile) is one number a_i; a_i
  clipped to [-1, P + K - 1] reads the same rows (a row wholly before 0 or wholly beyond
  the table reads one row), and with ``top = max_i a_i`` the pair's column in the band is
  ``c_ij = j + s_i``, ``s_i = top - a_i`` in [0, R - K]. So ``z = q . band^T / sqrt(H)``
  (Q, R) on the MXU (for 16-bit inputs the float32 band as two pieces,
  :func:`~copejax.ops.kernels.relative.band_pieces`), and ``term[i, j] = z[i, j + s_i]``:
  each row rotated left by its own s_i, a barrel shifter of log2(R - K + 1) lane
  rotations (``pltpu.roll``) and selects. Mosaic's strided rotate would shift row i by i in
  one op, but v4 has no lane-strided rotate and the backward's inverse needs a negative
  stride, which Mosaic refuses (both checked by compiling for the chips).
- Backward: ``dz[i, c] = dS[i, c - s_i]`` (dS padded to R lanes with zeros), the same
  shifter the other way; ``dq += dz . band`` and ``d band = dz^T . q`` (dz rounded to the
  inputs' dtype, as on the GPU).
- Other positions (exact for any): the GPU's walk. Rows clamped, bands from the largest row
  down, each pair placed by a loop over the band's R columns (a compare, a masked lane sum
  and a select each): R vector passes per band, taken only by a tile pair whose positions
  jump.
- The table's gradient: ``d rev`` in one (P + 2R, H) float32 slab per batch row in HBM, the
  dq kernel's output aliased to zeros, each pair's band read, added to and written back by
  DMA. The dq kernel walks a batch row's heads, query tiles and key tiles in sequence (all
  but the batch axis "arbitrary"), so no two steps write one slab at once; summed outside:
  O(B (P + 2R) H), as the GPU's (B, P', H), added to with atomics there. (A slab per
  head would need the head axis first in the grid: Mosaic's parallel axes form a prefix.)

Speed is unmeasured (no TPU). Each step waits for its band's DMA, 128 KiB at R = 256, H =
128, instead of prefetching the next step's: the next band's start depends on the next
pair's positions, which a scalar-prefetched table of band starts per tile pair could give
the block pipeline.

Shape letters as in :mod:`copejax.ops.kernels.tpu_forward`; P table rows, R the band's rows,
X = P + 2R the reversed table's rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from copejax.ops.kernels.padding import power_of_two
from copejax.ops.kernels.relative import band_dot
from copejax.ops.kernels.tpu_params import LANES, dma_add, dma_copy

Ref = Any  # a Pallas ref
F32 = jnp.float32
BIG = 2**30  # beyond any position difference (positions are below 2**30)


@dataclasses.dataclass(frozen=True)
class TpuRelative:
    """The static facts of Shaw's term in the TPU kernels: the table's ``rows`` P, whether
    distances beyond it read its last row (``capped``) and the ``band`` R."""

    rows: int
    capped: bool
    band: int

    @property
    def edge(self) -> int:
        """E: the distance at row 0 of the reversed table."""
        return self.rows + self.band - 1

    @property
    def table_rows(self) -> int:
        """X = P + 2R: distances E down to -R."""
        return self.rows + 2 * self.band


def tpu_relative(rows: int, capped: bool, size_q: int, size_k: int) -> TpuRelative:
    """The term's statics for tiles of ``size_q`` queries and ``size_k`` keys."""
    return TpuRelative(rows, capped, max(power_of_two(size_q + size_k - 1), LANES))


def reversed_table(static: TpuRelative, table_PH: jax.Array) -> jax.Array:
    """``rev`` (X, H) float32: row t holds ``ext(E - t)``, the row distance E - t reads."""
    distance_X = static.edge - jnp.arange(static.table_rows)
    rev_XH = table_PH.astype(F32)[jnp.clip(distance_X, 0, static.rows - 1)]
    if static.capped:
        return rev_XH
    return jnp.where((distance_X < static.rows)[:, None], rev_XH, 0.0)


class RelativeRefs(NamedTuple):
    """A kernel's refs for the term: the statics, ``rev`` in HBM, a (R, H) VMEM band, a DMA
    semaphore and, in the dq kernel, the (B, X, H) gradient slab in HBM with a second
    (R, H) VMEM band for its read-modify-write."""

    static: TpuRelative
    table: Ref
    band: Ref
    sem: Ref
    slab: Ref | None = None
    slab_band: Ref | None = None


def relative_scratch(static: TpuRelative, dim: int, *, slab: bool) -> list:
    """The kernels' scratch for the term: the (R, H) band (two in the dq kernel: the
    table's and the slab's) and a DMA semaphore."""
    band = pltpu.VMEM((static.band, dim), F32)
    return [band] * (2 if slab else 1) + [pltpu.SemaphoreType.DMA(())]


def _load_band(refs: RelativeRefs, top: jax.Array) -> jax.Array:
    """The band of distances ``top`` down to ``top - R + 1``, (R, H) float32."""
    static = refs.static
    dma_copy(refs.table.at[pl.ds(static.edge - top, static.band), :], refs.band, refs.sem)
    return refs.band[...]


def rotate(x_QR: jax.Array, shift_Q1: jax.Array, *, left: bool, limit: int) -> jax.Array:
    """Row i of ``x_QR`` rotated along its lanes by ``shift_Q1[i]`` in [0, limit]: left
    (``out[i, c] = x[i, c + s_i]``) or right (``out[i, c] = x[i, c - s_i]``), modulo R. A
    barrel shifter: one uniform rotation and a select per bit of the shift."""
    size = x_QR.shape[1]
    for bit in range(max(limit, 1).bit_length()):
        amount = 1 << bit
        rolled = pltpu.roll(x_QR, size - amount if left else amount, 1)
        x_QR = jnp.where((jax.lax.shift_right_logical(shift_Q1, bit) & 1) == 1, rolled, x_QR)
    return x_QR


class PairGeometry:
    """Which band columns a tile pair reads.

    Attributes:
      fast: whether every row's allowed pairs have one ``a_i = d_ij + j`` and the clipped
        a_i span at most R - K (then ``top`` and ``shift_Q1`` place the pair).
      top: the band's largest distance (fast path).
      shift_Q1: s_i = top - a_i (0 for rows with no allowed pair).
      row_QK, ok_QK, hi, bands: the walk's clamped rows, the pairs that read one, the largest
        row read and the bands of R rows from it down that cover the least (0: none).
    """

    def __init__(
        self, static: TpuRelative, q_pos_Q1: jax.Array, k_pos_1K: jax.Array, allowed_QK: jax.Array
    ) -> None:
        size_k = k_pos_1K.shape[1]
        distance_QK = q_pos_Q1 - k_pos_1K
        a_QK = distance_QK + jax.lax.broadcasted_iota(jnp.int32, distance_QK.shape, 1)
        a_hi_Q1 = jnp.max(jnp.where(allowed_QK, a_QK, -BIG), axis=1, keepdims=True)
        a_lo_Q1 = jnp.min(jnp.where(allowed_QK, a_QK, BIG), axis=1, keepdims=True)
        seen_Q1 = a_hi_Q1 >= a_lo_Q1
        a_Q1 = jnp.clip(a_hi_Q1, -1, static.rows + size_k - 1)
        self.top = jnp.max(jnp.where(seen_Q1, a_Q1, -1))
        bottom = jnp.min(jnp.where(seen_Q1, a_Q1, self.top))
        uneven = jnp.max(jnp.where(seen_Q1 & (a_hi_Q1 != a_lo_Q1), 1, 0))
        self.fast = (uneven == 0) & (self.top - bottom <= static.band - size_k)
        self.shift_Q1 = jnp.where(seen_Q1, self.top - a_Q1, 0)
        distance_QK = jnp.maximum(distance_QK, 0)
        if static.capped:
            self.row_QK, self.ok_QK = jnp.minimum(distance_QK, static.rows - 1), allowed_QK
        else:
            self.row_QK, self.ok_QK = distance_QK, allowed_QK & (distance_QK < static.rows)
        lo = jnp.min(jnp.where(self.ok_QK, self.row_QK, static.rows))
        self.hi = jnp.max(jnp.where(self.ok_QK, self.row_QK, -1))
        # truncating division: floor division's sign op has no Mosaic lowering off a TPU
        span = jax.lax.div(jnp.maximum(self.hi - lo, 0), jnp.int32(static.band))
        self.bands = jnp.where(self.hi >= lo, span + 1, 0)


def add_relative(
    refs: RelativeRefs, s_QK: jax.Array, q_QH: jax.Array, inputs: tuple, allowed_QK: jax.Array
) -> tuple[jax.Array, PairGeometry]:
    """The pair's masked scores ``s_QK`` with the term added on its allowed pairs, and the
    pair's geometry; ``inputs`` end with the (Q, 1) and (1, K) positions."""
    geo = PairGeometry(refs.static, inputs[-2], inputs[-1], allowed_QK)
    return s_QK + jnp.where(allowed_QK, relative_term_QK(refs, geo, q_QH), 0.0), geo


def relative_term_QK(refs: RelativeRefs, geo: PairGeometry, q_QH: jax.Array) -> jax.Array:
    """``q_i . ext(d_ij) / sqrt(H)`` (Q, K) float32 on the allowed pairs (anything
    elsewhere: the caller masks)."""
    static = refs.static
    size_q, size_k = geo.ok_QK.shape
    scale = 1.0 / math.sqrt(q_QH.shape[-1])

    def z_QR(top: jax.Array) -> jax.Array:
        return band_dot(q_QH, _load_band(refs, top), (1, 1)) * scale

    def fast(_: None) -> jax.Array:
        limit = static.band - size_k
        return rotate(z_QR(geo.top), geo.shift_Q1, left=True, limit=limit)[:, :size_k]

    def walk(_: None) -> jax.Array:
        index_QR = jax.lax.broadcasted_iota(jnp.int32, (size_q, static.band), 1)

        def band(b: jax.Array, term_QK: jax.Array) -> jax.Array:
            top = geo.hi - b * static.band
            z = z_QR(top)
            column_QK = jnp.where(geo.ok_QK, top - geo.row_QK, -1)

            def place(r: jax.Array, term_QK: jax.Array) -> jax.Array:
                z_Q1 = jnp.sum(jnp.where(index_QR == r, z, 0.0), axis=1, keepdims=True)
                return term_QK + jnp.where(column_QK == r, z_Q1, 0.0)

            return jax.lax.fori_loop(0, static.band, place, term_QK)

        return jax.lax.fori_loop(0, geo.bands, band, jnp.zeros((size_q, size_k), F32))

    return jax.lax.cond(geo.fast, fast, walk, None)


def relative_grads(
    refs: RelativeRefs, geo: PairGeometry, q_QH: jax.Array, ds_QK: jax.Array, row: jax.Array
) -> jax.Array:
    """The term's part of dq, (Q, H) float32, for the pair's ``ds_QK`` (0 off the allowed
    pairs); adds ``d rev`` of the bands the pair read to batch row ``row``'s slab. Called
    after :func:`add_relative` for the same pair: on the fast path its band is still in
    ``refs.band``."""
    static = refs.static
    size_q, size_k = ds_QK.shape
    scale = 1.0 / math.sqrt(q_QH.shape[-1])

    def band_grads(top: jax.Array, dz_QR: jax.Array, band_RH: jax.Array) -> jax.Array:
        dz_QR = dz_QR.astype(q_QH.dtype)
        rows = refs.slab.at[row, pl.ds(static.edge - top, static.band), :]
        d_band_RH = jax.lax.dot(dz_QR.T, q_QH, preferred_element_type=F32)
        dma_add(rows, refs.slab_band, refs.sem, d_band_RH)
        return band_dot(dz_QR, band_RH, (1, 0))

    def fast(_: None) -> jax.Array:
        padded_QR = jnp.concatenate([ds_QK, jnp.zeros((size_q, static.band - size_k), F32)], axis=1)
        limit = static.band - size_k
        dz_QR = rotate(padded_QR, geo.shift_Q1, left=False, limit=limit) * scale
        return band_grads(geo.top, dz_QR, refs.band[...])  # add_relative's band

    def walk(_: None) -> jax.Array:
        index_QR = jax.lax.broadcasted_iota(jnp.int32, (size_q, static.band), 1)
        ds_ok_QK = jnp.where(geo.ok_QK, ds_QK, 0.0)

        def band(b: jax.Array, dq_QH: jax.Array) -> jax.Array:
            top = geo.hi - b * static.band
            column_QK = jnp.where(geo.ok_QK, top - geo.row_QK, -1)

            def gather(r: jax.Array, dz_QR: jax.Array) -> jax.Array:
                dz_Q1 = jnp.sum(jnp.where(column_QK == r, ds_ok_QK, 0.0), axis=1, keepdims=True)
                return dz_QR + jnp.where(index_QR == r, dz_Q1, 0.0)

            dz_QR = jax.lax.fori_loop(0, static.band, gather, jnp.zeros(index_QR.shape, F32))
            return dq_QH + band_grads(top, dz_QR * scale, _load_band(refs, top))

        return jax.lax.fori_loop(0, geo.bands, band, jnp.zeros(q_QH.shape, F32))

    return jax.lax.cond(geo.fast, fast, walk, None)
