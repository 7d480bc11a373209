"""GPT-OSS's attention sink on the fused kernels (OpenAI 2025, model card arXiv 2508.10925).

A learned logit ``z_n`` per head joins every softmax denominator and mixes no value: it is a
key of value 0 that every query sees. With ``l_i = sum_j exp(s_ij)`` over the allowed keys,

    L'_i = log(exp(z_n) + l_i),   P_ij = exp(s_ij - L'_i),   y_i = sum_j P_ij v_j.

Forward. An online softmax folds key tiles into (max, sum, output) in any order, and the sink
is one more tile, of one key with value 0. The kernels fold it last, outside the programs:
with ``L_i`` and ``o_i`` the kernel's log-sum-exp and output over the keys alone,
``L'_i = logaddexp(L_i, z_n)`` and ``y_i = o_i exp(L_i - L'_i)``, in float32 (the kernels'
outputs are float32). That is the same merge as seeding the running max and sum with the sink
(the engine's way, ``copejax.ops.engine_blocks``), it reaches every softmax kernel (Triton's
and Mosaic's, CoPE's, Shaw's, selective attention's) without an operand in any of them, and
it is one elementwise pass over (B, T, N, W) that XLA fuses into the cast of the output.
A query with no allowed key (padding rows only: a softmax row always sees its own key) has
``o = 0`` whatever its ``L``, so ``y = 0``, as the naive path's masked softmax gives.

Backward. The kernels read ``L'`` (so their P are the weights above) and
``D_i = dO_i . y_i``: dq, dk, dv and the terms' gradients are the plain softmax's,

    dS_ij = P_ij (dO_i . v_j - D_i),

because ``dy_i / ds_ij = P_ij (v_j - y_i)`` holds with the sink in the denominator too. The
sink's own gradient: ``dP_ij / dz_n = -P_ij p_i`` with ``p_i = exp(z_n - L'_i)`` the sink's
weight, so ``dy_i / dz_n = -p_i y_i`` and

    dz_n = -sum_{b, i} p_i D_i,

an O(T) sum outside the kernels (padding rows add 0: their D is 0). Where ``L'`` is an output
too (PaTH's chunks merge two softmaxes of a row by it), its cotangent enters the kernels as
``D_i - dL'_i``; since ``dL'_i / dz_n = p_i``, the same sum over that difference is the
sink's gradient then.

Shape letters: B batch, T queries, N query heads, W value width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fold_sink(
    o_BTNW: jax.Array, lse_BNT: jax.Array, sink_N: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The kernels' output and log-sum-exp over the keys, with the sink folded in.

    Args:
      o_BTNW: the kernel's output over the keys alone, float32.
      lse_BNT: its log-sum-exp ``L_i``, float32.
      sink_N: the sink logit per query head.

    Returns:
      (y_BTNW float32, ``L'`` (B, N, T) float32).
    """
    sink_1N1 = sink_N.astype(jnp.float32)[None, :, None]
    lse_with_BNT = jnp.logaddexp(lse_BNT, sink_1N1)
    keep_BTN1 = jnp.moveaxis(jnp.exp(lse_BNT - lse_with_BNT), 1, 2)[..., None]
    return o_BTNW * keep_BTN1, lse_with_BNT


def sink_gradient(lse_BNT: jax.Array, delta_BNT: jax.Array, sink_N: jax.Array) -> jax.Array:
    """``dz_n = -sum_{b, i} exp(z_n - L'_i) D_i`` (N,) float32, from the folded ``L'`` and
    ``D_i = dO_i . y_i`` (less ``dL'_i``, if ``L'`` has a cotangent) as the backward kernels
    read them."""
    p_sink_BNT = jnp.exp(sink_N.astype(jnp.float32)[None, :, None] - lse_BNT)
    return -jnp.sum(p_sink_BNT * delta_BNT, axis=(0, 2))
