"""Multi-head causal self-attention: the one place where a position scheme meets attention.

Each site of the layer's :class:`~copejax.positions.base.AttentionSite` is called exactly once,
in this order: qk -> content logits -> bias -> normalizer -> weighted values -> output ->
carry. Logits, bias and normalisation are float32 whatever the compute dtype.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax import sharding as ax
from copejax.model_config import ModelConfig
from copejax.positions.base import AttentionContext, AttentionSite, Carry


def causal_segment_mask_BTS(segment_ids_BT: jax.Array | None, batch: int, length: int) -> jax.Array:
    """True where query t may see key s: s <= t (by index) and both in the same segment."""
    t_T1 = jnp.arange(length)[:, None]
    s_1S = jnp.arange(length)[None, :]
    mask_BTS = jnp.broadcast_to(s_1S <= t_T1, (batch, length, length))
    if segment_ids_BT is not None:
        mask_BTS = mask_BTS & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
    return mask_BTS


class Attention(nn.Module):
    """Attention with position-scheme sites.

    Attributes:
      cfg: the model configuration.
      shared: what the scheme's ``shared_attention_module`` built once for the whole model
        (None when nothing is shared); this layer asks ``layer_attention_module`` for its own.
    """

    cfg: ModelConfig
    shared: Any = None

    def setup(self) -> None:
        cfg = self.cfg
        dtype = cfg.compute_dtype
        use_bias = cfg.block == "gpt2"

        def dense(features: tuple[int, ...], axes: tuple[str, ...], name: str) -> nn.Module:
            return nn.DenseGeneral(
                features=features,
                axis=-1,
                use_bias=use_bias,
                dtype=dtype,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.normal(cfg.init_std), axes
                ),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
                name=name,
            )

        shape = (cfg.num_heads, cfg.resolved_head_dim)
        qkv_axes = (ax.EMBED, ax.HEADS, ax.HEAD_DIM)
        self.query = dense(shape, qkv_axes, "query")
        self.key = dense(shape, qkv_axes, "key")
        self.value = dense(shape, qkv_axes, "value")
        self.out = nn.DenseGeneral(
            features=cfg.d_model,
            axis=(-2, -1),
            use_bias=use_bias,
            dtype=dtype,
            kernel_init=nn.with_logical_partitioning(
                nn.initializers.normal(cfg.init_std / math.sqrt(2 * cfg.num_layers)),
                (ax.HEADS, ax.HEAD_DIM, ax.EMBED),
            ),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (ax.EMBED,)),
            name="out",
        )
        own = cfg.scheme().layer_attention_module(cfg.dims, self.shared)
        if own is None and self.shared is None:
            own = AttentionSite(cfg.dims)  # a scheme without attention sites (nope)
        self.own_site = own

    def _site(self) -> AttentionSite:
        return self.own_site if self.own_site is not None else self.shared

    def __call__(self, x_BTD: jax.Array, ctx: AttentionContext) -> tuple[jax.Array, Carry]:
        """Args: x_BTD the normalised layer input; ctx positions, mask and carry.

        Returns: the output y_BTD (compute dtype) and the updated carry.
        """
        site = self._site()
        q_BTNH = self.query(x_BTD)
        k_BSNH = self.key(x_BTD)
        v_BSNH = self.value(x_BTD)
        q_BTNH, k_BSNH, v_BSNH = site.qk(q_BTNH, k_BSNH, v_BSNH, ctx)
        q_BTNH = nn.with_logical_constraint(q_BTNH, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM))

        scale = 1.0 / math.sqrt(q_BTNH.shape[-1])
        logits_BNTS = (
            jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSNH, preferred_element_type=jnp.float32)
            * scale
        )
        bias_BNTS = site.bias(q_BTNH, k_BSNH, v_BSNH, logits_BNTS, ctx)
        if bias_BNTS is not None:
            logits_BNTS = logits_BNTS + bias_BNTS.astype(jnp.float32)
        weights_BNTS = site.normalize(logits_BNTS, ctx)
        self.sow("intermediates", "attention_weights", weights_BNTS)

        y_BTNH = jnp.einsum("BNTS,BSNH->BTNH", weights_BNTS.astype(v_BSNH.dtype), v_BSNH)
        y_BTNH = site.output(y_BTNH, ctx)
        carry = site.carry_after_attention(ctx.carry, weights_BNTS, ctx)
        y_BTD = self.out(y_BTNH)
        return nn.with_logical_constraint(y_BTD, (ax.BATCH, ax.LENGTH, ax.EMBED)), carry

    def carry_after_mlp(self, carry: Carry, attn_out_BTD: jax.Array, x_BTD: jax.Array) -> Carry:
        """Lets the block update the scheme's carry after its MLP (TAPE eq. 8)."""
        return self._site().carry_after_mlp(carry, attn_out_BTD, x_BTD)
