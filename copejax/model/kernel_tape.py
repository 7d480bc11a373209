"""TAPE on the fused kernels (Zhu et al. 2025, arXiv 2501.00712): its qk site's queries and
keys as the kernels' q and k, its position mixing (eq. 7) as float32 value columns.

TAPE's logits are content logits of the transformed ``q'_i`` and ``k'_j`` (eq. 6,
:mod:`copejax.positions.tape`), which the kernels take as they are: per query head (TAPE's qk
site makes its keys per query head) and of width H' (K R for tensorial positions: H with
L = R = 2). A width that is no power of two of at least 16 (Triton's block shapes) is
padded with zeros to one, W, and q is scaled by ``sqrt(W / H')`` (in float32, then cast), so
that the kernels' ``q . k / sqrt(W)`` is the naive path's ``q' . k' / sqrt(H')`` (TAPE's qk
site keeps the model's 1 / sqrt(H) inside q').

Eq. 7's mixing ``e~_i = sum_j P_ij e_j`` is the attention's weighted sum over the keys, so the
kernels compute it as more value columns: the values become ``[v_j, e_j, 0...]``, each key's
C-wide position tensor per query head, padded to a power of two, in **float32**. The house
rule keeps the mixed positions in float32 when the model runs in bfloat16 (the naive and
blockwise paths mix float32 e with float32 weights), and the kernels round the weights P to
the values' dtype before the value matmul and return the output in it: float32 values are
what keeps both unrounded. Splitting e into bfloat16 high and low columns would keep e's
bits but still round every weight to 8 bits, up to 2^-9 of each term (a NumPy probe over
512 keys with |e| <= 1: 1e-3 off, against 2e-8 with float32 values), and the mixed high
part's sum once more. The value matmuls take the precision of the model's
other float32 matmuls (``jax_default_matmul_precision`` reaches the kernels' dots as it
reaches the naive path's float32 mixing einsum; by default TF32 on recent GPUs). The content
values ride in the same float32 operand (the kernels take one value array), which rounds the
weights less than the naive bfloat16 path does; y is cast back to v's dtype.

Cost (not measured: no GPU here): the value operand is float32 of width H + C padded to a
power of two (4 H with the default L = R = 2, where C = 2 H), against H columns of the
model's dtype. In bfloat16 that is 8x the bytes of v, of the output and of its cotangent,
and 4x the columns of P V, dO V^T and P^T dO at float32 (TF32) tensor-core rate, half
bfloat16's: about 8x their time; q . k and dS's matmuls are unchanged. The high and low
split (H + 2 C = 5 H bfloat16 columns, padded to 8 H) moves as many bytes in about the same
time, without the accuracy; a second value operand in float32 for e alone would save the
content's H of the 4 H columns at the price of another operand and accumulator in every
softmax kernel (Triton's and Mosaic's, CoPE's, Shaw's, selective attention's). With GQA the
values become per query head, as TAPE's keys already are. Shape letters as in
:mod:`copejax.model.kernel_xl`; C = K L R position features per head.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

TAPE = "tape"
MIN_WIDTH = 16  # Triton's smallest matmul tile
# Parts whose logits or queries the kernels would read from TAPE's padded, rescaled q'.
READERS = ("cope", "selective", "relative", "relative_capped", "transformer_xl", "path")


def kernel_width(width: int) -> int:
    """The power of two of at least ``MIN_WIDTH`` that holds ``width`` columns."""
    return max(MIN_WIDTH, 1 << (width - 1).bit_length())


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def padded_qk(q_BTNH: jax.Array, k_BSNH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """q' and k' padded to :func:`kernel_width` columns (unchanged if they fit it), q scaled
    by ``sqrt(W / width)`` in float32, both in their dtypes."""
    width = q_BTNH.shape[-1]
    padded = kernel_width(width)
    if padded == width:
        return q_BTNH, k_BSNH
    scale = math.sqrt(padded / width)
    q_BTNW = (_pad_last(q_BTNH.astype(jnp.float32), padded) * scale).astype(q_BTNH.dtype)
    return q_BTNW, _pad_last(k_BSNH, padded)


def value_columns(v_BSNH: jax.Array, extra_BSNC: jax.Array) -> jax.Array:
    """``[v, e, 0...]`` (B, S, N, W_v) float32: the values and each key's mixed features per
    query head, padded to :func:`kernel_width` columns."""
    columns = [v_BSNH.astype(jnp.float32), extra_BSNC.astype(jnp.float32)]
    values_BSNW = jnp.concatenate(columns, axis=-1)
    return _pad_last(values_BSNW, kernel_width(values_BSNW.shape[-1]))


def kernel_operands(
    qkv: tuple[jax.Array, jax.Array, jax.Array],
    v_BSNH: jax.Array,
    extra_BSNC: jax.Array | None,
    head_dim: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernels' q, k and values from the qk site's.

    Args:
      qkv: (q_BTNH', k_BSGH', v_BSGH) as the qk site returned them: TAPE's q' and k' (K R
        wide, the keys per query head: G = N) or any scheme's (H wide, G key/value heads).
      v_BSNH: the values repeated to N heads.
      extra_BSNC: the site's mixed values (TAPE's position tensors), or None.
      head_dim: the model's H.

    Returns:
      (q, k, values): q and k padded by :func:`padded_qk` when the qk site changed their
      width; the values ``[v, e, 0...]`` float32 per query head with mixed values, v per
      query head where the keys are, else v unchanged.
    """
    q_BTNH, k_BSGH, v_BSGH = qkv
    if q_BTNH.shape[-1] != head_dim:
        q_BTNH, k_BSGH = padded_qk(q_BTNH, k_BSGH)
    if extra_BSNC is not None:
        v_BSGH = value_columns(v_BSNH, extra_BSNC)
    elif k_BSGH.shape[2] != v_BSGH.shape[2]:
        v_BSGH = v_BSNH
    return q_BTNH, k_BSGH, v_BSGH


def split_columns(
    y_BTNW: jax.Array, width: int, extra_BSNC: jax.Array | None, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array | None]:
    """The kernels' output cut into y (B, T, N, ``width``) in ``dtype`` and, with mixed
    values, the mixed features (B, T, N, C) float32 (else None)."""
    if extra_BSNC is None:
        return y_BTNW, None
    channels = extra_BSNC.shape[-1]
    mixed_BTNC = y_BTNW[..., width : width + channels].astype(jnp.float32)
    return y_BTNW[..., :width].astype(dtype), mixed_BTNC


def tape_refusal(names: list[str]) -> str | None:
    """Why the kernels cannot run TAPE with the other parts ``names``, or None."""
    readers = sorted(set(READERS) & set(names))
    if readers:
        return (
            f"its queries and keys with {readers} (they read the queries or the content "
            "logits, which on the kernels are TAPE's q' and k', padded and rescaled)"
        )
    return None
