"""Multi-head causal self-attention: the one place where a position scheme meets attention.

Each site of the layer's :class:`~copejax.positions.base.AttentionSite` is called exactly once,
in this order: qk -> content logits -> bias -> normalizer -> weighted values -> output ->
carry. Logits, bias and normalisation are float32 whatever the compute dtype.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.model import logit_scaling, ring_decode
from copejax.model.attention_paths import (
    choose_impl,
    dot_product_attention,
    kernel_attention,
    ring_cache_applies,
)
from copejax.model.config import ModelConfig
from copejax.model.dense_init import contracted_size, kernel_init
from copejax.model.kernel_tape import kernel_operands, split_columns
from copejax.ops import engine, engine_blocks
from copejax.ops.kv_cache import KeyCache, RingCache
from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Carry,
    check_block_terms,
    masked_softmax_BNTS,
)
from copejax.positions.context import repeat_kv_heads
from copejax.runtime import sharding as ax


class Projection(nn.Module):
    """A multi-axis linear map by einsum, with an explicitly shaped, axis-named kernel.

    (Flax's DenseGeneral flattens its kernel at creation, which breaks a 3-axis sharding
    annotation under ``jax.set_mesh``; an explicit kernel keeps its logical axes.)
    """

    cfg: ModelConfig
    equation: str
    kernel_shape: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    use_bias: bool
    init_std: float | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        std = cfg.init_std if self.init_std is None else self.init_std
        fan_in = contracted_size(self.equation, self.kernel_shape)
        init = kernel_init(cfg.dense_init, std, fan_in)
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(init, self.kernel_axes),
            self.kernel_shape,
            jnp.float32,
        )
        y = jnp.einsum(self.equation, x.astype(cfg.compute_dtype), kernel.astype(cfg.compute_dtype))
        if self.use_bias:
            out_rank = len(self.equation.split("->")[1]) - 2  # output axes after B, T
            out_shape = y.shape[2:]
            bias = self.param(
                "bias",
                nn.with_logical_partitioning(nn.initializers.zeros, self.kernel_axes[-out_rank:]),
                out_shape,
                jnp.float32,
            )
            y = y + bias.astype(cfg.compute_dtype)
        return y


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
        heads, head_dim, use_bias = cfg.num_heads, cfg.resolved_head_dim, cfg.block == "gpt2"
        self.query = Projection(
            cfg,
            "BTD,DNH->BTNH",
            (cfg.d_model, heads, head_dim),
            (ax.EMBED, ax.HEADS, ax.HEAD_DIM),
            use_bias,
            name="query",
        )
        kv = functools.partial(
            Projection,
            cfg,
            "BTD,DKH->BTKH",
            (cfg.d_model, cfg.resolved_kv_heads, head_dim),
            (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
            use_bias,
        )
        self.key, self.value = kv(name="key"), kv(name="value")
        if cfg.attention_sink:  # GPT-OSS's sink logit per head; 0: exp(0) = 1 at the start
            self.sink_N = self.param(
                "attention_sink",
                nn.with_logical_partitioning(nn.initializers.zeros, (ax.HEADS,)),
                (heads,),
                jnp.float32,
            )
        if cfg.logit_scaling == "ssmax" and cfg.ssmax_learned:
            self.ssmax_s_N = self.param(
                "ssmax_scale",
                nn.with_logical_partitioning(
                    nn.initializers.constant(cfg.ssmax_scale), (ax.HEADS,)
                ),
                (heads,),
                jnp.float32,
            )
        self.out = Projection(
            cfg,
            "BTNH,NHD->BTD",
            (heads, head_dim, cfg.d_model),
            (ax.HEADS, ax.HEAD_DIM, ax.EMBED),
            use_bias,
            init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers),
            name="out",
        )
        own = cfg.scheme.layer_attention_module(cfg.dims, self.shared)
        if own is None and self.shared is None:
            own = AttentionSite(cfg.dims)  # a scheme without attention sites (nope)
        self.own_site = own
        self.key_cache = KeyCache(name="key_cache")  # used only in decode mode
        if ring_cache_applies(cfg):  # a window layer's decode cache (copejax.model.ring_decode)
            self.ring_cache = RingCache(cfg.window, cfg.window_sink_tokens, name="ring_cache")

    def _site(self) -> AttentionSite:
        return self.own_site if self.own_site is not None else self.shared

    def __call__(self, x_BTD: jax.Array, ctx: AttentionContext) -> tuple[jax.Array, Carry]:
        """Args: x_BTD the normalised layer input; ctx positions, segment ids and carry.

        Returns: the output y_BTD (compute dtype) and the updated carry.
        """
        y_BTNH, carry = self.attend(self.query(x_BTD), self.key(x_BTD), self.value(x_BTD), ctx)
        y_BTD = self.out(y_BTNH)
        return nn.with_logical_constraint(y_BTD, (ax.BATCH, ax.LENGTH, ax.EMBED)), carry

    def attend(
        self, q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, ctx: AttentionContext
    ) -> tuple[jax.Array, Carry]:
        """Everything between the projections: the sites, the attention path, the cache.

        Args: q_BTNH the projected queries; k_BSKH, v_BSKH the projected keys and values of
        the K key/value heads (the new tokens' when decoding); ctx as for ``__call__``.

        Returns: the per-head output y_BTNH (after the output site) and the updated carry.
        ``copejax.linen.PositionAttention`` and ``copejax.functional`` call it directly.
        """
        site = self._site()
        cfg = self.cfg
        sinks = cfg.window_sink_tokens if cfg.window is not None else 0
        ctx = ctx.replace(window=cfg.window, sink_tokens=sinks)
        if ctx.decode and ring_cache_applies(cfg):
            ring_decode.check_ring(cfg)
            q_BTNH, k_BSKH, v_BSKH, ctx = ring_decode.decode_ring(
                site, self.ring_cache, q_BTNH=q_BTNH, k_BTKH=k_BSKH, v_BTKH=v_BSKH, ctx=ctx
            )
        elif ctx.decode:
            q_BTNH, k_BSKH, v_BSKH, ctx = self._decode_qkv(site, q_BTNH, k_BSKH, v_BSKH, ctx)
        else:
            q_BTNH, k_BSKH, v_BSKH = site.qk(q_BTNH, k_BSKH, v_BSKH, ctx)
        q_BTNH = self._scale_queries(q_BTNH, ctx)
        q_BTNH = nn.with_logical_constraint(q_BTNH, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM))
        # Grouped-query attention: the sites after qk and the engine see N-head keys and
        # values (O(S) memory); the projections and the cache hold K heads.
        k_BSNH = repeat_kv_heads(k_BSKH, cfg.num_heads)
        v_BSNH = repeat_kv_heads(v_BSKH, cfg.num_heads)
        batch, length_q, heads = q_BTNH.shape[:3]
        impl = choose_impl(
            cfg,
            k_BSNH.shape[1],
            self.is_mutable_collection("intermediates"),
            pairs=batch * heads * length_q * k_BSNH.shape[1],
            decoding=ctx.decode,
        )
        block = cfg.attention_block_for(k_BSNH.shape[1])
        ctx = ctx.replace(impl=impl, block=block, scan_impl=cfg.scan_impl)
        extra_BSNC = site.mixed_values(ctx)
        if impl == "blockwise":
            y_BTNH, mixed_BTNC = self._blockwise(
                site, q_BTNH=q_BTNH, k_BSNH=k_BSNH, v_BSNH=v_BSNH, extra_BSNC=extra_BSNC, ctx=ctx
            )
        elif impl == "dot_product_attention":
            # copejax.model.checks allows this kernel only for schemes whose logits are
            # content plus a position-only bias; nothing needs the weights.
            y_BTNH = dot_product_attention(site, q_BTNH, k_BSNH, v_BSNH, ctx)
            mixed_BTNC = None
        elif impl == "kernel":  # validated: a scheme the fused kernels cover
            # TAPE's mixed positions ride as float32 value columns (copejax.model.kernel_tape)
            qkv = (q_BTNH, k_BSKH, v_BSKH)
            qkv = kernel_operands(qkv, v_BSNH, extra_BSNC, cfg.resolved_head_dim)
            kv = (k_BSNH, v_BSNH)
            y_BTNW = kernel_attention(cfg, site, qkv, kv, ctx, sink_N=self._sink())
            y_BTNH, mixed_BTNC = split_columns(y_BTNW, v_BSNH.shape[-1], extra_BSNC, v_BSNH.dtype)
        else:
            weights_BNTS = self._weights(site, q_BTNH, k_BSNH, v_BSNH, ctx)
            y_BTNH = jnp.einsum("BNTS,BSNH->BTNH", weights_BNTS.astype(v_BSNH.dtype), v_BSNH)
            mixed_BTNC = None
            if extra_BSNC is not None:
                mixed_BTNC = jnp.einsum(
                    "BNTS,BSNC->BTNC", weights_BNTS, extra_BSNC.astype(jnp.float32)
                )
        y_BTNH = site.output(y_BTNH, ctx)
        return y_BTNH, site.carry_after_attention(ctx.carry, mixed_BTNC, ctx)

    def _sink(self) -> jax.Array | None:
        return self.sink_N if self.cfg.attention_sink else None

    def _scale_queries(self, q_BTNH: jax.Array, ctx: AttentionContext) -> jax.Array:
        """``model.logit_scaling``: q times a per-query factor (``copejax.model.logit_scaling``)."""
        cfg = self.cfg
        if cfg.logit_scaling == "llama4":
            scale_BT = logit_scaling.llama4_scale_BT(
                ctx.q_positions_BT, cfg.llama4_floor_scale, cfg.llama4_attn_scale
            )
            return logit_scaling.scale_queries(q_BTNH, scale_BT[..., None])
        if cfg.logit_scaling == "ssmax":
            q_ids_BT, k_ids_BS = ctx.ids()
            n_BT = logit_scaling.keys_seen_BT(q_ids_BT, k_ids_BS, ctx.cache_index)
            if ctx.window is not None:  # the window's keys, and the sinks left behind it
                past_BT = jnp.maximum(n_BT - ctx.window, 0)
                n_BT = jnp.minimum(n_BT, ctx.window) + jnp.minimum(past_BT, ctx.sink_tokens)
            s_N = (
                self.ssmax_s_N
                if cfg.ssmax_learned
                else jnp.full((cfg.num_heads,), cfg.ssmax_scale, jnp.float32)
            )
            return logit_scaling.scale_queries(q_BTNH, logit_scaling.ssmax_scale_BTN(n_BT, s_N))
        return q_BTNH

    def _blockwise(
        self,
        site: AttentionSite,
        *,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        extra_BSNC: jax.Array | None,
        ctx: AttentionContext,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The blockwise engine: the site's block terms and normalizer, O(T) memory."""
        if ctx.explicit_mask_BTS is not None:
            raise ValueError(
                "the blockwise engine reads segment ids; an explicit mask is for naive-path "
                "unit tests (use attention_impl='naive')"
            )
        check_block_terms(site)
        width = v_BSNH.shape[-1]
        values_BSNW = v_BSNH
        if extra_BSNC is not None:  # TAPE's positions are mixed like extra value features
            values_BSNW = jnp.concatenate(
                [v_BSNH.astype(jnp.float32), extra_BSNC.astype(jnp.float32)], axis=-1
            )
        q_ids_BT, k_ids_BS = ctx.ids()
        y_BTNW, _ = engine.blockwise_attention(
            q_BTNH,
            k_BSNH,
            values_BSNW,
            q_positions_BT=ctx.q_positions_BT,
            k_positions_BS=ctx.k_positions_BS,
            q_segment_ids_BT=q_ids_BT,
            k_segment_ids_BS=k_ids_BS,
            offset=ctx.cache_index,
            terms=site.block_terms(q_BTNH, k_BSNH, v_BSNH, ctx),
            normalizer=site.block_normalizer(ctx) or engine_blocks.SOFTMAX,
            block=ctx.block,
            scan_impl=ctx.scan_impl,
            backward=self.cfg.attention_backward,
            window=ctx.window,
            sink_tokens=ctx.sink_tokens,
            k_index_BS=ctx.k_index_BS,
            k_rank_BS=ctx.key_ranks(),
            sink_N=self._sink(),
        )
        y_BTNH = y_BTNW[..., :width].astype(v_BSNH.dtype)
        return y_BTNH, (None if extra_BSNC is None else y_BTNW[..., width:])

    def _decode_qkv(
        self,
        site: AttentionSite,
        q_BTNH: jax.Array,
        k_BTNH: jax.Array,
        v_BTNH: jax.Array,
        ctx: AttentionContext,
    ) -> tuple[jax.Array, jax.Array, jax.Array, AttentionContext]:
        """Decode mode: the scheme's per-key state and the qk site's k, v go into the cache.

        Returns the new queries, the cached keys and values of every slot (B, S, K, H: the
        key/value heads, or N where the qk site made per-query-head keys, as TAPE does) and
        the context with ``key_state`` (the scheme's cached arrays, new tokens included).
        """
        ctx = ctx.replace(key_state=self.key_cache.read() or None)
        state = site.cache_state(k_BTNH, v_BTNH, ctx)
        ctx = ctx.replace(key_state=self.key_cache(state, ctx.cache_index) if state else None)
        qk_ctx = ctx.replace(k_positions_BS=ctx.q_positions_BT)  # qk sees the new keys only
        q_BTNH, k_BTNH, v_BTNH = site.qk(q_BTNH, k_BTNH, v_BTNH, qk_ctx)
        kv = self.key_cache({"key": k_BTNH, "value": v_BTNH}, ctx.cache_index)
        updates = site.cache_update(kv, ctx)  # read by later calls; this one attends to kv
        if updates:
            self.key_cache.replace(updates)
        return q_BTNH, kv["key"], kv["value"], ctx

    def _weights(
        self,
        site: AttentionSite,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        """The generic path: float32 content logits, the bias site, the normalizer site."""
        scale = 1.0 / math.sqrt(q_BTNH.shape[-1])
        logits_BNTS = (
            jnp.einsum("BTNH,BSNH->BNTS", q_BTNH, k_BSNH, preferred_element_type=jnp.float32)
            * scale
        )
        bias_BNTS = site.bias(q_BTNH, k_BSNH, v_BSNH, logits_BNTS, ctx)
        if bias_BNTS is not None:
            logits_BNTS = logits_BNTS + bias_BNTS.astype(jnp.float32)
        if self.cfg.attention_sink:  # validated: the scheme keeps the softmax
            weights_BNTS = masked_softmax_BNTS(logits_BNTS, ctx.mask_BTS, self._sink())
        else:
            weights_BNTS = site.normalize(logits_BNTS, ctx)
        self.sow("intermediates", "attention_weights", weights_BNTS)
        return weights_BNTS

    def carry_after_mlp(self, carry: Carry, attn_out_BTD: jax.Array, x_BTD: jax.Array) -> Carry:
        """Lets the block update the scheme's carry after its MLP (TAPE eq. 8)."""
        return self._site().carry_after_mlp(carry, attn_out_BTD, x_BTD)
