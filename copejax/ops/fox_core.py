"""The Forgetting Transformer's maths (Lin et al. 2025, arXiv 2503.02130), pure functions.

The forget gates and their float32 prefix sums (restarting at packed-segment starts), the
decay bias ``D_ij = c_i - c_j`` in its naive (B, N, T, S) and block-pair forms, and FoX Pro's
token shift, per-head RMSNorm and output site. :mod:`copejax.positions.fox` is the scheme
and its Linen site, which read these.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from copejax.ops import scan, segments
from copejax.ops.engine_blocks import PairBlock

__all__ = [
    "OUTPUT_NORM_EPS",
    "QK_NORM_EPS",
    "decay_BNTS",
    "fox_cached_cumsum",
    "fox_decay_bias",
    "fox_log_forget_gates",
    "fox_output",
    "fox_pair",
    "mix_previous",
    "rms_norm_heads",
    "token_shift",
]

QK_NORM_EPS = 1e-6
OUTPUT_NORM_EPS = 1e-6  # the authors' norm_eps (configs/model/forgetting_transformer.py)


def fox_log_forget_gates(x_BTD: jax.Array, w_DN: jax.Array, b_N: jax.Array) -> jax.Array:
    """log f_t = log_sigmoid(w_f . x_t + b_f) per head, in float32.

    Args:
      x_BTD: the attention layer's input.
      w_DN: gate weights, one column per head.
      b_N: gate biases.

    Returns:
      logf_BTN, float32, all <= 0.
    """
    z_BTN = jnp.einsum(
        "BTD,DN->BTN", x_BTD.astype(jnp.float32), w_DN.astype(jnp.float32)
    ) + b_N.astype(jnp.float32)
    return jax.nn.log_sigmoid(z_BTN)


def fox_cached_cumsum(
    logf_BTN: jax.Array,
    starts_BT: jax.Array,
    previous_BN: jax.Array | None,
    impl: str = "auto",
) -> jax.Array:
    """The prefix sums ``c`` of log forget gates of T new tokens, continuing cached ones.

    ``c`` restarts at each segment start; new tokens before the first start continue the
    previous token's sum ``previous_BN`` (ignored when the first new token starts a segment).

    Returns:
      c_BTN, float32.
    """
    c_BTN = scan.segment_cumsum(logf_BTN, starts_BT[:, :, None], axis=1, impl=impl)
    if previous_BN is None:
        return c_BTN
    continues_BT1 = (jnp.cumsum(starts_BT, axis=1) == 0)[:, :, None]
    return c_BTN + jnp.where(continues_BT1, previous_BN[:, None, :].astype(jnp.float32), 0.0)


def fox_decay_bias(logf_BTN: jax.Array, mask_BTS: jax.Array, impl: str = "auto") -> jax.Array:
    """D_ij = sum_{l=j+1..i} log f_l for allowed (i, j), exactly 0 elsewhere.

    Computed as ``c_i - c_j`` with ``c`` the prefix sums of ``log f`` restarted at each
    segment start (``scan.segment_cumsum``), so D never mixes gates of two segments.

    Args:
      logf_BTN: log forget gates (float32, <= 0).
      mask_BTS: True where query t may attend to key s; self-attention, T == S.
      impl: the scan implementation (``copejax.ops.scan``).

    Returns:
      bias_BNTS, float32, <= 0 where allowed.
    """
    if mask_BTS.shape[1] != mask_BTS.shape[2] or mask_BTS.shape[1] != logf_BTN.shape[1]:
        raise ValueError(
            f"fox: needs self-attention with T == S and one gate per token, got mask "
            f"{mask_BTS.shape} and gates {logf_BTN.shape}"
        )
    ids_BT = segments.segment_ids_from_mask(mask_BTS)
    starts_BT1 = segments.segment_starts_BT(ids_BT)[:, :, None]
    c_BNT = jnp.moveaxis(scan.segment_cumsum(logf_BTN, starts_BT1, axis=1, impl=impl), 2, 1)
    bias_BNTS = c_BNT[:, :, :, None] - c_BNT[:, :, None, :]
    return jnp.where(mask_BTS[:, None], bias_BNTS, 0.0)


def token_shift(x_BTNH: jax.Array, a_BTN: jax.Array, segment_ids_BT: jax.Array | None) -> jax.Array:
    """x_t <- a_t x_t + (1 - a_t) x_{t-1}; x_{t-1} is 0 at t = 0 and across segment starts.

    Segment starts come from the ids (t = 0 or an id different from t - 1's), never from the
    (B, T, T) mask, so that the blockwise path holds no (T, T) array.

    Args:
      x_BTNH: keys or values.
      a_BTN: mixing weights in [0, 1] per token and head (float32).
      segment_ids_BT: packed documents' ids; None: one segment per row (only t = 0 starts).

    Returns:
      shifted array, same shape and dtype as ``x_BTNH`` (mixed in float32).
    """
    x32_BTNH = x_BTNH.astype(jnp.float32)
    prev_BTNH = jnp.pad(x32_BTNH[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0)))
    if segment_ids_BT is not None:
        keep_BT11 = ~segments.segment_starts_BT(segment_ids_BT)[:, :, None, None]
        prev_BTNH = jnp.where(keep_BT11, prev_BTNH, 0.0)
    return mix_previous(x_BTNH, prev_BTNH, a_BTN)


def mix_previous(x_BTNH: jax.Array, prev_BTNH: jax.Array, a_BTN: jax.Array) -> jax.Array:
    """a_t x_t + (1 - a_t) prev_t in float32, cast back to the dtype of ``x_BTNH``."""
    a_BTN1 = a_BTN.astype(jnp.float32)[..., None]
    mixed_BTNH = a_BTN1 * x_BTNH.astype(jnp.float32) + (1.0 - a_BTN1) * prev_BTNH
    return mixed_BTNH.astype(x_BTNH.dtype)


def rms_norm_heads(x_BTNH: jax.Array, scale_NH: jax.Array, eps: float = QK_NORM_EPS) -> jax.Array:
    """RMSNorm over each head's features with a per-head, per-feature scale (float32 inside)."""
    x32_BTNH = x_BTNH.astype(jnp.float32)
    rms_BTN1 = jnp.sqrt(jnp.mean(jnp.square(x32_BTNH), axis=-1, keepdims=True) + eps)
    return (x32_BTNH / rms_BTN1 * scale_NH.astype(jnp.float32)).astype(x_BTNH.dtype)


def fox_output(
    y_BTNH: jax.Array,
    x_BTD: jax.Array,
    norm_scale_NH: jax.Array | None,
    gate_w_DNH: jax.Array | None,
) -> jax.Array:
    """FoX Pro's output site: per-head RMSNorm, then the output gate (float32 inside).

    ``y <- rms_norm_h(y) * scale`` when ``norm_scale_NH`` is given (eps 1e-6, over each head's
    H features), then ``y <- y * sigmoid(x W_o)`` when ``gate_w_DNH`` is given: the order of
    the authors' ``FusedGroupNormGated`` (norm, scale, then the sigmoid gate).

    Args:
      y_BTNH: the attention output per head, before the output projection.
      x_BTD: the attention layer's input (the gate reads it).
      norm_scale_NH: the output norm's scale, or None for no output norm.
      gate_w_DNH: the output gate's weights, or None for no gate.

    Returns:
      y_BTNH in the dtype of the input.
    """
    out_BTNH = y_BTNH.astype(jnp.float32)
    if norm_scale_NH is not None:
        out_BTNH = rms_norm_heads(out_BTNH, norm_scale_NH, OUTPUT_NORM_EPS)
    if gate_w_DNH is not None:
        z_BTNH = jnp.einsum("BTD,DNH->BTNH", x_BTD.astype(jnp.float32), gate_w_DNH)
        out_BTNH = out_BTNH * jax.nn.sigmoid(z_BTNH)
    return out_BTNH.astype(y_BTNH.dtype)


def decay_BNTS(c_BTN: jax.Array, c_BSN: jax.Array) -> jax.Array:
    """c_i - c_j for every (query, key) pair: (B, N, T, S)."""
    return jnp.moveaxis(c_BTN, 2, 1)[..., :, None] - jnp.moveaxis(c_BSN, 2, 1)[..., None, :]


def fox_pair(params: None, pair: PairBlock, prepared: None, carry: Any) -> tuple[jax.Array, Any]:
    """FoX's block term for one (query block, key block) pair (``copejax.ops.engine``):
    ``D_ij = c_i - c_j`` (B, N, Q, K) from the prefix sums ``c`` of log f, which the term
    carries as per-token arrays ``q_arrays["c"]`` (B, Q, N) and ``k_arrays["c"]`` (B, K, N)
    (``copejax.terms.fox`` builds them). No params, no carry."""
    return decay_BNTS(pair.q_arrays["c"], pair.k_arrays["c"]), carry
