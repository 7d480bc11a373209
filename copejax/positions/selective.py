"""Selective attention (Leviathan, Kalman & Matias 2024, arXiv 2410.02703): tokens mask later
tokens' view of earlier ones.

Section 3 and Figure 2 of the paper: one existing head's scaled logits, passed through a ReLU,
form the selection matrix ``S_kj = relu(l^h_kj)`` ("token k decides that token j is no longer
needed"), with three constraints: causal (``S_kj = 0`` for j > k), the first token is never
masked (``S_k0 = 0``, the paper's <BOS>), and no token masks itself (``S_kk = 0``). The
accumulated mask ``F_ij = sum_{k < i} S_kj`` (the sketch's roll by one query, then a cumulative
sum over queries) is subtracted from the logits of every head before the softmax. Nothing is
learned. Here "the first token" is the first token of each packed segment, and the sums run
within a segment (S is zero across segments), so packed documents are independent.

Paths: the naive bias reads the content logits; the blockwise engine adds, per (query block,
key block) pair, the within-block exclusive cumulative sum of S over the block's queries to a
per-(query block, key) prefix ``P_gj = sum_{k < first query of block g} S_kj`` computed before
the walk (one pass over query blocks against all keys, (B, S, G) floats: O(T^2 / Q) memory,
e.g. 4 MiB per row at T = 16K, Q = 256). The engine walks query blocks independently, so an
O(T) form would need a carry across query blocks in the engine itself. Measured (XLA's memory
analysis of the layer's gradient on CPU, B = 1, D = 128, N = 4, blocks of 256): 38.5 MiB of
temporaries at T = 4096 and 78 MiB at 8192 on the engine, 1.56 GiB on the naive path at 4096.
Decoding keeps the
accumulated ``F`` of every cache slot in the "cache" collection (:class:`PenaltyCache`): each
call adds the new queries' rows of S, so prefill + steps equal the full forward (with
``prune_budget``, :class:`EvictionCache` keeps each slot's evicted flag as well).

Context pruning (Section 4 of the paper): because S >= 0, ``F_ij`` never decreases in i, so a
key whose F exceeds a threshold stays masked for every later query and can be evicted from the
cache. ``prune_threshold`` masks those keys exactly (zero weight) on every path, so cached and
uncached evaluation agree. ``prune_budget`` is the paper's memory-budget rule: a context
buffer of at most that many keys per segment; when query i's key joins a full buffer, the
buffered key with the largest ``F_ij`` is evicted (ties: the oldest) before query i attends, and
never returns. The evictions are sequential in the queries: a scan over the queries with a
(B, S) state (:func:`budget_eviction_times`, O(S) memory per step, O(T S H) work) gives each
key its eviction time, which every path (naive, engine, decode) reads as a per-key array. The
fixed-slot cache keeps evicted slots (the masking is exact, the memory is not reclaimed).
Sources checked for these rules: the paper's Figure 2 sketch (ReLU, <BOS>, self, roll and
cumsum, as transcribed in public reimplementations) and the budget-eviction loop of one public
reimplementation; the per-segment buffer and the tie rule are this module's choices.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.ops import segments
from copejax.ops.engine_blocks import BlockTerm
from copejax.ops.kv_cache import CACHE, RingView
from copejax.ops.selective import (
    NONLINEARITIES,
    accumulated_penalty_BTS,
    budget_eviction_times,
    evicted_bias,
    penalty_bias,
    selection_BTS,
)
from copejax.ops.selective_block import block_column_sums, selective_pair
from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Dims,
    PositionScheme,
    check_choice,
)
from copejax.positions.registry import register


@register
@dataclasses.dataclass(frozen=True)
class Selective(PositionScheme):
    """Selective attention: one head's ReLU'd logits, accumulated over earlier queries,
    subtracted from every head's logits. Parameter-free.

    Options:
      head: the head whose logits select (the paper reuses an existing head; default 0).
      nonlinearity: "relu" (default, the paper's Figure 2) or "sigmoid" (not the paper's sketch;
        offered as the bounded alternative the issue names: every allowed pair then adds a
        positive amount, so F grows with the distance even for uninformative logits).
      prune_threshold: None (default), or t > 0: a key whose accumulated F exceeds t gets zero
        weight for the query and every later one (the paper's context pruning, Section 4, as a
        threshold rule). Applied on every path; meant for evaluation of a model trained without.
      prune_budget: None (default), or an integer >= 1: the paper's memory budget, at most
        that many keys per segment in the buffer; when a new key overfills it, the buffered
        key with the largest F (ties: the oldest) is evicted for good
        (:func:`budget_eviction_times`). Applied on every path, like ``prune_threshold``.

    Used alone it is also the model's only position signal besides causality (like NoPE); the
    paper combines it with the baseline's own encoding (``selective+rope``).
    """

    name = "selective"
    sites = ("bias",)
    cache_in_key_order = True
    paper = "Leviathan et al. 2024, arXiv 2410.02703"

    head: int = 0
    nonlinearity: str = "relu"
    prune_threshold: float | None = None
    prune_budget: int | None = None

    def validate(self, dims: Dims) -> None:
        check_choice(self.name, "nonlinearity", self.nonlinearity, NONLINEARITIES)
        head = self.head
        if isinstance(head, bool) or not isinstance(head, int) or not 0 <= head < dims.num_heads:
            raise ValueError(
                f"{self.name}: head must be an integer in [0, {dims.num_heads}), got {head!r}"
            )
        threshold = self.prune_threshold
        if threshold is not None and (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or not math.isfinite(threshold)
            or threshold <= 0
        ):
            raise ValueError(
                f"{self.name}: prune_threshold must be None or a finite number > 0, "
                f"got {threshold!r}"
            )

        budget = self.prune_budget
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 1
        ):
            raise ValueError(
                f"{self.name}: prune_budget must be None or an integer >= 1, got {budget!r}"
            )

    def ring_decode_refusal(self, dims: Dims, window: int) -> str | None:
        if self.prune_budget is None:
            return None
        return (
            f"prune_budget={self.prune_budget} keeps a buffer of every key of the segment not "
            "yet evicted, also keys that left the window, which the ring does not keep"
        )

    def attention_module(self, dims: Dims) -> AttentionSite:
        return _SelectiveSite(dims=dims, scheme=self, name=self.name)


class PenaltyCache(nn.Module):
    """Decode mode: the accumulated penalty F of every cache slot, (B, S) float32.

    Unlike the key cache, whose slots are written once, every call adds the new queries' rows
    of S to every slot; returns the total before this call. A window layer decoding from its
    ring buffer (``ring``: ``AttentionContext.ring_view``) keeps one total per ring slot.
    """

    @nn.compact
    def __call__(self, added_BS: jax.Array, ring: RingView | None = None) -> jax.Array:
        shape = added_BS.shape if ring is None else (added_BS.shape[0], ring.order_BR.shape[1])
        total = self.variable(CACHE, "selective_penalty", jnp.zeros, shape, jnp.float32)
        previous_BS = total.value if ring is None else ring.view(total.value)
        updated_BS = previous_BS + added_BS.astype(jnp.float32)
        total.value = updated_BS if ring is None else ring.store(updated_BS)
        return previous_BS


class EvictionCache(nn.Module):
    """Decode mode with ``prune_budget``: 1.0 where a cache slot was evicted, (B, S)."""

    @nn.compact
    def __call__(self, evicted_BS: jax.Array) -> jax.Array:
        flags = self.variable(CACHE, "selective_evicted", jnp.zeros, evicted_BS.shape, jnp.float32)
        previous_BS = flags.value
        flags.value = evicted_BS.astype(jnp.float32)
        return previous_BS


def _kv_head(head: int, q_heads: int, k_heads: int) -> int:
    """The key head that query head ``head`` reads (grouped-query attention shares keys)."""
    return head // (q_heads // k_heads)


class _SelectiveSite(AttentionSite):
    scheme: Selective = Selective()

    def setup(self) -> None:
        self.penalty_cache = PenaltyCache(name="penalty")  # decode mode only
        self.eviction_cache = EvictionCache(name="evictions")  # decode with prune_budget

    def _eviction_times(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        ctx: AttentionContext,
        first_BS: jax.Array,
        previous_f_BS: jax.Array | None,
    ) -> jax.Array:
        """Each key's eviction time under ``prune_budget`` (updating the decode cache)."""
        s = self.scheme
        q_ids_BT, k_ids_BS = ctx.ids()
        k_head = _kv_head(s.head, q_BTNH.shape[2], k_BSNH.shape[2])
        previous_evicted_BS = None
        if ctx.decode:  # read the flags, then store the ones after this call
            previous_evicted_BS = self.eviction_cache.variables.get(CACHE, {}).get(
                "selective_evicted"
            )
        times_BS, evicted_BS = budget_eviction_times(
            q_BTNH[:, :, s.head],
            k_BSNH[:, :, k_head],
            q_ids_BT=q_ids_BT,
            k_ids_BS=k_ids_BS,
            first_BS=first_BS,
            offset=ctx.cache_index,
            budget=s.prune_budget,
            nonlinearity=s.nonlinearity,
            previous_f_BS=previous_f_BS,
            previous_evicted_BS=previous_evicted_BS,
        )
        if ctx.decode:
            self.eviction_cache(evicted_BS)
        return times_BS

    def _first_keys(self, ctx: AttentionContext) -> jax.Array:
        """(B, S) True where key s is the first of its segment."""
        _, k_ids_BS = ctx.ids()
        return segments.segment_starts_BT(k_ids_BS)

    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array:
        s = self.scheme
        length_q, length_k = logits_BNTS.shape[2], logits_BNTS.shape[3]
        s_BTS = selection_BTS(
            logits_BNTS[:, s.head],
            ctx.mask_BTS,
            self._first_keys(ctx),
            ctx.cache_index + jnp.arange(length_q),
            jnp.arange(length_k),
            nonlinearity=s.nonlinearity,
        )
        previous_BS = None
        if ctx.decode:
            previous_BS = self.penalty_cache(jnp.sum(s_BTS, axis=1), ctx.ring_view)
        f_BTS = accumulated_penalty_BTS(s_BTS, previous_BS)
        self.sow("intermediates", "penalty_BTS", f_BTS)
        bias_BTS = penalty_bias(f_BTS, s.prune_threshold)
        if s.prune_budget is not None:
            first_BS = self._first_keys(ctx)
            times_BS = self._eviction_times(q_BTNH, k_BSNH, ctx, first_BS, previous_BS)
            bias_BTS = evicted_bias(bias_BTS, ctx.cache_index + jnp.arange(length_q), times_BS)
        return jnp.where(ctx.mask_BTS, bias_BTS, 0.0)[:, None]

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        """The within-block sums per pair plus the per-(query block, key) prefix P (B, S, G)."""
        s = self.scheme
        length_q = q_BTNH.shape[1]
        size_q = min(ctx.block, length_q)  # the engine's query block length
        first_BS = self._first_keys(ctx)
        k_head = _kv_head(s.head, q_BTNH.shape[2], k_BSNH.shape[2])
        colsums_GBS = block_column_sums(
            q_BTNH[:, :, s.head],
            k_BSNH[:, :, k_head],
            *ctx.ids(),
            first_BS,
            offset=ctx.cache_index,
            size_q=size_q,
            nonlinearity=s.nonlinearity,
        )
        prefix_GBS = jnp.cumsum(colsums_GBS, axis=0) - colsums_GBS
        previous_BS = None
        if ctx.decode:
            previous_BS = self.penalty_cache(jnp.sum(colsums_GBS, axis=0), ctx.ring_view)
            prefix_GBS = prefix_GBS + previous_BS[None]
        k_arrays = {"prefix": jnp.moveaxis(prefix_GBS, 0, 2), "first": first_BS.astype(jnp.float32)}
        if s.prune_budget is not None:
            k_arrays["evicted_at"] = self._eviction_times(
                q_BTNH, k_BSNH, ctx, first_BS, previous_BS
            )
        batch = q_BTNH.shape[0]
        group_BT = jnp.broadcast_to(
            (jnp.arange(length_q) // size_q).astype(jnp.float32), (batch, length_q)
        )
        pair = functools.partial(
            selective_pair,
            head=s.head,
            nonlinearity=s.nonlinearity,
            size_q=size_q,
            prune_threshold=s.prune_threshold,
        )
        return (
            BlockTerm(
                pair,
                q_arrays={"group": group_BT},
                k_arrays=k_arrays,
            ),
        )
