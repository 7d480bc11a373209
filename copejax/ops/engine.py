"""One blockwise attention engine for every position scheme, in O(T) memory.

Queries go in blocks of Q, keys in blocks of K. For each (query block, key block) pair the engine
computes the scaled content logits ``q . k / sqrt(H)``, adds each scheme's *block term* (its bias
for that pair, from the two blocks' positions, q, k and per-token arrays; see
:class:`BlockTerm`) and folds the pair into an online softmax (Milakov & Gimelshein 2018,
arXiv 1805.02867) or, for stick-breaking, into the stick remainder. Key blocks are walked from
the newest to the oldest, so that a term may keep a *carry* across them: CoPE's count of the
newer blocks' gates (arXiv 2405.18719, eq. 4), stick-breaking's log remainder
(arXiv 2410.17980). Key blocks after the query block are skipped (``lax.cond``).

Sliding windows (``window`` W: query i sees keys ``i - W < j <= i``): a query block walks only
the band of key blocks that meet its window, at most ``(W + Q - 2) // K + 2`` of them, gathered
by index, so that the cost is O(T W) rather than O(T^2) (the flash backward walks the same
band). With StreamingLLM's kept sink tokens (``sink_tokens``), the older key blocks that hold a
segment's first keys are walked after the band; every older block is then tested
(``lax.cond``), but only those with a sink key are computed.

Backward passes (``backward``):

- ``"flash"`` (softmax, no term with a carry): a ``jax.custom_vjp`` after FlashAttention-2
  (Dao 2023, arXiv 2307.08691). The forward keeps the output ``o_i`` (float32) and each
  query's log-sum-exp ``L_i = log sum_j exp s_ij``. The backward recomputes each pair's scores
  ``s_ij`` (content logits plus block terms) and, with ``P_ij = exp(s_ij - L_i)`` on allowed
  pairs, ``D_i = sum_h dO_ih o_ih``:

      dV_j  = sum_i P_ij dO_i
      dP_ij = dO_i . v_j
      dS_ij = P_ij (dP_ij - D_i)

  and pulls ``dS`` back through the score function of the pair (``jax.vjp``), which gives the
  gradients of q, k, the terms' per-token arrays, their parameters and their per-query-block
  precomputations (pulled back once per query block). No (T, S) array and no saved walk.
  A sink logit ``z_n`` (GPT-OSS; ``sink_N``) is a key of value 0 in every row, so ``L_i``
  includes it and ``dz_n = -sum_i exp(z_n - L_i) D_i``.
- ``"remat"``: JAX differentiates the walk, each pair's body rematerialised
  (``jax.checkpoint``) and, above ``REMAT_WALKS_ABOVE`` blocks, whole query-block walks too, so
  the backward keeps carries only. Needed by carries (CoPE, stick-breaking); timed against
  "flash" by ``python -m experiments.bench`` (the "fox remat" arm).

Shape letters: B batch, T queries, S keys, N heads, H head dim (values may be wider: TAPE mixes
its position tensors as extra value features), Q / K query / key block length, G blocks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from copejax import segments
from copejax.ops import scan

Pytree = Any
MASKED_LOGIT = -1e30
# Rematerialise whole query-block walks only above this many key blocks (remat backward).
REMAT_WALKS_ABOVE = 8
BACKWARDS = ("auto", "flash", "remat")
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
      logits_BNQK: the scaled content logits q . k / sqrt(H), float32, unmasked.
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
    logits_BNQK: jax.Array
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
        None: no carry (the flash backward applies).
      position_only: the bias reads positions and params only, never q, k or per-token arrays
        (ALiBi, T5, Kerple, FIRE): a fused kernel may take it as a precomputed bias.
    """

    bias: BiasFn
    params: Pytree = None
    q_arrays: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    k_arrays: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    prepare: Callable[[Pytree, jax.Array, dict[str, jax.Array]], Pytree] | None = None
    init: Callable[[int, int, int], Pytree] | None = None
    position_only: bool = False


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
    suffix sum shifted by one key, plus the carried softplus total of the newer blocks."""
    allowed_B1QK = allowed_BQK[:, None]
    z_BNQK = jnp.where(allowed_B1QK, z_BNQK.astype(jnp.float32), 0.0)
    softplus_BNQK = jnp.where(allowed_B1QK, jax.nn.softplus(z_BNQK), 0.0)
    suffix_BNQK = scan.cumsum(softplus_BNQK, axis=-1, reverse=True, impl=scan_impl)
    after_BNQK = jnp.pad(suffix_BNQK[..., 1:], ((0, 0), (0, 0), (0, 0), (0, 1)))
    after_BNQK = after_BNQK + state["remainder_BNQ"][..., None]
    weights_BNQK = jnp.where(allowed_B1QK, jnp.exp(jax.nn.log_sigmoid(z_BNQK) - after_BNQK), 0.0)
    weighted_BQNW = jnp.einsum(
        "BNQK,BKNW->BQNW",
        weights_BNQK.astype(v_BKNW.dtype),
        v_BKNW,
        preferred_element_type=jnp.float32,
    )
    return {
        "acc_BQNW": state["acc_BQNW"] + weighted_BQNW,
        "remainder_BNQ": state["remainder_BNQ"] + suffix_BNQK[..., 0],
    }


# ----------------------------------------------------------------------------- scores


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static facts of one call: block sizes, counts, the terms and the normalizer."""

    terms: tuple[BlockTerm, ...]
    normalizer: Normalizer
    size_q: int
    size_k: int
    count_q: int
    count_k: int
    scan_impl: str
    window: int | None = None
    sink_tokens: int = 0
    explicit_index: bool = False

    @property
    def banded(self) -> bool:
        """Whether query blocks walk only the key blocks that meet their window."""
        return self.window is not None and not self.explicit_index

    @property
    def band_blocks(self) -> int:
        """The most key blocks a window of W keys meets from a query block of Q queries."""
        return min(self.count_k, (self.window + self.size_q - 2) // self.size_k + 2)

    def walk_plan(self, offset: jax.Array, qi: jax.Array, kn: dict) -> tuple[jax.Array, ...]:
        """The key blocks query block qi walks, newest first, and whether each is live:
        the band that meets the window, then (with sink tokens) every older block, live
        where it holds a key among its segment's first ``sink_tokens``."""
        q_first = self.q_start(offset, qi)
        newest = jnp.minimum((q_first + self.size_q - 1) // self.size_k, self.count_k - 1)
        band = newest - jnp.arange(self.band_blocks)
        live = (band >= 0) & ((band + 1) * self.size_k - 1 >= q_first - self.window + 1)
        if not self.sink_tokens:
            return band, live
        has_sink_G = jnp.any(kn["rank"] < self.sink_tokens, axis=(1, 2))
        live = live | ((band >= 0) & has_sink_G[jnp.clip(band, 0, self.count_k - 1)])
        older = jnp.arange(self.count_k)[::-1]
        older_live = (older < newest - self.band_blocks + 1) & has_sink_G[older]
        return jnp.concatenate([band, older]), jnp.concatenate([live, older_live])

    def gather(self, tree: Pytree, kj: jax.Array) -> Pytree:
        """Key block kj (clipped to the blocks) of blocked arrays (G, ...)."""
        kj = jnp.clip(kj, 0, self.count_k - 1)
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, kj, 0, False), tree)

    def q_start(self, offset: jax.Array, qi: jax.Array) -> jax.Array:
        return offset + qi * self.size_q

    def live(self, offset: jax.Array, qi: jax.Array, kj: jax.Array) -> jax.Array:
        """Whether key block kj holds any key at or before query block qi's last query
        (always, with explicit key indices: a ring buffer's slots are not in key order)."""
        if self.explicit_index:
            return jnp.asarray(True)
        return kj * self.size_k <= self.q_start(offset, qi) + self.size_q - 1

    def prepare(self, params: Sequence[Pytree], qf: dict) -> list[Pytree]:
        return [
            None if t.prepare is None else t.prepare(p, qf["q"], x)
            for t, p, x in zip(self.terms, params, qf["x"], strict=True)
        ]

    def allowed(self, offset: jax.Array, qi: jax.Array, qn: dict, kj: jax.Array, kn: dict):
        return segments.pair_allowed_BQK(
            qn["seg"],
            kn["seg"],
            self.q_start(offset, qi),
            kj * self.size_k,
            self.normalizer.include_self,
            window=self.window,
            sink_tokens=self.sink_tokens,
            k_index_BK=kn.get("idx"),
            k_rank_BK=kn.get("rank"),
        )

    def scores(
        self,
        params: Sequence[Pytree],
        prepared: Sequence[Pytree],
        carries: Sequence[Pytree],
        *,
        qf: dict,
        qn: dict,
        kf: dict,
        kn: dict,
        allowed_BQK: jax.Array,
        offset: jax.Array,
        qi: jax.Array,
        kj: jax.Array,
    ) -> tuple[jax.Array, list[Pytree]]:
        """The pair's scores (content logits plus every term), float32, and the new carries."""
        logits_BNQK = content_logits_BNQK(qf["q"], kf["k"])
        scores_BNQK = logits_BNQK
        new_carries = []
        for term, p, prep, old_carry, qx, kx in zip(
            self.terms, params, prepared, carries, qf["x"], kf["x"], strict=True
        ):
            pair = PairBlock(
                q_BQNH=qf["q"],
                k_BKNH=kf["k"],
                q_positions_BQ=qn["pos"],
                k_positions_BK=kn["pos"],
                allowed_BQK=allowed_BQK,
                logits_BNQK=logits_BNQK,
                q_arrays=qx,
                k_arrays=kx,
                q_start=self.q_start(offset, qi),
                k_start=kj * self.size_k,
            )
            bias_BNQK, carry = term.bias(p, pair, prep, old_carry)
            scores_BNQK = scores_BNQK + jnp.where(
                allowed_BQK[:, None], bias_BNQK.astype(jnp.float32), 0.0
            )
            new_carries.append(carry)
        return scores_BNQK, new_carries


# ----------------------------------------------------------------------------- remat walk


def _remat_walk(layout: _Layout, data: dict) -> tuple[jax.Array, jax.Array]:
    """Every query block walks its key blocks newest first; JAX differentiates the walk.

    ``data``: the blocked inputs, {"params", "qf", "qn", "kf", "kn", "v", "offset"} (see
    :func:`blockwise_attention`). Returns (outputs (G, B, Q, N, W) float32, per-query statistic
    (G, B, N, Q): the log-sum-exp for softmax, the log stick remainder for stick-breaking).
    """
    params, qf, qn, kf, kn = (data[key] for key in ("params", "qf", "qn", "kf", "kn"))
    v_GBKNW, offset = data["v"], data["offset"]
    batch, heads, width = v_GBKNW.shape[1], v_GBKNW.shape[3], v_GBKNW.shape[4]
    sticks = layout.normalizer.kind == "stickbreaking"
    k_index_rev = jnp.arange(layout.count_k)[::-1]
    k_rev = jax.tree.map(lambda x: x[::-1], (kf, kn, v_GBKNW))

    def one_query_block(qi: jax.Array, qf_i: dict, qn_i: dict) -> tuple[jax.Array, jax.Array]:
        prepared = layout.prepare(params, qf_i)
        if sticks:
            init_acc = stickbreaking_init(batch, heads, layout.size_q, width)
        else:
            init_acc = softmax_init(batch, heads, layout.size_q, width, data["sink"])
        init_carries = [
            None if t.init is None else t.init(batch, heads, layout.size_q) for t in layout.terms
        ]

        def step(state: tuple, kj: jax.Array, kf_j: dict, kn_j: dict, v_j: jax.Array) -> tuple:
            acc, carries = state
            allowed_BQK = layout.allowed(offset, qi, qn_i, kj, kn_j)
            scores_BNQK, carries = layout.scores(
                params,
                prepared,
                carries,
                qf=qf_i,
                qn=qn_i,
                kf=kf_j,
                kn=kn_j,
                allowed_BQK=allowed_BQK,
                offset=offset,
                qi=qi,
                kj=kj,
            )
            if sticks:
                acc = stickbreaking_update(acc, scores_BNQK, allowed_BQK, v_j, layout.scan_impl)
            else:
                acc = softmax_update(acc, scores_BNQK, allowed_BQK, v_j)
            return acc, carries

        def body(state: tuple, k_in: tuple) -> tuple[tuple, None]:
            kj, (kf_j, kn_j, v_j) = k_in
            state = jax.lax.cond(
                layout.live(offset, qi, kj),
                lambda s: step(s, kj, kf_j, kn_j, v_j),
                lambda s: s,
                state,
            )
            return state, None

        def band_body(state: tuple, k_in: tuple) -> tuple[tuple, None]:
            kj, live = k_in
            kj = jnp.clip(kj, 0, layout.count_k - 1)
            kf_j, kn_j, v_j = layout.gather((kf, kn, v_GBKNW), kj)
            state = jax.lax.cond(live, lambda s: step(s, kj, kf_j, kn_j, v_j), lambda s: s, state)
            return state, None

        init = (init_acc, init_carries)
        if layout.banded:
            band_body = jax.checkpoint(band_body, prevent_cse=False)
            (acc, _), _ = jax.lax.scan(band_body, init, layout.walk_plan(offset, qi, kn))
        else:
            body = jax.checkpoint(body, prevent_cse=False)
            (acc, _), _ = jax.lax.scan(body, init, (k_index_rev, k_rev))
        if sticks:
            return acc["acc_BQNW"], -acc["remainder_BNQ"]
        return softmax_finish(acc)

    if layout.count_k > REMAT_WALKS_ABOVE:
        one_query_block = jax.checkpoint(one_query_block, prevent_cse=False)
    return jax.lax.map(lambda xs: one_query_block(*xs), (jnp.arange(layout.count_q), qf, qn))


# ----------------------------------------------------------------------------- flash


def _flash_backward(
    layout: _Layout, data: dict, out_GBQNW: jax.Array, lse_GBNQ: jax.Array, d_out_GBQNW: jax.Array
) -> dict:
    """FlashAttention-2's backward (module docstring), one query block at a time; returns the
    cotangent of ``data`` (None for its integer parts)."""
    params, qf, qn, kf, kn = (data[key] for key in ("params", "qf", "qn", "kf", "kn"))
    v_GBKNW, offset = data["v"], data["offset"]
    d_out_GBQNW = d_out_GBQNW.astype(jnp.float32)
    delta_GBNQ = jnp.moveaxis(jnp.sum(d_out_GBQNW * out_GBQNW, axis=-1), 3, 2)
    zeros = _zeros_like

    def per_query_block(carry: tuple, q_in: tuple) -> tuple[tuple, dict]:
        if layout.banded:
            return per_query_band(carry, q_in)
        d_params, d_kf, d_v = carry
        qi, qf_i, qn_i, d_out_i, lse_i, delta_i = q_in
        prepared, prepare_vjp = jax.vjp(layout.prepare, params, qf_i)

        pair_grads = pair_grads_of((qi, qf_i, qn_i, d_out_i, lse_i, delta_i, prepared))

        def body(inner: tuple, k_in: tuple) -> tuple[tuple, tuple]:
            d_params_i, d_qf_i, d_prep_i = inner
            kj, kf_j, kn_j, v_j = k_in

            def live(_: None) -> tuple:
                return pair_grads(kj, kf_j, kn_j, v_j)

            def dead(_: None) -> tuple:
                return (zeros(params), zeros(qf_i), zeros(kf_j), zeros(prepared), zeros(v_j))

            dp, dq, dk, dprep, dv = jax.lax.cond(layout.live(offset, qi, kj), live, dead, None)
            inner = (
                _add(d_params_i, dp),
                _add(d_qf_i, dq),
                _add(d_prep_i, dprep),
            )
            return inner, (dk, dv)

        inner0 = (zeros(params), zeros(qf_i), zeros(prepared))
        (d_params_i, d_qf_i, d_prep_i), (d_kf_i, d_v_i) = jax.lax.scan(
            body, inner0, (jnp.arange(layout.count_k), kf, kn, v_GBKNW)
        )
        d_params_prep, d_qf_prep = prepare_vjp(d_prep_i)
        d_qf_i = _add(d_qf_i, d_qf_prep)
        carry = (
            _add(d_params, _add(d_params_i, d_params_prep)),
            _add(d_kf, d_kf_i),
            d_v + d_v_i,
        )
        return carry, d_qf_i

    def per_query_band(carry: tuple, q_in: tuple) -> tuple[tuple, dict]:
        """The same for a window: the band's key blocks, gathered by index, their gradients
        added back at their index."""
        d_params, d_kf, d_v = carry
        qi, qf_i, qn_i, d_out_i, lse_i, delta_i = q_in
        prepared, prepare_vjp = jax.vjp(layout.prepare, params, qf_i)

        def body(inner: tuple, k_in: tuple) -> tuple[tuple, None]:
            d_params_i, d_qf_i, d_prep_i, d_kf, d_v = inner
            kj, live = k_in
            kj = jnp.clip(kj, 0, layout.count_k - 1)
            kf_j, kn_j, v_j = layout.gather((kf, kn, v_GBKNW), kj)
            dp, dq, dk, dprep, dv = jax.lax.cond(
                live,
                lambda _: pair_grads_of((qi, qf_i, qn_i, d_out_i, lse_i, delta_i, prepared))(
                    kj, kf_j, kn_j, v_j
                ),
                lambda _: (zeros(params), zeros(qf_i), zeros(kf_j), zeros(prepared), zeros(v_j)),
                None,
            )
            d_kf = jax.tree.map(lambda a, g: a.at[kj].add(g.astype(a.dtype)), d_kf, dk)
            inner = (
                _add(d_params_i, dp),
                _add(d_qf_i, dq),
                _add(d_prep_i, dprep),
                d_kf,
                d_v.at[kj].add(dv),
            )
            return inner, None

        inner0 = (zeros(params), zeros(qf_i), zeros(prepared), d_kf, d_v)
        (d_params_i, d_qf_i, d_prep_i, d_kf, d_v), _ = jax.lax.scan(
            body, inner0, layout.walk_plan(offset, qi, kn)
        )
        d_params_prep, d_qf_prep = prepare_vjp(d_prep_i)
        d_qf_i = _add(d_qf_i, d_qf_prep)
        return (_add(d_params, _add(d_params_i, d_params_prep)), d_kf, d_v), d_qf_i

    def pair_grads_of(q_side: tuple) -> Callable:
        """The gradients of one (query block, key block) pair for query block ``q_side``:
        (qi, qf_i, qn_i, d_out_i, lse_i, delta_i, prepared)."""
        qi, qf_i, qn_i, d_out_i, lse_i, delta_i, prepared = q_side

        def grads(kj: jax.Array, kf_j: dict, kn_j: dict, v_j: jax.Array) -> tuple:
            allowed_BQK = layout.allowed(offset, qi, qn_i, kj, kn_j)

            def score_fn(p: list, q_side: dict, k_side: dict, prep: list) -> jax.Array:
                return layout.scores(
                    p,
                    prep,
                    [None] * len(layout.terms),
                    qf=q_side,
                    qn=qn_i,
                    kf=k_side,
                    kn=kn_j,
                    allowed_BQK=allowed_BQK,
                    offset=offset,
                    qi=qi,
                    kj=kj,
                )[0]

            scores_BNQK, score_vjp = jax.vjp(score_fn, params, qf_i, kf_j, prepared)
            p_BNQK = jnp.where(allowed_BQK[:, None], jnp.exp(scores_BNQK - lse_i[..., None]), 0.0)
            d_v_j = jnp.einsum(
                "BNQK,BQNW->BKNW", p_BNQK, d_out_i, preferred_element_type=jnp.float32
            ).astype(v_j.dtype)
            d_p_BNQK = jnp.einsum("BQNW,BKNW->BNQK", d_out_i, v_j.astype(jnp.float32))
            d_s_BNQK = p_BNQK * (d_p_BNQK - delta_i[..., None])
            return (*score_vjp(d_s_BNQK), d_v_j)

        return grads

    init = (zeros(params), zeros(kf), jnp.zeros_like(v_GBKNW))
    q_in = (
        jnp.arange(layout.count_q),
        qf,
        qn,
        d_out_GBQNW,
        lse_GBNQ,
        delta_GBNQ,
    )
    (d_params, d_kf, d_v), d_qf = jax.lax.scan(per_query_block, init, q_in)
    d_sink = None
    if data["sink"] is not None:
        # The sink is a key with value 0 in every row: dS = P_sink (0 - D_i).
        sink_1N1 = data["sink"].astype(jnp.float32)[None, :, None]
        p_sink_GBNQ = jnp.exp(sink_1N1 - lse_GBNQ)
        d_sink = -jnp.sum(p_sink_GBNQ * delta_GBNQ, axis=(0, 1, 3)).astype(data["sink"].dtype)
    return {
        "sink": d_sink,
        "params": d_params,
        "qf": d_qf,
        "qn": None,
        "kf": d_kf,
        "kn": None,
        "v": d_v,
        "offset": None,
    }


def _zeros_like(tree: Pytree) -> Pytree:
    """Zeros shaped like ``tree`` (None leaves stay None)."""
    return jax.tree.map(jnp.zeros_like, tree)


def _add(a: Pytree, b: Pytree) -> Pytree:
    return jax.tree.map(lambda x, y: x + y.astype(x.dtype), a, b)


def _flash_walk(layout: _Layout) -> Callable:
    """The softmax walk with the flash backward, as a ``jax.custom_vjp`` of the blocked
    inputs ``data`` -> outputs (G, B, Q, N, W) float32."""

    @jax.custom_vjp
    def walk(data: dict) -> jax.Array:
        return _remat_walk(layout, data)[0]

    def forward(data: dict) -> tuple[jax.Array, tuple]:
        out_GBQNW, lse_GBNQ = _remat_walk(layout, data)
        return out_GBQNW, (data, out_GBQNW, lse_GBNQ)

    def backward(residuals: tuple, d_out_GBQNW: jax.Array) -> tuple[dict]:
        return (_flash_backward(layout, *residuals, d_out_GBQNW),)

    walk.defvjp(forward, backward)
    return walk


# ----------------------------------------------------------------------------- entry point


def blockwise_attention(
    q_BTNH: jax.Array,
    k_BSNH: jax.Array,
    v_BSNW: jax.Array,
    *,
    q_positions_BT: jax.Array,
    k_positions_BS: jax.Array,
    q_segment_ids_BT: jax.Array,
    k_segment_ids_BS: jax.Array,
    offset: jax.Array | int = 0,
    terms: Sequence[BlockTerm] = (),
    normalizer: Normalizer = SOFTMAX,
    block: int = 128,
    scan_impl: str = "auto",
    backward: str = "auto",
    window: int | None = None,
    sink_tokens: int = 0,
    k_index_BS: jax.Array | None = None,
    k_rank_BS: jax.Array | None = None,
    sink_N: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Causal attention over (query block, key block) pairs, never a (T, S) array.

    Args:
      q_BTNH, k_BSNH: queries and keys after the qk site.
      v_BSNW: values (W = H, or wider when a scheme mixes extra per-key features).
      q_positions_BT, k_positions_BS: integer positions (what the terms read).
      q_segment_ids_BT, k_segment_ids_BS: packed documents; query t (key ``offset + t``) sees
        key s iff s <= offset + t and the ids are equal.
      offset: the key index of query 0 (0 in self-attention, the cache index when decoding).
      terms: the schemes' block terms, summed into the scores.
      normalizer: softmax, or stick-breaking.
      block: the block length (queries use ``min(block, T)``, keys ``min(block, S)``).
      scan_impl: suffix sums of stick-breaking (``copejax.ops.scan``).
      backward: "auto" (flash where it applies, softmax and no term with a carry, over more
        than ``REMAT_WALKS_ABOVE`` key blocks; remat otherwise), "flash" or "remat".
      window: a sliding window W (query i sees keys ``i - W < j <= i``); None: full causal.
      sink_tokens: with a window, the first n keys of each segment stay visible
        (StreamingLLM, arXiv 2309.17453).
      k_index_BS: each key's index when the keys are not in order (a ring-buffer decode
        cache; empty slots carry a huge index); every key block is then walked.
      k_rank_BS: each key's index within its segment (for the sinks); None: derived from
        ``k_segment_ids_BS``.
      sink_N: a learned logit per head (float, (N,)) that joins every query's softmax
        denominator and mixes no value (GPT-OSS's attention sink); seeds the online softmax.
        Softmax only; differentiable on both backwards.

    Returns:
      (y_BTNW in ``v_BSNW``'s dtype, stat_BNT): with the remat backward, the per-query
      log-sum-exp (softmax; the sink included) or the log of the stick remainder,
      log prod_k (1 - beta_ik) (stick-breaking), float32; None with the flash backward.
    """
    if backward not in BACKWARDS:
        raise ValueError(f"engine: backward must be one of {BACKWARDS}, got {backward!r}")
    if normalizer.kind not in NORMALIZERS:
        raise ValueError(f"engine: normalizer must be one of {NORMALIZERS}, got {normalizer!r}")
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"engine: window must be a positive integer or None, got {window!r}")
    if not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"engine: sink_tokens must be an integer >= 0, got {sink_tokens!r}")
    sink_tokens = sink_tokens if window is not None else 0
    length_q, length_k = q_BTNH.shape[1], k_BSNH.shape[1]
    size_q, size_k = min(block, length_q), min(block, length_k)
    terms = tuple(terms)
    layout = _Layout(
        terms=terms,
        normalizer=normalizer,
        size_q=size_q,
        size_k=size_k,
        count_q=num_blocks(length_q, size_q),
        count_k=num_blocks(length_k, size_k),
        scan_impl=scan_impl,
        window=window,
        sink_tokens=sink_tokens,
        explicit_index=k_index_BS is not None,
    )
    qf = {
        "q": to_blocks(q_BTNH, size_q),
        "x": [jax.tree.map(lambda a: to_blocks(a, size_q), t.q_arrays) for t in terms],
    }
    qn = {"pos": to_blocks(q_positions_BT, size_q), "seg": to_blocks(q_segment_ids_BT, size_q)}
    kf = {
        "k": to_blocks(k_BSNH, size_k),
        "x": [jax.tree.map(lambda a: to_blocks(a, size_k), t.k_arrays) for t in terms],
    }
    kn = {"pos": to_blocks(k_positions_BS, size_k), "seg": to_blocks(k_segment_ids_BS, size_k)}
    if k_index_BS is not None:  # padding keys get a huge index: never visible
        pad = layout.count_k * size_k - length_k
        padded_BS = jnp.pad(k_index_BS, ((0, 0), (0, pad)), constant_values=EMPTY_KEY_INDEX)
        kn["idx"] = to_blocks(padded_BS.astype(jnp.int32), size_k)
    if sink_tokens:
        if k_rank_BS is None:
            k_rank_BS = segments.segment_rank_BS(k_segment_ids_BS)
        kn["rank"] = to_blocks(k_rank_BS.astype(jnp.int32), size_k)
    if sink_N is not None and normalizer.kind != "softmax":
        raise ValueError(
            f"engine: sink_N joins a softmax denominator; normalizer {normalizer.kind!r} has none"
        )
    data = {
        "sink": sink_N,
        "params": [t.params for t in terms],
        "qf": qf,
        "qn": qn,
        "kf": kf,
        "kn": kn,
        "v": to_blocks(v_BSNW, size_k),
        "offset": jnp.asarray(offset, jnp.int32),
    }
    flash_applies = normalizer.kind == "softmax" and all(t.init is None for t in terms)
    if backward == "flash" and not flash_applies:
        raise ValueError(
            "engine: backward='flash' needs softmax and no term with a carry; use 'remat'"
        )
    # "auto": flash where it applies and the walk is long. Up to REMAT_WALKS_ABOVE key blocks
    # the remat backward keeps every walk's carries and recomputes no walk, and measured
    # faster (FoX at T = 1024: remat 326 ms, flash 419 ms; experiments/results/bench.md).
    flash = backward == "flash" or (
        backward == "auto" and flash_applies and layout.count_k > REMAT_WALKS_ABOVE
    )
    if flash:
        out_GBQNW = _flash_walk(layout)(data)
        stat_GBNQ = None
    else:
        out_GBQNW, stat_GBNQ = _remat_walk(layout, data)
    y_BTNW = from_blocks(out_GBQNW, length_q).astype(v_BSNW.dtype)
    if stat_GBNQ is None:
        return y_BTNW, None
    stat_BNT = jnp.moveaxis(from_blocks(jnp.moveaxis(stat_GBNQ, 3, 2), length_q), 2, 1)
    return y_BTNW, stat_BNT
