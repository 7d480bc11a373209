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

from copejax.ops import blockwise, scan
from copejax.ops.blockwise_stickbreaking import blockwise_stickbreaking_attention
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
      scan_impl: suffix-sum implementation, see ``copejax.ops.scan``.
      attention_impl: "naive" ((B, N, T, S) logits), "blockwise"
        (``copejax.ops.blockwise_stickbreaking``: O(T) memory, no (T, S) array in the forward
        or backward pass) or "auto" (default: blockwise from ``blockwise_min_len`` tokens
        on). Both give the same values and gradients; sown intermediates (leftover, attention
        weights) come from the naive path only, so "auto" stays naive while the
        "intermediates" collection is mutable.
      block_size: query and key block length of the blockwise path.
      blockwise_min_len: the length from which "auto" goes blockwise.
    """

    name = "stickbreaking"
    sites = ("normalizer",)
    paper = "Tan et al. 2024, arXiv 2410.17980"

    include_self: bool = False
    scan_impl: str = "auto"
    attention_impl: str = "auto"
    block_size: int = 256
    blockwise_min_len: int = 512

    def validate(self, dims: Dims) -> None:
        if not isinstance(self.include_self, bool):
            raise ValueError(
                f"{self.name}: include_self must be True or False, got {self.include_self!r}"
            )
        if self.scan_impl not in scan.IMPLS:
            raise ValueError(
                f"{self.name}: scan_impl must be one of {scan.IMPLS}, got {self.scan_impl!r}"
            )
        blockwise.check_attention_options(
            self.name, self.attention_impl, self.block_size, self.blockwise_min_len
        )

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _StickBreakingSite(dims=dims, scheme=self)


class _StickBreakingSite(AttentionSite):
    scheme: StickBreaking = StickBreaking()

    def attend(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> jax.Array | None:
        """The blockwise path (O(T) memory) when ``attention_impl`` selects it, else None."""
        s = self.scheme
        sowing = self.is_mutable_collection("intermediates")
        if not blockwise.use_blockwise(
            s.attention_impl, q_BTNH.shape[1], s.blockwise_min_len, sowing
        ):
            return None
        return blockwise_stickbreaking_attention(
            q_BTNH,
            k_BSNH,
            v_BSNH,
            blockwise.context_segment_ids(ctx.segment_ids_BT, ctx.mask_BTS),
            include_self=s.include_self,
            block=s.block_size,
            scan_impl=s.scan_impl,
        )

    def normalize(self, logits_BNTS: jax.Array, ctx: AttentionContext) -> jax.Array:
        offset = ctx.cache_index if ctx.decode else None
        allowed_BTS = stickbreaking_allowed_BTS(ctx.mask_BTS, self.scheme.include_self, offset)
        weights_BNTS, leftover_BNT = stickbreaking_weights(
            logits_BNTS, allowed_BTS, self.scheme.scan_impl
        )
        self.sow("intermediates", "leftover", leftover_BNT)
        return weights_BNTS
