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
the output site: output norm, then output gate (:func:`fox_output`), then the output projection.
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
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax import segments
from copejax import sharding as ax
from copejax.kv_cache import CACHE
from copejax.ops import scan
from copejax.ops.engine import BlockTerm, PairBlock
from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Dims,
    PositionScheme,
)
from copejax.positions.context import repeat_kv_heads
from copejax.positions.registry import register

GATE_INIT_STD = 0.02
QK_NORM_EPS = 1e-6
OUTPUT_NORM_EPS = 1e-6  # the authors' norm_eps (configs/model/forgetting_transformer.py)
# FoX Pro: the five components the authors' pro_*.yaml configs switch on.
PRO_OPTIONS = {
    "output_gate": True,
    "output_norm": True,
    "qk_norm": True,
    "key_shift": True,
    "value_shift": True,
}


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
    return _mix(x_BTNH, prev_BTNH, a_BTN)


def _mix(x_BTNH: jax.Array, prev_BTNH: jax.Array, a_BTN: jax.Array) -> jax.Array:
    """a_t x_t + (1 - a_t) prev_t in float32, cast back to the dtype of ``x_BTNH``."""
    a_BTN1 = a_BTN.astype(jnp.float32)[..., None]
    mixed_BTNH = a_BTN1 * x_BTNH.astype(jnp.float32) + (1.0 - a_BTN1) * prev_BTNH
    return mixed_BTNH.astype(x_BTNH.dtype)


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
        return _FoXSite(dims=dims, scheme=self)


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
        return _mix(x_BTNH, prev_BTNH, self._sigmoid_gate(ctx.x_BTD, w_DN, x_BTNH.shape[2]))

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
        return (BlockTerm(_fox_pair, q_arrays={"c": c_BTN}, k_arrays={"c": c_BSN}),)

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
        return jnp.where(ctx.mask_BTS[:, None], _decay(c_BTN, c_BSN), 0.0)

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


def _decay(c_BTN: jax.Array, c_BSN: jax.Array) -> jax.Array:
    """c_i - c_j for every (query, key) pair: (B, N, T, S)."""
    return jnp.moveaxis(c_BTN, 2, 1)[..., :, None] - jnp.moveaxis(c_BSN, 2, 1)[..., None, :]


def _fox_pair(params: None, pair: PairBlock, prepared: None, carry: Any) -> tuple[jax.Array, Any]:
    return _decay(pair.q_arrays["c"], pair.k_arrays["c"]), carry
