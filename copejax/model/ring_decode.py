"""Decoding a window layer from a ring buffer, for every scheme that allows it.

A sliding-window layer (query i sees keys ``i - W < j <= i`` of its segment, plus the
segment's first n keys; StreamingLLM, arXiv 2309.17453) never reads a key older than W, so its
decode cache is a ring of W slots plus n sink slots (:class:`copejax.ops.kv_cache.RingCache`)
whatever the generated length. The slots also keep each key's position, segment id, index,
rank in its segment and the scheme's per-key decode state (``AttentionSite.cache_state``:
FoX's prefix sums of log forget gates, CoPE's gate keys, TAPE's position tensors, PaTH's
projections and rewritten keys).

A call reads the slots **in key order**: the n + W old slots sorted by key index, empty ones
first, then the call's T new keys. On that *view* of n + W + T keys every scheme runs the
same decode logic as on a full cache, with the view's slot ``n + W`` as query 0's index
(``ctx.cache_index``) and each key's index shifted by the same amount (``ctx.k_index_BS``),
so the window mask, the causal order and every in-key-order sum (CoPE's counts, stick-breaking's
remainders, PaTH's products) are those of the full cache restricted to the keys a query may
see. Keys outside the window are never visible to this or any later query, so the result
equals the full forward with the window mask: ``tests/test_ring_decode.py``.

With CoPE the counts then cover only the window plus the kept sinks, as in the full forward
with a window (a valid variant, not the paper's full-context CoPE). A scheme that cannot
decode from the ring refuses it with the reason (``PositionScheme.ring_decode_refusal``):
PaTH when its short convolution reads further back than the window, selective attention
with ``prune_budget`` (its buffer counts every key of the segment not yet evicted, also keys
that left the window). ``model.window_decode_cache = "full"`` decodes window layers with the
full cache and the window mask instead (exact; memory grows). A site that keeps per-key arrays
of its own (selective attention's penalties) keeps them in ring slots too, through
``ctx.ring_view``.

Shape letters: B batch, T new tokens, R ring slots (n + W), V view slots (R + T), N heads,
K key/value heads, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from copejax.model.attention_paths import ring_cache_applies
from copejax.model.config import ModelConfig
from copejax.ops import segments
from copejax.ops.engine_blocks import EMPTY_KEY_INDEX
from copejax.ops.kv_cache import RingCache, RingView
from copejax.positions.base import AttentionContext, AttentionSite

# What the ring keeps for every key besides the scheme's own arrays.
_META = ("positions", "segment_ids", "key_plus1", "rank")
# The length probed by unbounded_decode: a scheme that decodes this far takes any length.
ANY_LENGTH = 2**30


def ring_refusal(cfg: ModelConfig) -> str | None:
    """Why ``cfg``'s window layer cannot decode from a ring buffer (None: it can, or it is no
    window layer)."""
    if cfg.window is None:
        return None
    return cfg.scheme.ring_decode_refusal(cfg.dims, cfg.window)


def check_ring(cfg: ModelConfig) -> None:
    """Raises ValueError when ``cfg``'s window layer should decode from a ring and cannot."""
    reason = ring_refusal(cfg) if cfg.window_decode_cache == "ring" else None
    if reason is not None:
        raise ValueError(
            f"model.window_decode_cache='ring': a window layer of {cfg.scheme.name!r} cannot "
            f"decode from a ring buffer of window={cfg.window} slots: {reason}. Set "
            "model.window_decode_cache='full' to decode with the full cache and the window "
            "mask (exact; memory grows with the length)"
        )


def unbounded_decode(cfg: ModelConfig) -> bool:
    """Whether every layer of ``cfg`` decodes from a ring buffer and its scheme takes any
    length (``PositionScheme.check_decode``), so that the model-wide cursor needs only the
    write index and decoding may go past ``max_len`` (:class:`copejax.ops.kv_cache.DecodeCursor`).
    A scheme with a position table (learned positions, Shaw's distances) keeps the bounded
    cursor, which refuses lengths beyond its table."""
    for layer in {cfg.for_layer(i) for i in range(cfg.num_layers)}:
        if not ring_cache_applies(layer) or ring_refusal(layer) is not None:
            return False
        try:
            layer.scheme.check_decode(layer.dims, ANY_LENGTH)
        except (ValueError, NotImplementedError):
            return False
    return True


def _in_order(a_BR: jax.Array, order_BR: jax.Array) -> jax.Array:
    """``a_BR`` (B, R, ...) with its slots permuted by ``order_BR`` (B, R)."""
    index = order_BR.reshape(*order_BR.shape, *([1] * (a_BR.ndim - 2)))
    return jnp.take_along_axis(a_BR, index, axis=1)


def decode_ring(
    site: AttentionSite,
    ring: RingCache,
    *,
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    ctx: AttentionContext,
) -> tuple[jax.Array, jax.Array, jax.Array, AttentionContext]:
    """Decode mode of a window layer: the ring's slots in key order, then the T new keys.

    Args:
      site: the layer's attention sites.
      ring: the layer's :class:`RingCache` (n sink slots and a ring of W).
      q_BTNH, k_BTKH, v_BTKH: the new tokens' projections (before the qk site).
      ctx: the decode context (``cache_index`` the first new key's index; the cursor's ids).

    Returns:
      the queries after the qk site, the view's keys and values (B, V, K, H; N heads where the
      qk site made per-query-head keys, as TAPE does) and the view's context: query 0 at
      index R, the view's positions, ids, shifted key indices, ranks and ``key_state``.
    """
    batch, length = q_BTNH.shape[:2]
    slots = ring.window + ring.sink_tokens
    q_ids_BT = ctx.ids()[0]
    index_T = ctx.cache_index + jnp.arange(length, dtype=jnp.int32)
    old = ring.read()  # empty while the cache is being created
    plus1_BR = old.get("key_plus1", jnp.zeros((batch, slots), jnp.int32))
    order_BR = jnp.argsort(plus1_BR, axis=1, stable=True)  # empty slots first, then key order
    plus1_BR = _in_order(plus1_BR, order_BR)
    empty_BR = plus1_BR == 0
    view = {name: _in_order(a, order_BR) for name, a in old.items() if name != "key_plus1"}

    def meta(name: str, new_BT: jax.Array) -> jax.Array:
        old_BR = view.get(name, jnp.zeros((batch, slots), jnp.int32))
        return jnp.concatenate([old_BR, new_BT.astype(jnp.int32)], axis=1)

    ids_BV = meta("segment_ids", q_ids_BT)
    # An empty slot gets an id no key of the view has, so it never continues a segment.
    ids_BV = ids_BV.at[:, :slots].set(
        jnp.where(empty_BR, jnp.min(ids_BV, axis=1, keepdims=True) - 1, ids_BV[:, :slots])
    )
    # Each new key's rank in its segment from the last old key's (the ring keeps key
    # index - 1 whatever W and n), so the ring needs nothing from the model-wide cursor.
    starts_BT = segments.segment_starts_BT(q_ids_BT, ids_BV, slots)
    t_T = jnp.arange(length, dtype=jnp.int32)
    start_BT = jax.lax.cummax(jnp.where(starts_BT, t_T, -1), axis=1)
    last_rank_B1 = view.get("rank", jnp.zeros((batch, slots), jnp.int32))[:, -1:]
    rank_BT = jnp.where(start_BT >= 0, t_T - start_BT, last_rank_B1 + 1 + t_T)
    shift = slots - ctx.cache_index  # view index = key index + shift; query 0 at R
    index_BR = jnp.where(empty_BR, EMPTY_KEY_INDEX, plus1_BR - 1 + shift)
    ctx = ctx.replace(
        cache_index=jnp.asarray(slots, jnp.int32),
        k_positions_BS=meta("positions", ctx.q_positions_BT),
        k_segment_ids_BS=ids_BV,
        k_index_BS=jnp.concatenate(
            [index_BR, jnp.broadcast_to(slots + jnp.arange(length), (batch, length))], axis=1
        ),
        k_rank_BS=meta("rank", rank_BT),
        key_state=None,
        ring_view=RingView(order_BR, index_T, rank_BT, ring.window, ring.sink_tokens),
    )

    def full(name: str, new_BT: jax.Array) -> jax.Array:
        """The view of one per-key array: the old slots in key order, then the new keys."""
        old_BR = view.get(name)
        if old_BR is None:
            old_BR = jnp.zeros((batch, slots, *new_BT.shape[2:]), new_BT.dtype)
        return jnp.concatenate([old_BR, new_BT.astype(old_BR.dtype)], axis=1)

    # As on a full cache: the state read before this call's writes, zeros at the new slots.
    cached = {n: a for n, a in view.items() if n not in _META}
    padded = {
        name: full(name, jnp.zeros((batch, length, *a_BR.shape[2:]), a_BR.dtype))
        for name, a_BR in cached.items()
    }
    state_BT = site.cache_state(k_BTKH, v_BTKH, ctx.replace(key_state=padded or None))
    state = {name: full(name, new_BT) for name, new_BT in state_BT.items()}
    ctx = ctx.replace(key_state=state or None)
    qk_ctx = ctx.replace(k_positions_BS=ctx.q_positions_BT)  # qk sees the new keys only
    q_BTNH, k_BTKH, v_BTKH = site.qk(q_BTNH, k_BTKH, v_BTKH, qk_ctx)
    kv = {"key": full("key", k_BTKH), "value": full("value", v_BTKH)}
    updates = site.cache_update(kv, ctx)  # read by later calls; this one attends to kv
    written = {**kv, **state, **updates}
    unsort_BR = jnp.argsort(order_BR, axis=1)
    rewritten = {name: _in_order(a_BV[:, :slots], unsort_BR) for name, a_BV in updates.items()}
    new = {name: a_BV[:, slots:] for name, a_BV in written.items()}
    new.update(positions=ctx.q_positions_BT.astype(jnp.int32), segment_ids=q_ids_BT)
    ring(new, index_T, rank_BT, rewritten)
    return q_BTNH, kv["key"], kv["value"], ctx
