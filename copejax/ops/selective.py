"""Selective attention's cores (Leviathan et al. 2024, arXiv 2410.02703), pure functions: the
selection S of one head, its causal accumulation F over earlier queries, the bias -F with
threshold pruning, and the memory-budget eviction rule. The scheme is
``copejax.positions.selective``; its block form is ``copejax.ops.selective_block``.

Shapes: B batch, T queries, S keys, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NONLINEARITIES = ("relu", "sigmoid")
# Added to the logit of a pruned key: its weight is exactly zero (the query's own key and the
# segment's first key are never pruned, so every row keeps a finite maximum).
PRUNED_LOGIT = -1e30


def selection_BTS(
    logits_BTS: jax.Array,
    allowed_BTS: jax.Array,
    first_BS: jax.Array,
    q_index_T: jax.Array,
    k_index_S: jax.Array,
    *,
    nonlinearity: str = "relu",
) -> jax.Array:
    """The selection matrix S of one head, zero where the paper's constraints forbid it.

    Args:
      logits_BTS: the selecting head's scaled content logits (float32).
      allowed_BTS: causal, same-segment mask.
      first_BS: True where key s is the first token of its segment (never masked).
      q_index_T: key index of each query (``cache_index + t``); k_index_S: index of each key.
      nonlinearity: "relu" (the paper's Figure 2) or "sigmoid".

    Returns:
      S_BTS, float32, >= 0; exactly zero off ``allowed``, on first tokens and on the diagonal.
    """
    logits_BTS = logits_BTS.astype(jnp.float32)
    if nonlinearity == "relu":
        s_BTS = jax.nn.relu(logits_BTS)
    elif nonlinearity == "sigmoid":
        s_BTS = jax.nn.sigmoid(logits_BTS)
    else:
        raise ValueError(
            f"selective: nonlinearity must be one of {NONLINEARITIES}, got {nonlinearity!r}"
        )
    self_TS = q_index_T[:, None] == k_index_S[None, :]
    keep_BTS = allowed_BTS & ~first_BS[:, None, :] & ~self_TS[None]
    return jnp.where(keep_BTS, s_BTS, 0.0)


def accumulated_penalty_BTS(s_BTS: jax.Array, previous_BS: jax.Array | None = None) -> jax.Array:
    """F_ts = previous_s + sum_{t' < t} S_t's: the exclusive cumulative sum over queries.

    ``previous_BS`` is the penalty accumulated by earlier queries (the cache's, when decoding).
    """
    f_BTS = jnp.cumsum(s_BTS, axis=1) - s_BTS
    if previous_BS is not None:
        f_BTS = f_BTS + previous_BS[:, None, :].astype(jnp.float32)
    return f_BTS


def penalty_bias(f_BTS: jax.Array, prune_threshold: float | None) -> jax.Array:
    """-F, or PRUNED_LOGIT where F exceeds the pruning threshold."""
    bias_BTS = -f_BTS
    if prune_threshold is not None:
        bias_BTS = jnp.where(f_BTS > prune_threshold, PRUNED_LOGIT, bias_BTS)
    return bias_BTS


NEVER = 2.0**30  # eviction time of a key that is never evicted


def budget_eviction_times(
    q_BTH: jax.Array,
    k_BSH: jax.Array,
    *,
    q_ids_BT: jax.Array,
    k_ids_BS: jax.Array,
    first_BS: jax.Array,
    offset: jax.Array | int,
    budget: int,
    nonlinearity: str,
    previous_f_BS: jax.Array | None = None,
    previous_evicted_BS: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The paper's fixed-budget context pruning, query by query.

    Query t (key ``offset + t``) first adds its own key to its segment's buffer; if the buffer
    then holds more than ``budget`` keys, the one with the largest ``F_tj`` (ties: the oldest)
    is evicted; then t attends. ``F`` is accumulated along the way from the selecting head's
    queries and keys (the same S as :func:`selection_BTS`).

    Args:
      q_BTH, k_BSH: the selecting head's queries and keys (after the qk site).
      q_ids_BT, k_ids_BS: segment ids; first_BS: first keys of segments.
      offset: key index of query 0 (the cache index when decoding).
      budget: buffer size per segment, >= 1.
      previous_f_BS, previous_evicted_BS: the cache's F and eviction flags before the call.

    Returns:
      (eviction time (B, S) float32: the key index of the query that evicted the key, -1 when
      evicted before this call, NEVER otherwise; evicted flags after the call (B, S) bool).
    No gradient flows through the (discrete) evictions.
    """
    q_BTH = jax.lax.stop_gradient(q_BTH)
    k_BSH = jax.lax.stop_gradient(k_BSH)
    batch, length_k = k_BSH.shape[:2]
    scale = 1.0 / math.sqrt(q_BTH.shape[-1])
    k_index_S = jnp.arange(length_k)
    f_BS = jnp.zeros((batch, length_k), jnp.float32)
    if previous_f_BS is not None:
        f_BS = jax.lax.stop_gradient(previous_f_BS.astype(jnp.float32))
    evicted_BS = jnp.zeros((batch, length_k), bool)
    if previous_evicted_BS is not None:
        evicted_BS = previous_evicted_BS.astype(bool)
    times_BS = jnp.where(evicted_BS, -1.0, NEVER)

    def step(carry: tuple, inputs: tuple) -> tuple[tuple, None]:
        f_BS, evicted_BS, times_BS = carry
        t, q_BH, ids_B = inputs
        q_index = offset + t
        allowed_BS = (k_index_S[None] <= q_index) & (k_ids_BS == ids_B[:, None])
        live_BS = allowed_BS & ~evicted_BS
        over_B = jnp.sum(live_BS, axis=-1) > budget
        victim_B = jnp.argmax(jnp.where(live_BS, f_BS, -jnp.inf), axis=-1)
        evict_BS = over_B[:, None] & (k_index_S[None] == victim_B[:, None])
        logits_BS = jnp.einsum("BH,BSH->BS", q_BH, k_BSH, preferred_element_type=jnp.float32)
        s_BS = selection_BTS(
            logits_BS[:, None] * scale,
            allowed_BS[:, None],
            first_BS,
            jnp.reshape(q_index, (1,)),
            k_index_S,
            nonlinearity=nonlinearity,
        )[:, 0]
        times_BS = jnp.where(evict_BS, q_index.astype(jnp.float32), times_BS)
        return (f_BS + s_BS, evicted_BS | evict_BS, times_BS), None

    length_q = q_BTH.shape[1]
    xs = (jnp.arange(length_q), jnp.moveaxis(q_BTH, 1, 0), jnp.moveaxis(q_ids_BT, 1, 0))
    offset = jnp.asarray(offset, jnp.int32)
    (_, evicted_BS, times_BS), _ = jax.lax.scan(step, (f_BS, evicted_BS, times_BS), xs)
    return times_BS, evicted_BS


def evicted_bias(bias_BTS: jax.Array, q_index_T: jax.Array, times_BS: jax.Array) -> jax.Array:
    """PRUNED_LOGIT where key s was evicted at or before query t's turn."""
    gone_BTS = q_index_T[None, :, None].astype(jnp.float32) >= times_BS[:, None, :]
    return jnp.where(gone_BTS, PRUNED_LOGIT, bias_BTS)
