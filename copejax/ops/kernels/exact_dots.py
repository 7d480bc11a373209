"""float32 matmuls on bfloat16 tensor cores: a float32 operand cut into three bfloat16
pieces (8 + 8 + 8 significant bits) times an operand bfloat16 holds exactly (0 / 1
triangles, bfloat16 queries), three single passes where ``Precision.HIGHEST`` lowers to
Triton's FMA loop on a GPU and takes six passes on a TPU (issue 45). The fused kernels'
within-tile sums (:mod:`copejax.ops.kernels.stick`, selective attention's) and CoPE's tables
(:mod:`copejax.ops.kernels.rows_matmul`) take them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from copejax.ops.kernels.tiles import dot_f32


def bf16_pieces(x: jax.Array) -> list[jax.Array]:
    """x (float32) as three bfloat16 pieces, smallest first, whose sum is x to float32's
    precision (8 + 8 + 8 significant bits). Each piece is cut by masking off the low 16 bits
    (:func:`_bf16_truncated`), so that it is a bfloat16 value before any conversion and each
    remainder is exact in float32: nothing rests on a float32 -> bfloat16 -> float32 round
    trip, which XLA may skip (``xla_allow_excess_precision``, on by default). With rounding
    conversions, the CPU code jaxlib 0.11.2 emits for TPU interpret mode did (with the flag
    off, the same optimized HLO was exact), and the sums kept bfloat16's precision
    (stick-breaking's dk off by 7e-3 in float32)."""
    hi = _bf16_truncated(x)
    rest = x - hi
    mid = _bf16_truncated(rest)
    return [(rest - mid).astype(jnp.bfloat16), mid.astype(jnp.bfloat16), hi.astype(jnp.bfloat16)]


def _bf16_truncated(x: jax.Array) -> jax.Array:
    """float32 x with its mantissa cut to bfloat16's 7 stored bits (toward zero): a float32
    that bfloat16 holds exactly."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jax.lax.bitcast_convert_type(bits & jnp.int32(-65536), jnp.float32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def dot_exact_f32(
    x: jax.Array, exact: jax.Array, contract: tuple[int, int], exact_left: bool = False
) -> jax.Array:
    """``x`` (float32) times ``exact``, a matrix whose entries bfloat16 holds exactly (0 / 1
    triangles, bfloat16 queries), to float32's precision: three bfloat16 matmuls of x's
    pieces (:func:`bf16_pieces`) with float32 accumulation. ``contract``: x's axis, then
    exact's; the result's rows are x's (``exact_left``: exact's). On a GPU these run on the
    tensor cores, where a float32 matmul at ``Precision.HIGHEST`` lowers to Triton's FMA loop
    (stick-breaking's kernels, which used one, measured 22.7x the nope kernel on an H100) and
    the default keeps TF32's 10 bits; on a TPU they are three single MXU passes where HIGHEST
    takes six. Its derivative (a custom JVP: autodiff through the pieces would round the
    cotangent to bfloat16) is float32 matmuls at ``Precision.HIGHEST``."""
    return pieces_dot(x, exact, contract, exact_left)


def pieces_dot(
    x: jax.Array, exact: jax.Array, contract: tuple[int, int], exact_left: bool
) -> jax.Array:
    """:func:`dot_exact_f32`'s product without its custom derivative (autodiff through it
    rounds the cotangent to bfloat16): for callers that differentiate by hand."""
    exact = exact.astype(jnp.bfloat16)
    total = None
    for piece in bf16_pieces(x):
        if exact_left:
            product = dot_f32(exact, piece, (contract[1], contract[0]))
        else:
            product = dot_f32(piece, exact, contract)
        total = product if total is None else total + product
    return total


def highest_dot(
    x: jax.Array, exact: jax.Array, contract: tuple[int, int], exact_left: bool
) -> jax.Array:
    """:func:`dot_exact_f32`'s product as one float32 matmul at ``Precision.HIGHEST``."""
    x, exact = x.astype(jnp.float32), exact.astype(jnp.float32)
    pair, axes = ((exact, x), contract[::-1]) if exact_left else ((x, exact), contract)
    return jax.lax.dot_general(
        *pair,
        (((axes[0],), (axes[1],)), ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def _dot_exact_jvp(
    contract: tuple[int, int], exact_left: bool, primals: tuple, tangents: tuple
) -> tuple[jax.Array, jax.Array]:
    x, exact = primals
    x_dot, exact_dot = tangents
    out = pieces_dot(x, exact, contract, exact_left)
    out_dot = highest_dot(x_dot, exact, contract, exact_left)
    return out, out_dot + highest_dot(x, exact_dot, contract, exact_left)


dot_exact_f32.defjvp(_dot_exact_jvp)
