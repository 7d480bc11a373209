"""The "cache" collection for incremental decoding (a KV cache; Pope et al. 2022, arXiv 2211.05102).

Three Linen modules keep their arrays in the ``cache`` collection
(``copejax.model.decode.init_cache``
creates them with zeros), the first two sized by the length S of the call that created them:

- :class:`DecodeCursor`, one per model: the write index, the positions and the segment ids of
  every cached token, and the decode mask of the new queries over the S cache slots;
- :class:`KeyCache`, one per attention layer: the keys and values after the qk site and any
  per-key arrays the position scheme keeps (``AttentionSite.cache_state``);
- :class:`RingCache`, instead, in a sliding-window layer: the same per-key arrays in n + W
  slots (``copejax.model.ring_decode``).

A call with T new tokens writes slots ``index .. index + T - 1`` and advances the index by T
(T > 1 is a prefill, T = 1 a step). New query t sits at slot ``index + t`` and may attend to
slot s iff ``s <= index + t`` (so s was written) and both are in the same segment.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

CACHE = "cache"


@struct.dataclass
class DecodeView:
    """What the model learns from the cursor for one decode call.

    Attributes:
      index: slot of the first new token (int32 scalar); query t is key ``index + t``.
      positions_BS: positions of the S cache slots (after this call's write).
      segment_ids_BS: segment ids of the S cache slots (after this call's write); new query t
        may attend to slot s iff s <= index + t and the ids match (``copejax.ops.segments``).
      fits: False when the call wrote past the cache's S slots (results are then invalid).
    """

    index: jax.Array
    positions_BS: jax.Array
    segment_ids_BS: jax.Array
    fits: jax.Array


class DecodeCursor(nn.Module):
    """The model's write index, cached positions and segment ids (B, S).

    ``unbounded``: the write index only, for a model whose every layer decodes from a ring
    buffer (``copejax.model.ring_decode.unbounded_decode``), which keeps what it needs of each key
    in
    its slots; the view's positions and ids are then the new tokens' (S = T) and decoding
    may go on past the cache's ``max_len``.
    """

    unbounded: bool = False

    @nn.compact
    def __call__(self, positions_BT: jax.Array, segment_ids_BT: jax.Array | None) -> DecodeView:
        if not self.has_variable(CACHE, "index") and not self.is_initializing():
            raise ValueError(
                "decode=True needs a cache: pass variables {'params': ..., 'cache': "
                "copejax.model.decode.init_cache(cfg, batch, max_len)} and mutable=['cache']"
            )
        batch, length = positions_BT.shape
        if segment_ids_BT is None:
            segment_ids_BT = jnp.zeros((batch, length), jnp.int32)
        index = self.variable(CACHE, "index", lambda: jnp.zeros((), jnp.int32))
        if self.unbounded:
            start = index.value
            index.value = start + length
            return DecodeView(
                index=start,
                positions_BS=positions_BT.astype(jnp.int32),
                segment_ids_BS=segment_ids_BT.astype(jnp.int32),
                fits=jnp.asarray(True),
            )
        positions = self.variable(CACHE, "positions", jnp.zeros, (batch, length), jnp.int32)
        segments = self.variable(CACHE, "segment_ids", jnp.zeros, (batch, length), jnp.int32)
        cache_batch, slots = positions.value.shape
        if cache_batch != batch or length > slots:
            raise ValueError(
                f"decode: {length} new tokens for batch {batch} do not fit a cache of batch "
                f"{cache_batch} with {slots} slots; allowed: the cache's batch and T <= {slots}"
            )
        start = index.value
        positions.value = jax.lax.dynamic_update_slice_in_dim(
            positions.value, positions_BT.astype(jnp.int32), start, axis=1
        )
        segments.value = jax.lax.dynamic_update_slice_in_dim(
            segments.value, segment_ids_BT.astype(jnp.int32), start, axis=1
        )
        index.value = start + length
        return DecodeView(
            index=start,
            positions_BS=positions.value,
            segment_ids_BS=segments.value,
            fits=start + length <= slots,
        )


class KeyCache(nn.Module):
    """One layer's cached per-key arrays, each (B, S, ...), written at the cursor's index."""

    @nn.compact
    def __call__(self, new: dict[str, jax.Array], index: jax.Array) -> dict[str, jax.Array]:
        """Writes each (B, T, ...) array of ``new`` at slots ``index ..``; returns (B, S, ...)."""
        full = {}
        for name, new_BT in new.items():
            slot = self.variable(CACHE, name, jnp.zeros, new_BT.shape, new_BT.dtype)
            slot.value = jax.lax.dynamic_update_slice_in_dim(
                slot.value, new_BT.astype(slot.value.dtype), index, axis=1
            )
            full[name] = slot.value
        return full

    def replace(self, arrays: dict[str, jax.Array]) -> None:
        """Overwrites whole cached arrays (B, S, ...) that exist already (in their dtype)."""
        for name, full in arrays.items():
            old = self.get_variable(CACHE, name)
            if old is None or old.shape != full.shape:
                raise ValueError(
                    f"KeyCache.replace: no cached array {name!r} of shape {full.shape}"
                )
            self.put_variable(CACHE, name, full.astype(old.dtype))

    def read(self) -> dict[str, jax.Array]:
        """The arrays cached so far (before this call's writes); empty before the first call."""
        return dict(self.variables.get(CACHE, {}))


class RingCache(nn.Module):
    """A window layer's cache: ``sink_tokens`` sink slots and a ring of ``window`` slots.

    Sliding-window attention (query i sees keys ``i - W < j <= i``) never reads a key older
    than W, so key j (not a sink) lives in ring slot ``n + j mod W``, overwriting key j - W;
    the cache's memory does not grow with the generated length. StreamingLLM's kept sinks
    (arXiv 2309.17453): sink slot r holds the latest key whose index within its segment is r
    (r < n); a new segment's first keys replace the old segment's, which no later query of
    the new segment may see. Each slot also keeps its key's position, segment id, index
    (``key_plus1``: index + 1, 0 for an empty slot), rank within its segment and the scheme's
    per-key decode state (``AttentionSite.cache_state``).

    A call reads the slots as they were before its writes (:func:`copejax.model.ring_decode.
    decode_ring` reads them in key order), the caller attends to them and to the call's own T
    keys, rewrites slots if its scheme updates cached arrays, and the call's keys are then
    written (the last W of them into the ring, those with rank < n into the sink slots).
    """

    window: int
    sink_tokens: int = 0

    @nn.compact
    def __call__(
        self,
        new: dict[str, jax.Array],
        key_index_T: jax.Array,
        rank_BT: jax.Array,
        rewritten: dict[str, jax.Array] | None = None,
    ) -> dict[str, jax.Array]:
        """Args: ``new`` (B, T, ...) arrays of the new keys (their key, value, positions,
        segment ids and the scheme's per-key state); ``key_index_T`` their key indices;
        ``rank_BT`` their index within their segment; ``rewritten`` whole (B, n + W, ...)
        arrays that replace the slots' before the new keys are written (PaTH's rank-1 updates
        of cached keys). Returns the slots before this call's writes, (B, n + W, ...), with
        ``key_index`` (B, n + W) (``EMPTY`` for an empty slot) and ``rank``."""
        from copejax.ops.engine_blocks import EMPTY_KEY_INDEX

        window, sinks = self.window, self.sink_tokens
        batch, length = rank_BT.shape
        arrays = {
            **new,
            "key_plus1": jnp.broadcast_to(key_index_T[None] + 1, (batch, length)).astype(jnp.int32),
            "rank": rank_BT.astype(jnp.int32),
        }
        slots = {
            name: self.variable(
                CACHE, name, jnp.zeros, (batch, sinks + window, *a.shape[2:]), a.dtype
            )
            for name, a in arrays.items()
        }
        old = {name: slot.value for name, slot in slots.items()}
        for name, full in (rewritten or {}).items():
            slots[name].value = full.astype(slots[name].value.dtype)
        for name, slot in slots.items():
            slot.value = ring_write(
                slot.value,
                arrays[name],
                key_index_T,
                rank_BT,
                window=window,
                sink_tokens=sinks,
                clear_sinks_in_ring=name == "key_plus1",  # a sink's ring slot reads empty
            )
        plus1_BR = old.pop("key_plus1")
        old["key_index"] = jnp.where(plus1_BR > 0, plus1_BR - 1, EMPTY_KEY_INDEX)
        return old

    def read(self) -> dict[str, jax.Array]:
        """The slots as they are (before this call's writes; ``key_plus1`` as stored), each
        (B, n + W, ...); empty before the cache exists (while initialising)."""
        return dict(self.variables.get(CACHE, {}))


def ring_write(
    slots_BR: jax.Array,
    new_BT: jax.Array,
    key_index_T: jax.Array,
    rank_BT: jax.Array,
    *,
    window: int,
    sink_tokens: int,
    clear_sinks_in_ring: bool = False,
) -> jax.Array:
    """One array of a ring (:class:`RingCache`) after writing T new keys: key j (rank >= n)
    into ring slot ``n + j mod W`` (the last min(T, W) keys, at distinct slots), the last new
    key of rank r < n into sink slot r. ``clear_sinks_in_ring``: a key of rank < n writes 0
    into its ring slot (the ``key_plus1`` marker of an empty slot).

    Args: ``slots_BR`` (B, n + W, ...); ``new_BT`` (B, T, ...); ``key_index_T`` the new keys'
    indices; ``rank_BT`` their index within their segment. Returns (B, n + W, ...).
    """
    batch, length = rank_BT.shape
    tail = min(length, window)
    ring_slot_T = sink_tokens + key_index_T[length - tail :] % window
    ring_BT = new_BT[:, length - tail :].astype(slots_BR.dtype)
    if clear_sinks_in_ring:
        keep_BT = rank_BT[:, length - tail :] >= sink_tokens
        ring_BT = jnp.where(
            keep_BT.reshape(*keep_BT.shape, *([1] * (ring_BT.ndim - 2))), ring_BT, 0
        )
    slots_BR = slots_BR.at[:, ring_slot_T].set(ring_BT)
    if not sink_tokens:
        return slots_BR
    match_BRT = rank_BT[:, None, :] == jnp.arange(sink_tokens)[None, :, None]
    extra = [1] * (new_BT.ndim - 2)
    has_BR = jnp.any(match_BRT, axis=-1).reshape(batch, sink_tokens, *extra)
    last_BR = length - 1 - jnp.argmax(match_BRT[..., ::-1], axis=-1)
    picked_BR = jnp.take_along_axis(new_BT, last_BR.reshape(batch, sink_tokens, *extra), axis=1)
    sink_BR = jnp.where(has_BR, picked_BR.astype(slots_BR.dtype), slots_BR[:, :sink_tokens])
    return slots_BR.at[:, :sink_tokens].set(sink_BR)


@struct.dataclass
class RingView:
    """How a ring decode call's view of the keys (:func:`copejax.model.ring_decode.decode_ring`: the
    n + W old slots in key order, then the T new keys) maps back to the ring's slots, for a
    site that keeps per-key arrays of its own in ring slots (selective attention's penalties).
    """

    order_BR: jax.Array  # view slot r holds ring slot order_BR[:, r]
    key_index_T: jax.Array
    rank_BT: jax.Array
    window: int = struct.field(pytree_node=False)
    sink_tokens: int = struct.field(pytree_node=False)

    def view(self, slots_BR: jax.Array) -> jax.Array:
        """(B, n + W, ...) ring slots -> (B, n + W + T, ...) view, zeros at the new keys."""
        index = self.order_BR.reshape(*self.order_BR.shape, *([1] * (slots_BR.ndim - 2)))
        old_BR = jnp.take_along_axis(slots_BR, index, axis=1)
        new_shape = (slots_BR.shape[0], self.rank_BT.shape[1], *slots_BR.shape[2:])
        return jnp.concatenate([old_BR, jnp.zeros(new_shape, slots_BR.dtype)], axis=1)

    def store(self, view_BV: jax.Array) -> jax.Array:
        """(B, n + W + T, ...) view -> the ring's (B, n + W, ...) slots after the call."""
        slots = self.window + self.sink_tokens
        unsort_BR = jnp.argsort(self.order_BR, axis=1)
        index = unsort_BR.reshape(*unsort_BR.shape, *([1] * (view_BV.ndim - 2)))
        old_BR = jnp.take_along_axis(view_BV[:, :slots], index, axis=1)
        return ring_write(
            old_BR,
            view_BV[:, slots:],
            self.key_index_T,
            self.rank_BT,
            window=self.window,
            sink_tokens=self.sink_tokens,
        )
