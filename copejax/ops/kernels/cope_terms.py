"""CoPE's term in the fused kernels (Golovneva et al. 2024, arXiv 2405.18719): its options
(:class:`CopeStatic`), its arrays (:class:`CopeTerm`) and its position terms on one tile pair.

Given a pair's capped contextual positions ``p_QK``, each of the paper's three terms, exactly
as :mod:`copejax.ops.cope` defines them:

- "interpolate" (eq. 7-8): ``z_i[p_ij]``, ``z = q e^T`` (Q, P) read by linear interpolation
  (:func:`interpolate_QK`);
- "alibi" (eq. 10): ``m_h p_ij``, one signed slope per head;
- "mlp" (CoPE-MLP, Appendix C): ``q_i . MLP(p_ij) = sum_f (q_i W_out)[f] gelu(w_in[f] p_ij
  s + b_in[f])`` (``cope_mlp_term``, s = 1 / p_max). The MLP is nonlinear in p, so reading it
  at the P integer positions and interpolating would not be exact: it is evaluated at every
  pair's fractional p, one hidden unit at a time (a loop of F elementwise passes over the
  tile, each with an erf, against the interpolation's P passes of a few flops). Its pull-back
  (:func:`mlp_units_vjp`, a custom vjp) recomputes each unit instead of keeping F (Q, K)
  residuals, so a pair holds O(QK + QF) floats whatever F. The forward kernels call the plain
  :func:`mlp_units_QK`: Triton lowers no custom vjp.

erf: Triton has no lowering of ``lax.erf``, so :func:`erf_f32` is Eigen's float32 rational
approximation (which XLA's f32 erf lowering has used), clamped to [-4, 4]: within 4e-7 of
erf everywhere (``tests/ops/kernels/test_cope_variants.py``).

Per-head operands (:meth:`CopeTerm.per_head`), 2-D blocks on both backends: "interpolate"
(e_PH,), "alibi" (m_11,), "mlp" (W_out_FH, [w_in; b_in]_2F), rows and columns padded to
powers of two (Triton's block shapes); the loop runs over the F real units only. Shape
letters: Q / K the tile's queries / keys, H head dim, P table rows, F the MLP's hidden units
(padded).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from copejax.ops.kernels.padding import MIN_BLOCK, power_of_two
from copejax.ops.kernels.rows_matmul import rows_matmul

POSITION_TERMS = ("interpolate", "alibi", "mlp")
# Eigen's float erf: x * alpha(x^2) / beta(x^2) on [-4, 4], highest power first.
_ERF_ALPHA = (
    -2.72614225801306e-10,
    2.77068142495902e-08,
    -2.10102402082508e-06,
    -5.69250639462346e-05,
    -7.34990630326855e-04,
    -2.95459980854025e-03,
    -1.60960333262415e-02,
)
_ERF_BETA = (
    -1.45660718464996e-05,
    -2.13374055278905e-04,
    -1.68282697438203e-03,
    -7.37332916720468e-03,
    -1.42647390514189e-02,
)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@dataclasses.dataclass(frozen=True)
class CopeStatic:
    """CoPE's static options in the kernels: ``p_max``, the position term divided by sqrt(H)
    (``scale_term``), every allowed gate 1 (``unit_gates``), the ``position_term``
    ("interpolate", "alibi" or "mlp", with the MLP's ``mlp_units`` hidden units and input
    scale ``mlp_scale``, 1 / p_max in the model) and whether the gates read gate keys
    (``gate_keys``, set by :meth:`CopeTerm.kernel_static`)."""

    p_max: int
    scale_term: bool = False
    unit_gates: bool = False
    position_term: str = "interpolate"
    mlp_units: int = 0
    mlp_scale: float = 1.0
    gate_keys: bool = False

    @property
    def num_params(self) -> int:
        """The per-head parameter operands (:mod:`copejax.ops.kernels.cope_terms`)."""
        return 2 if self.position_term == "mlp" else 1


@dataclasses.dataclass(frozen=True)
class CopeTerm:
    """CoPE in the kernels: the position term's parameters as the engine's block term holds
    them (``params``: the table e, (P, H) shared by the heads or (N, P, H) one per head;
    "alibi": the signed slopes (N,); "mlp": (w_in_F, b_in_F, w_out_FH)), its static options,
    and the gates' keys (sep-keys' ``k' = W x`` or val-gates' v, (B, S, G, H) per key/value
    head) or None: gates on the content logits."""

    params: Any
    static: CopeStatic
    gate_k_BSGH: jax.Array | None = None

    def kernel_static(self) -> CopeStatic:
        """The static options with ``gate_keys`` as the term has them."""
        return dataclasses.replace(self.static, gate_keys=self.gate_k_BSGH is not None)

    def per_head(self, heads: int) -> tuple[jax.Array, ...]:
        """The parameters as the kernels read them, float32 (N, R, C) each, R and C padded
        to powers of two (the table's rows and the MLP's units to at least 16, Triton's
        smallest matmul) with zeros (capped positions never reach padded table rows; the
        MLP's loop skips padded units)."""
        kind = self.static.position_term
        if kind == "alibi":
            slopes = jnp.broadcast_to(jnp.asarray(self.params, jnp.float32), (heads,))
            return (slopes.reshape(heads, 1, 1),)
        if kind == "interpolate":  # z = q e^T is a Triton matmul: at least 16 rows
            rows = max(MIN_BLOCK, power_of_two(self.params.shape[-2]))
            return (_padded(self.params, heads, rows=True, size=rows),)
        w_in_F, b_in_F, w_out_FH = self.params
        units = max(MIN_BLOCK, power_of_two(w_out_FH.shape[0]))  # q W_out^T: a Triton matmul
        vec_2F = jnp.stack([w_in_F, b_in_F])
        w_out = _padded(w_out_FH, heads, rows=True, size=units)
        return w_out, _padded(vec_2F, heads, rows=False, size=units)


def _padded(x: jax.Array, heads: int, *, rows: bool, size: int | None = None) -> jax.Array:
    """x (R, C) or (N, R, C) as float32 (N, R, C), its rows (or columns) padded to ``size``
    (default: a power of two)."""
    x = jnp.broadcast_to(x.astype(jnp.float32), (heads, *x.shape[-2:]))
    axis = 1 if rows else 2
    widths = [(0, 0)] * 3
    widths[axis] = (0, (size or power_of_two(x.shape[axis])) - x.shape[axis])
    return jnp.pad(x, widths)


def erf_f32(x: jax.Array) -> jax.Array:
    """erf(x) in float32 from elementwise ops every Pallas backend lowers."""
    x = jnp.clip(x, -4.0, 4.0)
    x2 = x * x
    alpha = x2 * _ERF_ALPHA[0] + _ERF_ALPHA[1]
    for c in _ERF_ALPHA[2:]:
        alpha = alpha * x2 + c
    beta = x2 * _ERF_BETA[0] + _ERF_BETA[1]
    for c in _ERF_BETA[2:]:
        beta = beta * x2 + c
    return x * alpha / beta


def gelu_f32(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(gelu(a), gelu'(a)), the exact (erf) GELU as ``jax.nn.gelu(approximate=False)``."""
    cdf = (erf_f32(a / math.sqrt(2.0)) + 1.0) / 2.0
    return a * cdf, cdf + a * jnp.exp(-0.5 * a * a) * _INV_SQRT_2PI


def interpolate_QK(z_QP: jax.Array, p_QK: jax.Array) -> jax.Array:
    """``z_i`` read at the fractional ``p_ij`` in [0, P - 1] by linear interpolation: a sum
    over the table rows of ``z_i[r] max(0, 1 - |p_ij - r|)``, the value and derivative of
    :func:`copejax.ops.interpolate.interpolate_last_axis` (0 at integer p), with no gather.
    The loop (not unrolled) runs over the rows the tile's positions reach only
    (:func:`_reached_rows`): once the count passes p_max every p is P - 1 and one row is
    read."""
    first, end = _reached_rows(p_QK, z_QP.shape[1])

    def row(r: jax.Array, out_QK: jax.Array) -> jax.Array:
        hat_QK = jnp.maximum(1.0 - jnp.abs(p_QK - r.astype(jnp.float32)), 0.0)
        return out_QK + _column(z_QP, r) * hat_QK

    return jax.lax.fori_loop(first, end, row, jnp.zeros(p_QK.shape, jnp.float32))


def _reached_rows(p_QK: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
    """[first, end) of the table rows r with ``|p - r| < 1`` for some p of the tile."""
    first = jnp.maximum(jnp.floor(jnp.min(p_QK)).astype(jnp.int32), 0)
    return first, jnp.minimum(jnp.floor(jnp.max(p_QK)).astype(jnp.int32) + 2, rows)


@jax.custom_vjp
def interpolate_vjp(z_QP: jax.Array, p_QK: jax.Array) -> jax.Array:
    """:func:`interpolate_QK` with a pull-back that loops over the same rows (autodiff of
    the loop would keep a (Q, K) residual per row); for the backward kernels, as
    :func:`mlp_units_vjp`."""
    return interpolate_QK(z_QP, p_QK)


def _interpolate_forward(z_QP: jax.Array, p_QK: jax.Array) -> tuple:
    return interpolate_QK(z_QP, p_QK), (z_QP, p_QK)


def _interpolate_backward(residuals: tuple, g_QK: jax.Array) -> tuple[jax.Array, jax.Array]:
    """d z[:, r] = sum_j g hat(p - r); d p = sum_r g z[:, r] hat'(p - r), with hat' =
    -sign(p - r) inside |p - r| < 1 and 0 elsewhere (autodiff's of max and abs)."""
    z_QP, p_QK = residuals
    first, end = _reached_rows(p_QK, z_QP.shape[1])
    cols_QP = jax.lax.broadcasted_iota(jnp.int32, z_QP.shape, 1)

    def row(r: jax.Array, state: tuple) -> tuple:
        d_z_QP, d_p_QK = state
        x_QK = p_QK - r.astype(jnp.float32)
        inside_QK = jnp.abs(x_QK) < 1.0
        hat_QK = jnp.where(inside_QK, 1.0 - jnp.abs(x_QK), 0.0)
        d_z_QP = d_z_QP + jnp.where(cols_QP == r, jnp.sum(g_QK * hat_QK, axis=1, keepdims=True), 0)
        # -sign(x) without lax.sign, whose Mosaic lowering reads the TPU's chip info
        slope_QK = jnp.where(inside_QK & (x_QK != 0.0), jnp.where(x_QK > 0.0, -1.0, 1.0), 0.0)
        return d_z_QP, d_p_QK + g_QK * _column(z_QP, r) * slope_QK

    init = (jnp.zeros(z_QP.shape, jnp.float32), jnp.zeros(p_QK.shape, jnp.float32))
    return jax.lax.fori_loop(first, end, row, init)


interpolate_vjp.defvjp(_interpolate_forward, _interpolate_backward)


def _column(x_QF: jax.Array, f: jax.Array) -> jax.Array:
    """Column f of x as (Q, 1) (a masked sum: no dynamic slice of a register tile)."""
    cols_QF = jax.lax.broadcasted_iota(jnp.int32, x_QF.shape, 1)
    return jnp.sum(jnp.where(cols_QF == f, x_QF, 0.0), axis=1, keepdims=True)


def _entry(x_2F: jax.Array, row: int, f: jax.Array) -> jax.Array:
    """x[row, f] as (1, 1)."""
    rows_2F = jax.lax.broadcasted_iota(jnp.int32, x_2F.shape, 0)
    picked_2F = jnp.where(rows_2F == row, x_2F, 0.0)
    return jnp.sum(_column(picked_2F, f), axis=0, keepdims=True)


def _total(x_QK: jax.Array) -> jax.Array:
    """The sum of x as (1, 1)."""
    return jnp.sum(jnp.sum(x_QK, axis=1, keepdims=True), axis=0, keepdims=True)


def _unit_input(x_QK: jax.Array, vec_2F: jax.Array, f: jax.Array) -> tuple:
    """(w_in[f], the unit's pre-activation w_in[f] x + b_in[f])."""
    w_11 = _entry(vec_2F, 0, f)
    return w_11, x_QK * w_11 + _entry(vec_2F, 1, f)


def mlp_units_QK(
    qw_QF: jax.Array, p_QK: jax.Array, vec_2F: jax.Array, units: int, input_scale: float
) -> jax.Array:
    """``sum_f qw[:, f] gelu(w_in[f] p s + b_in[f])`` over the first ``units`` hidden units,
    float32 (Q, K); ``qw = q W_out^T``, ``vec_2F`` the rows w_in and b_in."""
    x_QK = p_QK * input_scale

    def unit(f: jax.Array, out_QK: jax.Array) -> jax.Array:
        hidden_QK, _ = gelu_f32(_unit_input(x_QK, vec_2F, f)[1])
        return out_QK + _column(qw_QF, f) * hidden_QK

    return jax.lax.fori_loop(0, units, unit, jnp.zeros(p_QK.shape, jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def mlp_units_vjp(qw_QF, p_QK, vec_2F, units: int, input_scale: float) -> jax.Array:
    """:func:`mlp_units_QK` with a pull-back that recomputes each unit (see the module)."""
    return mlp_units_QK(qw_QF, p_QK, vec_2F, units, input_scale)


def _mlp_forward(qw_QF, p_QK, vec_2F, units, input_scale):
    return mlp_units_QK(qw_QF, p_QK, vec_2F, units, input_scale), (qw_QF, p_QK, vec_2F)


def _mlp_backward(units: int, input_scale: float, residuals: tuple, g_QK: jax.Array) -> tuple:
    qw_QF, p_QK, vec_2F = residuals
    x_QK = p_QK * input_scale
    cols_QF = jax.lax.broadcasted_iota(jnp.int32, qw_QF.shape, 1)
    rows_2F = jax.lax.broadcasted_iota(jnp.int32, vec_2F.shape, 0)
    cols_2F = jax.lax.broadcasted_iota(jnp.int32, vec_2F.shape, 1)

    def unit(f: jax.Array, state: tuple) -> tuple:
        d_qw_QF, d_x_QK, d_vec_2F = state
        w_11, a_QK = _unit_input(x_QK, vec_2F, f)
        hidden_QK, slope_QK = gelu_f32(a_QK)
        d_qw_QF = d_qw_QF + jnp.where(
            cols_QF == f, jnp.sum(g_QK * hidden_QK, axis=1, keepdims=True), 0.0
        )
        d_a_QK = g_QK * _column(qw_QF, f) * slope_QK
        d_x_QK = d_x_QK + d_a_QK * w_11
        d_w_11, d_b_11 = _total(d_a_QK * x_QK), _total(d_a_QK)
        d_vec_2F = d_vec_2F + jnp.where(cols_2F == f, jnp.where(rows_2F == 0, d_w_11, d_b_11), 0.0)
        return d_qw_QF, d_x_QK, d_vec_2F

    zeros = (jnp.zeros(qw_QF.shape, jnp.float32), jnp.zeros(p_QK.shape, jnp.float32))
    init = (*zeros, jnp.zeros(vec_2F.shape, jnp.float32))
    d_qw_QF, d_x_QK, d_vec_2F = jax.lax.fori_loop(0, units, unit, init)
    return d_qw_QF, d_x_QK * input_scale, d_vec_2F


mlp_units_vjp.defvjp(_mlp_forward, _mlp_backward)


def split_params(kind: str, params: tuple) -> tuple[jax.Array | None, tuple]:
    """(the rows the queries multiply: e (P, H) or W_out (F, H), None for "alibi"; the
    other parameters: (m_11,) for "alibi", (vec_2F,) for "mlp", () for "interpolate")."""
    if kind == "alibi":
        return None, tuple(params)
    return params[0], tuple(params[1:])


def join_params(kind: str, rows: Any, others: tuple) -> tuple:
    """The parameters (or their gradients) in :func:`split_params`' order, joined again."""
    return tuple(others) if kind == "alibi" else (rows, *others)


def term_table_QR(q_QH: jax.Array, rows_RH: jax.Array | None) -> jax.Array | None:
    """The term's per-query table, float32, from :func:`split_params`' rows: ``z = q e^T``
    (Q, P) for "interpolate", ``q W_out^T`` (Q, F) for "mlp", None where there are no rows
    ("alibi"). It is the only part of the term that reads
    q, so a kernel whose queries stay put (the dq kernel) sums its cotangent over the walk
    and pulls that back to q and the rows once
    (:func:`~copejax.ops.kernels.rows_matmul.rows_pullback`)."""
    return None if rows_RH is None else rows_matmul(q_QH, rows_RH)


def table_term_QK(
    kind: str,
    table_QR: jax.Array | None,
    others: tuple,
    p_QK: jax.Array,
    *,
    units: int = 0,
    input_scale: float = 1.0,
    backward: bool = False,
) -> jax.Array:
    """The position term of one pair, float32 (Q, K), from the capped positions ``p_QK``.

    Args:
      kind: one of :data:`POSITION_TERMS`.
      table_QR: the queries' table (:func:`term_table_QR`).
      others: the parameters besides the rows (:func:`split_params`).
      p_QK: the pair's positions in [0, p_max - 1].
      units, input_scale: the MLP's hidden units and the scale of its input (1 / p_max).
      backward: the caller differentiates the term (the custom pull-backs of the
        interpolation and the MLP: one of their inputs must be differentiated).
    """
    if kind == "interpolate":
        interpolate = interpolate_vjp if backward else interpolate_QK
        return interpolate(table_QR, p_QK)
    if kind == "alibi":
        (m_11,) = others
        return m_11 * p_QK
    (vec_2F,) = others
    units_fn = mlp_units_vjp if backward else mlp_units_QK
    return units_fn(table_QR, p_QK, vec_2F, units, input_scale)


def gate_logits_QK(q_QH: jax.Array, gk_KH: jax.Array) -> jax.Array:
    """sep-keys' and val-gates' gate logits ``q . k' / sqrt(H)``, float32 like the naive
    path's (``copejax.positions.cope``: both operands in float32)."""
    return rows_matmul(q_QH, gk_KH.astype(jnp.float32)) * (1.0 / math.sqrt(q_QH.shape[-1]))
