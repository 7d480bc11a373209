"""``init_cache`` and ``decode``: incremental decoding for your own model, the cache a pytree.

A prefill (T > 1 new tokens) and then steps (T = 1) give what one :func:`attention` call over
the whole sequence gives (``tests/test_functional.py`` checks it for every registered scheme).
The cache holds the keys and values after the qk site, the positions and segment ids of every
slot, the write index and each scheme's own per-key state (FoX's prefix sums and token-shift
state, CoPE's gate keys, PaTH's rewritten keys, ...): a dict of arrays, handed in and out, so
it can live in a ``jax.lax.scan`` carry. A window layer keeps a ring buffer of its window
instead (``copejax.model.ring_decode``).

Shape letters: B batch, T new tokens, N heads, K key/value heads, H head dim, D model dim.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

from copejax.functional.layer import Params, _for_call, module
from copejax.linen import PositionAttention
from copejax.positions.base import Carry

__all__ = ["decode", "init_cache"]

Cache = dict[str, Any]


def init_cache(
    scheme: str,
    params: Params,
    *,
    batch: int,
    max_len: int,
    num_kv_heads: int,
    head_dim: int,
    num_heads: int | None = None,
    d_model: int | None = None,
    window: int | None = None,
    train_len: int | None = None,
    dtype: Any = jnp.float32,
    **options: Any,
) -> Cache:
    """An empty cache (zeros, write index 0) for ``batch`` rows of ``max_len`` tokens.

    Args:
      scheme, params: as for ``functional.init``; ``params`` is checked against the
        parameters these sizes and options make (a mismatch raises, naming both).
      batch: B.
      max_len: the cache's slots (the longest prompt plus steps); a window layer keeps its
        window (and its sink slots) only, and decodes past ``max_len``.
      num_kv_heads: K. head_dim: H.
      num_heads: N (None: K, no grouping).
      d_model: D, for schemes that read the layer input.
      window: the layer's sliding window, as given to :func:`decode`.
      train_len: as for ``functional.init``.
      dtype: the dtype of q, k and v.
      **options: the scheme's options.

    Returns:
      the cache, a dict of arrays (B, S, ...) and scalars.
    """
    if batch < 1 or max_len < 1:
        raise ValueError(f"init_cache: batch and max_len must be >= 1, got {batch}, {max_len}")
    layer = module(
        scheme,
        num_heads=num_kv_heads if num_heads is None else num_heads,
        head_dim=head_dim,
        d_model=d_model,
        num_kv_heads=num_kv_heads,
        train_len=train_len,
        window=window,
        dtype=dtype,
        **options,
    )
    shapes = jax.eval_shape(
        lambda: layer.init(jax.random.key(0), batch, max_len, method=PositionAttention.init_decode)
    )
    expected = traverse_util.flatten_dict(jax.tree.map(jnp.shape, shapes.get("params", {})))
    given = traverse_util.flatten_dict(jax.tree.map(jnp.shape, dict(params)))
    wrong = {"/".join(k): v for k, v in expected.items() if given.get(k) != v}
    if wrong:  # params may hold more: the embed site's, TAPE's update after the MLP
        raise ValueError(
            f"init_cache: params do not match {scheme!r} with these sizes and options: "
            f"expected shapes {wrong}, got {given}"
        )
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), dict(shapes["cache"]))


def decode(
    q_BTNH: jax.Array,
    k_BTKH: jax.Array,
    v_BTKH: jax.Array,
    cache: Cache,
    *,
    scheme: str,
    params: Params,
    positions: jax.Array,
    segment_ids: jax.Array | None = None,
    x: jax.Array | None = None,
    carry: Carry = None,
    impl: str = "auto",
    window: int | None = None,
    train_len: int | None = None,
    **options: Any,
) -> tuple[jax.Array, Cache]:
    """Appends T new tokens to the cache and attends over every cached one.

    Args:
      q_BTNH, k_BTKH, v_BTKH: the new tokens' projected queries, keys and values.
      cache: :func:`init_cache`'s result, or the previous call's.
      positions: the new tokens' positions, (B, T) or (T,).
      segment_ids: their documents' ids (B, T); None: one per row.
      x: their attention-layer input (B, T, D), for schemes that read it.
      carry: TAPE's position tensors of the new tokens (``functional.embed``).
      scheme, params, impl, window, train_len, **options: as for ``functional.attention``.

    Returns:
      (y_BTNH, the updated cache).
    """
    layer = _for_call(
        scheme, q_BTNH, k_BTKH, x, options, train_len=train_len, impl=impl, window=window
    )
    y_BTNH, variables = layer.apply(
        {"params": params, "cache": cache},
        q_BTNH,
        k_BTKH,
        v_BTKH,
        positions=positions,
        segment_ids=segment_ids,
        x=x,
        carry=carry,
        decode=True,
        mutable=["cache"],
    )
    return y_BTNH, dict(variables["cache"])
