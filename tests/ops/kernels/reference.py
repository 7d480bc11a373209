"""An independent reference for the fused kernels: dense masked softmax attention in NumPy
(float64) for values, and the same maths in jnp (float32, dense) for gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mask_BTS(
    segment_ids_BT: np.ndarray, window: int | None, sinks: int, rank_BT: np.ndarray
) -> np.ndarray:
    """Query i sees key j <= i of its segment; with a window, i - W < j or rank_j < sinks."""
    length = segment_ids_BT.shape[1]
    index = np.arange(length)
    allowed = (index[None, :, None] >= index[None, None, :]) & (
        segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    )
    if window is not None:
        near = (index[:, None] - index[None, :] < window)[None]
        near = near | (rank_BT[:, None, :] < sinks)
        allowed &= near
    return allowed


def attention_numpy(q, k, v, bias_BNTS, allowed_BTS) -> np.ndarray:
    """softmax(q . k / sqrt(H) + bias) v over allowed keys, float64; G <= N heads in k, v."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]) + bias_BNTS
    s = np.where(allowed_BTS[:, None], s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", w, v)


def attention_jnp(q, k, v, bias_BNTS, allowed_BTS) -> jax.Array:
    """The same in float32 jnp (differentiable), the naive path's arithmetic."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    s = jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32)
    s = s / np.sqrt(q.shape[-1]) + bias_BNTS
    s = jnp.where(allowed_BTS[:, None], s, -1e30)
    w = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("BNTS,BSNH->BTNH", w.astype(v.dtype), v, preferred_element_type=jnp.float32)


def stick_weights_jnp(z_BNTS, allowed_BTS, *, xp=jnp):
    """Stick-breaking's A_ij = sigmoid(z_ij) prod_{j < k, k allowed} (1 - sigmoid(z_ik)), as
    exp(log_sigmoid(z_ij) - sum_{k > j} softplus(z_ik)) over allowed keys (float32 jnp, or
    float64 with ``xp=np``)."""
    allowed = allowed_BTS[:, None]
    z = xp.where(allowed, z_BNTS, 0.0)
    softplus = xp.where(allowed, xp.logaddexp(z, 0.0), 0.0)
    newer = xp.cumsum(softplus[..., ::-1], axis=-1)[..., ::-1] - softplus  # sum over k > j
    return xp.where(allowed, xp.exp(-xp.logaddexp(-z, 0.0) - newer), 0.0)


def stick_attention(q, k, v, bias_BNTS, allowed_BTS, *, xp=jnp):
    """sum_j A_ij v_j with stick-breaking weights; G <= N heads in k, v."""
    groups = q.shape[2] // k.shape[2]
    k, v = xp.repeat(k, groups, axis=2), xp.repeat(v, groups, axis=2)
    z = xp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1]) + bias_BNTS
    return xp.einsum("bnts,bsnh->btnh", stick_weights_jnp(z, allowed_BTS, xp=xp), v)


def cope_term(q, k, table_PH, allowed_BTS, p_max: int, *, xp=jnp):
    """CoPE's position term z_i[p_ij] (arXiv 2405.18719 eq. 4-8) for every pair: gates on the
    scaled content logits, suffix sums over allowed keys capped at p_max - 1, z = q . e read
    by linear interpolation; k with G <= N heads."""
    groups = q.shape[2] // k.shape[2]
    k = xp.repeat(k, groups, axis=2)
    logits = xp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    gates = xp.where(allowed_BTS[:, None], 1.0 / (1.0 + xp.exp(-logits)), 0.0)
    suffix = xp.cumsum(gates[..., ::-1], axis=-1)[..., ::-1]
    p = xp.minimum(suffix, p_max - 1.0)
    z = xp.einsum("btnh,ph->bntp", q, table_PH)
    lo = xp.floor(p).astype(np.int32)
    hi = xp.minimum(lo + 1, p_max - 1)
    w = p - xp.floor(p)
    read = lambda index: xp.take_along_axis(z, index, axis=-1)
    return (1.0 - w) * read(lo) + w * read(hi)
