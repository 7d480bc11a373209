"""A position scheme as one Linen module that users drop into their own attention.

:class:`PositionAttention` takes the projected queries, keys and values of *your* attention
layer and returns its per-head output with the scheme applied at every site it uses (qk
transform, logit bias, normalizer, output gate; ``copejax/positions/base.py``), on the path
``impl`` picks: ``"naive"`` (float32 (B, N, T, S) logits), ``"blockwise"`` (the O(T) engine,
``copejax.ops.engine``), ``"dot_product_attention"``, ``"auto"`` or ``"kernel"``. It is the
project's own :class:`copejax.model.attention.Attention` without the projections (its
:meth:`~copejax.model.attention.Attention.attend`), so its parameters and results are the
model's::

    class MyAttention(nn.Module):
        @nn.compact
        def __call__(self, x_BTD, positions_BT):
            q = nn.DenseGeneral((4, 16), name="q")(x_BTD)
            k = nn.DenseGeneral((4, 16), name="k")(x_BTD)
            v = nn.DenseGeneral((4, 16), name="v")(x_BTD)
            pos = PositionAttention("cope", num_heads=4, head_dim=16, name="cope")
            y_BTNH = pos(q, k, v, positions=positions_BT)
            return nn.DenseGeneral(x_BTD.shape[-1], axis=(-2, -1), name="o")(y_BTNH)

Parameters are plain arrays under the scheme's own names (the same names as in the model's
attention layer; ``copejax.functional.init`` returns the same tree). Sharding annotations
(``copejax.runtime.sharding``'s logical axis names) are opt-in (``logical_axes=True``), so
``flax.nnx.bridge.ToNNX`` and plain ``jax.grad`` see plain arrays. Decoding keeps its state in
the ``cache`` collection: call with ``decode=True`` and ``mutable=["cache"]`` after
:meth:`PositionAttention.init_cache` (or use ``copejax.functional.decode``, which hands the
cache in and out as a pytree).

Shape letters: B batch, T query length, S key length, N heads, K key/value heads, H head dim,
D model dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.model import checks
from copejax.model.attention import Attention
from copejax.model.attention_paths import ring_cache_applies
from copejax.model.config import ATTENTION_IMPLS, ModelConfig
from copejax.ops.kv_cache import DecodeCursor
from copejax.positions import registry
from copejax.positions.base import AttentionContext, Carry, EmbedOutput

__all__ = ["PositionAttention", "layer_config", "reads_layer_input"]

# Options of a scheme that read the attention layer's input x (B, T, D): FoX's gates and token
# shift, PaTH's transforms, CoPE's separate gate keys. The error for a missing x names them.
_INPUT_READERS = {"fox": None, "path": None, "cope": ("gates", "sep_keys")}


def reads_layer_input(scheme: str, options: Mapping[str, Any] | None = None) -> bool:
    """Whether ``scheme`` (with ``options``) reads the attention layer's input x_BTD."""
    options = dict(options or {})
    for part in scheme.split("+"):
        if part not in _INPUT_READERS:
            continue
        condition = _INPUT_READERS[part]
        if condition is None or options.get(condition[0]) == condition[1]:
            return True
    return False


def layer_config(
    scheme: str,
    *,
    num_heads: int,
    head_dim: int,
    d_model: int | None = None,
    num_kv_heads: int | None = None,
    train_len: int | None = None,
    impl: str = "auto",
    window: int | None = None,
    dtype: str = "float32",
    options: Mapping[str, Any] | None = None,
) -> ModelConfig:
    """The one-layer model configuration a :class:`PositionAttention` runs, validated.

    ``d_model`` is needed only by schemes that read the layer input (:func:`reads_layer_input`);
    ``train_len`` (the model's ``max_len``) only by options whose None means "the training
    length" (e.g. learned's ``table_size``, relative's ``max_distance``, FIRE's
    ``threshold_init``); leaving it None then raises, naming the option.

    Raises:
      ValueError: an unknown scheme (naming the allowed ones), an option the scheme does not
        take, an ``impl`` outside ``model.attention_impl``'s choices, or a missing ``d_model``.
    """
    options = dict(options or {})
    for part in scheme.split("+"):
        registry.get(part)  # an unknown name lists the known ones
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
    if d_model is None and reads_layer_input(scheme, options):
        raise ValueError(
            f"{scheme!r} reads the attention layer's input x (B, T, D): pass d_model=D "
            "(and x=x_BTD to attention / decode)"
        )
    if train_len is None:
        _check_length_free(scheme, options)
    cfg = ModelConfig(
        vocab_size=1,
        d_model=num_heads * head_dim if d_model is None else d_model,
        num_heads=num_heads,
        num_layers=1,
        head_dim=head_dim,
        dtype=dtype,
        position=scheme,
        position_options=options,
        max_len=1 if train_len is None else train_len,
        attention_impl=impl,
        window=window,
        num_kv_heads=num_kv_heads,
    )
    return checks.validate(cfg)


# The options whose None means "the model's max_len" (each scheme's docstring says so), and
# for RoPE the scalings that read its option at all.
_LENGTH_OPTIONS = {
    "cope": "p_max",
    "fire": "threshold_init",
    "learned": "table_size",
    "randomized": "max_position",
    "relative": "max_distance",
    "relative_capped": "max_distance",
    "rope": "original_max_len",
    "xpos": "center",
}
_ROPE_LENGTH_SCALINGS = ("dynamic", "yarn", "llama3", "longrope")


def _check_length_free(scheme: str, options: Mapping[str, Any]) -> None:
    """Refuses, naming the option, a scheme whose options leave a size to the training length when
    none was given."""
    for part in scheme.split("+"):
        option = _LENGTH_OPTIONS.get(part)
        if option is None:
            continue
        default = getattr(registry.get(part)(), option)
        if options.get(option, default) is not None:
            continue
        if part == "rope" and options.get("scaling", "none") not in _ROPE_LENGTH_SCALINGS:
            continue
        raise ValueError(
            f"{part}: option {option}=None means the training length max_len, which was not "
            f"given: pass train_len=T or set {option}"
        )


class PositionAttention(nn.Module):
    """Causal attention with a copejax position scheme, from your projected q, k, v.

    Attributes:
      scheme: a registered scheme name, or several joined with ``+`` (``"cope+rope"``).
      num_heads: N, the query heads.
      head_dim: H.
      d_model: D, the width of the layer input x (schemes that read it: FoX, PaTH, CoPE
        with ``gates="sep_keys"``); None otherwise.
      num_kv_heads: K key/value heads (grouped-query attention; None: N).
      train_len: the training length (``ModelConfig.max_len``), for options whose None means it (see
        :func:`layer_config`); None: no such option may be None.
      impl: the attention path, one of ``model.attention_impl``'s values.
      window: a sliding window W (query i sees keys i - W < j <= i); None: full causal.
      dtype: "float32" or "bfloat16", the compute dtype of the sites.
      options: the scheme's options (``python -m copejax.positions`` lists them).
      logical_axes: keep the parameters' logical axis annotations (``nn.LogicallyPartitioned``
        boxes, for ``copejax.runtime.sharding``'s mesh recipe); False (default): plain arrays.
    """

    scheme: str
    num_heads: int
    head_dim: int
    d_model: int | None = None
    num_kv_heads: int | None = None
    train_len: int | None = None
    impl: str = "auto"
    window: int | None = None
    dtype: str = "float32"
    options: Any = None
    logical_axes: bool = False

    def config(self) -> ModelConfig:
        """This module's one-layer :class:`~copejax.model.config.ModelConfig`."""
        return layer_config(
            self.scheme,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            d_model=self.d_model,
            num_kv_heads=self.num_kv_heads,
            train_len=self.train_len,
            impl=self.impl,
            window=self.window,
            dtype=self.dtype,
            options=self.options,
        )

    def setup(self) -> None:
        cfg = self.config()
        scheme = cfg.scheme
        # The embed site sits one level down, under "embed": its name may be the attention
        # site's (TAPE's both are "tape"), and the attention sites share this module's scope.
        self.embed_site = _Embed(cfg, name="embed")
        self.shared_positions = scheme.shared_attention_module(cfg.dims)
        # The model's attention layer; its projections are never called, so they have no
        # parameters, and its sites and caches live in this module's scope.
        self.layer = Attention(cfg, shared=self.shared_positions)
        nn.share_scope(self, self.layer)
        self.decode_cursor = DecodeCursor(unbounded=ring_cache_applies(cfg))

    def _unbox(self) -> None:
        """Drops the logical-axis boxes of freshly created parameters (``logical_axes=False``)."""
        if self.logical_axes or not self.is_initializing() or "params" not in self.variables:
            return
        scope = self.scope
        for name, value in nn.unbox(dict(self.variables["params"])).items():
            scope.put_variable("params", name, value)

    def __call__(
        self,
        q_BTNH: jax.Array,
        k_BSKH: jax.Array,
        v_BSKH: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        x: jax.Array | None = None,
        carry: Carry = None,
        decode: bool = False,
        deterministic: bool = True,
        return_carry: bool = False,
    ) -> jax.Array | tuple[jax.Array, Carry]:
        """Attention of T queries over S keys (S = T, or the cache's slots when decoding).

        Args:
          q_BTNH: queries; k_BSKH, v_BSKH: keys and values, K heads (K divides N).
          positions: integer positions (B, T) or (T,); None: 0 .. T - 1 (the cache's next
            positions are not guessed when decoding: pass them).
          segment_ids: packed documents (B, T); None: one per row.
          x: the attention layer's input (B, T, D), for schemes that read it.
          carry: the scheme's layer-to-layer state (TAPE: from :meth:`embed`).
          decode: append the T tokens to the ``cache`` collection and attend over it.
          deterministic: False in training (randomized positions sample).
          return_carry: also return the updated carry.

        Returns:
          y_BTNH in q's dtype (and the carry with ``return_carry``).
        """
        cfg = self.config()
        batch, length = q_BTNH.shape[:2]
        positions_BT = _positions(positions, batch, length, decode)
        if x is None:
            if reads_layer_input(cfg.position, dict(cfg.position_options)):
                raise ValueError(
                    f"{cfg.position!r} reads the attention layer's input: pass x=x_BTD "
                    f"(B, T, D) here and d_model=D when building it"
                )
            x = jnp.zeros((batch, length, 0), q_BTNH.dtype)
        if "carry" in cfg.scheme.sites and carry is None:
            raise ValueError(
                f"{cfg.position!r} carries position state from layer to layer: pass "
                "carry=embed(...).carry (copejax.functional.embed)"
            )
        ctx = AttentionContext.create(
            x, positions_BT, segment_ids, carry=carry, deterministic=deterministic
        )
        if decode:
            view = self.decode_cursor(positions_BT, ctx.q_segment_ids_BT)
            cfg.scheme.check_decode(cfg.dims, view.positions_BS.shape[1])
            ctx = ctx.replace(
                k_positions_BS=view.positions_BS,
                k_segment_ids_BS=view.segment_ids_BS,
                decode=True,
                cache_index=view.index,
            )
        y_BTNH, carry = self.layer.attend(q_BTNH, k_BSKH, v_BSKH, ctx)
        self._unbox()
        y_BTNH = y_BTNH.astype(q_BTNH.dtype)
        return (y_BTNH, carry) if return_carry else y_BTNH

    def embed(
        self,
        x_BTD: jax.Array,
        positions: jax.Array | None = None,
        deterministic: bool = True,
    ) -> EmbedOutput:
        """The embed site (learned / sinusoidal / randomized positions, TAPE's initial
        tensor): (x_BTD, positions_BT, carry); unchanged for schemes without one."""
        batch, length = x_BTD.shape[:2]
        positions_BT = _positions(positions, batch, length, False)
        out = self.embed_site(x_BTD, positions_BT, deterministic)
        self._unbox()
        return out

    def carry_after_mlp(self, carry: Carry, attn_out_BTD: jax.Array, x_BTD: jax.Array) -> Carry:
        """The carry site after the block's MLP (TAPE eq. 8); unchanged for other schemes."""
        out = self.layer.carry_after_mlp(carry, attn_out_BTD, x_BTD)
        self._unbox()
        return out

    def initialize(self) -> None:
        """Creates every parameter (embed, attention sites, carry) from dummy inputs of T = 2
        tokens: what ``PositionAttention.init(key, method=PositionAttention.initialize)`` and
        ``copejax.functional.init`` call."""
        cfg = self.config()
        n, k, h, d = cfg.num_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim, cfg.d_model
        length = 2
        dtype = cfg.compute_dtype
        x_BTD = jnp.zeros((1, length, d), dtype)
        emb = self.embed(x_BTD, None)
        q = jnp.zeros((1, length, n, h), dtype)
        kv = jnp.zeros((1, length, k, h), dtype)
        _, carry = self(q, kv, kv, x=x_BTD, carry=emb.carry, return_carry=True)
        y_BTD = jnp.zeros((1, length, d), dtype)
        self.carry_after_mlp(carry, y_BTD, y_BTD)

    def init_decode(self, batch: int, max_len: int) -> None:
        """Creates the decode cache of ``batch`` rows and ``max_len`` slots (and the
        parameters): ``PositionAttention.init(key, batch, max_len,
        method=PositionAttention.init_decode)["cache"]``, zeroed, is an empty cache."""
        cfg = self.config()
        n, k, h, d = cfg.num_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim, cfg.d_model
        dtype = cfg.compute_dtype
        x_BTD = jnp.zeros((batch, max_len, d), dtype)
        positions_BT = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch, max_len))
        emb = self.embed(x_BTD, positions_BT)
        q = jnp.zeros((batch, max_len, n, h), dtype)
        kv = jnp.zeros((batch, max_len, k, h), dtype)
        self(q, kv, kv, positions=positions_BT, x=x_BTD, carry=emb.carry, decode=True)


class _Embed(nn.Module):
    """The scheme's embed site (or the identity) in a scope of its own."""

    cfg: ModelConfig

    def setup(self) -> None:
        self.site = self.cfg.scheme.embed_module(self.cfg.dims)

    def __call__(
        self, x_BTD: jax.Array, positions_BT: jax.Array, deterministic: bool
    ) -> EmbedOutput:
        if self.site is None:
            return EmbedOutput(x_BTD=x_BTD, positions_BT=positions_BT)
        return self.site(x_BTD, positions_BT, deterministic)


def _positions(positions: jax.Array | None, batch: int, length: int, decode: bool) -> jax.Array:
    """(B, T) int32 positions from None (0 .. T - 1), (T,) or (B, T)."""
    if positions is None:
        if decode:
            raise ValueError("decode: pass the new tokens' positions (B, T) or (T,)")
        positions = jnp.arange(length, dtype=jnp.int32)
    positions = jnp.asarray(positions)
    if positions.ndim == 1:
        positions = jnp.broadcast_to(positions, (batch, length))
    if positions.shape != (batch, length):
        raise ValueError(
            f"positions must have shape ({length},) or ({batch}, {length}), got {positions.shape}"
        )
    return positions.astype(jnp.int32)
