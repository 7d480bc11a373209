"""TAPE's tensor maths (Zhu et al. 2025, arXiv 2501.00712), pure functions.

Cutting heads into blocks and back, the position-tensor transform of q and k (eq. 6), the
attention mixing of positions (eq. 7), the MLP update of the position tensor (eq. 8) and the
RoPE / random initial tensors. :mod:`copejax.positions.tape` is the scheme and its Linen sites,
which read these; its docstring states the reading of the paper's sizes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from copejax.positions.rope import rope_inv_freq


def to_blocks(x_BTNH: jax.Array, num_blocks: int, layout: str) -> jax.Array:
    """Cuts each head into ``num_blocks`` (K) blocks of H / K features: returns x_BTNKL."""
    *lead, head_dim = x_BTNH.shape
    size = head_dim // num_blocks
    if layout == "half":
        return jnp.swapaxes(x_BTNH.reshape(*lead, size, num_blocks), -1, -2)
    return x_BTNH.reshape(*lead, num_blocks, size)


def from_blocks(y_BTNKC: jax.Array, layout: str) -> jax.Array:
    """Inverse of :func:`to_blocks` for blocks of any width C: returns y_BTN(K*C)."""
    *lead, num_blocks, width = y_BTNKC.shape
    if layout == "half":
        y_BTNKC = jnp.swapaxes(y_BTNKC, -1, -2)
    return y_BTNKC.reshape(*lead, num_blocks * width)


def tape_qk(x_BTNH: jax.Array, e_BTMLR: jax.Array, layout: str, tensorial: bool) -> jax.Array:
    """Eq. 6 factorised: each block's features are carried into position coordinates.

    Args:
      x_BTNH: queries or keys.
      e_BTMLR: position tensor, M = N * K blocks grouped by head.
      layout: "half" or "interleaved" grouping of a head's features into blocks.
      tensorial: True: ``x'_m = e_m^T x_m`` (L = H / K rows, width R per block), so that
        ``q'_i . k'_j = sum_m q_im^T e_im e_jm^T k_jm``. False (Table 6's vector ablation,
        L = 1): ``x'_m = x_m (outer) e_m`` (width (H / K) * R), so that
        ``q'_i . k'_j = sum_m (q_im . k_jm) (e_im . e_jm)``, i.e. phi(s) = s I.

    Returns:
      x'_BTNH' in ``x_BTNH``'s dtype (computed in float32), H' = K R (tensorial) or H R.
    """
    batch, length, heads, _ = x_BTNH.shape
    num_blocks = e_BTMLR.shape[2] // heads
    e_BTNKLR = e_BTMLR.astype(jnp.float32).reshape(
        batch, length, heads, num_blocks, *e_BTMLR.shape[3:]
    )
    x_BTNKL = to_blocks(x_BTNH.astype(jnp.float32), num_blocks, layout)
    if tensorial:
        y_BTNKC = jnp.einsum("BTNKL,BTNKLR->BTNKR", x_BTNKL, e_BTNKLR)
    else:
        y_BTNKLR = x_BTNKL[..., :, None] * e_BTNKLR[..., 0, None, :]
        y_BTNKC = y_BTNKLR.reshape(*y_BTNKLR.shape[:4], -1)
    return from_blocks(y_BTNKC, layout).astype(x_BTNH.dtype)


def tape_mix(e_BSMLR: jax.Array, weights_BNTS: jax.Array) -> jax.Array:
    """Eq. 7: ``e~_t = sum_s w_ts e_s`` per block, with the block's head's attention map.

    Args:
      e_BSMLR: key positions' tensors (M = N * K, grouped by head).
      weights_BNTS: attention weights (rows sum to 1 over allowed keys, 0 elsewhere).

    Returns:
      e~_BTMLR in float32.
    """
    batch, length, blocks = e_BSMLR.shape[:3]
    heads = weights_BNTS.shape[1]
    e_BSNKLR = e_BSMLR.astype(jnp.float32).reshape(
        batch, length, heads, blocks // heads, *e_BSMLR.shape[3:]
    )
    mixed_BTNKLR = jnp.einsum("BNTS,BSNKLR->BTNKLR", weights_BNTS.astype(jnp.float32), e_BSNKLR)
    return mixed_BTNKLR.reshape(*mixed_BTNKLR.shape[:2], blocks, *e_BSMLR.shape[3:])


def tape_update(
    e_BTMLR: jax.Array,
    gates_BTMF: jax.Array | None,
    w1: jax.Array,
    w2: jax.Array,
    equivariant: bool = True,
) -> jax.Array:
    """Eq. 8: ``W2 diag(gates) W1 e`` per block (the residual is added by the caller).

    Args:
      e_BTMLR: the positions to transform (eq. 7's e~, or e itself without attention mixing).
      gates_BTMF: psi(x~) per block; None means all ones (no token-feature gating).
      w1: (F, L) acting on the rows (equivariant), or (F, L R) on the flattened matrix
        (Table 6's "without rotation equivariance").
      w2: (L, F), or (L R, F) when not equivariant.
      equivariant: which of the two forms ``w1`` and ``w2`` have.

    Returns:
      The update, e_hat_BTMLR, float32.
    """
    e_BTMLR = e_BTMLR.astype(jnp.float32)
    if equivariant:
        h_BTMFR = jnp.einsum("FL,BTMLR->BTMFR", w1, e_BTMLR)
        if gates_BTMF is not None:
            h_BTMFR = h_BTMFR * gates_BTMF.astype(jnp.float32)[..., None]
        return jnp.einsum("LF,BTMFR->BTMLR", w2, h_BTMFR)
    flat_BTMC = e_BTMLR.reshape(*e_BTMLR.shape[:3], -1)
    h_BTMF = jnp.einsum("FC,BTMC->BTMF", w1, flat_BTMC)
    if gates_BTMF is not None:
        h_BTMF = h_BTMF * gates_BTMF.astype(jnp.float32)
    return jnp.einsum("CF,BTMF->BTMC", w2, h_BTMF).reshape(e_BTMLR.shape)


def rope_tape_embeddings(
    positions_BT: jax.Array, num_heads: int, head_dim: int, base: float, tensorial: bool = True
) -> jax.Array:
    """Section 3.3's RoPE initialisation with L = R = 2, one frequency per block.

    Block k of every head holds the transposed rotation by ``theta_k * position`` (see the
    module docstring), theta_k = base^(-2k / H) as in ``rope``. With ``tensorial=False`` the
    2 x 2 matrix is flattened to one row of 4 coordinates and divided by sqrt(2), so that
    ``e_i . e_j = cos(theta_k (i - j))``.

    Returns:
      e_BTMLR, float32, M = num_heads * head_dim / 2; (L, R) = (2, 2), or (1, 4).
    """
    angle_BTK = positions_BT.astype(jnp.float32)[..., None] * rope_inv_freq(head_dim, base)
    cos_BTK, sin_BTK = jnp.cos(angle_BTK), jnp.sin(angle_BTK)
    # e[l, r] = Rot[r, l] with Rot = [[cos, -sin], [sin, cos]].
    row0_BTKR = jnp.stack([cos_BTK, sin_BTK], axis=-1)
    row1_BTKR = jnp.stack([-sin_BTK, cos_BTK], axis=-1)
    e_BTKLR = jnp.stack([row0_BTKR, row1_BTKR], axis=-2)
    if not tensorial:
        e_BTKLR = e_BTKLR.reshape(*e_BTKLR.shape[:3], 1, 4) / math.sqrt(2.0)
    e_BTNKLR = jnp.broadcast_to(
        e_BTKLR[:, :, None], (*e_BTKLR.shape[:2], num_heads, *e_BTKLR.shape[2:])
    )
    return e_BTNKLR.reshape(*e_BTKLR.shape[:2], -1, *e_BTKLR.shape[3:])


def random_tape_embeddings(
    positions_BT: jax.Array, freq_MLR: jax.Array, phase_MLR: jax.Array
) -> jax.Array:
    """Random Fourier features: ``e[m, l, r] = sqrt(2 / R) cos(p freq[m, l, r] + phase)``."""
    angle_BTMLR = positions_BT.astype(jnp.float32)[..., None, None, None] * freq_MLR + phase_MLR
    return math.sqrt(2.0 / freq_MLR.shape[-1]) * jnp.cos(angle_BTMLR)
