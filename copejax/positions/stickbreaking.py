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
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from copejax.ops import scan
from copejax.ops.engine import Normalizer
from copejax.positions.base import AttentionContext, AttentionSite, Dims, PositionScheme
from copejax.positions.registry import register


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


@register
@dataclasses.dataclass(frozen=True)
class StickBreaking(PositionScheme):
    """Stick-breaking attention at the normalizer site (no softmax, no position encoding).

    Options:
      include_self: let query i break a stick at its own key (keys j <= i); default False
        (keys j < i, seed 002), so the first token of each segment attends to nothing.

    On the blockwise engine the walk carries the log stick remainder of the newer key blocks
    (``copejax.ops.engine``, normalizer "stickbreaking"); the path and the suffix-sum
    implementation are model options (``model.attention_impl``, ``model.scan_impl``).
    """

    name = "stickbreaking"
    sites = ("normalizer",)
    walk_carry = True
    paper = "Tan et al. 2024, arXiv 2410.17980"

    include_self: bool = False

    def validate(self, dims: Dims) -> None:
        if not isinstance(self.include_self, bool):
            raise ValueError(
                f"{self.name}: include_self must be True or False, got {self.include_self!r}"
            )

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _StickBreakingSite(dims=dims, scheme=self)


class _StickBreakingSite(AttentionSite):
    scheme: StickBreaking = StickBreaking()

    def block_normalizer(self, ctx: AttentionContext) -> Normalizer:
        return Normalizer("stickbreaking", include_self=self.scheme.include_self)

    def normalize(self, logits_BNTS: jax.Array, ctx: AttentionContext) -> jax.Array:
        offset = ctx.cache_index if ctx.decode else None
        allowed_BTS = stickbreaking_allowed_BTS(ctx.mask_BTS, self.scheme.include_self, offset)
        weights_BNTS, leftover_BNT = stickbreaking_weights(logits_BNTS, allowed_BTS, ctx.scan_impl)
        self.sow("intermediates", "leftover", leftover_BNT)
        return weights_BNTS
