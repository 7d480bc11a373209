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

from copejax import sharding as ax
from copejax.kv_cache import KeyCache
from copejax.model_config import ModelConfig
from copejax.ops import engine
from copejax.positions.base import AttentionContext, AttentionSite, Carry, check_block_terms

# "auto" goes blockwise from this many keys on (self-attention: T = S; decoding: cache slots).
# Side-by-side probes on a 2-core CPU had the engine at or below the naive path from T = 256
# for nope, CoPE and FoX (causal block skipping halves the work); 512 keeps short task
# sequences on the simpler path.
AUTO_BLOCKWISE_FROM = 512


def choose_impl(cfg: ModelConfig, length_k: int, sowing: bool, backend: str | None = None) -> str:
    """The attention path of one call from ``model.attention_impl``.

    "auto": the naive path while intermediates (attention maps, gates) are being sown; on a
    GPU in bfloat16, ``jax.nn.dot_product_attention`` (cuDNN's fused kernel) for the schemes
    it can express (``ModelConfig.dot_product_attention_allowed``); otherwise the naive path
    below ``AUTO_BLOCKWISE_FROM`` keys (faster there on CPU, measured by
    ``experiments/bench.py``) and the blockwise engine from it on, decoding steps included
    (a step then reads the cache block by block).
    """
    impl = cfg.attention_impl
    if impl != "auto":
        return impl
    if sowing:
        return "naive"
    backend = jax.default_backend() if backend is None else backend
    if backend == "gpu" and cfg.dtype == "bfloat16" and cfg.dot_product_attention_allowed():
        return "dot_product_attention"
    return "naive" if length_k < AUTO_BLOCKWISE_FROM else "blockwise"


def dot_product_attention(
    site: AttentionSite,
    q_BTNH: jax.Array,
    k_BSNH: jax.Array,
    v_BSNH: jax.Array,
    ctx: AttentionContext,
) -> jax.Array:
    """``jax.nn.dot_product_attention`` with the scheme's position-only bias (ALiBi, T5,
    Kerple, FIRE), evaluated once over the whole (T, S) grid from the same block terms the
    engine uses; cuDNN on GPU for 16-bit inputs, XLA's implementation elsewhere."""
    bias_BNTS = None
    terms = site.block_terms(q_BTNH, k_BSNH, v_BSNH, ctx)
    if terms:
        pair = engine.PairBlock(
            q_BQNH=q_BTNH,
            k_BKNH=k_BSNH,
            q_positions_BQ=ctx.q_positions_BT,
            k_positions_BK=ctx.k_positions_BS,
            allowed_BQK=ctx.mask_BTS,
            logits_BNQK=None,
            q_arrays={},
            k_arrays={},
            q_start=jnp.asarray(ctx.cache_index),
            k_start=jnp.asarray(0),
        )
        bias_BNTS = sum(term.bias(term.params, pair, None, None)[0] for term in terms)
    fused = jax.default_backend() == "gpu" and q_BTNH.dtype in (jnp.bfloat16, jnp.float16)
    if fused and bias_BNTS is not None:  # cuDNN takes the inputs' dtype; XLA adds float32
        bias_BNTS = bias_BNTS.astype(q_BTNH.dtype)
    return jax.nn.dot_product_attention(
        q_BTNH,
        k_BSNH,
        v_BSNH,
        bias=bias_BNTS,
        mask=ctx.mask_BTS[:, None, :, :],
        implementation="cudnn" if fused else None,
    )


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
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(nn.initializers.normal(std), self.kernel_axes),
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
        qkv = functools.partial(
            Projection,
            cfg,
            "BTD,DNH->BTNH",
            (cfg.d_model, heads, head_dim),
            (ax.EMBED, ax.HEADS, ax.HEAD_DIM),
            use_bias,
        )
        self.query, self.key, self.value = qkv(name="query"), qkv(name="key"), qkv(name="value")
        self.out = Projection(
            cfg,
            "BTNH,NHD->BTD",
            (heads, head_dim, cfg.d_model),
            (ax.HEADS, ax.HEAD_DIM, ax.EMBED),
            use_bias,
            init_std=cfg.init_std / math.sqrt(2 * cfg.num_layers),
            name="out",
        )
        own = cfg.scheme().layer_attention_module(cfg.dims, self.shared)
        if own is None and self.shared is None:
            own = AttentionSite(cfg.dims)  # a scheme without attention sites (nope)
        self.own_site = own
        self.key_cache = KeyCache(name="key_cache")  # used only in decode mode

    def _site(self) -> AttentionSite:
        return self.own_site if self.own_site is not None else self.shared

    def __call__(self, x_BTD: jax.Array, ctx: AttentionContext) -> tuple[jax.Array, Carry]:
        """Args: x_BTD the normalised layer input; ctx positions, segment ids and carry.

        Returns: the output y_BTD (compute dtype) and the updated carry.
        """
        site = self._site()
        q_BTNH = self.query(x_BTD)
        k_BSNH = self.key(x_BTD)
        v_BSNH = self.value(x_BTD)
        if ctx.decode:
            q_BTNH, k_BSNH, v_BSNH, ctx = self._decode_qkv(site, q_BTNH, k_BSNH, v_BSNH, ctx)
        else:
            q_BTNH, k_BSNH, v_BSNH = site.qk(q_BTNH, k_BSNH, v_BSNH, ctx)
        q_BTNH = nn.with_logical_constraint(q_BTNH, (ax.BATCH, ax.LENGTH, ax.HEADS, ax.HEAD_DIM))
        cfg = self.cfg
        impl = choose_impl(cfg, k_BSNH.shape[1], self.is_mutable_collection("intermediates"))
        block = cfg.attention_block_for(k_BSNH.shape[1])
        ctx = ctx.replace(impl=impl, block=block, scan_impl=cfg.scan_impl)
        extra_BSNC = site.mixed_values(ctx)
        if impl == "blockwise":
            y_BTNH, mixed_BTNC = self._blockwise(
                site, q_BTNH=q_BTNH, k_BSNH=k_BSNH, v_BSNH=v_BSNH, extra_BSNC=extra_BSNC, ctx=ctx
            )
        elif impl == "dot_product_attention":
            # ModelConfig.validate allows this kernel only for schemes whose logits are
            # content plus a position-only bias; nothing needs the weights.
            y_BTNH = dot_product_attention(site, q_BTNH, k_BSNH, v_BSNH, ctx)
            mixed_BTNC = None
        else:
            weights_BNTS = self._weights(site, q_BTNH, k_BSNH, v_BSNH, ctx)
            y_BTNH = jnp.einsum("BNTS,BSNH->BTNH", weights_BNTS.astype(v_BSNH.dtype), v_BSNH)
            mixed_BTNC = None
            if extra_BSNC is not None:
                mixed_BTNC = jnp.einsum(
                    "BNTS,BSNC->BTNC", weights_BNTS, extra_BSNC.astype(jnp.float32)
                )
        y_BTNH = site.output(y_BTNH, ctx)
        carry = site.carry_after_attention(ctx.carry, mixed_BTNC, ctx)
        y_BTD = self.out(y_BTNH)
        return nn.with_logical_constraint(y_BTD, (ax.BATCH, ax.LENGTH, ax.EMBED)), carry

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
            normalizer=site.block_normalizer(ctx) or engine.SOFTMAX,
            block=ctx.block,
            scan_impl=ctx.scan_impl,
            backward=self.cfg.attention_backward,
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

        Returns the new queries, the cached keys and values of every slot (B, S, N, H) and the
        context with ``key_state`` (the scheme's cached arrays, new tokens included).
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
        weights_BNTS = site.normalize(logits_BNTS, ctx)
        self.sow("intermediates", "attention_weights", weights_BNTS)
        return weights_BNTS

    def carry_after_mlp(self, carry: Carry, attn_out_BTD: jax.Array, x_BTD: jax.Array) -> Carry:
        """Lets the block update the scheme's carry after its MLP (TAPE eq. 8)."""
        return self._site().carry_after_mlp(carry, attn_out_BTD, x_BTD)
