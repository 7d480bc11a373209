"""What the position sites read: the model's dimensions, the attention context (positions,
segment ids, decode state, carry) and the embed site's output.

Split from :mod:`copejax.positions.base` (which re-exports every name here), so that the
interface module holds the sites and the scheme spec. Shape letters: B batch, T query length,
S key length, N heads, K key/value heads, H head dim, D model dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from copejax.ops import segments

Carry = Any  # a pytree of arrays, or None for schemes without a carry


@dataclasses.dataclass(frozen=True)
class Dims:
    """Sizes a scheme needs to build its modules.

    Attributes:
      d_model: model width D.
      num_heads: attention heads N.
      head_dim: per-head width H.
      num_layers: transformer blocks.
      max_len: the training context length (learned tables, FIRE's L, YaRN's original length).
      num_kv_heads: key/value heads K of grouped-query attention (None: N). The qk site and
        :meth:`AttentionSite.cache_state` receive K-head keys and values; every later site
        receives them repeated to N heads (:func:`repeat_kv_heads`).
    """

    d_model: int
    num_heads: int
    head_dim: int
    num_layers: int
    max_len: int
    num_kv_heads: int | None = None

    @property
    def kv_heads(self) -> int:
        """K, the key/value heads (N without grouping)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads


def repeat_kv_heads(x_BSKH: jax.Array, num_heads: int) -> jax.Array:
    """Grouped-query attention's keys or values for every query head (Ainslie et al. 2023,
    arXiv 2305.13245): K heads repeated group-major to N, so query head n reads key/value
    head ``n // (N / K)``. Unchanged when the array has N heads already.

    Args:
      x_BSKH: keys, values or per-key features with the heads on axis 2 (K divides N).
      num_heads: N.

    Returns:
      x_BSNH.
    """
    kv_heads = x_BSKH.shape[2]
    if kv_heads == num_heads:
        return x_BSKH
    if num_heads % kv_heads:
        raise ValueError(f"{kv_heads} key/value heads do not divide {num_heads} query heads")
    return jnp.repeat(x_BSKH, num_heads // kv_heads, axis=2)


@struct.dataclass
class AttentionContext:
    """What the attention sites may read besides q, k and v.

    Segment ids are the input; the (B, T, S) mask is derived (:attr:`mask_BTS`) only where the
    naive path reads it (``copejax.ops.segments``). Build one with :meth:`create`.

    Attributes:
      x_BTD: the attention layer's (normalised) input, for input-dependent schemes (FoX).
      q_positions_BT: integer positions of the queries.
      k_positions_BS: integer positions of the keys (equal to the queries' without a cache).
      q_segment_ids_BT: the queries' packed-document ids (None: one segment per row).
      k_segment_ids_BS: the keys' ids (the cache's when decoding; None: one segment).
      carry: the scheme's layer-to-layer state (None unless the scheme uses the carry site).
      deterministic: True at evaluation (no dropout, no random positions).
      decode: True in incremental decoding (``Transformer(..., decode=True)``): the T
        queries are new tokens and the S keys are the cache's slots (see ``copejax.ops.kv_cache``);
        k_BSNH, v_BSNH, ``k_positions_BS`` and ``k_segment_ids_BS`` cover the S slots, except
        at the qk site, which transforms the new keys only (there ``k_positions_BS`` are the
        new tokens' positions).
      cache_index: the key index of query 0: query t is key ``cache_index + t`` (0 without a
        cache; an int32 scalar, traced, in decode mode).
      key_state: in decode mode, the per-key arrays (B, S, ...) that the sites asked to keep
        with :meth:`AttentionSite.cache_state`; None otherwise.
      explicit_mask_BTS: a mask that replaces the derived one, for unit tests of the naive
        bias and normalizer sites on arbitrary masks; the blockwise engine refuses it.
      impl: the attention path of this call, "naive", "blockwise" or "dot_product_attention"
        (chosen by the layer from ``model.attention_impl``).
      block: the blockwise engine's block length.
      scan_impl: the cumulative-sum implementation (``copejax.ops.scan``).
      window: the layer's sliding window W (None: full causal attention); query i sees keys
        ``i - W < j <= i`` of its segment (``copejax.ops.segments.pair_allowed_BQK``).
      sink_tokens: with a window, the first n keys of each segment stay visible too
        (StreamingLLM, arXiv 2309.17453).
      k_index_BS: each key's index (a ring-buffer decode cache, whose slots are not in key
        order; empty slots carry a huge index); None: key s is key s.
      k_rank_BS: each key's index within its segment (for the sinks); None: derived from
        ``k_segment_ids_BS`` with the keys in order.
      ring_view: when a window layer decodes from its ring buffer (``copejax.model.ring_decode``),
        how the keys (the ring's slots in key order, then the new keys) map back to the ring's
        slots (``copejax.ops.kv_cache.RingView``), for a site that keeps per-key arrays of its own;
        None otherwise.
      packed: whether segment ids were given (static): False promises one document per row,
        so that a fused kernel may take the causal mask from indices, with no (T, S) array
        (:func:`is_plain_causal`).
    """

    x_BTD: jax.Array
    q_positions_BT: jax.Array
    k_positions_BS: jax.Array
    q_segment_ids_BT: jax.Array | None = None
    k_segment_ids_BS: jax.Array | None = None
    carry: Carry = None
    deterministic: bool = struct.field(pytree_node=False, default=True)
    decode: bool = struct.field(pytree_node=False, default=False)
    cache_index: Any = 0
    key_state: dict[str, jax.Array] | None = None
    explicit_mask_BTS: jax.Array | None = None
    impl: str = struct.field(pytree_node=False, default="naive")
    block: int = struct.field(pytree_node=False, default=128)
    scan_impl: str = struct.field(pytree_node=False, default="auto")
    window: int | None = struct.field(pytree_node=False, default=None)
    sink_tokens: int = struct.field(pytree_node=False, default=0)
    k_index_BS: jax.Array | None = None
    k_rank_BS: jax.Array | None = None
    ring_view: Any = None
    packed: bool = struct.field(pytree_node=False, default=True)

    @classmethod
    def create(
        cls,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        segment_ids_BT: jax.Array | None = None,
        **fields: Any,
    ) -> AttentionContext:
        """Self-attention's context: keys are the queries, ids default to one segment per row.

        The model, the benchmark and the tests build contexts here; decoding then replaces
        the key fields with the cache's (``Transformer.forward_embedded``).
        """
        batch, length = positions_BT.shape
        ids_BT = segments.default_segment_ids(segment_ids_BT, batch, length)
        return cls(
            x_BTD=x_BTD,
            q_positions_BT=positions_BT,
            k_positions_BS=positions_BT,
            q_segment_ids_BT=ids_BT,
            k_segment_ids_BS=ids_BT,
            packed=segment_ids_BT is not None,
            **fields,
        )

    def is_plain_causal(self) -> bool:
        """Whether :attr:`mask_BTS` is known, statically, to be causal self-attention by index
        (within the window, if any, and without sink tokens) over one document per row: no
        segment ids, no cache, no test mask, keys in order."""
        return (
            not self.packed
            and not self.decode
            and self.explicit_mask_BTS is None
            and self.k_index_BS is None
            and self.sink_tokens == 0
            and self.q_positions_BT.shape[1] == self.k_positions_BS.shape[1]
        )

    def ids(self) -> tuple[jax.Array, jax.Array]:
        """(query ids (B, T), key ids (B, S)), zeros where none were given."""
        batch, length_q = self.q_positions_BT.shape
        q_ids_BT = segments.default_segment_ids(self.q_segment_ids_BT, batch, length_q)
        length_k = self.k_positions_BS.shape[1]
        k_ids_BS = segments.default_segment_ids(self.k_segment_ids_BS, batch, length_k)
        return q_ids_BT, k_ids_BS

    @property
    def mask_BTS(self) -> jax.Array:
        """True where query t (key ``cache_index + t``) may attend to key s: causal by index
        and same segment; derived from the ids (or the explicit test mask)."""
        if self.explicit_mask_BTS is not None:
            return self.explicit_mask_BTS
        q_ids_BT, k_ids_BS = self.ids()
        return segments.causal_mask_BTS(
            q_ids_BT,
            k_ids_BS,
            self.cache_index,
            window=self.window,
            sink_tokens=self.sink_tokens,
            k_index_BS=self.k_index_BS,
            k_rank_BS=self.key_ranks(),
        )

    def key_ranks(self) -> jax.Array | None:
        """Each key's index within its segment when sink tokens are kept, else None."""
        if self.window is None or not self.sink_tokens:
            return None
        if self.k_rank_BS is not None:
            return self.k_rank_BS
        return segments.segment_rank_BS(self.ids()[1])

    @property
    def segment_ids_BT(self) -> jax.Array:
        """The queries' segment ids (zeros when none were given)."""
        return self.ids()[0]

    def segment_starts_BT(self) -> jax.Array:
        """True where query t begins a segment (the key before it is in another segment)."""
        q_ids_BT, k_ids_BS = self.ids()
        if self.decode:
            return segments.segment_starts_BT(q_ids_BT, k_ids_BS, self.cache_index)
        return segments.segment_starts_BT(q_ids_BT)


@struct.dataclass
class EmbedOutput:
    """Result of the embed site: embeddings, (possibly relabelled) positions, initial carry."""

    x_BTD: jax.Array
    positions_BT: jax.Array
    carry: Carry = None
