"""The blockwise engine's building blocks (:mod:`copejax.ops.engine`).

The types a scheme's block form is made of (:class:`PairBlock`, what a term sees of one
(query block, key block) pair; :class:`BlockTerm`, a scheme's bias for it, with an optional
carry; :class:`Normalizer`), cutting sequences into blocks, the scaled content logits, and
the online states the walk folds pairs into: the softmax's running max, sum and accumulator
(Milakov & Gimelshein 2018, arXiv 1805.02867) and stick-breaking's remainder
(arXiv 2410.17980). Shape letters as in :mod:`copejax.ops.engine`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from copejax.ops import scan

Pytree = Any
MASKED_LOGIT = -1e30
# The key index of an empty ring-buffer slot: after every query, so never visible.
EMPTY_KEY_INDEX = 2**30
NORMALIZERS = ("softmax", "stickbreaking")


@struct.dataclass
class PairBlock:
    """What a block term may read for one (query block, key block) pair.

    Attributes:
      q_BQNH, k_BKNH: the blocks' queries and keys (after the qk site).
      q_positions_BQ, k_positions_BK: their integer positions.
      allowed_BQK: causal, same segment (and not the query itself for stick-breaking without
        ``include_self``); padding keys are never allowed.
      logits_BNQK: the scaled content logits q . k / sqrt(H), float32, unmasked (None for a
        term's ``advance``, which computes what it needs).
      q_arrays, k_arrays: the term's own per-token arrays, cut to the two blocks.
      q_start, k_start: the key index of the first query and of the first key (with an
        explicit key index, a ring-buffer decode cache, ``k_start`` is the slot of the first
        key, not its index).
    """

    q_BQNH: jax.Array
    k_BKNH: jax.Array
    q_positions_BQ: jax.Array
    k_positions_BK: jax.Array
    allowed_BQK: jax.Array
    logits_BNQK: jax.Array | None
    q_arrays: dict[str, jax.Array]
    k_arrays: dict[str, jax.Array]
    q_start: jax.Array
    k_start: jax.Array


# (params, pair, prepared, carry) -> (bias_BNQK float32, carry). Off ``allowed`` the bias may be
# anything finite: the engine masks the scores.
BiasFn = Callable[[Pytree, PairBlock, Pytree, Pytree], tuple[jax.Array, Pytree]]


@dataclasses.dataclass(frozen=True)
class BlockTerm:
    """A scheme's logit term in block form: pure functions plus the arrays they read.

    Everything an array-valued function reads must be in ``params``, ``q_arrays`` or
    ``k_arrays`` (so that the flash backward can differentiate it); the functions close over
    static values only.

    Attributes:
      bias: the term for one pair; see ``BiasFn``.
      params: arrays read whole (tables, MLP weights, slopes); differentiable.
      q_arrays: per-query float arrays (B, T, ...), cut into query blocks (FoX's prefix sums).
      k_arrays: per-key float arrays (B, S, ...), cut into key blocks (CoPE's gate keys).
      prepare: (params, q_BQNH, q_arrays of the block) -> what ``bias`` reads as ``prepared``,
        computed once per query block (CoPE's and Shaw's ``z = q . e``). None: nothing.
      init: (B, N, Q) -> the term's walk carry, for terms that count across key blocks (CoPE).
        None: no carry.
      advance: (params, pair, prepared, carry) -> the carry after the pair, without the bias:
        what the flash backward's carry pass calls (CoPE: the count plus the block's gates).
        None: ``bias(...)[1]``.
      position_only: the bias reads positions and params only, never q, k or per-token arrays
        (ALiBi, T5, Kerple, FIRE): a fused kernel may take it as a precomputed bias.
      settled: (params, prepared, carry) -> (whether, bias_BNQ): whether, given the carry
        entering a pair, the term is one value per query over the whole pair and leaves the
        carry unchanged (CoPE once every query has counted p_max - 1 gates: every older key
        sits at the cap), a boolean scalar, and that value (B, N, Q) float32. The engine then
        adds the value as a row constant instead of calling ``bias``, and the flash backward
        differentiates only that (its ``lax.cond`` per pair sits outside the differentiated
        function, so the full term's intermediates are neither computed nor zero-filled).
        None: never settled.
      retreat: (params, pair, prepared, carry) -> the carry entering a pair that is not
        settled from the carry leaving it: ``advance``'s inverse (CoPE: the count minus the
        block's gates). With it the flash backward replays the carries oldest first, from
        the forward's last carries, in the walk it differentiates, instead of a separate
        newest-first pass over the key blocks (:class:`Replay`). None: that pass.
    """

    bias: BiasFn
    params: Pytree = None
    q_arrays: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    k_arrays: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    prepare: Callable[[Pytree, jax.Array, dict[str, jax.Array]], Pytree] | None = None
    init: Callable[[int, int, int], Pytree] | None = None
    advance: Callable[[Pytree, PairBlock, Pytree, Pytree], Pytree] | None = None
    position_only: bool = False
    settled: Callable[[Pytree, Pytree, Pytree], tuple[jax.Array, jax.Array]] | None = None
    retreat: Callable[[Pytree, PairBlock, Pytree, Pytree], Pytree] | None = None


@struct.dataclass
class Replay:
    """What the forward walk leaves for the flash backward to replay the terms' carries
    oldest first (terms with ``retreat``), per query block.

    Attributes:
      carries: the terms' carries after the oldest key block (None for terms without one).
      newest_settled: the newest key block the walk found settled (``BlockTerm.settled``):
        it and every older block are settled; -1 for none. int32.
    """

    carries: list[Pytree]
    newest_settled: jax.Array


@dataclasses.dataclass(frozen=True)
class Normalizer:
    """How the pairs' scores become weights: "softmax" (always over keys up to and including
    the query's own), or "stickbreaking" (with or without the query's own key,
    ``include_self``)."""

    kind: str = "softmax"
    include_self: bool = True


SOFTMAX = Normalizer()


# ----------------------------------------------------------------------------- blocks


def num_blocks(length: int, block: int) -> int:
    """G = ceil(length / block); raises ValueError for a non-positive block."""
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        raise ValueError(f"block size must be a positive integer, got {block!r}")
    return -(-length // block)


def to_blocks(x_BT: jax.Array, block: int) -> jax.Array:
    """(B, T, ...) -> (G, B, block, ...), padding T up to a multiple of ``block`` (integers
    repeat the last value, floats get zeros)."""
    length = x_BT.shape[1]
    pad = num_blocks(length, block) * block - length
    if pad:
        widths = [(0, 0)] * x_BT.ndim
        widths[1] = (0, pad)
        x_BT = jnp.pad(x_BT, widths, mode="edge" if x_BT.dtype.kind in "iub" else "constant")
    x_BGQ = x_BT.reshape(x_BT.shape[0], -1, block, *x_BT.shape[2:])
    return jnp.moveaxis(x_BGQ, 1, 0)


def from_blocks(x_GBQ: jax.Array, length: int) -> jax.Array:
    """(G, B, Q, ...) -> (B, T, ...), dropping the padding."""
    x_BGQ = jnp.moveaxis(x_GBQ, 0, 1)
    x_BT = x_BGQ.reshape(x_BGQ.shape[0], -1, *x_BGQ.shape[3:])
    return x_BT[:, :length]


def content_logits_BNQK(q_BQNH: jax.Array, k_BKNH: jax.Array) -> jax.Array:
    """q . k / sqrt(H) in float32, as the naive path computes them."""
    scale = 1.0 / math.sqrt(q_BQNH.shape[-1])
    logits = jnp.einsum("BQNH,BKNH->BNQK", q_BQNH, k_BKNH, preferred_element_type=jnp.float32)
    return logits * scale


# ----------------------------------------------------------------------------- online softmax


def softmax_init(
    batch: int, heads: int, size: int, width: int, sink_N: jax.Array | None = None
) -> dict[str, jax.Array]:
    """Empty online-softmax state: max, denominator (B, N, Q), weighted values (B, Q, N, W).

    ``sink_N`` (GPT-OSS's attention sink, a logit per head that joins the denominator and
    mixes no value) seeds the state as a key with value zero: max = sink, denominator 1
    (``exp(sink - stop_gradient(sink))``, so that the sink gets its gradient).
    """
    state = {
        "max_BNQ": jnp.full((batch, heads, size), MASKED_LOGIT, jnp.float32),
        "sum_BNQ": jnp.zeros((batch, heads, size), jnp.float32),
        "acc_BQNW": jnp.zeros((batch, size, heads, width), jnp.float32),
    }
    if sink_N is not None:
        sink_BNQ = jnp.broadcast_to(sink_N.astype(jnp.float32)[None, :, None], (batch, heads, size))
        state["max_BNQ"] = jax.lax.stop_gradient(sink_BNQ)
        state["sum_BNQ"] = jnp.exp(sink_BNQ - jax.lax.stop_gradient(sink_BNQ))
    return state


def softmax_update(
    state: dict[str, jax.Array], scores_BNQK: jax.Array, allowed_BQK: jax.Array, v_BKNW: jax.Array
) -> dict[str, jax.Array]:
    """Adds one key block; disallowed keys get exactly zero weight. The running max is only a
    shift for exp: it carries no gradient."""
    allowed_B1QK = allowed_BQK[:, None]
    scores_BNQK = jnp.where(allowed_B1QK, scores_BNQK.astype(jnp.float32), MASKED_LOGIT)
    new_max_BNQ = jax.lax.stop_gradient(
        jnp.maximum(state["max_BNQ"], jnp.max(scores_BNQK, axis=-1))
    )
    rescale_BNQ = jnp.exp(state["max_BNQ"] - new_max_BNQ)
    exp_BNQK = jnp.where(allowed_B1QK, jnp.exp(scores_BNQK - new_max_BNQ[..., None]), 0.0)
    weighted_BQNW = jnp.einsum(
        "BNQK,BKNW->BQNW", exp_BNQK.astype(v_BKNW.dtype), v_BKNW, preferred_element_type=jnp.float32
    )
    return {
        "max_BNQ": new_max_BNQ,
        "sum_BNQ": state["sum_BNQ"] * rescale_BNQ + jnp.sum(exp_BNQK, axis=-1),
        "acc_BQNW": state["acc_BQNW"] * jnp.moveaxis(rescale_BNQ, 1, 2)[..., None] + weighted_BQNW,
    }


def softmax_finish(state: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(weighted values / denominator (B, Q, N, W) float32, log-sum-exp (B, N, Q)). A query
    with no allowed key gets zeros and a log-sum-exp of MASKED_LOGIT."""
    sum_BNQ = state["sum_BNQ"]
    sum_BQN1 = jnp.moveaxis(sum_BNQ, 1, 2)[..., None]
    out_BQNW = state["acc_BQNW"] / jnp.where(sum_BQN1 > 0, sum_BQN1, 1.0)
    lse_BNQ = jnp.where(
        sum_BNQ > 0, state["max_BNQ"] + jnp.log(jnp.where(sum_BNQ > 0, sum_BNQ, 1.0)), MASKED_LOGIT
    )
    return out_BQNW, lse_BNQ


# ----------------------------------------------------------------------------- stick-breaking


# A stick whose log remainder -r is below -STICK_SPENT is used up in float32: every older
# weight A_ij <= exp(-r) underflows to exactly 0 (2^-149, the smallest subnormal, is
# e^-103.3). The engine skips the older key blocks of a query block once every query's
# remainder r passes it; their weights and gradients are exactly 0 on either path.
STICK_SPENT = 110.0


def stick_spent(remainder_BNQ: jax.Array) -> jax.Array:
    """Whether every query of the block has used up its stick (a boolean scalar)."""
    return jnp.all(remainder_BNQ >= STICK_SPENT)


def stickbreaking_init(batch: int, heads: int, size: int, width: int) -> dict[str, jax.Array]:
    return {
        "acc_BQNW": jnp.zeros((batch, size, heads, width), jnp.float32),
        "remainder_BNQ": jnp.zeros((batch, heads, size), jnp.float32),
    }


def stickbreaking_update(
    state: dict[str, jax.Array],
    z_BNQK: jax.Array,
    allowed_BQK: jax.Array,
    v_BKNW: jax.Array,
    scan_impl: str,
) -> dict[str, jax.Array]:
    """``log A_ij = log_sigmoid(z_ij) - sum_{k in (j, i)} softplus(z_ik)``: within the block a
    suffix sum shifted by one key, plus the carried softplus total of the newer blocks (the
    state's ``remainder_BNQ``); see :func:`_stick_block` for the block's backward."""
    allowed_B1QK = allowed_BQK[:, None]
    z_BNQK = jnp.where(allowed_B1QK, z_BNQK.astype(jnp.float32), 0.0)
    weighted_BQNW, total_BNQ = _stick_block(
        scan_impl, z_BNQK, allowed_B1QK, state["remainder_BNQ"], v_BKNW
    )
    return {
        "acc_BQNW": state["acc_BQNW"] + weighted_BQNW,
        "remainder_BNQ": state["remainder_BNQ"] + total_BNQ,
    }


def stick_terms(z_BNQK: jax.Array, allowed_B1QK: jax.Array) -> tuple[jax.Array, ...]:
    """(e = exp(-|z|), softplus(z) (0 off ``allowed``), log_sigmoid(z)) from one exp and one
    log1p: ``softplus(z) = max(z, 0) + log1p(e)``, ``log_sigmoid(z) = min(z, 0) - log1p(e)``
    (the forms of ``jax.nn.softplus`` / ``jax.nn.log_sigmoid``, their common part shared)."""
    e_BNQK = jnp.exp(-jnp.abs(z_BNQK))
    log1p_BNQK = jnp.log1p(e_BNQK)
    softplus_BNQK = jnp.where(allowed_B1QK, jnp.maximum(z_BNQK, 0.0) + log1p_BNQK, 0.0)
    return e_BNQK, softplus_BNQK, jnp.minimum(z_BNQK, 0.0) - log1p_BNQK


def stick_weights(
    scan_impl: str, z_BNQK: jax.Array, allowed_B1QK: jax.Array, remainder_BNQ: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One key block's (exp(-|z|), softplus suffix sums, weights A_ij) given the softplus
    total of the newer blocks (see :func:`_stick_block`)."""
    e_BNQK, softplus_BNQK, log_sigmoid_BNQK = stick_terms(z_BNQK, allowed_B1QK)
    suffix_BNQK = scan.cumsum(softplus_BNQK, axis=-1, reverse=True, impl=scan_impl)
    after_BNQK = jnp.pad(suffix_BNQK[..., 1:], ((0, 0), (0, 0), (0, 0), (0, 1)))
    after_BNQK = after_BNQK + remainder_BNQ[..., None]
    weights_BNQK = jnp.where(allowed_B1QK, jnp.exp(log_sigmoid_BNQK - after_BNQK), 0.0)
    return e_BNQK, suffix_BNQK, weights_BNQK


def _stick_forward(
    scan_impl: str,
    z_BNQK: jax.Array,
    allowed_B1QK: jax.Array,
    remainder_BNQ: jax.Array,
    v_BKNW: jax.Array,
) -> tuple[tuple[jax.Array, jax.Array], tuple]:
    e_BNQK, suffix_BNQK, weights_BNQK = stick_weights(
        scan_impl, z_BNQK, allowed_B1QK, remainder_BNQ
    )
    weighted_BQNW = jnp.einsum(
        "BNQK,BKNW->BQNW",
        weights_BNQK.astype(v_BKNW.dtype),
        v_BKNW,
        preferred_element_type=jnp.float32,
    )
    residuals = (z_BNQK, allowed_B1QK, e_BNQK, weights_BNQK, v_BKNW)
    return (weighted_BQNW, suffix_BNQK[..., 0]), residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _stick_block(
    scan_impl: str,
    z_BNQK: jax.Array,
    allowed_B1QK: jax.Array,
    remainder_BNQ: jax.Array,
    v_BKNW: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One key block of stick-breaking (arXiv 2410.17980) with a hand-written backward.

    Forward, with ``r_i`` the softplus total of the newer blocks and ``z`` zero off
    ``allowed``: ``sp_ij = softplus(z_ij)``, ``a_ij = sum_{k > j} sp_ik + r_i``,
    ``A_ij = exp(log_sigmoid(z_ij) - a_ij)`` (0 off ``allowed``); returns
    ``(sum_j A_ij v_j, sum_j sp_ij)``. Backward, from the cotangents ``dY_i`` of the first
    output and ``dT_i`` of the second, with ``G_ij = A_ij (dY_i . v_j)``:

        dv_j  = sum_i A_ij dY_i
        dr_i  = -sum_j G_ij
        dsp_ij = dT_i - sum_{k < j} G_ik
        dz_ij = G_ij sigmoid(-z_ij) + dsp_ij sigmoid(z_ij)     (0 off ``allowed``)

    (``d log_sigmoid(z) / dz = sigmoid(-z)``, ``d softplus(z) / dz = sigmoid(z)``, both read
    from the saved ``exp(-|z|)``). JAX's own derivative of the same forward evaluates the
    transcendental functions again and keeps more intermediates; this saves about a fifth of
    stick-breaking's layer time on CPU (T = 1024, B x N = 8: 1.65x instead of 2.04x the
    fastest nope path, process CPU time).
    """
    return _stick_forward(scan_impl, z_BNQK, allowed_B1QK, remainder_BNQ, v_BKNW)[0]


def _stick_backward(scan_impl: str, residuals: tuple, cotangents: tuple) -> tuple:
    z_BNQK, allowed_B1QK, e_BNQK, weights_BNQK, v_BKNW = residuals
    d_weighted_BQNW, d_total_BNQ = cotangents
    d_weighted_BQNW = d_weighted_BQNW.astype(jnp.float32)
    d_v_BKNW = jnp.einsum(
        "BNQK,BQNW->BKNW",
        weights_BNQK.astype(v_BKNW.dtype),
        d_weighted_BQNW.astype(v_BKNW.dtype),
        preferred_element_type=jnp.float32,
    ).astype(v_BKNW.dtype)
    d_weights_BNQK = jnp.einsum(
        "BQNW,BKNW->BNQK", d_weighted_BQNW, v_BKNW, preferred_element_type=jnp.float32
    )
    g_BNQK = d_weights_BNQK * weights_BNQK
    prefix_BNQK = scan.cumsum(g_BNQK, axis=-1, impl=scan_impl)
    before_BNQK = jnp.pad(prefix_BNQK[..., :-1], ((0, 0), (0, 0), (0, 0), (1, 0)))
    d_softplus_BNQK = d_total_BNQ[..., None] - before_BNQK
    one_plus_e_BNQK = 1.0 + e_BNQK
    sigmoid_BNQK = jnp.where(z_BNQK >= 0, 1.0, e_BNQK) / one_plus_e_BNQK
    sigmoid_neg_BNQK = jnp.where(z_BNQK >= 0, e_BNQK, 1.0) / one_plus_e_BNQK
    d_z_BNQK = jnp.where(
        allowed_B1QK, g_BNQK * sigmoid_neg_BNQK + d_softplus_BNQK * sigmoid_BNQK, 0.0
    )
    return d_z_BNQK, None, -prefix_BNQK[..., -1], d_v_BKNW


_stick_block.defvjp(_stick_forward, _stick_backward)
