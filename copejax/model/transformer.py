"""Decoder-only transformer LM with a pluggable position scheme.

Llama-style blocks by default (pre-RMSNorm, SwiGLU, no biases; Touvron et al. 2023,
arXiv 2302.13971); GPT-2 style blocks (pre-LayerNorm, GELU, biases; Radford et al. 2019) as the
CoPE paper's language-modelling runs use. Positions are always passed in.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.model import ring_decode
from copejax.model.attention import Attention
from copejax.model.config import ModelConfig
from copejax.model.dense_init import kernel_init
from copejax.ops.kv_cache import DecodeCursor
from copejax.positions.base import AttentionContext, Carry, EmbedOutput
from copejax.runtime import sharding as ax


def _norm(cfg: ModelConfig, name: str) -> nn.Module:
    if cfg.block == "gpt2":
        return nn.LayerNorm(
            epsilon=cfg.norm_eps,
            dtype=cfg.compute_dtype,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones, (ax.EMBED,)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (ax.EMBED,)),
            name=name,
        )
    return nn.RMSNorm(
        epsilon=cfg.norm_eps,
        dtype=cfg.compute_dtype,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, (ax.EMBED,)),
        name=name,
    )


class Mlp(nn.Module):
    """SwiGLU (llama) or GELU (gpt2) feed-forward layer."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        cfg = self.cfg
        gpt2 = cfg.block == "gpt2"

        def dense(features: int, axes: tuple[str, str], std: float, name: str) -> nn.Module:
            fan_in = cfg.d_model if axes[0] == ax.EMBED else hidden
            init = kernel_init(cfg.dense_init, std, fan_in)
            return nn.Dense(
                features,
                use_bias=gpt2,
                dtype=cfg.compute_dtype,
                kernel_init=nn.with_logical_partitioning(init, axes),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]),
                name=name,
            )

        hidden, std = cfg.resolved_mlp_dim, cfg.init_std
        out_std = std / (2 * cfg.num_layers) ** 0.5
        if gpt2:
            h_BTF = nn.gelu(dense(hidden, (ax.EMBED, ax.MLP), std, "wi")(x_BTD))
        else:
            gate_BTF = dense(hidden, (ax.EMBED, ax.MLP), std, "wi_gate")(x_BTD)
            up_BTF = dense(hidden, (ax.EMBED, ax.MLP), std, "wi_up")(x_BTD)
            h_BTF = nn.silu(gate_BTF) * up_BTF
        h_BTF = nn.with_logical_constraint(h_BTF, (ax.BATCH, ax.LENGTH, ax.MLP))
        return dense(cfg.d_model, (ax.MLP, ax.EMBED), out_std, "wo")(h_BTF)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    cfg: ModelConfig
    shared: Any = None

    @nn.compact
    def __call__(self, x_BTD: jax.Array, ctx: AttentionContext) -> tuple[jax.Array, Carry]:
        cfg = self.cfg
        drop = nn.Dropout(cfg.dropout, deterministic=ctx.deterministic)
        attention = Attention(cfg, shared=self.shared, name="attention")
        h_BTD = _norm(cfg, "attention_norm")(x_BTD)
        attn_out_BTD, carry = attention(h_BTD, ctx.replace(x_BTD=h_BTD))
        x_BTD = x_BTD + drop(attn_out_BTD)
        x_BTD = x_BTD + drop(Mlp(cfg, name="mlp")(_norm(cfg, "mlp_norm")(x_BTD)))
        carry = attention.carry_after_mlp(carry, attn_out_BTD, x_BTD)
        return nn.with_logical_constraint(x_BTD, (ax.BATCH, ax.LENGTH, ax.EMBED)), carry


class Transformer(nn.Module):
    """Decoder-only LM.

    Call with ``tokens_BT`` (int), ``positions_BT`` (int, per document when packed) and
    optionally ``segment_ids_BT`` (packed documents attend only within their segment).
    Training passes ``deterministic=False`` and the rngs ``dropout`` and ``positions``.
    Returns float32 logits of shape (B, T, V).

    Incremental decoding: ``decode=True`` with variables ``{"params": ..., "cache": ...}``
    (``copejax.model.decode.init_cache``) and ``mutable=["cache"]``; each call appends its T tokens
    to the cache (T > 1 a prefill, T = 1 a step) and returns their logits, equal to those of
    the full forward pass over the whole sequence.
    """

    cfg: ModelConfig

    def setup(self) -> None:
        cfg = self.cfg
        scheme = cfg.scheme
        self.token_embed = nn.Embed(
            cfg.vocab_size,
            scheme.token_dim(cfg.d_model),
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(cfg.init_std), (ax.VOCAB, ax.EMBED)
            ),
            name="token_embed",
        )
        self.position_embed = scheme.embed_module(cfg.dims)
        # Modules shared by every layer (T5's table, CoPE with share_layers) are owned here;
        # with a layer_pattern each layer builds its own (copejax.model.layouts refuses sharing).
        self.shared_positions = (
            None if cfg.resolved_pattern() else scheme.shared_attention_module(cfg.dims)
        )
        self.blocks = [
            Block(cfg.for_layer(i), shared=self.shared_positions, name=f"block_{i}")
            for i in range(cfg.num_layers)
        ]
        self.final_norm = _norm(cfg, "final_norm")
        if not cfg.tie_embeddings:
            self.lm_head = nn.Dense(
                cfg.vocab_size,
                use_bias=False,
                kernel_init=nn.with_logical_partitioning(
                    kernel_init(cfg.dense_init, cfg.init_std, cfg.d_model), (ax.EMBED, ax.VOCAB)
                ),
                name="lm_head",
            )
        self.dropout = nn.Dropout(cfg.dropout)
        self.decode_cursor = DecodeCursor(  # used only in decode mode
            unbounded=ring_decode.unbounded_decode(cfg), name="decode_cursor"
        )

    def embed(
        self, tokens_BT: jax.Array, positions_BT: jax.Array, deterministic: bool
    ) -> EmbedOutput:
        """Token embeddings plus the embed site: (x_BTD, positions_BT, carry)."""
        x_BTD = self.token_embed(tokens_BT)
        if self.cfg.scale_embeddings:
            x_BTD = x_BTD * jnp.sqrt(jnp.float32(self.token_embed.features))
        x_BTD = x_BTD.astype(self.cfg.compute_dtype)
        if self.position_embed is None:
            out = EmbedOutput(x_BTD=x_BTD, positions_BT=positions_BT)
        else:
            out = self.position_embed(x_BTD, positions_BT, deterministic)
        x_BTD = self.dropout(out.x_BTD.astype(self.cfg.compute_dtype), deterministic)
        return out.replace(x_BTD=x_BTD)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array,
        segment_ids_BT: jax.Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
    ) -> jax.Array:
        if positions_BT.shape != tokens_BT.shape:
            raise ValueError(
                f"positions_BT shape {positions_BT.shape} must equal tokens_BT shape "
                f"{tokens_BT.shape}"
            )
        emb = self.embed(tokens_BT, positions_BT, deterministic)
        return self.forward_embedded(emb, segment_ids_BT, deterministic, decode)

    def forward_embedded(
        self,
        emb: EmbedOutput,
        segment_ids_BT: jax.Array | None = None,
        deterministic: bool = True,
        decode: bool = False,
    ) -> jax.Array:
        """The blocks and the output layer, from :meth:`embed`'s output (logits_BTV, float32).

        Separate from ``__call__`` so that tests can differentiate with respect to x_BTD.
        """
        cfg = self.cfg
        x_BTD = nn.with_logical_constraint(emb.x_BTD, (ax.BATCH, ax.LENGTH, ax.EMBED))
        ctx = AttentionContext.create(
            x_BTD, emb.positions_BT, segment_ids_BT, carry=emb.carry, deterministic=deterministic
        )
        if decode:
            view = self.decode_cursor(emb.positions_BT, ctx.q_segment_ids_BT)
            for layer_cfg in {cfg.for_layer(i) for i in range(cfg.num_layers)} | {cfg}:
                layer_cfg.scheme.check_decode(layer_cfg.dims, view.positions_BS.shape[1])
            ctx = ctx.replace(
                k_positions_BS=view.positions_BS,
                k_segment_ids_BS=view.segment_ids_BS,
                decode=True,
                cache_index=view.index,
            )
        for block in self.blocks:
            x_BTD, carry = block(x_BTD, ctx)
            ctx = ctx.replace(carry=carry)
        x_BTD = self.final_norm(x_BTD)
        if cfg.tie_embeddings:
            # With a concatenative scheme the token embedding is narrower than D: the tied
            # output layer reads the token part of the representation.
            token_dim = self.token_embed.features
            logits_BTV = self.token_embed.attend(x_BTD[..., :token_dim].astype(jnp.float32))
        else:
            logits_BTV = self.lm_head(x_BTD.astype(jnp.float32))
        logits_BTV = logits_BTV.astype(jnp.float32)
        if decode:  # writes past the cache's slots are clamped: make them visibly invalid
            logits_BTV = jnp.where(view.fits, logits_BTV, jnp.nan)
        return nn.with_logical_constraint(logits_BTV, (ax.BATCH, ax.LENGTH, ax.VOCAB))
