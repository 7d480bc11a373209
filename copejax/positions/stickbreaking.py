"""Stick-breaking attention (Tan et al. 2024, arXiv 2410.17980): softmax replaced by breaks.

Each query walks back over its keys from the nearest; key j breaks off the share
``beta_ij = sigmoid(z_ij)`` of what the nearer keys left:
``A_ij = beta_ij prod_{j<k<i} (1 - beta_ik)``. In log space with a stable softplus
(seed 002): ``log A_ij = log_sigmoid(z_ij) - sum_{k in (j, i)} softplus(z_ik)``, the sum a
float32 suffix sum over keys in which masked keys contribute exactly 0. By default the
current token is not a key (seed 002's sum stops at j - 1); ``include_self`` lets keys j <= i.
Weights are in [0, 1] and sum to ``1 - leftover`` with ``leftover_i = prod_k (1 - beta_ik)``,
the weight no key took; it is exposed with ``sow("intermediates", "leftover", ...)``. No
softmax and no position encoding: the order of breaking is the only positional signal.

Two forms of the output, both here:

- the equation (default, seed 002's notes and the paper's definition): ``y_i = sum_j A_ij v_j``;
  the leftover is only recorded;
- the authors' model code (IBM dolomite-engine, ``SBAttention``; its config's flags
  ``sb_remainder`` and ``head_norm``): ``y_i <- y_i + leftover_i * b_h`` with a learned per-head
  vector b (``remainder_bias``, initialised to 0, so it starts as the equation), then a
  per-head GroupNorm of the N heads' outputs (``head_norm``: mean and variance over each
  head's H features, eps 1e-5, a learned scale (1) and shift (0) per head and feature, as
  ``torch.nn.GroupNorm(N, N H)`` does), before the output projection.
  :func:`stickbreaking_authors_output` is its pure core.

How the leftover reaches the output site, which is handed only y: with ``remainder_bias`` the
qk site appends a constant-1 channel to v, so that the weighted sum carries
``sum_j A_ij = 1 - leftover_i`` in channel H on every attention path (the engine mixes values
of any width), and the output site strips it again. Parts of a combination that
transform v (FoX's ``value_shift``) must therefore not be combined with ``remainder_bias``.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.ops import scan
from copejax.ops.engine_blocks import Normalizer
from copejax.positions.base import AttentionContext, AttentionSite, Dims, PositionScheme
from copejax.positions.registry import register
from copejax.runtime import sharding as ax


def stickbreaking_allowed_BTS(
    mask_BTS: jax.Array, include_self: bool, query_offset: jax.Array | int | None = None
) -> jax.Array:
    """The keys each query breaks sticks over: the mask, without its own token unless asked.

    Query t's own key is key ``t + query_offset``; None means ``S - T`` (the queries are the
    last T of the S keys). In incremental decoding the offset is the cache index.
    """
    if include_self:
        return mask_BTS
    length_q, length_k = mask_BTS.shape[1:]
    offset = length_k - length_q if query_offset is None else query_offset
    t_T1 = jnp.arange(length_q)[:, None] + offset
    s_1S = jnp.arange(length_k)[None, :]
    return mask_BTS & (s_1S != t_T1)


def stickbreaking_weights(
    z_BNTS: jax.Array, allowed_BTS: jax.Array, impl: str = "auto"
) -> tuple[jax.Array, jax.Array]:
    """Stick-breaking attention weights and the leftover weight, float32.

    Args:
      z_BNTS: the (scaled, biased) attention logits.
      allowed_BTS: True where key s takes part for query t; the allowed keys must lie at or
        before the query (causal), as the walk goes from the query backwards.
      impl: the scan implementation (``copejax.ops.scan``).

    Returns:
      (weights_BNTS, leftover_BNT): ``A_ij`` (exactly 0 off ``allowed``) and
      ``prod_k (1 - beta_ik)`` over allowed keys, so that weights sum to ``1 - leftover``.
      A query with no allowed key gets zero weights and leftover 1.
    """
    allowed_B1TS = allowed_BTS[:, None]
    z_BNTS = jnp.where(allowed_B1TS, z_BNTS.astype(jnp.float32), 0.0)
    softplus_BNTS = jnp.where(allowed_B1TS, jax.nn.softplus(z_BNTS), 0.0)
    suffix_BNTS = scan.cumsum(softplus_BNTS, axis=-1, reverse=True, impl=impl)
    # sum over keys strictly after j: the suffix sum shifted by one key (no subtraction).
    after_BNTS = jnp.pad(suffix_BNTS[..., 1:], ((0, 0), (0, 0), (0, 0), (0, 1)))
    log_weights_BNTS = jax.nn.log_sigmoid(z_BNTS) - after_BNTS
    weights_BNTS = jnp.where(allowed_B1TS, jnp.exp(log_weights_BNTS), 0.0)
    leftover_BNT = jnp.exp(-suffix_BNTS[..., 0])
    return weights_BNTS, leftover_BNT


HEAD_NORM_EPS = 1e-5  # torch.nn.GroupNorm's default, which the authors' SBAttention uses


def stickbreaking_authors_output(
    y_BTNH: jax.Array,
    leftover_BTN: jax.Array | None,
    head_bias_NH: jax.Array | None,
    norm_scale_NH: jax.Array | None,
    norm_shift_NH: jax.Array | None,
    *,
    eps: float = HEAD_NORM_EPS,
) -> jax.Array:
    """The authors' output form: ``y + leftover * b_h``, then GroupNorm per head (float32).

    Args:
      y_BTNH: ``sum_j A_ij v_j`` per head.
      leftover_BTN: the weight no key took, ``prod_j (1 - beta_ij)``; needed with a bias.
      head_bias_NH: b, or None for no remainder term.
      norm_scale_NH, norm_shift_NH: the GroupNorm's affine parameters, or None for no norm.
      eps: the GroupNorm's epsilon.

    Returns:
      y_BTNH in the dtype of the input.
    """
    out_BTNH = y_BTNH.astype(jnp.float32)
    if head_bias_NH is not None:
        out_BTNH = out_BTNH + leftover_BTN.astype(jnp.float32)[..., None] * head_bias_NH
    if norm_scale_NH is not None:
        mean_BTN1 = jnp.mean(out_BTNH, axis=-1, keepdims=True)
        var_BTN1 = jnp.mean(jnp.square(out_BTNH - mean_BTN1), axis=-1, keepdims=True)
        out_BTNH = (out_BTNH - mean_BTN1) * jax.lax.rsqrt(var_BTN1 + eps)
        out_BTNH = out_BTNH * norm_scale_NH + norm_shift_NH
    return out_BTNH.astype(y_BTNH.dtype)


@register
@dataclasses.dataclass(frozen=True)
class StickBreaking(PositionScheme):
    """Stick-breaking attention at the normalizer site (no softmax, no position encoding).

    Options:
      include_self: let query i break a stick at its own key (keys j <= i); default False
        (keys j < i, seed 002), so the first token of each segment attends to nothing.
      remainder_bias: the authors' ``y + leftover * b_h`` (a learned vector per head, zero
        at initialisation); default False (the equation).
      head_norm: the authors' per-head GroupNorm of the output; default False. The authors'
        form is both options on.

    On the blockwise engine the walk carries the log stick remainder of the newer key blocks
    (``copejax.ops.engine``, normalizer "stickbreaking"); the path and the suffix-sum
    implementation are model options (``model.attention_impl``, ``model.scan_impl``).
    """

    name = "stickbreaking"
    sites = ("qk", "normalizer", "output")
    walk_carry = True
    paper = "Tan et al. 2024, arXiv 2410.17980"

    include_self: bool = False
    remainder_bias: bool = False
    head_norm: bool = False

    def validate(self, dims: Dims) -> None:
        for key in ("include_self", "remainder_bias", "head_norm"):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ValueError(f"{self.name}: {key} must be True or False, got {value!r}")

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _StickBreakingSite(dims=dims, scheme=self, name=self.name)


class _StickBreakingSite(AttentionSite):
    scheme: StickBreaking = StickBreaking()

    def setup(self) -> None:
        s, n, h = self.scheme, self.dims.num_heads, self.dims.head_dim
        axes = (ax.HEADS, ax.HEAD_DIM)

        def param(name: str, init: nn.initializers.Initializer) -> jax.Array:
            return self.param(name, nn.with_logical_partitioning(init, axes), (n, h), jnp.float32)

        if s.remainder_bias:
            self.head_bias = param("head_bias", nn.initializers.zeros)
        if s.head_norm:
            self.norm_scale = param("head_norm_scale", nn.initializers.ones)
            self.norm_shift = param("head_norm_shift", nn.initializers.zeros)

    def qk(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """With ``remainder_bias``: v gains a constant-1 channel that carries sum_j A_ij."""
        if not self.scheme.remainder_bias:
            return q_BTNH, k_BSNH, v_BSNH
        ones_BSN1 = jnp.ones((*v_BSNH.shape[:-1], 1), v_BSNH.dtype)
        return q_BTNH, k_BSNH, jnp.concatenate([v_BSNH, ones_BSN1], axis=-1)

    def block_normalizer(self, ctx: AttentionContext) -> Normalizer:
        return Normalizer("stickbreaking", include_self=self.scheme.include_self)

    def normalize(self, logits_BNTS: jax.Array, ctx: AttentionContext) -> jax.Array:
        offset = ctx.cache_index if ctx.decode else None
        allowed_BTS = stickbreaking_allowed_BTS(ctx.mask_BTS, self.scheme.include_self, offset)
        weights_BNTS, leftover_BNT = stickbreaking_weights(logits_BNTS, allowed_BTS, ctx.scan_impl)
        self.sow("intermediates", "leftover", leftover_BNT)
        return weights_BNTS

    def output(self, y_BTNH: jax.Array, ctx: AttentionContext) -> jax.Array:
        """The authors' form when asked: strips the sum-of-weights channel, adds the remainder
        term, normalises each head."""
        s = self.scheme
        leftover_BTN = None
        if s.remainder_bias:
            leftover_BTN = 1.0 - y_BTNH[..., -1].astype(jnp.float32)
            y_BTNH = y_BTNH[..., :-1]
        if not (s.remainder_bias or s.head_norm):
            return y_BTNH
        return stickbreaking_authors_output(
            y_BTNH,
            leftover_BTN,
            self.head_bias if s.remainder_bias else None,
            self.norm_scale if s.head_norm else None,
            self.norm_shift if s.head_norm else None,
        )
