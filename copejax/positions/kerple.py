"""KERPLE: kernelized relative positional embedding (Chi et al. 2022, arXiv 2205.09921).

Two conditionally positive definite kernels turned into logit biases (the TAPE paper, seed 004,
section 2.2, writes them the same way):

- "log":   ``b(i, j) = -r1 log(1 + r2 |i - j|)``
- "power": ``b(i, j) = -r1 |i - j|^r2``, with r2 in (0, 2]

r1 and r2 are learnable per head and positive. Positivity: ``r = softplus(raw)`` for r1 and for
the log variant's r2; the power variant's ``r2 = 2 sigmoid(raw)`` keeps it inside (0, 2).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from copejax.ops.engine_blocks import BlockTerm, PairBlock
from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Dims,
    PositionScheme,
    check_choice,
    check_positive,
)
from copejax.positions.registry import register
from copejax.runtime import sharding as ax

VARIANTS = ("log", "power")


def kerple_bias(
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    r1_N: jax.Array,
    r2_N: jax.Array,
    variant: str,
) -> jax.Array:
    """The KERPLE bias for positive r1, r2 (one per head).

    Args:
      q_positions_BT, k_positions_BS: positions i and j.
      r1_N, r2_N: the kernel parameters.
      variant: "log" or "power".

    Returns:
      bias_BNTS, float32 (finite with finite gradients for every pair, so it can be masked).
    """
    distance_BTS = jnp.abs(
        q_positions_BT[:, :, None].astype(jnp.float32)
        - k_positions_BS[:, None, :].astype(jnp.float32)
    )
    distance_B1TS = distance_BTS[:, None]
    r1_1N11 = r1_N.astype(jnp.float32)[None, :, None, None]
    r2_1N11 = r2_N.astype(jnp.float32)[None, :, None, None]
    if variant == "log":
        return -r1_1N11 * jnp.log1p(r2_1N11 * distance_B1TS)
    if variant == "power":
        # d^r2 as exp(r2 log d) on d >= 1 and 0 at d = 0: avoids 0 * log(0) in the r2 gradient.
        safe_log_B1TS = jnp.log(jnp.maximum(distance_B1TS, 1.0))
        powered_BNTS = jnp.where(distance_B1TS > 0, jnp.exp(r2_1N11 * safe_log_B1TS), 0.0)
        return -r1_1N11 * powered_BNTS
    raise ValueError(f"kerple: variant must be one of {VARIANTS}, got {variant!r}")


def _inverse_softplus(x: float) -> float:
    return float(np.log(np.expm1(x)))


@register
@dataclasses.dataclass(frozen=True)
class Kerple(PositionScheme):
    """KERPLE log or power kernel bias with learnable positive r1, r2 per head.

    Options:
      variant: "log" (-r1 log(1 + r2 |i-j|)) or "power" (-r1 |i-j|^r2).
      r1_init: initial r1 of every head, > 0.
      r2_init: initial r2 of every head, > 0 (and < 2 for "power").
    """

    name = "kerple"
    sites = ("bias",)
    position_only_bias = True
    paper = "Chi et al. 2022, arXiv 2205.09921"

    variant: str = "log"
    r1_init: float = 1.0
    r2_init: float = 1.0

    def validate(self, dims: Dims) -> None:
        check_choice(self.name, "variant", self.variant, VARIANTS)
        check_positive(self.name, r1_init=self.r1_init, r2_init=self.r2_init)
        if self.variant == "power" and not self.r2_init < 2:
            raise ValueError(
                f"{self.name}: r2_init must be in (0, 2) for the power variant "
                f"(r2 = 2 sigmoid(raw)), got {self.r2_init!r}"
            )

    def positive(self, raw1_N: jax.Array, raw2_N: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(r1, r2) from the raw parameters: softplus, and 2 sigmoid for the power r2."""
        r2_N = 2.0 * jax.nn.sigmoid(raw2_N) if self.variant == "power" else jax.nn.softplus(raw2_N)
        return jax.nn.softplus(raw1_N), r2_N

    def raw_init(self) -> tuple[float, float]:
        """Raw parameter values that map to (r1_init, r2_init)."""
        if self.variant == "power":
            half = self.r2_init / 2
            raw2 = float(np.log(half / (1 - half)))
        else:
            raw2 = _inverse_softplus(self.r2_init)
        return _inverse_softplus(self.r1_init), raw2

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _KerpleSite(dims=dims, scheme=self, name=self.name)


class _KerpleSite(AttentionSite):
    scheme: Kerple = Kerple()

    def setup(self) -> None:
        raw1, raw2 = self.scheme.raw_init()
        shape = (self.dims.num_heads,)

        def param(name: str, value: float) -> jax.Array:
            init = nn.initializers.constant(value)
            return self.param(
                name, nn.with_logical_partitioning(init, (ax.HEADS,)), shape, jnp.float32
            )

        self.raw1_N = param("r1_raw", raw1)
        self.raw2_N = param("r2_raw", raw2)

    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        r1_N, r2_N = self.scheme.positive(self.raw1_N, self.raw2_N)
        bias_BNTS = kerple_bias(
            ctx.q_positions_BT, ctx.k_positions_BS, r1_N, r2_N, self.scheme.variant
        )
        return jnp.where(ctx.mask_BTS[:, None], bias_BNTS, 0.0)

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        bias = functools.partial(_kerple_pair, scheme=self.scheme)
        return (BlockTerm(bias, params=(self.raw1_N, self.raw2_N), position_only=True),)


def _kerple_pair(
    raw: tuple[jax.Array, jax.Array], pair: PairBlock, prepared: None, carry: Any, *, scheme: Kerple
) -> tuple[jax.Array, Any]:
    r1_N, r2_N = scheme.positive(*raw)
    bias_BNQK = kerple_bias(pair.q_positions_BQ, pair.k_positions_BK, r1_N, r2_N, scheme.variant)
    return bias_BNQK, carry
