"""Forgetting Transformer, FoX (Lin et al. 2025, arXiv 2503.02130): softmax with a forget gate.

A per-head scalar forget gate ``f_t = sigmoid(w_f . x_t + b_f)`` from the layer input turns
into the additive logit bias ``D_ij = sum_{l=j+1..i} log f_l`` (``D_ii = 0``), so that
``O = softmax(Q K^T / sqrt(H) + D) V`` (paper eq. 4-6). No other position encoding.
``D`` is a difference of prefix sums of ``log f`` in float32; the prefix sums restart at every
packed-segment start, so no gate of one document reaches another, and entries that the mask
forbids are exactly 0.

The "Pro" block of the paper (section 3) is five options here, all on in :data:`PRO_OPTIONS`
(the authors' ``pro_*.yaml`` configs of zhixuan-lin/forgetting-transformer set the same five):
``output_gate`` (``y * sigmoid(W_o x)`` per head and feature), ``output_norm`` (RMSNorm of each
head's attention output over its H features, a learnable scale per head and feature initialised
to 1, eps 1e-6, applied before the output gate, as the authors' ``FusedGroupNormGated`` does),
``qk_norm`` (RMSNorm of q and k per head with a learnable scale per head and feature), and
data-dependent token shift of keys and/or values (``key_shift``, ``value_shift``),
``k_t <- a_t k_t + (1 - a_t) k_{t-1}`` with ``a_t = sigmoid(w . x_t)`` per head.
Order in the qk site: token shift, then QK-norm (as the paper's reference code does); order at
the output site: output norm, then output gate, then the output projection. The maths (gates,
prefix sums, decay bias, token shift, norms, :func:`~copejax.ops.fox_core.fox_output`) is in
:mod:`copejax.ops.fox_core`; this module is the scheme and its Linen site.
Token shift restarts at packed-segment starts, read off ``AttentionContext.segment_ids_BT``
(never off the (B, T, T) mask, so the blockwise path stays O(T) in memory); in decode mode it
keeps only each row's last raw k / v (:class:`PreviousToken`), not one per cache slot.

Initialisation: the seed notes say nothing about it. Weights are normal with std 0.02 and
the forget-gate bias is the constant ``forget_bias_init`` (default 0, so f is about 0.5 at
the start, which is what a zero bias with small weights gives, as in the authors' reference
code for the data-dependent gate); a larger value, e.g. 3 (f about 0.95), starts with a longer
memory.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.ops import scan
from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.fox_core import (
    decay_BNTS,
    fox_cached_cumsum,
    fox_log_forget_gates,
    fox_output,
    fox_pair,
    mix_previous,
    rms_norm_heads,
    token_shift,
)
from copejax.ops.kv_cache import CACHE
from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Dims,
    PositionScheme,
)
from copejax.positions.context import repeat_kv_heads
from copejax.positions.registry import register
from copejax.runtime import sharding as ax

GATE_INIT_STD = 0.02
# FoX Pro: the five components the authors' pro_*.yaml configs switch on.
PRO_OPTIONS = {
    "output_gate": True,
    "output_norm": True,
    "qk_norm": True,
    "key_shift": True,
    "value_shift": True,
}


class PreviousToken(nn.Module):
    """Decode mode: each row's last raw key (or value) so far, (B, 1, N, H), in the cache.

    Token shift needs only the token before the first new one, so FoX keeps one raw k / v per
    row instead of one per cache slot. Each call returns the stored token (zeros before the
    first call) and stores the last of the T new ones; calls must follow the cache's order.
    """

    @nn.compact
    def __call__(self, x_BTNH: jax.Array) -> jax.Array:
        batch, _, heads, head_dim = x_BTNH.shape
        last = self.variable(CACHE, "last", jnp.zeros, (batch, 1, heads, head_dim), x_BTNH.dtype)
        previous_B1NH = last.value
        last.value = x_BTNH[:, -1:].astype(last.value.dtype)
        return previous_B1NH


@register
@dataclasses.dataclass(frozen=True)
class FoX(PositionScheme):
    """Forgetting attention: a data-dependent forget-gate logit bias, optionally the Pro block.

    FoX Pro is ``output_gate``, ``output_norm``, ``qk_norm``, ``key_shift`` and ``value_shift``
    together (:data:`PRO_OPTIONS`); each can be switched on alone for ablations.

    Options:
      output_gate: multiply each head's output by sigmoid(W_o x) per feature (Pro).
      output_norm: RMSNorm of each head's output (learnable scale per head and feature, eps
        1e-6) before the output gate (Pro; the authors' ``use_output_norm``).
      qk_norm: RMSNorm of q and k per head with a learnable scale (Pro).
      key_shift: data-dependent token shift of the keys (Pro).
      value_shift: data-dependent token shift of the values (Pro).
      unit_forget_gate: force f = 1 (log f = 0): plain softmax attention (identity tests).
      forget_bias_init: initial value of the forget-gate bias b_f (0: f about 0.5).

    On the blockwise engine the bias is ``c_i - c_j`` from the prefix sums ``c`` of log f, an
    O(T N) array per layer (no walk carry: the flash backward applies). The path and the scan
    implementation are model options (``model.attention_impl``, ``model.scan_impl``).
    """

    name = "fox"
    sites = ("qk", "bias", "output")
    cache_in_key_order = True
    paper = "Lin et al. 2025, arXiv 2503.02130"

    output_gate: bool = False
    output_norm: bool = False
    qk_norm: bool = False
    key_shift: bool = False
    value_shift: bool = False
    unit_forget_gate: bool = False
    forget_bias_init: float = 0.0

    def validate(self, dims: Dims) -> None:
        for key in (
            "output_gate",
            "output_norm",
            "qk_norm",
            "key_shift",
            "value_shift",
            "unit_forget_gate",
        ):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ValueError(f"{self.name}: {key} must be True or False, got {value!r}")
        if not isinstance(self.forget_bias_init, int | float) or not math.isfinite(
            self.forget_bias_init
        ):
            raise ValueError(
                f"{self.name}: forget_bias_init must be a finite number, "
                f"got {self.forget_bias_init!r}"
            )

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _FoXSite(dims=dims, scheme=self, name=self.name)


def _param(
    module: nn.Module,
    name: str,
    init: nn.initializers.Initializer,
    axes: tuple[str, ...],
    shape: tuple[int, ...],
) -> jax.Array:
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


class _FoXSite(AttentionSite):
    scheme: FoX = FoX()

    def setup(self) -> None:
        s, d, n, h = self.scheme, self.dims.d_model, self.dims.num_heads, self.dims.head_dim
        # Key-side parameters act on the K key/value heads (grouped-query attention).
        kv = self.dims.kv_heads
        normal = nn.initializers.normal(GATE_INIT_STD)
        if not s.unit_forget_gate:
            self.forget_w = _param(self, "forget_w", normal, (ax.EMBED, ax.HEADS), (d, n))
            bias_init = nn.initializers.constant(s.forget_bias_init)
            self.forget_b = _param(self, "forget_b", bias_init, (ax.HEADS,), (n,))
        if s.key_shift:
            self.key_shift_w = _param(self, "key_shift_w", normal, (ax.EMBED, ax.KV_HEADS), (d, kv))
            self.previous_key = PreviousToken(name="previous_raw_key")  # decode mode only
        if s.value_shift:
            self.value_shift_w = _param(
                self, "value_shift_w", normal, (ax.EMBED, ax.KV_HEADS), (d, kv)
            )
            self.previous_value = PreviousToken(name="previous_raw_value")
        if s.qk_norm:
            ones = nn.initializers.ones
            self.q_scale = _param(self, "q_norm_scale", ones, (ax.HEADS, ax.HEAD_DIM), (n, h))
            self.k_scale = _param(self, "k_norm_scale", ones, (ax.KV_HEADS, ax.HEAD_DIM), (kv, h))
        if s.output_norm:
            ones = nn.initializers.ones
            self.output_norm_scale = _param(
                self, "output_norm_scale", ones, (ax.HEADS, ax.HEAD_DIM), (n, h)
            )
        if s.output_gate:
            self.output_w = _param(
                self, "output_gate_w", normal, (ax.EMBED, ax.HEADS, ax.HEAD_DIM), (d, n, h)
            )

    def _sigmoid_gate(self, x_BTD: jax.Array, w_DK: jax.Array, heads: int) -> jax.Array:
        """Token shift's gate per key/value head, repeated to ``heads`` when the keys reach
        this site per query head (after TAPE's qk in a composite): the same shift."""
        a_BTK = jax.nn.sigmoid(jnp.einsum("BTD,DK->BTK", x_BTD.astype(jnp.float32), w_DK))
        return repeat_kv_heads(a_BTK[..., None], heads)[..., 0]

    def _log_forget_gates(self, x_BTD: jax.Array) -> jax.Array:
        if self.scheme.unit_forget_gate:
            # log f = 0 through the same scan and masking: D = 0, plain softmax attention.
            return jnp.zeros((*x_BTD.shape[:2], self.dims.num_heads), jnp.float32)
        return fox_log_forget_gates(x_BTD, self.forget_w, self.forget_b)

    def cache_state(
        self, k_BTNH: jax.Array, v_BTNH: jax.Array, ctx: AttentionContext
    ) -> dict[str, jax.Array]:
        """Per key: the prefix sum ``c`` of log forget gates (token shift keeps its own state)."""
        starts_BT = ctx.segment_starts_BT()
        previous_BN = None
        if ctx.key_state is not None and "fox_cumsum" in ctx.key_state:
            previous_BN = jnp.take(
                ctx.key_state["fox_cumsum"], jnp.maximum(ctx.cache_index - 1, 0), axis=1
            )
        logf_BTN = self._log_forget_gates(ctx.x_BTD)
        c_BTN = fox_cached_cumsum(logf_BTN, starts_BT, previous_BN, ctx.scan_impl)
        return {"fox_cumsum": c_BTN}

    def _shift_cached(
        self, x_BTNH: jax.Array, previous: PreviousToken, w_DN: jax.Array, ctx: AttentionContext
    ) -> jax.Array:
        """Token shift of new tokens whose previous token may be the cached last one (decode)."""
        previous_B1NH = previous(x_BTNH).astype(jnp.float32)
        x32_BTNH = x_BTNH.astype(jnp.float32)
        prev_BTNH = jnp.concatenate([previous_B1NH, x32_BTNH[:, :-1]], axis=1)
        starts_BT11 = ctx.segment_starts_BT()[:, :, None, None]
        prev_BTNH = jnp.where(starts_BT11, 0.0, prev_BTNH)
        return mix_previous(x_BTNH, prev_BTNH, self._sigmoid_gate(ctx.x_BTD, w_DN, x_BTNH.shape[2]))

    def qk(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        s = self.scheme
        if ctx.decode:  # the previous token's raw k / v may be the cached last one
            if s.key_shift:
                k_BSNH = self._shift_cached(k_BSNH, self.previous_key, self.key_shift_w, ctx)
            if s.value_shift:
                v_BSNH = self._shift_cached(v_BSNH, self.previous_value, self.value_shift_w, ctx)
        else:
            if s.key_shift:
                a_BSN = self._sigmoid_gate(ctx.x_BTD, self.key_shift_w, k_BSNH.shape[2])
                k_BSNH = token_shift(k_BSNH, a_BSN, ctx.segment_ids_BT)
            if s.value_shift:
                a_BSN = self._sigmoid_gate(ctx.x_BTD, self.value_shift_w, v_BSNH.shape[2])
                v_BSNH = token_shift(v_BSNH, a_BSN, ctx.segment_ids_BT)
        if s.qk_norm:
            q_BTNH = rms_norm_heads(q_BTNH, self.q_scale)
            groups = k_BSNH.shape[2] // self.k_scale.shape[0]
            k_BSNH = rms_norm_heads(k_BSNH, jnp.repeat(self.k_scale, groups, axis=0))
        return q_BTNH, k_BSNH, v_BSNH

    def _prefix_sums(
        self, ctx: AttentionContext, logf_BTN: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """(c of the queries (B, T, N), c of the keys (B, S, N)): D_ij = c_i - c_j.

        ``logf_BTN``: the layer's log forget gates when the caller has them already.
        """
        if ctx.decode:  # query t is key cache_index + t
            c_BSN = ctx.key_state["fox_cumsum"]
            keys_T = ctx.cache_index + jnp.arange(ctx.x_BTD.shape[1])
            return jnp.take(c_BSN, keys_T, axis=1), c_BSN
        if logf_BTN is None:
            logf_BTN = self._log_forget_gates(ctx.x_BTD)
        starts_BT1 = ctx.segment_starts_BT()[:, :, None]
        c_BTN = scan.segment_cumsum(logf_BTN, starts_BT1, axis=1, impl=ctx.scan_impl)
        return c_BTN, c_BTN

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        """D_ij = c_i - c_j per pair from the prefix sums (no walk carry)."""
        c_BTN, c_BSN = self._prefix_sums(ctx)
        return (BlockTerm(fox_pair, q_arrays={"c": c_BTN}, k_arrays={"c": c_BSN}),)

    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array | None:
        logf_BTN = self._log_forget_gates(ctx.x_BTD)
        self.sow("intermediates", "log_forget_gates", logf_BTN)
        # D_ts = c of query t (key cache_index + t when decoding) minus c of key s; the
        # segment starts come from the context's ids, as on the blockwise engine.
        c_BTN, c_BSN = self._prefix_sums(ctx, logf_BTN)
        return jnp.where(ctx.mask_BTS[:, None], decay_BNTS(c_BTN, c_BSN), 0.0)

    def output(self, y_BTNH: jax.Array, ctx: AttentionContext) -> jax.Array:
        s = self.scheme
        if not (s.output_gate or s.output_norm):
            return y_BTNH
        return fox_output(
            y_BTNH,
            ctx.x_BTD,
            self.output_norm_scale if s.output_norm else None,
            self.output_w if s.output_gate else None,
        )
