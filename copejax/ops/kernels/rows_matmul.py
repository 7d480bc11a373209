"""``q . rows^T`` in float32 on the tensor cores, with its pull-backs: CoPE's tables ``q e^T``
and ``q W_out^T`` and its gate logits on separate keys (Golovneva et al. 2024, arXiv
2405.18719; :mod:`copejax.ops.kernels.cope_terms`). Shape letters: Q queries, H head dim,
R rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops.kernels.exact_dots import dot_exact_f32, pieces_dot


def rows_matmul(q_QH: jax.Array, rows_RH: jax.Array) -> jax.Array:
    """q . rows^T in float32 (no TF32 for a position term): bfloat16 queries are exact in
    bfloat16, so three bfloat16 matmuls of the rows' pieces on the tensor cores
    (:func:`~copejax.ops.kernels.exact_dots.dot_exact_f32`); float32 queries at HIGHEST. A kernel
    whose queries stay put takes it once and pulls its summed cotangent back by
    :func:`rows_pullback`."""
    if q_QH.dtype == jnp.bfloat16:
        return dot_exact_f32(rows_RH, q_QH, (1, 1), exact_left=True)
    return jax.lax.dot_general(
        q_QH.astype(jnp.float32),
        rows_RH,
        (((1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def rows_pullback(
    q_QH: jax.Array, rows_RH: jax.Array, ct_QR: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The pull-back of ``q . rows^T`` (:func:`rows_matmul`) of a float32 cotangent, both
    float32: (d q, d rows). bfloat16 q: ``ct^T q`` in three bfloat16 matmuls (q exact) and
    ``ct rows`` in six (rows in two bfloat16 pieces, 16 bits), on the tensor cores where
    autodiff would run float32 FMA loops; float32 q at HIGHEST."""
    if q_QH.dtype != jnp.bfloat16:
        _, pull = jax.vjp(rows_matmul, q_QH.astype(jnp.float32), rows_RH)
        return pull(ct_QR)
    d_rows_RH = pieces_dot(ct_QR, q_QH, (0, 0), False)
    hi_RH = rows_RH.astype(jnp.bfloat16)
    mid_RH = (rows_RH - hi_RH.astype(jnp.float32)).astype(jnp.bfloat16)
    d_q_QH = pieces_dot(ct_QR, hi_RH, (1, 0), False) + pieces_dot(ct_QR, mid_RH, (1, 0), False)
    return d_q_QH, d_rows_RH
