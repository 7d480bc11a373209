"""PaTH attention: accumulated data-dependent Householder-like transforms (Yang et al. 2025,
arXiv 2505.16381).

Each token t has a transform ``H_t = I - beta_t w_t w_t^T`` per key/value head, with
``beta_t = 2 sigmoid(W_beta x_t + b_beta)`` in (0, 2) (an eigenvalue 1 - beta_t in (-1, 1)
along w_t) and ``w_t`` the L2-normalised output of a low-rank projection of the layer input
(D -> rank -> K H), a short causal depthwise convolution (kernel 3) and SiLU, as the authors'
code (fla-org/flash-linear-attention ``fla/layers/path_attn.py``, whose w and beta have
``num_kv_heads`` heads). With grouped key/value heads (K < N) the transforms act on the K key
heads: query head n reads key head n // (N / K) and that head's H_t (K = N: one per head).
The logits are

    A_ij = q_i^T (H_i H_{i-1} ... H_{j+1}) k_j / sqrt(H)        (j <= i; empty product at j = i)

They replace the content logits: the bias site returns ``A - q.k / sqrt(H)`` (the layer adds the
content logits back), so the generic layer, the composite machinery (``path+fox`` is
PaTH-FoX: FoX's forget-gate bias on top, the paper's section 3.3) and the blockwise engine need
no special path.

Since every H_s is symmetric, ``A_ij = (H_{j+1} ... H_i q_i)^T k_j``: walking keys from the
newest to the oldest, a query is transformed by each key's H after its logit is taken. The
naive path walks all S keys at once (:func:`path_logits_BNQK`). The engine's block term
(:mod:`copejax.ops.path_block`) carries the transformed queries from key block to older key
block, every block in the UT / WY form of its product (the paper's section 3.2), the blocks
holding queries too (as fla's intra-chunk part: matrix products, no walk over keys). O(T)
memory; the engine differentiates the walk (remat backward: the carry rules out the flash
backward).

Decoding follows the paper's rank-1 key updates: the cache keeps every key k_j transformed by
all H_u that arrived after it; a call with new tokens attends with those keys (the transforms
of older tokens count as identity, beta = 0) and then applies the new tokens' H to the cached
keys (``cache_update``), O(S K H) per new token: the cache holds the K key heads. Packed
documents: the convolution never reads across a segment start, and a product
H_i ... H_{j+1} is only used for j, i in one segment.

Shape letters: B batch, T queries, S keys, N heads, K key/value heads, H head dim, D model dim,
R rank, C conv.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.ops import segments
from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.path_block import path_pair, path_wy
from copejax.positions.base import AttentionContext, AttentionSite, Dims, PositionScheme
from copejax.positions.context import repeat_kv_heads
from copejax.positions.registry import register
from copejax.runtime import sharding as ax

L2_EPS = 1e-6  # w / sqrt(|w|^2 + eps), as fla's l2_norm


def path_w(
    u_BSNH: jax.Array, conv_CNH: jax.Array, starts_BS: jax.Array, slots_T: jax.Array
) -> jax.Array:
    """w at key slots ``slots_T``: causal depthwise conv of u over the slots of the same segment,
    SiLU, L2 normalisation per head. Returns (B, T, N, H) float32.

    ``u_BSNH`` is the low-rank projection of every slot, ``starts_BS`` marks segment starts;
    tap c reads slot ``t - c`` only if no segment starts in ``(t - c, t]`` and it exists.
    """
    u_BSNH = u_BSNH.astype(jnp.float32)
    total_BTNH = jnp.zeros((u_BSNH.shape[0], slots_T.shape[0], *u_BSNH.shape[2:]), jnp.float32)
    ok_BT = jnp.ones((u_BSNH.shape[0], slots_T.shape[0]), bool)
    for tap in range(conv_CNH.shape[0]):
        src_T = slots_T - tap
        if tap > 0:  # the slot after src must not start a segment
            ok_BT = ok_BT & (src_T >= 0)[None] & ~jnp.take(starts_BS, src_T + 1, axis=1)
        u_BTNH = jnp.take(u_BSNH, jnp.maximum(src_T, 0), axis=1)
        total_BTNH = total_BTNH + jnp.where(ok_BT[..., None, None], u_BTNH * conv_CNH[tap], 0.0)
    w_BTNH = jax.nn.silu(total_BTNH)
    return w_BTNH * jax.lax.rsqrt(jnp.sum(w_BTNH**2, axis=-1, keepdims=True) + L2_EPS)


def path_u_beta(
    x_BTD: jax.Array,
    w_down_DR: jax.Array,
    w_up_RKH: jax.Array,
    beta_w_DK: jax.Array,
    beta_b_K: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """The low-rank projection u = x W_down W_up (B, T, K, H) that the convolution reads, and
    beta = 2 sigmoid(x W_beta + b) (B, T, K), float32."""
    x_BTD = x_BTD.astype(jnp.float32)
    u_BTKH = jnp.einsum("BTD,DR,RKH->BTKH", x_BTD, w_down_DR, w_up_RKH)
    beta_BTK = 2.0 * jax.nn.sigmoid(jnp.einsum("BTD,DK->BTK", x_BTD, beta_w_DK) + beta_b_K)
    return u_BTKH, beta_BTK


def path_logits_BNQK(
    r_BQNH: jax.Array,
    k_BKNH: jax.Array,
    w_BKNH: jax.Array,
    beta_BKN: jax.Array,
    *,
    q_index_Q: jax.Array,
    k_index_K: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Unscaled PaTH logits of one block of keys, walked from the newest key to the oldest.

    ``r_BQNH`` are the queries transformed by the H of every newer key already walked
    (``H_{e} ... H_i q_i`` for keys e > this block's). At key s the logit is ``r_i . k_s``;
    then r_i <- H_s r_i where s <= i (the product H_i ... H_{s+1} needs H_s for older keys).
    Returns (logits (B, N, Q, K) float32, r after the block's oldest key).
    """
    f32 = jnp.float32

    def step(r_BQNH: jax.Array, key: tuple) -> tuple[jax.Array, jax.Array]:
        k_BNH, w_BNH, beta_BN, s = key
        logit_BNQ = jnp.einsum("BQNH,BNH->BNQ", r_BQNH, k_BNH)
        proj_BQN = jnp.einsum("BQNH,BNH->BQN", r_BQNH, w_BNH)
        live_Q11 = (s <= q_index_Q)[:, None, None]
        update_BQNH = (beta_BN[:, None] * proj_BQN)[..., None] * w_BNH[:, None]
        return r_BQNH - jnp.where(live_Q11, update_BQNH, 0.0), logit_BNQ

    keys = (
        jnp.moveaxis(k_BKNH.astype(f32), 1, 0)[::-1],
        jnp.moveaxis(w_BKNH.astype(f32), 1, 0)[::-1],
        jnp.moveaxis(beta_BKN.astype(f32), 1, 0)[::-1],
        k_index_K[::-1],
    )
    r_BQNH, logits_KBNQ = jax.lax.scan(step, r_BQNH.astype(f32), keys)
    return jnp.moveaxis(logits_KBNQ[::-1], 0, -1), r_BQNH


@register
@dataclasses.dataclass(frozen=True)
class PaTH(PositionScheme):
    """PaTH: logits through the accumulated Householder-like transforms of the tokens between
    query and key. PaTH-FoX (the forget gate on top) is the composite ``path+fox``.

    Options:
      rank: width R of the low-rank projection of the input that gives w (fla: 32).
      conv_size: kernel of the short causal convolution over w (fla: 3; 1: no convolution
        beyond a per-channel scale).
    """

    name = "path"
    sites = ("bias",)
    cache_in_key_order = True
    grouped_kv = True  # w and beta per key/value head (fla's layer); the sites repeat them
    window_sinks = False  # the product from a sink to a query spans unwalked key blocks
    paper = "Yang et al. 2025, arXiv 2505.16381"
    walk_carry = True
    # Each key block's UT transform is a (C, C) matrix per head, kept with its gradient: at
    # T = 16384 (B x N = 8) one layer's XLA buffers are 1.92 GiB with blocks of 256 and 1.39
    # GiB with 128, for 8 % more time at T = 4096 (side-by-side, 3 rounds, CPU otherwise idle).
    max_engine_block = 128

    rank: int = 32
    conv_size: int = 3

    def validate(self, dims: Dims) -> None:
        for key in ("rank", "conv_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {key} must be an integer >= 1, got {value!r}")

    def ring_decode_refusal(self, dims: Dims, window: int) -> str | None:
        if window < self.conv_size - 1:  # a new key's w reads the u of C - 1 keys before it
            return (
                f"its short convolution (conv_size={self.conv_size}) reads the last "
                f"{self.conv_size - 1} keys, more than the ring keeps; use window >= "
                f"{self.conv_size - 1}"
            )
        return None

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _PaTHSite(dims=dims, scheme=self, name=self.name)


def _uniform_conv_init(
    key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32
) -> jax.Array:
    bound = 1.0 / math.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class _PaTHSite(AttentionSite):
    scheme: PaTH = PaTH()

    def setup(self) -> None:
        s, d, n, h = self.scheme, self.dims.d_model, self.dims.kv_heads, self.dims.head_dim
        lecun = nn.initializers.lecun_normal()
        self.w_down = self.param(
            "w_down", nn.with_logical_partitioning(lecun, (ax.EMBED, None)), (d, s.rank)
        )
        self.w_up = self.param(
            "w_up",
            nn.with_logical_partitioning(
                nn.initializers.variance_scaling(
                    1.0, "fan_in", "normal", in_axis=0, out_axis=(1, 2)
                ),
                (None, ax.KV_HEADS, ax.HEAD_DIM),
            ),
            (s.rank, n, h),
        )
        # Tap c multiplies the token c steps back; U(-1/sqrt(C), 1/sqrt(C)) as PyTorch's
        # default for a depthwise Conv1d (fla's ShortConvolution).
        self.conv = self.param(
            "w_conv",
            nn.with_logical_partitioning(_uniform_conv_init, (None, ax.KV_HEADS, ax.HEAD_DIM)),
            (s.conv_size, n, h),
        )
        self.beta_w = self.param(
            "beta_w", nn.with_logical_partitioning(lecun, (ax.EMBED, ax.KV_HEADS)), (d, n)
        )
        self.beta_b = self.param(
            "beta_b", nn.with_logical_partitioning(nn.initializers.zeros, (ax.KV_HEADS,)), (n,)
        )

    def _u_beta(self, x_BTD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Low-rank projection u (B, T, K, H) and beta = 2 sigmoid(.) (B, T, K), float32."""
        return path_u_beta(x_BTD, self.w_down, self.w_up, self.beta_w, self.beta_b)

    def cache_state(
        self, k_BTKH: jax.Array, v_BTKH: jax.Array, ctx: AttentionContext
    ) -> dict[str, jax.Array]:
        """Per key and key/value head: u (for later tokens' convolution), w and beta."""
        u_BTKH, beta_BTK = self._u_beta(ctx.x_BTD)
        batch, length = ctx.k_positions_BS.shape
        if ctx.key_state is not None and "path_u" in ctx.key_state:
            old_BSKH = ctx.key_state["path_u"]
        else:
            old_BSKH = jnp.zeros((batch, length, *u_BTKH.shape[2:]), jnp.float32)
        u_BSKH = jax.lax.dynamic_update_slice_in_dim(old_BSKH, u_BTKH, ctx.cache_index, axis=1)
        _, ids_BS = ctx.ids()
        slots_T = ctx.cache_index + jnp.arange(u_BTKH.shape[1])
        w_BTKH = path_w(u_BSKH, self.conv, segments.segment_starts_BT(ids_BS), slots_T)
        return {"path_u": u_BTKH, "path_w": w_BTKH, "path_beta": beta_BTK}

    def _w_beta(self, ctx: AttentionContext) -> tuple[jax.Array, jax.Array]:
        """(w (B, S, N, H), beta (B, S, N)) of the keys, each key/value head's repeated to its
        query heads. Decoding: the cached ones, with beta = 0 before this call's first token
        (the cached keys already carry those transforms)."""
        if ctx.decode:
            slots_S = jnp.arange(ctx.k_positions_BS.shape[1])
            fresh_1S1 = (slots_S >= ctx.cache_index)[None, :, None]
            w_BSKH = ctx.key_state["path_w"]
            beta_BSK = jnp.where(fresh_1S1, ctx.key_state["path_beta"], 0.0)
        else:
            starts_BS = segments.segment_starts_BT(ctx.segment_ids_BT)

            def fresh(x_BTD: jax.Array, *params: jax.Array) -> tuple[jax.Array, jax.Array]:
                u_BSKH, beta_BSK = path_u_beta(x_BTD, *params[:2], *params[3:])
                slots_S = jnp.arange(u_BSKH.shape[1])
                return path_w(u_BSKH, params[2], starts_BS, slots_S), beta_BSK

            # rematerialised: the projection, convolution and normalisation kept several
            # float32 (B, S, K, H) residuals
            params = (self.w_down, self.w_up, self.conv, self.beta_w, self.beta_b)
            w_BSKH, beta_BSK = jax.checkpoint(fresh)(ctx.x_BTD, *params)
        heads = self.dims.num_heads
        return repeat_kv_heads(w_BSKH, heads), repeat_kv_heads(beta_BSK[..., None], heads)[..., 0]

    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        w_BSNH, beta_BSN = self._w_beta(ctx)
        self.sow("intermediates", "path_beta", beta_BSN)
        path_BNTS, _ = path_logits_BNQK(
            q_BTNH,
            k_BSNH,
            w_BSNH,
            beta_BSN,
            q_index_Q=ctx.cache_index + jnp.arange(q_BTNH.shape[1]),
            k_index_K=jnp.arange(k_BSNH.shape[1]),
        )
        path_BNTS = path_BNTS / math.sqrt(q_BTNH.shape[-1])
        return jnp.where(ctx.mask_BTS[:, None], path_BNTS - logits_BNTS, 0.0)

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        """One term with a walk carry: the queries transformed by the newer key blocks (its
        ``k_arrays`` also hold beta, which the fused kernels' chunks read:
        :mod:`copejax.model.kernel_path`)."""
        w_BSNH, beta_BSN = self._w_beta(ctx)
        width = q_BTNH.shape[-1]
        t_BSNK, kp_BSNH = path_wy(k_BSNH, w_BSNH, beta_BSN, min(ctx.block, k_BSNH.shape[1]))

        def init(batch: int, heads: int, size: int) -> jax.Array:
            return jnp.zeros((batch, size, heads, width), jnp.float32)

        return (
            BlockTerm(
                path_pair,
                k_arrays={"w": w_BSNH, "t": t_BSNK, "k_suffix": kp_BSNH, "beta": beta_BSN},
                init=init,
            ),
        )

    def cache_update(self, cached: dict[str, jax.Array], ctx: AttentionContext) -> dict[str, Any]:
        """The paper's decode: each new token u's H_u is applied to every cached key before it,
        k_s <- H_u k_s for s < u, in order of u (rank-1 updates, O(S K H) per token). The cache
        holds the K key/value heads' keys, and w, beta are per key/value head."""
        k_BSNH = cached["key"]  # K heads (N where a qk site made per-query-head keys: TAPE)
        w_BSNH = repeat_kv_heads(ctx.key_state["path_w"], k_BSNH.shape[2])
        beta_BSN = repeat_kv_heads(ctx.key_state["path_beta"][..., None], k_BSNH.shape[2])[..., 0]
        slots_S = jnp.arange(k_BSNH.shape[1])

        def step(k_BSNH: jax.Array, t: jax.Array) -> tuple[jax.Array, None]:
            u = ctx.cache_index + t
            w_BNH = jnp.take(w_BSNH, u, axis=1)
            beta_BN = jnp.take(beta_BSN, u, axis=1)
            proj_BSN = jnp.einsum("BSNH,BNH->BSN", k_BSNH, w_BNH)
            update_BSNH = (beta_BN[:, None] * proj_BSN)[..., None] * w_BNH[:, None]
            return k_BSNH - jnp.where((slots_S < u)[None, :, None, None], update_BSNH, 0.0), None

        new_tokens = ctx.q_positions_BT.shape[1]
        k_BSNH, _ = jax.lax.scan(step, k_BSNH.astype(jnp.float32), jnp.arange(new_tokens))
        return {"key": k_BSNH.astype(cached["key"].dtype)}
