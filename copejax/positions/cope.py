"""Contextual Position Encoding, CoPE (Golovneva et al. 2024, arXiv 2405.18719).

Section 4 and Appendix B's listing: gates ``g_ij = sigmoid(q_i . k_j / sqrt(H))`` on the
allowed keys, contextual positions ``p_ij = sum_{k=j..i} g_ik`` capped at ``p_max - 1``, and
the position term ``z_i[p_ij]`` interpolated from ``z_i[p] = q_i . e[p]`` at integer p
(eq. 7-9), added to the content logits. The variants of sections 4-5 and Appendices C-D are
options; the pure functions live in ``copejax.ops.cope``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from copejax.ops import cope as cope_ops
from copejax.ops.cope_block import cope_block_term
from copejax.ops.engine_blocks import BlockTerm
from copejax.positions.alibi import alibi_slopes as press_slopes
from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Dims,
    PositionScheme,
    check_choice,
    masked_softmax_BNTS,
)
from copejax.positions.context import repeat_kv_heads
from copejax.positions.registry import register
from copejax.runtime import sharding as ax

GATES = ("keys", "sep_keys", "values")
POSITION_TERMS = ("interpolate", "alibi", "mlp")


class GateKey(nn.Module):
    """Sep-keys: the separate gate keys k'_j = W x_j (B, T, K, H) of CoPE's gates (Table 8),
    one per key/value head like the keys (K = N without grouped-query attention).

    The kernel keeps its 3-axis shape (D, N, H) and logical names: Flax's DenseGeneral
    reshapes a flattened kernel at creation, which breaks the 3-axis sharding annotation under
    ``jax.set_mesh`` (the training program's mesh).
    """

    d_model: int
    num_heads: int
    head_dim: int

    @nn.compact
    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        kernel_DNH = self.param(
            "kernel",
            nn.with_logical_partitioning(
                nn.initializers.normal(0.02), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM)
            ),
            (self.d_model, self.num_heads, self.head_dim),
            jnp.float32,
        )
        dtype = jnp.result_type(x_BTD.dtype, kernel_DNH.dtype)
        return jnp.einsum("BTD,DKH->BTKH", x_BTD.astype(dtype), kernel_DNH.astype(dtype))


@register
@dataclasses.dataclass(frozen=True)
class CoPE(PositionScheme):
    """CoPE with every variant of the paper as an option.

    Options:
      gates: what the gates are computed from, always scaled by 1 / sqrt(H) like the listing's
        logits. "keys" (default): the content logits q.k / sqrt(H) the attention computes
        (in ``cope+rope`` those of the rotated q and k). "sep_keys": a separate bias-free key
        projection k' = W x of the layer input (Section 4 "sep-keys"), gates
        sigmoid(q.k' / sqrt(H)); k' is not rotated in ``cope+rope``. "values": gates
        sigmoid(q.v / sqrt(H)) (Section 4 "val-gates").
        With RoPE (``cope+rope``) the bias site sees the rotated q: "keys" gates then read
        rotated q_i against rotated k_j, so they depend on content and i - j only; "sep_keys"
        and "values" pair the rotated q_i with an unrotated k'_j or v_j, so their gates also
        depend on the query's absolute position i (shifting every position changes them;
        ``tests/positions/test_cope.py::test_cope_plus_rope_gates_and_absolute_positions``).
        The paper does not combine these gates with RoPE. The position term ``q_i . e[p]``
        also reads the rotated q, so in ``cope+rope`` it depends on the absolute position of
        the query whatever the gates.
      p_max: number of integer positions; p_ij is capped at p_max - 1. The paper uses 64
        (default), 16 and T; None means T = the model's max_len.
      share_layers: one set of CoPE parameters for all layers. The paper's Wikitext-103
        baseline shares e across layers and Table 8's "Layers do not share embeddings" is the
        per-layer ablation; here per layer is the default (False). When shared, the whole CoPE
        site is shared: e, and the sep-keys projection, MLP or learned slopes if used. In a
        combination ("cope+rope") the model shares a site only when every part asks to.
      per_head_embeddings: one table e per head, shape (N, p_max, H), instead of the paper's
        default table shared by the heads, shape (p_max, H).
      position_term: "interpolate" (default, eq. 7-9, e initialised to zero as in the
        listing); "alibi" (eq. 10, ``m_h * p_ij``); "mlp" (CoPE-MLP, Appendix C,
        ``q_i . MLP(p_ij)``, see ``copejax.ops.cope.cope_mlp_term``).
      alibi_slopes: for "alibi". None (default): m is learned, one per head (and per layer
        unless shared), initialised at 0. "press": Press et al.'s slopes 2^(-8h/N) (Appendix
        D's CoPE_ALiBi), or a tuple of N positive slopes (Appendix C's fixed geometric sets,
        first slope m[0] = 1, 1/2^2 or 1/2^4 in Table 7). Fixed slopes
        are magnitudes applied as a penalty, ``m_h = -slope_h``, as ALiBi's ``-m (i - j)``
        does: a larger count of gated tokens lowers the logit.
      mlp_hidden: hidden units of CoPE-MLP (Appendix C's N; 64 in its Table 7). The MLP reads
        p_ij / p_max; one hidden GELU layer initialised as evenly spaced ramps (unit f starts
        at p = f p_max / N); a linear output to H, initialised to zero so that the term starts
        at zero like the listing's e.
      scale_position_term: divide the position term by sqrt(H) (default False, as in the
        listing, where only the content logits are scaled).
      force_unit_gates: every allowed gate is 1: p_ij = i - j + 1 and CoPE is relative PE with
        embeddings e[i - j + 1] (Section 4). For the identity test.

    The attention path (naive (B, N, T, S) gates and positions, or the blockwise engine with
    ``copejax.ops.cope_block``'s term) and the suffix-sum implementation are model options
    (``model.attention_impl``, ``model.scan_impl``). Sown intermediates (gates, positions,
    position attention) come from the naive path.
    """

    name = "cope"
    sites = ("bias",)
    cache_in_key_order = True
    walk_carry = True
    paper = "Golovneva et al. 2024, arXiv 2405.18719"

    gates: str = "keys"
    p_max: int | None = 64
    share_layers: bool = False
    per_head_embeddings: bool = False
    position_term: str = "interpolate"
    alibi_slopes: Any = None
    mlp_hidden: int = 64
    scale_position_term: bool = False
    force_unit_gates: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.alibi_slopes, list):  # keep the scheme hashable
            object.__setattr__(self, "alibi_slopes", tuple(self.alibi_slopes))

    @property
    def share_across_layers(self) -> bool:  # type: ignore[override]
        return self.share_layers

    def num_positions(self, dims: Dims) -> int:
        """P = p_max, or the model's context length when p_max is None."""
        return dims.max_len if self.p_max is None else self.p_max

    def validate(self, dims: Dims) -> None:
        check_choice(self.name, "gates", self.gates, GATES)
        check_choice(self.name, "position_term", self.position_term, POSITION_TERMS)
        if self.p_max is not None and (
            isinstance(self.p_max, bool) or not isinstance(self.p_max, int) or self.p_max <= 0
        ):
            raise ValueError(
                f"{self.name}: p_max must be a positive integer or None (= max_len), "
                f"got {self.p_max!r}"
            )
        if isinstance(self.mlp_hidden, bool) or not isinstance(self.mlp_hidden, int):
            raise ValueError(f"{self.name}: mlp_hidden must be an integer, got {self.mlp_hidden!r}")
        if self.mlp_hidden <= 0:
            raise ValueError(f"{self.name}: mlp_hidden must be > 0, got {self.mlp_hidden!r}")
        self.fixed_slopes(dims)

    def fixed_slopes(self, dims: Dims) -> np.ndarray | None:
        """The fixed ALiBi magnitudes (N,), or None when the slopes are learned."""
        slopes = self.alibi_slopes
        if slopes is None:
            return None
        if isinstance(slopes, str):
            check_choice(self.name, "alibi_slopes", slopes, ("press",))
            return press_slopes(dims.num_heads)
        values = np.asarray(slopes, dtype=np.float64)
        if values.shape != (dims.num_heads,) or not np.all(values > 0):
            raise ValueError(
                f"{self.name}: alibi_slopes must be None (learned), 'press' or "
                f"{dims.num_heads} positive numbers (one per head), got {slopes!r}"
            )
        return values

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _CoPESite(dims=dims, scheme=self, name=self.name)


def _ramp_bias_init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    return -jnp.arange(shape[0], dtype=dtype)


class _CoPESite(AttentionSite):
    scheme: CoPE = CoPE()

    def setup(self) -> None:
        s, d = self.scheme, self.dims
        num_pos = s.num_positions(d)
        zeros = nn.initializers.zeros
        if s.position_term == "interpolate":
            if s.per_head_embeddings:
                shape = (d.num_heads, num_pos, d.head_dim)
                axes = (ax.HEADS, ax.POSITIONS, ax.POS_EMBED)
            else:
                shape, axes = (num_pos, d.head_dim), (ax.POSITIONS, ax.POS_EMBED)
            self.pos_emb = self.param(
                "pos_emb", nn.with_logical_partitioning(zeros, axes), shape, jnp.float32
            )
        elif s.position_term == "alibi" and s.alibi_slopes is None:
            self.slopes = self.param(
                "alibi_slopes",
                nn.with_logical_partitioning(zeros, (ax.HEADS,)),
                (d.num_heads,),
                jnp.float32,
            )
        elif s.position_term == "mlp":
            hidden = s.mlp_hidden
            self.mlp_w_in = self.param(
                "mlp_w_in",
                nn.with_logical_partitioning(nn.initializers.constant(hidden), (ax.POS_MLP,)),
                (hidden,),
                jnp.float32,
            )
            self.mlp_b_in = self.param(
                "mlp_b_in",
                nn.with_logical_partitioning(_ramp_bias_init, (ax.POS_MLP,)),
                (hidden,),
                jnp.float32,
            )
            self.mlp_w_out = self.param(
                "mlp_w_out",
                nn.with_logical_partitioning(zeros, (ax.POS_MLP, ax.POS_EMBED)),
                (hidden, d.head_dim),
                jnp.float32,
            )
        if s.gates == "sep_keys":
            self.gate_key = GateKey(d.d_model, d.kv_heads, d.head_dim, name="gate_key")

    def cache_state(
        self, k_BTNH: jax.Array, v_BTNH: jax.Array, ctx: AttentionContext
    ) -> dict[str, jax.Array]:
        """Decode mode: the separate gate keys k' = W x of the new tokens (sep_keys only)."""
        if self.scheme.gates != "sep_keys":
            return {}
        return {"cope_sep_keys": self.gate_key(ctx.x_BTD)}

    def _sep_keys(self, ctx: AttentionContext) -> jax.Array:
        """The sep-keys gate keys (B, S, N, H): cached or projected K heads, each query head
        reading its group's (grouped-query attention)."""
        k_BSKH = ctx.key_state["cope_sep_keys"] if ctx.decode else self.gate_key(ctx.x_BTD)
        return repeat_kv_heads(k_BSKH, self.dims.num_heads)

    def _gate_logits(
        self,
        q_BTNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        if self.scheme.gates == "keys":
            return logits_BNTS
        if self.scheme.gates == "values":
            other_BSNH = v_BSNH
        else:
            other_BSNH = self._sep_keys(ctx)
        scores_BNTS = jnp.einsum(
            "BTNH,BSNH->BNTS",
            q_BTNH.astype(jnp.float32),
            other_BSNH.astype(jnp.float32),
        )
        return scores_BNTS / math.sqrt(q_BTNH.shape[-1])

    def _slopes_N(self) -> jax.Array:
        fixed = self.scheme.fixed_slopes(self.dims)
        return self.slopes if fixed is None else -jnp.asarray(fixed, jnp.float32)

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        """The CoPE term for the blockwise engine (``copejax.ops.cope_block``)."""
        s = self.scheme
        gate_k_BSNH = None
        if s.gates == "values":
            gate_k_BSNH = v_BSNH
        elif s.gates == "sep_keys":
            gate_k_BSNH = self._sep_keys(ctx)
        mlp_params = None
        if s.position_term == "mlp":
            mlp_params = (self.mlp_w_in, self.mlp_b_in, self.mlp_w_out)
        term = cope_block_term(
            p_max=s.num_positions(self.dims),
            position_term=s.position_term,
            pos_emb=self.pos_emb if s.position_term == "interpolate" else None,
            slopes_N=self._slopes_N() if s.position_term == "alibi" else None,
            mlp_params=mlp_params,
            mlp_input_scale=1.0 / s.num_positions(self.dims),
            gate_k_BSNH=gate_k_BSNH,
            force_unit_gates=s.force_unit_gates,
            scale_position_term=s.scale_position_term,
            scan_impl=ctx.scan_impl,
        )
        return (term,)

    def _position_term(self, q_BTNH: jax.Array, positions_BNTS: jax.Array) -> jax.Array:
        s = self.scheme
        if s.position_term == "interpolate":
            return cope_ops.cope_interpolated_term(q_BTNH, self.pos_emb, positions_BNTS)
        if s.position_term == "alibi":
            return cope_ops.cope_alibi_term(self._slopes_N(), positions_BNTS)
        return cope_ops.cope_mlp_term(
            q_BTNH,
            positions_BNTS,
            self.mlp_w_in,
            self.mlp_b_in,
            self.mlp_w_out,
            input_scale=1.0 / s.num_positions(self.dims),
        )

    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        """The CoPE term z_i[p_ij] (or its ALiBi / MLP variant), float32 (B, N, T, S).

        Sows ``gates_BNTS``, ``positions_BNTS`` (capped) and ``position_attention_BNTS`` (the
        softmax of the CoPE term alone over the allowed keys, the paper's Fig. 4) into the
        "intermediates" collection; the forward pass is the same whether they are kept or not.
        """
        s = self.scheme
        gate_logits_BNTS = self._gate_logits(q_BTNH, v_BSNH, logits_BNTS, ctx)
        gates_BNTS = cope_ops.cope_gates(gate_logits_BNTS, ctx.mask_BTS, s.force_unit_gates)
        positions_BNTS = cope_ops.cope_positions(
            gates_BNTS, s.num_positions(self.dims), ctx.scan_impl
        )
        term_BNTS = self._position_term(q_BTNH, positions_BNTS)
        if s.scale_position_term:
            term_BNTS = term_BNTS / math.sqrt(q_BTNH.shape[-1])
        if self.is_mutable_collection("intermediates"):
            self.sow("intermediates", "gates_BNTS", gates_BNTS)
            self.sow("intermediates", "positions_BNTS", positions_BNTS)
            self.sow(
                "intermediates",
                "position_attention_BNTS",
                masked_softmax_BNTS(term_BNTS, ctx.mask_BTS),
            )
        return term_BNTS
