"""The "cache" collection for incremental decoding (a KV cache; Pope et al. 2022, arXiv 2211.05102).

Three Linen modules keep their arrays in the ``cache`` collection (``copejax.decode.init_cache``
creates them with zeros), the first two sized by the length S of the call that created them:

- :class:`DecodeCursor`, one per model: the write index, the positions and the segment ids of
  every cached token, and the decode mask of the new queries over the S cache slots;
- :class:`KeyCache`, one per attention layer: the keys and values after the qk site and any
  per-key arrays the position scheme keeps (``AttentionSite.cache_state``);
- :class:`RingCache`, instead, in a sliding-window layer: the same per-key arrays in n + W
  slots (``copejax.ring_decode``).

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
        may attend to slot s iff s <= index + t and the ids match (``copejax.segments``).
      fits: False when the call wrote past the cache's S slots (results are then invalid).
    """

    index: jax.Array
    positions_BS: jax.Array
    segment_ids_BS: jax.Array
    fits: jax.Array


class DecodeCursor(nn.Module):
    """The model's write index, cached positions and segment ids (B, S).

    ``unbounded``: the write index only, for a model whose every layer decodes from a ring
    buffer (``copejax.ring_decode.unbounded_decode``), which keeps what it needs of each key in
    its slots; the view's positions and ids are then the new tokens' (S = T) and decoding
    may go on past the cache's ``max_len``.
    """

    unbounded: bool = False

    @nn.compact
    def __call__(self, positions_BT: jax.Array, segment_ids_BT: jax.Array | None) -> DecodeView:
        if not self.has_variable(CACHE, "index") and not self.is_initializing():
            raise ValueError(
                "decode=True needs a cache: pass variables {'params': ..., 'cache': "
                "copejax.decode.init_cache(cfg, batch, max_len)} and mutable=['cache']"
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

    A call reads the slots as they were before its writes (:func:`copejax.ring_decode.
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
        # The ring: the last min(T, W) new keys, at distinct slots n + j mod W; sinks stay out.
        tail = min(length, window)
        ring_slot_T = sinks + key_index_T[length - tail :] % window
        keep_BT = rank_BT[:, length - tail :] >= sinks
        for name, slot in slots.items():
            new_BT = arrays[name][:, length - tail :]
            if name == "key_plus1":
                new_BT = jnp.where(keep_BT, new_BT, 0)
            slot.value = slot.value.at[:, ring_slot_T].set(new_BT.astype(slot.value.dtype))
        if sinks:  # sink slot r: the last new key of rank r, if any
            match_BRT = rank_BT[:, None, :] == jnp.arange(sinks)[None, :, None]
            has_BR = jnp.any(match_BRT, axis=-1)
            last_BR = length - 1 - jnp.argmax(match_BRT[..., ::-1], axis=-1)
            for name, slot in slots.items():
                a_BT = arrays[name]
                picked = jnp.take_along_axis(
                    a_BT, last_BR.reshape(batch, sinks, *([1] * (a_BT.ndim - 2))), axis=1
                )
                has = has_BR.reshape(batch, sinks, *([1] * (a_BT.ndim - 2)))
                sink = jnp.where(has, picked.astype(slot.value.dtype), slot.value[:, :sinks])
                slot.value = slot.value.at[:, :sinks].set(sink)
        plus1_BR = old.pop("key_plus1")
        old["key_index"] = jnp.where(plus1_BR > 0, plus1_BR - 1, EMPTY_KEY_INDEX)
        return old

    def read(self) -> dict[str, jax.Array]:
        """The slots as they are (before this call's writes; ``key_plus1`` as stored), each
        (B, n + W, ...); empty before the cache exists (while initialising)."""
        return dict(self.variables.get(CACHE, {}))
