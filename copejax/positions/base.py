"""The position-scheme interface: a scheme spec and the two Linen site modules it builds.

A position scheme is a frozen dataclass (its options) that declares which *sites* it acts at
and builds the Linen modules that act there (house style, STYLE.md):

- ``embed``: at the model input, adds to (or concatenates with) the token embeddings, may
  relabel positions (randomized positions) and may create the initial *carry*
  (TAPE's positional tensor). Built once per model by :meth:`PositionScheme.embed_module`.
- ``qk``: transforms q, k (and v) before the logits (RoPE, xPos, TAPE).
- ``bias``: an additive float32 logit term computed from q, k, v, positions, the content
  logits or the layer input (ALiBi, T5, Shaw, XL, Kerple, FIRE, CoPE, FoX).
- ``normalizer``: replaces the masked softmax (stick-breaking).
- ``output``: transforms the per-head attention output before the output projection (FoX's
  output gate).
- ``carry``: state that flows from layer to layer (TAPE), updated after attention and after
  the MLP.

The attention sites live in one :class:`AttentionSite` module per layer (or one module shared
by every layer when :attr:`PositionScheme.share_across_layers` is true, as T5 does).
``copejax/model/attention.py`` calls each site exactly once; nothing else special-cases schemes.

What the sites read (:class:`AttentionContext`, :class:`Dims`, :class:`EmbedOutput`) is in
:mod:`copejax.positions.context`, imported here too.

Shape letters: B batch, T query length, S key length, N heads, H head dim, D model dim.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from copejax.ops.engine_blocks import BlockTerm, Normalizer

# The context types live in copejax.positions.context; importers may keep reading them here.
from copejax.positions.context import AttentionContext, Carry, Dims, EmbedOutput

SITES = ("embed", "qk", "bias", "normalizer", "output", "carry")


def masked_softmax_BNTS(
    logits_BNTS: jax.Array, mask_BTS: jax.Array, sink_N: jax.Array | None = None
) -> jax.Array:
    """Softmax over keys in float32; masked keys get exactly zero weight.

    A fully masked row (only possible with padding queries) returns all zeros, not NaN.
    With ``sink_N`` (GPT-OSS's learned attention sink, one logit per head) ``exp(sink)`` joins
    every row's denominator and mixes no value, so a row's weights sum to less than 1.
    """
    logits_BNTS = logits_BNTS.astype(jnp.float32)
    mask_B1TS = mask_BTS[:, None]
    big_neg = jnp.finfo(jnp.float32).min
    masked_BNTS = jnp.where(mask_B1TS, logits_BNTS, big_neg)
    max_BNT1 = jnp.max(masked_BNTS, axis=-1, keepdims=True)
    sink_1N11 = None
    if sink_N is not None:
        sink_1N11 = sink_N.astype(jnp.float32)[None, :, None, None]
        max_BNT1 = jnp.maximum(max_BNT1, sink_1N11)
    max_BNT1 = jax.lax.stop_gradient(jnp.where(jnp.isfinite(max_BNT1), max_BNT1, 0.0))
    exp_BNTS = jnp.where(mask_B1TS, jnp.exp(masked_BNTS - max_BNT1), 0.0)
    denom_BNT1 = jnp.sum(exp_BNTS, axis=-1, keepdims=True)
    if sink_1N11 is not None:
        denom_BNT1 = denom_BNT1 + jnp.exp(sink_1N11 - max_BNT1)
    return exp_BNTS / jnp.where(denom_BNT1 > 0, denom_BNT1, 1.0)


class EmbedSite(nn.Module):
    """Base of embed-site modules: identity on the embeddings, positions unchanged, no carry.

    Subclasses override :meth:`__call__`. ``dims`` is set by the scheme that builds them.
    """

    dims: Dims

    def __call__(
        self, x_BTD: jax.Array, positions_BT: jax.Array, deterministic: bool = True
    ) -> EmbedOutput:
        return EmbedOutput(x_BTD=x_BTD, positions_BT=positions_BT)


class AttentionSite(nn.Module):
    """Base of attention-site modules. Every method defaults to 'do nothing'.

    Subclasses override the methods for the sites their scheme declares and define their
    parameters in ``setup`` (several methods may be called, so ``nn.compact`` cannot be used).
    Parameters should carry logical axis names (see ``copejax.runtime.sharding``).
    """

    dims: Dims

    def cache_state(
        self, k_BTNH: jax.Array, v_BTNH: jax.Array, ctx: AttentionContext
    ) -> dict[str, jax.Array]:
        """Decode mode only: per-key arrays (B, T, ...) of the T new tokens to cache.

        Called before the qk site with the projected (raw) keys and values (K heads with
        grouped-query attention); ``ctx.key_state``
        holds what was cached before this call (None before the first). The cached arrays,
        new tokens included, reach every later site as ``ctx.key_state`` (B, S, ...). Names
        start with the scheme's name (``"fox_..."``) and must be unique in a combination;
        "key" and "value" are taken. Default: nothing.
        """
        return {}

    def cache_update(
        self, cached: dict[str, jax.Array], ctx: AttentionContext
    ) -> dict[str, jax.Array]:
        """Decode mode only: cached arrays (B, S, ...) to overwrite whole once this call has
        read them (PaTH's rank-1 updates of every cached key).

        ``cached`` holds the cache's "key" and "value" after this call's write (what this
        call's attention reads); ``ctx.key_state`` the scheme's own cached arrays. Returns
        {name: new array} for names already in the cache. Default: nothing.
        """
        return {}

    def qk(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The qk site: returns transformed (q, k, v). Default: unchanged.

        With grouped-query attention (``Dims.kv_heads`` K < N) k and v arrive with K heads:
        a transform that is the same for every head (RoPE, xPos) or has per-key/value-head
        parameters keeps K heads (and the decode cache stays K heads); one that reads
        per-query-head state repeats them first with :func:`repeat_kv_heads` (TAPE). The
        layer repeats whatever comes back to N heads before the logits and later sites.
        """
        return q_BTNH, k_BSNH, v_BSNH

    def bias(
        self,
        q_BTNH: jax.Array,
        k_BSNH: jax.Array,
        v_BSNH: jax.Array,
        logits_BNTS: jax.Array,
        ctx: AttentionContext,
    ) -> jax.Array | None:
        """The bias site: an additive float32 logit term broadcastable to (B, N, T, S).

        ``logits_BNTS`` are the scaled content logits q.k / sqrt(H) in float32, unmasked
        (apply ``ctx.mask_BTS`` before any cumulative sum). Default: no bias (None). The naive
        path's form; :meth:`block_terms` is the same term for the blockwise engine.
        """
        return None

    def block_terms(
        self, q_BTNH: jax.Array, k_BSNH: jax.Array, v_BSNH: jax.Array, ctx: AttentionContext
    ) -> tuple[BlockTerm, ...]:
        """The bias site in block form for the blockwise engine (``copejax.ops.engine``).

        Called outside the engine's loops with the whole q, k, v and context: read parameters
        and compute per-token arrays here, and return pure functions of one (query block, key
        block) pair. Must equal :meth:`bias` on every allowed pair (the registry-wide test
        ``tests/test_blockwise_equivalence.py`` checks it). Default: no term; a site that
        overrides :meth:`bias` must override this too.
        """
        return ()

    def block_normalizer(self, ctx: AttentionContext) -> Normalizer | None:
        """The normalizer site in block form (stick-breaking); None: softmax."""
        return None

    def mixed_values(self, ctx: AttentionContext) -> jax.Array | None:
        """Per-key features (B, S, N, C) that the attention weights mix like values, for the
        carry site (TAPE eq. 7); None: nothing. The mix reaches :meth:`carry_after_attention`.
        """
        return None

    def normalize(self, logits_BNTS: jax.Array, ctx: AttentionContext) -> jax.Array:
        """The normalizer site: attention weights from the biased logits. Default: softmax."""
        return masked_softmax_BNTS(logits_BNTS, ctx.mask_BTS)

    def output(self, y_BTNH: jax.Array, ctx: AttentionContext) -> jax.Array:
        """The output site: per-head output before the output projection. Default: unchanged."""
        return y_BTNH

    def carry_after_attention(
        self, carry: Carry, mixed_BTNC: jax.Array | None, ctx: AttentionContext
    ) -> Carry:
        """The carry site, inside attention (TAPE eq. 7). Default: unchanged.

        ``mixed_BTNC`` is :meth:`mixed_values` weighted by each head's attention (None when
        the site mixes nothing), on every attention path.
        """
        return carry

    def carry_after_mlp(self, carry: Carry, attn_out_BTD: jax.Array, x_BTD: jax.Array) -> Carry:
        """The carry site, after the block's MLP (TAPE eq. 8). Default: unchanged.

        ``attn_out_BTD`` is the attention output of this block, ``x_BTD`` the block output.
        """
        return carry


@dataclasses.dataclass(frozen=True)
class PositionScheme:
    """A position scheme: its options (dataclass fields) and the modules it builds.

    Subclasses set the class variables, declare options as dataclass fields with defaults,
    check them in :meth:`validate` and override the builders for their sites.
    """

    name: ClassVar[str] = ""
    sites: ClassVar[tuple[str, ...]] = ()
    paper: ClassVar[str] = ""  # e.g. "Su et al. 2021, arXiv 2104.09864"
    share_across_layers: ClassVar[bool] = False
    # The bias site's bias reads positions and parameters only, never q, k or the input:
    # jax.nn.dot_product_attention can take it as a precomputed bias.
    position_only_bias: ClassVar[bool] = False
    # A block term carries state across key blocks (CoPE's gate count, stick-breaking's
    # remainder): the blockwise engine then differentiates its walk (remat), not flash.
    walk_carry: ClassVar[bool] = False
    # Decode state that reads the cache in key order (cached prefix sums, per-key gates or
    # penalties, keys rewritten by later tokens); a window layer's ring buffer is read in key
    # order for every scheme (copejax.model.ring_decode), so this only documents the scheme.
    cache_in_key_order: ClassVar[bool] = False
    # Works with grouped key/value heads (model.num_kv_heads < num_heads).
    grouped_kv: ClassVar[bool] = True
    # Works with a window's kept sink tokens (model.window_sink_tokens): False where a term
    # carried across key blocks must see the blocks between a sink and the window, which the
    # banded engine walk skips (PaTH's transforms).
    window_sinks: ClassVar[bool] = True
    # The largest block the blockwise engine uses for this scheme when model.attention_block
    # is unset (None: the model's length rule alone): a block term whose per-block work
    # holds (block x block) arrays per key block (PaTH's UT transforms) pays for large
    # blocks in memory.
    max_engine_block: ClassVar[int | None] = None
    # From how many keys model.attention_impl = "auto" takes the blockwise engine on a CPU
    # (None: copejax.model.attention_paths.AUTO_BLOCKWISE_FROM), for a scheme whose naive path
    # measured faster at longer lengths.
    auto_blockwise_from: ClassVar[int | None] = None

    def validate(self, dims: Dims) -> None:
        """Raises ValueError naming the bad value and what is allowed."""

    def token_dim(self, d_model: int) -> int:
        """Width of the token embedding (smaller than D for concatenative schemes)."""
        return d_model

    def check_decode(self, dims: Dims, cache_length: int) -> None:
        """Raises ValueError when a decode cache of ``cache_length`` slots outgrows the
        scheme's position tables, NotImplementedError when the scheme cannot decode
        incrementally. Default: any length decodes."""

    def ring_decode_refusal(self, dims: Dims, window: int) -> str | None:
        """Why a window layer of ``window`` keys cannot decode from a ring buffer of its
        window and sink slots (``copejax.model.ring_decode``), e.g. decode state that reaches
        further back than the window; None (default): it can."""
        return None

    def embed_module(self, dims: Dims) -> EmbedSite | None:
        """The embed-site module (built once per model), or None."""
        return None

    def attention_module(self, dims: Dims) -> AttentionSite | None:
        """The attention-site module (per layer, or shared), or None."""
        return None

    def shared_attention_module(self, dims: Dims) -> Any:
        """What the model builds once and hands to every layer (None: nothing is shared).

        By default the whole attention module when ``share_across_layers`` is true. Composite
        schemes return one entry per part, so that one part can share while another does not.
        """
        return self.attention_module(dims) if self.share_across_layers else None

    def layer_attention_module(self, dims: Dims, shared: Any) -> AttentionSite | None:
        """This layer's own module, given :meth:`shared_attention_module`'s result.

        None means the layer uses ``shared`` itself (or, when that is None too, no site).
        """
        return None if self.share_across_layers else self.attention_module(dims)

    def options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def check_positive(scheme: str, **values: float) -> None:
    """Raises a ValueError for any value that is not > 0, naming it and the scheme."""
    for key, value in values.items():
        if not value > 0:
            raise ValueError(f"{scheme}: {key} must be > 0, got {value!r}")


def check_choice(scheme: str, key: str, value: Any, allowed: tuple[Any, ...]) -> None:
    """Raises a ValueError when ``value`` is not one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{scheme}: {key} must be one of {allowed}, got {value!r}")


def check_block_terms(site: AttentionSite) -> None:
    """Refuses a site whose bias has no block form (it would be silently dropped)."""
    cls = type(site)
    if cls.bias is not AttentionSite.bias and cls.block_terms is AttentionSite.block_terms:
        raise NotImplementedError(
            f"{cls.__name__} defines a bias site but no block_terms: the blockwise engine "
            "cannot run it; use model.attention_impl='naive'"
        )
