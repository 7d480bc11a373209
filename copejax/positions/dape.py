"""DAPE: data-adaptive positional encoding (Zheng et al. 2024, arXiv 2405.14722).

The attention logits become ``A + B + f(A, B)``, where ``A`` are the content logits
``q . k / sqrt(H)`` of the N heads, ``B`` a static relative bias (Kerple or ALiBi) and ``f`` a
small MLP applied to every (query, key) pair separately (the paper's section 3): its input is
the concatenation ``[A_ij (N heads), B_ij (N heads)]`` (2N values), one hidden layer of width
``D_DAPE`` (32 by default) with a LeakyReLU, and N outputs, one per head. The exact form was
read from the authors' GPT-NeoX code (``ParallelKerpleLog_C``, ``AliBi_C`` in
chuanyang-Zheng/DAPE): the residual ``A + B`` beside ``f``, the input order (content, then
bias), ``nn.Linear`` layers with biases, ``nn.LeakyReLU()`` (slope 0.01), and the unmasked
scaled logits as input (the causal mask comes afterwards, so a pair's term never depends on
another pair). This module does the same; its initialisation follows PyTorch's ``nn.Linear``
(uniform in +-1/sqrt(fan_in) for weights and biases).

Because ``f`` reads the content logits, no fused kernel can take the bias precomputed
(``jax.nn.dot_product_attention`` is refused by ``copejax.model.checks``); the blockwise engine
evaluates it per (query block, key block) pair from ``PairBlock.logits_BNQK``. The naive path
holds the MLP's (B, T, S, D_DAPE) hidden activations: XLA's memory analysis of the layer's
gradient (CPU, B = 1, D = 128, N = 4, T = 4096) gives 10.5 GiB of temporaries naive and
60 MiB on the engine (blocks of 256), so long sequences belong on the engine ("auto" picks it
from 512 keys).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.ops.engine_blocks import BlockTerm, PairBlock
from copejax.positions.alibi import alibi_bias, alibi_slopes
from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Dims,
    PositionScheme,
    check_choice,
)
from copejax.positions.kerple import Kerple, kerple_bias
from copejax.positions.registry import register
from copejax.runtime import sharding as ax

STATIC_BIASES = ("kerple", "alibi")


def dape_mlp(
    logits_BNTS: jax.Array,
    static_BNTS: jax.Array,
    mlp: dict[str, jax.Array],
    negative_slope: float,
) -> jax.Array:
    """f(A, B): the per-pair MLP over the 2N concatenated logits, N outputs.

    Args:
      logits_BNTS: content logits A (float32), unmasked.
      static_BNTS: the static bias B, broadcastable to A's shape.
      mlp: ``w_in`` (2N, W), ``b_in`` (W,), ``w_out`` (W, N), ``b_out`` (N,).
      negative_slope: the LeakyReLU's slope for negative inputs.

    Returns:
      term_BNTS, float32.
    """
    heads = logits_BNTS.shape[1]
    static_BNTS = jnp.broadcast_to(static_BNTS.astype(jnp.float32), logits_BNTS.shape)
    w_in = mlp["w_in"].astype(jnp.float32)
    hidden_BTSW = (
        jnp.einsum("BNTS,NW->BTSW", logits_BNTS.astype(jnp.float32), w_in[:heads])
        + jnp.einsum("BNTS,NW->BTSW", static_BNTS, w_in[heads:])
        + mlp["b_in"].astype(jnp.float32)
    )
    hidden_BTSW = jax.nn.leaky_relu(hidden_BTSW, negative_slope)
    out_BNTS = jnp.einsum("BTSW,WN->BNTS", hidden_BTSW, mlp["w_out"].astype(jnp.float32))
    return out_BNTS + mlp["b_out"].astype(jnp.float32)[None, :, None, None]


@register
@dataclasses.dataclass(frozen=True)
class DAPE(PositionScheme):
    """DAPE: a static bias B plus a per-pair MLP of the content logits and B, ``B + f(A, B)``.

    Options:
      static_bias: "kerple" (default; the paper's main DAPE-Kerple, the log kernel
        ``-r1 log(1 + r2 |i - j|)`` with learnable r1, r2 per head, parametrised as in
        ``copejax.positions.kerple``) or "alibi" (Press et al.'s fixed slopes).
      hidden: the MLP's hidden width D_DAPE (32 in the paper).
      negative_slope: the LeakyReLU's slope (PyTorch's default 0.01, as the authors use).
      r1_init, r2_init: initial Kerple parameters (ignored for "alibi").
    """

    name = "dape"
    sites = ("bias",)
    paper = "Zheng et al. 2024, arXiv 2405.14722"

    static_bias: str = "kerple"
    hidden: int = 32
    negative_slope: float = 0.01
    r1_init: float = 1.0
    r2_init: float = 1.0

    def validate(self, dims: Dims) -> None:
        check_choice(self.name, "static_bias", self.static_bias, STATIC_BIASES)
        if isinstance(self.hidden, bool) or not isinstance(self.hidden, int) or self.hidden <= 0:
            raise ValueError(f"{self.name}: hidden must be a positive integer, got {self.hidden!r}")
        slope = self.negative_slope
        if isinstance(slope, bool) or not isinstance(slope, int | float) or not 0 <= slope < 1:
            raise ValueError(f"{self.name}: negative_slope must be in [0, 1), got {slope!r}")
        if self.static_bias == "kerple":
            self.kerple().validate(dims)
        else:
            alibi_slopes(dims.num_heads)

    def kerple(self) -> Kerple:
        """The log-kernel Kerple whose parametrisation the static bias uses."""
        return Kerple(variant="log", r1_init=self.r1_init, r2_init=self.r2_init)

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _DAPESite(dims=dims, scheme=self, name=self.name)


def _torch_linear_init(fan_in: int) -> nn.initializers.Initializer:
    """PyTorch's nn.Linear initialisation: uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)]."""
    bound = 1.0 / math.sqrt(fan_in)

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class _DAPESite(AttentionSite):
    scheme: DAPE = DAPE()

    def setup(self) -> None:
        s, heads = self.scheme, self.dims.num_heads
        width = s.hidden

        def param(name: str, fan_in: int, axes: tuple[str, ...], shape: tuple[int, ...]):
            init = nn.with_logical_partitioning(_torch_linear_init(fan_in), axes)
            return self.param(name, init, shape, jnp.float32)

        self.w_in = param("mlp_w_in", 2 * heads, (ax.HEADS, ax.POS_MLP), (2 * heads, width))
        self.b_in = param("mlp_b_in", 2 * heads, (ax.POS_MLP,), (width,))
        self.w_out = param("mlp_w_out", width, (ax.POS_MLP, ax.HEADS), (width, heads))
        self.b_out = param("mlp_b_out", width, (ax.HEADS,), (heads,))
        if s.static_bias == "kerple":
            raw1, raw2 = s.kerple().raw_init()

            def constant(name: str, value: float) -> jax.Array:
                init = nn.with_logical_partitioning(nn.initializers.constant(value), (ax.HEADS,))
                return self.param(name, init, (heads,), jnp.float32)

            self.r1_raw = constant("r1_raw", raw1)
            self.r2_raw = constant("r2_raw", raw2)

    def _params(self) -> dict[str, Any]:
        mlp = {"w_in": self.w_in, "b_in": self.b_in, "w_out": self.w_out, "b_out": self.b_out}
        if self.scheme.static_bias == "kerple":
            return {"mlp": mlp, "kerple_raw": (self.r1_raw, self.r2_raw)}
        return {"mlp": mlp}

    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        bias_BNTS = _dape_term(
            self._params(),
            logits_BNTS,
            ctx.q_positions_BT,
            ctx.k_positions_BS,
            scheme=self.scheme,
            heads=self.dims.num_heads,
        )
        return jnp.where(ctx.mask_BTS[:, None], bias_BNTS, 0.0)

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        pair = functools.partial(_dape_pair, scheme=self.scheme, heads=self.dims.num_heads)
        return (BlockTerm(pair, params=self._params()),)


def _static_BNTS(
    params: dict[str, Any],
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    *,
    scheme: DAPE,
    heads: int,
) -> jax.Array:
    if scheme.static_bias == "kerple":
        r1_N, r2_N = scheme.kerple().positive(*params["kerple_raw"])
        return kerple_bias(q_positions_BT, k_positions_BS, r1_N, r2_N, "log")
    return alibi_bias(q_positions_BT, k_positions_BS, alibi_slopes(heads))


def _dape_term(
    params: dict[str, Any],
    logits_BNTS: jax.Array,
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    *,
    scheme: DAPE,
    heads: int,
) -> jax.Array:
    """B + f(A, B), unmasked (the attention adds A)."""
    static_BNTS = _static_BNTS(params, q_positions_BT, k_positions_BS, scheme=scheme, heads=heads)
    term_BNTS = dape_mlp(logits_BNTS, static_BNTS, params["mlp"], scheme.negative_slope)
    return static_BNTS + term_BNTS


def _dape_pair(
    params: dict[str, Any],
    pair: PairBlock,
    prepared: None,
    carry: Any,
    *,
    scheme: DAPE,
    heads: int,
) -> tuple[jax.Array, Any]:
    bias_BNQK = _dape_term(
        params,
        pair.logits_BNQK,
        pair.q_positions_BQ,
        pair.k_positions_BK,
        scheme=scheme,
        heads=heads,
    )
    return bias_BNQK, carry
