"""The blockwise engine's logit terms as public constructors, and the protocol they follow.

The O(T) engine (:func:`copejax.ops.engine.blockwise_attention`, re-exported here) never
holds a (T, S) array: it walks (query block, key block) pairs and adds each *block term*'s
bias for the pair to the scaled content logits before an online softmax (or stick-breaking).
A term is a :class:`BlockTerm`:

``bias(params, pair, prepared, carry) -> (bias_BNQK, carry)``
    the float32 logit term of one pair, shape (B, N, Q, K). ``pair`` is a
    :class:`PairBlock`: the blocks' queries ``q_BQNH`` and keys ``k_BKNH`` (after the qk
    transform), their integer positions ``q_positions_BQ`` / ``k_positions_BK``, the allowed
    pairs ``allowed_BQK`` (causal, same document; the engine masks the scores, so the bias may
    be anything finite elsewhere), the content logits ``logits_BNQK``, the term's own
    per-token arrays cut to the two blocks (``q_arrays``, ``k_arrays``) and the key indices of
    the blocks' first query and key (``q_start``, ``k_start``).
``params``
    arrays the bias reads whole (slopes, tables, MLP weights); differentiable.
``q_arrays`` / ``k_arrays``
    per-token float arrays (B, T, ...) / (B, S, ...) the engine cuts into blocks (FoX's prefix
    sums, CoPE's gate keys). Everything array-valued that ``bias`` reads must come through
    ``params``, ``q_arrays``, ``k_arrays`` or ``prepared``, never a closure, so that the flash
    backward differentiates it.
``prepare(params, q_BQNH, q_arrays) -> prepared``
    optional, once per query block (CoPE's ``q . e`` for every integer position).
``init(B, N, Q) -> carry``, ``advance``, ``retreat``, ``settled``
    optional, for a term that counts across key blocks (walked newest first): CoPE's count of
    the newer blocks' gates. See :class:`BlockTerm`'s docstring.
``position_only``
    the bias reads positions and params only (ALiBi, T5, Kerple, FIRE): fused kernels may take
    it as a precomputed bias.

Constructors (one per scheme a user composes by hand; every registered scheme's site builds
its own in ``AttentionSite.block_terms``):

- :func:`alibi` (Press et al. 2022, arXiv 2108.12409): ``-m_h (i - j)``;
- :func:`cope` (Golovneva et al. 2024, arXiv 2405.18719): gates, counts carried across key
  blocks, interpolated position embeddings;
- :func:`fox` (Lin et al. 2025, arXiv 2503.02130): ``c_i - c_j`` from the prefix sums of the
  log forget gates, the same input as ``copejax.functional.fox_bias``.

    y_BTNH, _ = terms.blockwise_attention(q, k, v, terms=[terms.alibi(num_heads=4)])

Shape letters: B batch, T queries, S keys, N heads, H head dim, Q / K query / key block, P
positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.ops import scan, segments
from copejax.ops.cope_block import cope_block_term
from copejax.ops.engine import blockwise_attention
from copejax.ops.engine_blocks import SOFTMAX, BlockTerm, Normalizer, PairBlock
from copejax.ops.fox_core import fox_pair
from copejax.positions.alibi import alibi_bias, alibi_slopes

__all__ = [
    "SOFTMAX",
    "BlockTerm",
    "Normalizer",
    "PairBlock",
    "alibi",
    "alibi_pair",
    "blockwise_attention",
    "cope",
    "fox",
    "fox_pair",
]


def alibi_pair(
    slopes_N: jax.Array, pair: PairBlock, prepared: None, carry: None
) -> tuple[jax.Array, None]:
    """ALiBi's bias for one pair: ``-m_h (i - j)`` from the blocks' positions, (B, N, Q, K)."""
    return alibi_bias(pair.q_positions_BQ, pair.k_positions_BK, slopes_N), carry


def alibi(num_heads: int | None = None, *, slopes_N: jax.Array | None = None) -> BlockTerm:
    """ALiBi's term: the paper's slopes for ``num_heads`` heads, or the given ``slopes_N``
    (a parameter of the term, so they may be learned)."""
    if slopes_N is None:
        if num_heads is None:
            raise ValueError("terms.alibi: pass num_heads (the paper's slopes) or slopes_N")
        slopes_N = alibi_slopes(num_heads)
    return BlockTerm(alibi_pair, params=jnp.asarray(slopes_N, jnp.float32), position_only=True)


def cope(
    pos_emb: jax.Array,
    *,
    gate_k_BSNH: jax.Array | None = None,
    force_unit_gates: bool = False,
    scan_impl: str = "auto",
) -> BlockTerm:
    """CoPE's term with interpolated position embeddings (eq. 3-9), p_max = P.

    Args:
      pos_emb: e, (P, H) shared by the heads or (N, P, H); differentiable.
      gate_k_BSNH: the keys the gates read (CoPE's sep-keys or values); None: the content
        logits, the paper's default.
      force_unit_gates: every visible gate 1 (relative positions).
      scan_impl: the within-block suffix sum (``copejax.ops.scan``).

    Returns:
      the term; its carry is the count of the newer key blocks' gates (B, N, Q).
    """
    return cope_block_term(
        p_max=pos_emb.shape[-2],
        pos_emb=pos_emb,
        gate_k_BSNH=gate_k_BSNH,
        force_unit_gates=force_unit_gates,
        scan_impl=scan_impl,
    )


def fox(
    logf_BTN: jax.Array, segment_ids_BT: jax.Array | None = None, scan_impl: str = "auto"
) -> BlockTerm:
    """FoX's decay term for causal self-attention (S = T) from the log forget gates.

    Args:
      logf_BTN: log f per token and head, float32 <= 0 (``functional.fox_log_forget_gates``).
      segment_ids_BT: packed documents; the prefix sums restart at each (None: one per row).
      scan_impl: the prefix sum's implementation.

    Returns:
      the term, reading the prefix sums c as per-token arrays (no carry).
    """
    batch, length = logf_BTN.shape[:2]
    ids_BT = segments.default_segment_ids(segment_ids_BT, batch, length)
    starts_BT1 = segments.segment_starts_BT(ids_BT)[:, :, None]
    c_BTN = scan.segment_cumsum(logf_BTN.astype(jnp.float32), starts_BT1, axis=1, impl=scan_impl)
    return BlockTerm(fox_pair, q_arrays={"c": c_BTN}, k_arrays={"c": c_BTN})
