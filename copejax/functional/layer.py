"""``init``, ``attention``, ``embed`` and ``carry_after_mlp``: a position scheme on plain arrays.

Each call builds :class:`copejax.linen.PositionAttention` (the project's own attention layer
without its projections) and applies it to the arrays given: parameters are a plain dict of
arrays, nothing is hidden in Flax collections. See :mod:`copejax.functional`.

Shape letters: B batch, T query length, S key length, N heads, K key/value heads, H head dim,
D model dim.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.linen import PositionAttention
from copejax.positions.base import Carry, EmbedOutput

__all__ = ["attention", "carry_after_mlp", "embed", "init", "module"]

Params = dict[str, Any]


def module(
    scheme: str,
    *,
    num_heads: int,
    head_dim: int,
    d_model: int | None = None,
    num_kv_heads: int | None = None,
    train_len: int | None = None,
    impl: str = "auto",
    window: int | None = None,
    dtype: Any = jnp.float32,
    **options: Any,
) -> PositionAttention:
    """The :class:`~copejax.linen.PositionAttention` the functions of this module apply."""
    return PositionAttention(
        scheme,
        num_heads=num_heads,
        head_dim=head_dim,
        d_model=d_model,
        num_kv_heads=None if num_kv_heads == num_heads else num_kv_heads,
        train_len=train_len,
        impl=impl,
        window=window,
        dtype=jnp.dtype(dtype).name,
        options=options,
    )


def init(
    scheme: str,
    key: jax.Array,
    *,
    num_heads: int,
    head_dim: int,
    d_model: int | None = None,
    num_kv_heads: int | None = None,
    train_len: int | None = None,
    **options: Any,
) -> Params:
    """The scheme's parameters, a plain dict of float32 arrays ({} for ALiBi, RoPE, NoPE ...).

    Args:
      scheme: a registered name (``python -m copejax.positions`` lists them) or several
        joined with ``+`` (``"cope+rope"``).
      key: the PRNG key.
      num_heads: N.
      head_dim: H.
      d_model: D, the width of the attention layer's input x; needed by the schemes that read
        it (FoX's gates, PaTH, CoPE with ``gates="sep_keys"``); the error says so.
      num_kv_heads: K (grouped-query attention; None: N).
      train_len: the training length, for options whose None means it (learned's
        ``table_size``, relative's ``max_distance``, FIRE's ``threshold_init``, ...); None:
        such an option must be set (the error names it).
      **options: the scheme's options.

    Returns:
      {name: array or dict}: the attention sites' parameters under their scheme's name, the
      embed site's under "embed".
    """
    layer = module(
        scheme,
        num_heads=num_heads,
        head_dim=head_dim,
        d_model=d_model,
        num_kv_heads=num_kv_heads,
        train_len=train_len,
        **options,
    )
    variables = layer.init(key, method=PositionAttention.initialize)
    return jax.tree.map(jnp.asarray, nn.unbox(dict(variables.get("params", {}))))


def _for_call(
    scheme: str,
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    x: jax.Array | None,
    options: dict[str, Any],
    **fields: Any,
) -> PositionAttention:
    return module(
        scheme,
        num_heads=q_BTNH.shape[2],
        head_dim=q_BTNH.shape[3],
        d_model=None if x is None else x.shape[-1],
        num_kv_heads=k_BSKH.shape[2],
        dtype=q_BTNH.dtype,
        **fields,
        **options,
    )


def attention(
    q_BTNH: jax.Array,
    k_BSKH: jax.Array,
    v_BSKH: jax.Array,
    *,
    scheme: str,
    params: Params,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    x: jax.Array | None = None,
    impl: str = "auto",
    window: int | None = None,
    train_len: int | None = None,
    carry: Carry = None,
    return_carry: bool = False,
    **options: Any,
) -> jax.Array | tuple[jax.Array, Carry]:
    """Causal self-attention with the scheme at every site it uses; arrays in, arrays out.

    Args:
      q_BTNH: queries; k_BSKH, v_BSKH: keys and values (S = T), K heads (K divides N:
        grouped-query attention, query head n reads key/value head n // (N / K)).
      scheme: as for :func:`init`; params: :func:`init`'s result (the same options).
      positions: integer positions, (B, T) or (T,); None: 0 .. T - 1.
      segment_ids: packed documents' ids (B, T); None: one document per row.
      x: the attention layer's input (B, T, D), for schemes that read it (FoX, PaTH, CoPE
        sep-keys); the error names x and d_model when it is missing.
      impl: the attention path, ``model.attention_impl``'s values: "naive" (float32
        (B, N, T, S) logits), "blockwise" (the O(T) engine, ``copejax.ops.engine``),
        "dot_product_attention", "kernel" (the fused kernels, where they cover the scheme)
        or "auto" (naive below 512 keys, blockwise from there).
      window: a sliding window W (query i sees keys i - W < j <= i); None: full causal.
      train_len: as for :func:`init`.
      carry: the layer-to-layer state of schemes with a carry site (TAPE: ``embed(...).carry``).
      return_carry: also return the carry after attention (feed it to
        :func:`carry_after_mlp`).
      **options: the scheme's options, as given to :func:`init`.

    Returns:
      y_BTNH, in q's dtype (and the carry with ``return_carry``).
    """
    layer = _for_call(
        scheme, q_BTNH, k_BSKH, x, options, train_len=train_len, impl=impl, window=window
    )
    return layer.apply(
        {"params": params},
        q_BTNH,
        k_BSKH,
        v_BSKH,
        positions=positions,
        segment_ids=segment_ids,
        x=x,
        carry=carry,
        return_carry=return_carry,
    )


def embed(
    x_BTD: jax.Array,
    *,
    scheme: str,
    params: Params,
    num_heads: int,
    head_dim: int,
    positions: jax.Array | None = None,
    key: jax.Array | None = None,
    train_len: int | None = None,
    **options: Any,
) -> EmbedOutput:
    """The scheme's embed site on token embeddings: learned / sinusoidal tables added,
    randomized positions relabelled (sampled when ``key`` is given, as in training), TAPE's
    initial position tensor (the carry). Identity for schemes without one.

    Returns:
      ``EmbedOutput(x_BTD, positions_BT, carry)``.
    """
    layer = module(
        scheme,
        num_heads=num_heads,
        head_dim=head_dim,
        d_model=x_BTD.shape[-1],
        train_len=train_len,
        dtype=x_BTD.dtype,
        **options,
    )
    rngs = None if key is None else {"positions": key}
    return layer.apply(
        {"params": params},
        x_BTD,
        positions,
        key is None,
        method=PositionAttention.embed,
        rngs=rngs,
    )


def carry_after_mlp(
    carry: Carry,
    attn_out_BTD: jax.Array,
    x_BTD: jax.Array,
    *,
    scheme: str,
    params: Params,
    num_heads: int,
    head_dim: int,
    train_len: int | None = None,
    **options: Any,
) -> Carry:
    """The carry site after a block's MLP (TAPE eq. 8: the position tensor's update from the
    block's attention output ``attn_out_BTD`` and output ``x_BTD``); unchanged otherwise."""
    layer = module(
        scheme,
        num_heads=num_heads,
        head_dim=head_dim,
        d_model=x_BTD.shape[-1],
        train_len=train_len,
        **options,
    )
    return layer.apply(
        {"params": params}, carry, attn_out_BTD, x_BTD, method=PositionAttention.carry_after_mlp
    )
