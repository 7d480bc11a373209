"""What the fused kernels share about one (query tile, key tile) pair (issue 45).

Masks, the test that skips a fully masked pair, the key tiles a query tile walks and the
query tiles a key tile walks, and the scores of a pair (content logits plus the terms'
biases). The mask is :func:`copejax.ops.segments.pair_allowed_BQK`'s, one head and one row:
query i sees key j iff ``j <= i``, both belong to the same segment and, with a window W,
``i - W < j`` or j is among its segment's first ``sink_tokens`` keys (StreamingLLM,
arXiv 2309.17453); a full pair (every entry allowed) runs without the mask
(:meth:`Plan.run_pair`). The GPU kernels' exponentials are ``exp2`` (:data:`LOG2E`,
:func:`exp_gpu`, :func:`sigmoid_gpu`); the bfloat16-pieces matmuls are
:mod:`copejax.ops.kernels.exact_dots`'.

Shape letters: Q / K the tile's queries / keys, H head dim.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from copejax.ops.kernels.terms import TileBias, pair_grid, tile_bias_QK

MASKED_LOGIT = -1e30
# Scores times LOG2E are in log2 units: exp(s) = exp2(LOG2E s). The GPU softmax kernels
# keep them so (the scale folded into one multiply) because jnp.exp lowers to libdevice's
# accurate expf, about nine instructions besides its ex2.approx, and exp2 to that one.
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static facts of one kernel call.

    Attributes:
      size_q, size_k: tile lengths (T and S are padded to multiples of them).
      count_q, count_k: tiles of queries and of keys.
      window: sliding window W, or None for full causal attention.
      sink_tokens: with a window, each segment's first n keys stay visible.
      groups: query heads per key/value head (grouped-query attention).
      biases: the terms' tile functions (:mod:`copejax.ops.kernels.terms`).
      interpret: run in Pallas interpret mode (any backend; the CPU's only mode).
      stick: stick-breaking replaces the softmax (:mod:`copejax.ops.kernels.stick`).
      include_self: whether query i sees key i (stick-breaking's default does not).
      cope: CoPE's static options when its carried count is in the kernels
        (:class:`copejax.ops.kernels.cope.CopeStatic`), else None.
      backend: "triton" (:mod:`copejax.ops.kernels.forward`, lowered to Triton on a GPU) or
        "tpu" (:mod:`copejax.ops.kernels.tpu_forward`, lowered to Mosaic TPU).
      q_offset: the token of query row 0 (key row j is token j): 0 for self-attention, else
        a later block of queries against an earlier block of keys
        (:mod:`copejax.ops.kernels.offset`; PaTH's levels), whose rows are parts of larger
        softmaxes. Every method that takes a query tile or its first row adds it.
      full_tiles: the softmax kernels (:mod:`copejax.ops.kernels.forward`,
        :mod:`~copejax.ops.kernels.backward`; on a TPU :mod:`~copejax.ops.kernels.tpu_forward`,
        :mod:`~copejax.ops.kernels.tpu_dq`, :mod:`~copejax.ops.kernels.tpu_backward`), and on
        a GPU stick-breaking's forward and dq and CoPE's forward kernels, run a pair whose
        every (query, key) is allowed (:meth:`full`) without the mask's (Q, K) compares and
        selects (:meth:`run_pair`); False: every live pair masked (a benchmark lever,
        :func:`~copejax.ops.kernels.padding.full_tiles_for_tracing`).
      carry_starts: stick-breaking's carry groups on a GPU
        (:mod:`copejax.ops.kernels.carry_groups`): each group's first key tile, then
        count_k; () elsewhere.
    """

    size_q: int
    size_k: int
    count_q: int
    count_k: int
    window: int | None
    sink_tokens: int
    groups: int
    biases: tuple[TileBias, ...]
    interpret: bool
    stick: bool = False
    include_self: bool = True
    cope: Any = None
    backend: str = "triton"
    q_offset: int = 0
    full_tiles: bool = True
    carry_starts: tuple[int, ...] = ()

    @property
    def carry_groups(self) -> int:
        """Carry checkpoints per head (stick-breaking on a GPU), 0 without groups."""
        return max(len(self.carry_starts) - 1, 0)

    def key_tile(self, kj: jax.Array, kseg_ref: Any, krank_ref: Any) -> tuple:
        """Key tile kj of a program that walks key tiles: (its first key, its slice of refs
        holding whole key rows, its segment ids and ranks (K,))."""
        k_first = kj * self.size_k
        keys = pl.ds(pl.multiple_of(k_first, self.size_k), self.size_k)
        return k_first, keys, kseg_ref[keys], krank_ref[keys]

    def key_group(self, kj: jax.Array) -> jax.Array:
        """The carry group of key tile kj, an int32 scalar from the static starts (a compare
        per group: no table read in the kernel; Triton's lowering adds no booleans to
        ints)."""
        kj = jnp.asarray(kj, jnp.int32)
        group = kj * 0  # a value of the kernel (Triton yields no literal from a branch)
        for s in self.carry_starts[1:-1]:
            group = jnp.where(kj >= s, group + 1, group)
        return group

    def group_tiles(self, g: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[first, end) of group g's key tiles."""
        first, end = jnp.int32(0), jnp.int32(0)
        for i, (start, stop) in enumerate(itertools.pairwise(self.carry_starts)):
            first, end = jnp.where(g == i, start, first), jnp.where(g == i, stop, end)
        return first, end

    @property
    def carry_rows(self) -> int:
        """Rows of the carries: with carry groups the groups' and a spare one (which takes the
        stores of the tiles that enter no group), else one per key tile (CoPE on a TPU),
        padded to a power of two (Triton's block shapes)."""
        rows = self.carry_groups + 1 if self.carry_starts else self.count_k
        return 1 << max(rows - 1, 0).bit_length()

    def entry_row(self, kj: jax.Array, last: jax.Array) -> tuple[pl.Slice, jax.Array]:
        """(the carry row a newest-first walk stores at live key tile kj, kj's group): the
        group's row where kj is the first live tile the walk meets in it (``last``: the group
        of the previous live tile, -1 before the first), else the spare row after the
        groups' (a store, no branch). The dead tiles passed change no carry, so that is the
        carry entering the group for a program that walks it newest first and skips them."""
        group = self.key_group(kj)
        return pl.ds(jnp.where(group != last, group, self.carry_groups), 1), group

    @property
    def sinks(self) -> int:
        return self.sink_tokens if self.window is not None else 0

    @property
    def unseen_lse(self) -> float:
        """The log-sum-exp written for a query with no allowed key: 0 (its output is 0 and
        its backward weights are 0 either way), or with a query offset ``MASKED_LOGIT``, so
        that the caller's merge with the rest of the row gives it no weight."""
        return MASKED_LOGIT if self.q_offset else 0.0

    def token(self, row: jax.Array) -> jax.Array:
        """The token of query row ``row``: the row itself, or after ``q_offset`` tokens."""
        return row + self.q_offset if self.q_offset else row

    def key_tiles(self, qi: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[first, end) of the key tiles query tile qi may see: every older tile (and the
        diagonal one), or with a window and no sinks the band that meets the window."""
        q_first = self.token(qi * self.size_q)
        end = jnp.minimum(_div(q_first + self.size_q - 1, self.size_k) + 1, self.count_k)
        if self.window is None or self.sinks:
            return jnp.int32(0), end
        first = _div(jnp.maximum(q_first - self.window + 1, 0), self.size_k)
        return first, end

    def query_tiles(self, kj: jax.Array) -> tuple[jax.Array, jax.Array]:
        """[first, end) of the query tiles that may see key tile kj."""
        k_first = kj * self.size_k
        if self.q_offset:  # the row of query token k_first, if any
            k_first = jnp.maximum(k_first - self.q_offset, 0)
        first = _div(k_first, self.size_q)
        if self.window is None or self.sinks:
            return first, jnp.int32(self.count_q)
        k_last = kj * self.size_k + self.size_k - 1
        if self.q_offset:  # the rows after the last one that may see k_last (>= 0 for _div)
            after = jnp.maximum(k_last + self.window - 1 - self.q_offset + self.size_q, 0)
            return first, jnp.minimum(_div(after, self.size_q), self.count_q)
        end = jnp.minimum(_div(k_last + self.window - 1, self.size_q) + 1, self.count_q)
        return first, end

    def live(
        self,
        q_first: jax.Array,
        k_first: jax.Array,
        q_segments_Q: jax.Array,
        k_segments_K: jax.Array,
        k_rank_K: jax.Array | None,
    ) -> jax.Array:
        """Whether the pair may hold an allowed (query, key): its keys are not all after its
        queries, the two tiles' segment id ranges meet, and with a window some key is in
        the band or is a sink. A boolean scalar; False skips the pair's work. ``q_first``:
        the query tile's first row (:meth:`token` gives its token)."""
        q_first = self.token(q_first)
        live = k_first <= q_first + self.size_q - 1
        live &= jnp.min(k_segments_K) <= jnp.max(q_segments_Q)
        live &= jnp.max(k_segments_K) >= jnp.min(q_segments_Q)
        if self.window is not None:
            near = k_first + self.size_k - 1 > q_first - self.window
            if self.sinks:
                near |= jnp.min(k_rank_K) < self.sinks
            live &= near
        return live

    def full(
        self,
        q_first: jax.Array,
        k_first: jax.Array,
        q_segments_Q: jax.Array,
        k_segments_K: jax.Array,
    ) -> jax.Array:
        """Whether every (query, key) of the pair is allowed: every key at or before the
        first query (before it without ``include_self``), one segment for all of them, and
        with a window every key inside every query's band. A boolean scalar; ``q_first`` the
        query tile's first row. Padding never makes a full pair (its segment ids are its
        own)."""
        q_first = self.token(q_first)
        k_last = k_first + self.size_k - 1
        full = k_last <= q_first if self.include_self else k_last < q_first
        segment = jnp.min(q_segments_Q)
        full &= jnp.max(q_segments_Q) == segment
        full &= (jnp.min(k_segments_K) == segment) & (jnp.max(k_segments_K) == segment)
        if self.window is not None:
            full &= q_first + self.size_q - 1 - k_first < self.window
        return full

    def run_pair(
        self, mask_args: tuple, compute: Callable, state: Any, *, mask_free: bool = True
    ) -> Any:
        """``compute(state, allowed_QK)`` on a live pair, ``state`` unchanged on a dead one
        (``lax.cond``): ``mask_args`` = (first query row, first key, segment ids (Q,) and
        (K,), ranks (K,)). With ``full_tiles`` and ``mask_free`` (``compute`` takes None) a
        full pair (:meth:`full`) passes None for the mask: every entry allowed, its compares
        and selects skipped."""
        masked = lambda s: compute(s, self.allowed_QK(*mask_args))
        body = masked
        if self.full_tiles and mask_free:
            full = self.full(*mask_args[:4])
            body = lambda s: jax.lax.cond(full, lambda t: compute(t, None), masked, s)
        return jax.lax.cond(self.live(*mask_args), body, lambda s: s, state)

    def allowed_QK(
        self,
        q_first: jax.Array,
        k_first: jax.Array,
        q_segments_Q: jax.Array,
        k_segments_K: jax.Array,
        k_rank_K: jax.Array | None,
    ) -> jax.Array:
        """The pair's mask (Q, K) bool; segment ids and ranks as (Q,) and (K,) (GPU) or
        (Q, 1) and (1, K) (TPU); ``q_first`` the query tile's first row."""
        q_index_Q1 = self.token(q_first) + jax.lax.broadcasted_iota(jnp.int32, (self.size_q, 1), 0)
        k_index_1K = k_first + jax.lax.broadcasted_iota(jnp.int32, (1, self.size_k), 1)
        if self.include_self:
            allowed_QK = k_index_1K <= q_index_Q1
        else:
            allowed_QK = k_index_1K < q_index_Q1
        q_segments_Q1, k_segments_1K = pair_grid(q_segments_Q, k_segments_K)
        allowed_QK &= q_segments_Q1 == k_segments_1K
        if self.window is not None:
            near_QK = q_index_Q1 - k_index_1K < self.window
            if self.sinks:
                near_QK |= pair_grid(q_segments_Q, k_rank_K)[1] < self.sinks
            allowed_QK &= near_QK
        return allowed_QK


def _div(a: jax.Array, b: int) -> jax.Array:
    """``a // b`` for ``a >= 0``: truncating division, which Mosaic TPU lowers without the
    sign op that floor division of signed integers uses (whose Mosaic lowering reads the
    TPU's chip info, so it does not export from a CPU)."""
    return jax.lax.div(jnp.asarray(a, jnp.int32), jnp.int32(b))


def content_logits_QK(q_QH: jax.Array, k_KH: jax.Array, unit: float = 1.0) -> jax.Array:
    """q . k / sqrt(H) in float32 (the inputs' dtype into the matmul, float32 out), times
    ``unit`` in the same multiply (:data:`LOG2E`: in log2 units)."""
    logits_QK = jax.lax.dot_general(
        q_QH, k_KH, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    return logits_QK * (unit / math.sqrt(q_QH.shape[-1]))


def scores_QK(
    plan: Plan,
    q_QH: jax.Array,
    k_KH: jax.Array,
    allowed_QK: jax.Array,
    term_inputs: tuple[list, list, list, jax.Array, jax.Array],
    *,
    unit: float = 1.0,
    at: list | None = None,
    split_rows: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array | None]:
    """Content logits plus every term's bias on allowed pairs, times ``unit``
    (:data:`LOG2E`: in log2 units), MASKED_LOGIT elsewhere (``allowed_QK`` None: every pair
    allowed, :meth:`Plan.run_pair`).

    ``term_inputs``: (params, q values, k values, q positions, k positions) of the tile;
    ``at``, ``split_rows``: the separable terms' origins, and (scores without their rows,
    the rows (Q,) or None), as :func:`~copejax.ops.kernels.terms.tile_bias_QK` takes them.
    """
    scores = content_logits_QK(q_QH, k_KH, unit)
    rows_Q = None
    if plan.biases:
        arrays, positions = term_inputs[:3], term_inputs[3:]
        bias = tile_bias_QK(
            plan.biases, arrays, *positions, unit=unit, at=at, split_rows=split_rows
        )
        bias_QK, rows_Q = bias if split_rows else (bias, None)
        scores = scores + bias_QK
    if allowed_QK is not None:
        scores = jnp.where(allowed_QK, scores, MASKED_LOGIT)
    return (scores, rows_Q) if split_rows else scores


def exp_gpu(x: jax.Array) -> jax.Array:
    """``exp(x)`` as the GPU kernels' bodies take it: ``exp2(LOG2E x)``, a multiply and one
    ex2.approx (relative error about 2^-22), where ``jnp.exp`` lowers to libdevice's
    accurate expf, about nine more instructions a value."""
    return jnp.exp2(x * LOG2E)


@jax.custom_jvp
def sigmoid_gpu(x: jax.Array) -> jax.Array:
    """``sigmoid(x)`` as the GPU kernels' bodies take it: ``1 / (1 + exp_gpu(-x))`` (Pallas's
    Triton lowering of ``jax.nn.sigmoid`` takes libdevice's expf), with the derivative
    ``s (1 - s)`` of the value, as ``jax.nn.sigmoid``'s."""
    return 1.0 / (1.0 + exp_gpu(-x))


@sigmoid_gpu.defjvp
def _sigmoid_gpu_jvp(primals: tuple, tangents: tuple) -> tuple[jax.Array, jax.Array]:
    s = sigmoid_gpu(primals[0])
    return s, s * (1.0 - s) * tangents[0]


def softmax_ds(
    s_QK: jax.Array,
    allowed_QK: jax.Array,
    lse_Q: jax.Array,
    dp_QK: jax.Array,
    delta_Q: jax.Array,
    *,
    log2: bool = False,
    exp: Callable[[jax.Array], jax.Array] = jnp.exp,
) -> tuple[jax.Array, jax.Array]:
    """(P, dS) of a pair from its scores, FlashAttention-2's backward: ``P = exp(s - L)`` on
    allowed pairs (``allowed_QK`` None: all), ``dS = P (dP - D)``; float32 (Q, K), the
    per-query L and D as (Q,) (the GPU kernels) or (Q, 1) columns (the TPU's). ``log2``:
    the scores are in log2 units (:data:`LOG2E`), L is not; else ``exp`` (:func:`exp_gpu`
    in the GPU kernels)."""
    lse_Q1, delta_Q1 = (x if x.ndim == 2 else x[:, None] for x in (lse_Q, delta_Q))
    if log2:
        p_QK = jnp.exp2(s_QK - lse_Q1 * LOG2E)
    else:
        p_QK = exp(s_QK - lse_Q1)
    if allowed_QK is not None:
        p_QK = jnp.where(allowed_QK, p_QK, 0.0)
    return p_QK, p_QK * (dp_QK - delta_Q1)


def dot_f32(a: jax.Array, b: jax.Array, contract: tuple[int, int]) -> jax.Array:
    """A matmul contracting axis ``contract[0]`` of ``a`` with ``contract[1]`` of ``b``,
    accumulated in float32."""
    return jax.lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32
    )


def scan_sum(x: jax.Array, axis: int, newer: bool, inclusive: bool) -> jax.Array:
    """Each entry's sum over the entries after it along ``axis`` (``newer``) or before it,
    itself included with ``inclusive``, float32, from one forward prefix sum (``jnp.cumsum``,
    Triton's scan; its lowering has no reverse scan): the newer sum is the total minus the
    prefix. The GPU kernels' within-tile sums (:func:`~copejax.ops.kernels.triton_params.
    gpu_scan`), where the tensor-core form is a matmul with a triangular ones matrix."""
    if newer:
        after = jnp.sum(x, axis=axis, keepdims=True) - jnp.cumsum(x, axis=axis)
        return after + x if inclusive else after
    prefix = jnp.cumsum(x, axis=axis)
    return prefix if inclusive else prefix - x
