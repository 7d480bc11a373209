"""The model's frozen configuration; :func:`copejax.model.checks.validate` checks it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from copejax.model.layouts import parse_kind, preset_pattern
from copejax.model.logit_scaling import (
    LLAMA4_ATTN_SCALE,
    LLAMA4_FLOOR_SCALE,
    SSMAX_SCALE_INIT,
)
from copejax.model.saved_configs import upgrade_attention_options
from copejax.positions.base import Dims, PositionScheme

BLOCKS = ("llama", "gpt2")
DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("auto", "naive", "blockwise", "dot_product_attention", "kernel")
ATTENTION_BACKWARDS = ("auto", "flash", "remat")
SCAN_IMPLS = ("auto", "associative_scan", "cumsum")
# The blockwise engine's block length when model.attention_block is None: 128 below 4096 keys,
# 256 from there (side-by-side probes on a 2-core CPU: at T = 1024 blocks of 128 were faster
# for nope and CoPE, at T = 4096 blocks of 256 for nope and FoX; experiments/results/bench.md).
SMALL_BLOCK = 128
LARGE_BLOCK = 256
LARGE_BLOCK_FROM = 4096
# Sizes configs saved before ModelConfig.from_config wrote as 0 for "unset" (now None); the
# same keys as copejax.runtime.workdir.UNSET_AS_ZERO, which lets such a run resume.
UNSET_AS_ZERO = ("head_dim", "mlp_dim", "max_len", "window", "num_kv_heads")
# Sites a scheme may use with attention_impl="dot_product_attention": the kernel takes the
# queries, keys and values the qk site returns, an additive bias, and computes the masked
# softmax itself; a bias site is allowed when its bias reads positions only.
KERNEL_SITES = frozenset({"embed", "qk"})


def _freeze(options: Mapping[str, Any] | tuple) -> tuple[tuple[str, Any], ...]:
    if isinstance(options, tuple):
        return options
    items = []
    for key, value in sorted(dict(options).items()):
        items.append((key, tuple(value) if isinstance(value, list) else value))
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer.

    Attributes:
      vocab_size: V.
      d_model: D.
      num_heads: N.
      num_layers: blocks.
      head_dim: H; defaults to D // N.
      mlp_dim: hidden width of the MLP; defaults to 4D (gpt2) or 8D/3 rounded up to 8 (llama).
      block: "llama" (pre-RMSNorm, SwiGLU, no biases) or "gpt2" (LayerNorm, GELU, biases).
      tie_embeddings: share the token embedding with the output layer.
      norm_eps: epsilon of every RMSNorm / LayerNorm (1e-6, flax's default; HF Llama
        checkpoints set it as ``rms_norm_eps``, 1e-5 or 1e-6).
      dropout: residual and embedding dropout rate.
      dtype: compute dtype, "float32" or "bfloat16" (parameters are always float32).
      position: registered scheme name, e.g. "rope" or "cope+rope".
      position_options: options of the scheme (a mapping; stored as sorted pairs).
      max_len: training context length T (learned tables, FIRE's L, YaRN's original length).
      init_std: standard deviation of the weight initialisers.
      dense_init: how the block's dense kernels start: "normal" (default; N(0, init_std²),
        output projections init_std / sqrt(2 L)) or "fan_in" (haiku's hk.Linear default,
        truncated normal with std 1 / sqrt(fan_in), as the models of Ruoss et al. 2023); see
        ``copejax.model.dense_init``.
      scale_embeddings: multiply the token embeddings by sqrt of their width before the embed
        site (Vaswani et al. 2017 §3.4; the models of Ruoss et al. 2023, whose inputs the
        length-generalisation study follows). Off by default (GPT-2 / Llama inputs). With
        init_std 0.02 and no scaling a sinusoidal encoding (entries of magnitude up to 1) is
        about 35 times the token embedding; the tied output layer reads the unscaled table.
      attention_impl: the attention path of every layer. "naive": float32 (B, N, T, S)
        logits, the scheme's bias and normalizer sites; the reference, and the only path that
        sows attention maps. "blockwise": the engine of ``copejax.ops.engine``, every scheme in
        O(T) memory. "dot_product_attention": ``jax.nn.dot_product_attention`` (XLA's fused
        form on CPU/TPU, cuDNN where JAX picks it on GPU), for schemes whose only sites are
        embed and qk (nope, learned, sinusoidal, randomized, rope, xpos). "kernel": the fused
        Pallas kernels of ``copejax.ops.kernels`` (Triton on GPU, interpret mode elsewhere),
        for the schemes ``copejax.model.kernel_terms`` covers; others are refused by name.
        "auto" (default): naive for short sequences and while sowing, blockwise beyond
        (``copejax.model.attention_paths.choose_impl``), or the fastest path measured for the
        backend, dtype and scheme (``copejax.model.measured_paths``; no GPU has measured the
        kernels yet, so it takes them nowhere today).
      attention_block: the blockwise engine's block length (None: by length, see
        :meth:`attention_block_for`).
      attention_backward: the blockwise engine's backward pass: "flash" (custom VJP from the
        log-sum-exp, for softmax schemes; with a walk carry (CoPE, PaTH) only outside
        windows), "remat" (rematerialised walk) or "auto" (flash where it applies, except
        PaTH's carry: see ``copejax.ops.engine``; measured faster on CPU from 4 key blocks
        on).
      scan_impl: the cumulative sums of CoPE, FoX and stick-breaking ("auto",
        "associative_scan", "cumsum"; ``copejax.ops.scan``).
      window: sliding-window (local) attention: query i sees the last W keys of its segment,
        itself included (keys ``i - W < j <= i``; the convention of Mistral's and Gemma's
        ``sliding_window``). None (default): full causal attention. The blockwise engine
        walks only the key blocks in the window (O(T W)); decoding keeps a ring buffer of W
        slots (``copejax.ops.kv_cache.RingCache``, ``copejax.model.ring_decode``). With CoPE the
        counts
        cover the visible keys only, with stick-breaking the stick breaks over them only:
        valid variants.
      window_sink_tokens: with a window, the first n tokens of each segment stay visible to
        every query (StreamingLLM's attention sinks, arXiv 2309.17453) and the ring buffer
        keeps them in n extra slots. Positions are not reassigned: keys keep the positions
        they had when written (see README).
      window_decode_cache: how a window layer decodes: "ring" (default) from a ring buffer
        of n + W slots (``copejax.model.ring_decode``; a scheme that cannot is refused with the
        reason) or "full" from the full cache with the window mask (exact; memory grows).
      layer_pattern: per-layer kinds ``"scheme[:key=value,...]"`` repeating over the layers
        (``copejax.model.layouts``); () (default): every layer uses ``position``.
      layout: a named preset of ``copejax.model.layouts.PRESETS`` that sets ``layer_pattern``
        (e.g. "gemma3", "irope", "swan", "rnope"); None: none.
      num_kv_heads: K key/value heads, grouped-query attention (Ainslie et al. 2023, arXiv
        2305.13245); must divide num_heads; None: K = N; 1: multi-query attention. Query head n
        reads key/value head n // (N / K). The key and value projections and the decode cache
        hold K heads (logical axis ``kv_heads``); the sites after qk see them repeated to N.
      attention_sink: a learned logit per head (init 0) that joins every query's softmax
        denominator and mixes no value, as in GPT-OSS (OpenAI 2025, model card arXiv
        2508.10925). Softmax schemes only (stick-breaking has no denominator); not with
        attention_impl="dot_product_attention" (the kernel has no sink); the fused kernels
        fold it into their softmax (``copejax.ops.kernels.sink``).
      logit_scaling: "none", "ssmax" (Scalable-Softmax, arXiv 2501.19399: q times s log n, n
        the keys the query sees in its segment) or "llama4" (Llama 4's attention temperature
        tuning: q times log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1); see
        ``copejax.model.logit_scaling``. Softmax schemes only.
      ssmax_scale: SSMax's s, per head: its initial value (learned) or its fixed value.
      ssmax_learned: learn s (a parameter per head and layer) or keep it fixed.
      llama4_floor_scale, llama4_attn_scale: Llama 4's floor_scale (8192) and attn_scale (0.1).
    """

    vocab_size: int
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 2
    head_dim: int | None = None
    mlp_dim: int | None = None
    block: str = "llama"
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    dropout: float = 0.0
    dtype: str = "float32"
    position: str = "rope"
    position_options: Any = ()
    max_len: int = 512
    init_std: float = 0.02
    dense_init: str = "normal"
    scale_embeddings: bool = False
    attention_impl: str = "auto"
    attention_block: int | None = None
    attention_backward: str = "auto"
    scan_impl: str = "auto"
    window: int | None = None
    window_sink_tokens: int = 0
    window_decode_cache: str = "ring"
    layer_pattern: tuple[str, ...] = ()
    layout: str | None = None
    num_kv_heads: int | None = None
    attention_sink: bool = False
    logit_scaling: str = "none"
    ssmax_scale: float = SSMAX_SCALE_INIT
    ssmax_learned: bool = True
    llama4_floor_scale: float = LLAMA4_FLOOR_SCALE
    llama4_attn_scale: float = LLAMA4_ATTN_SCALE
    # The resolved scheme of ``position`` and ``position_options``, built once per config (in
    # __post_init__, so ``dataclasses.replace`` rebuilds it); not compared or hashed.
    scheme: PositionScheme = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "position_options", _freeze(self.position_options))
        if isinstance(self.layer_pattern, list):
            object.__setattr__(self, "layer_pattern", tuple(self.layer_pattern))
        from copejax.positions.registry import make_scheme

        object.__setattr__(self, "scheme", make_scheme(self.position, dict(self.position_options)))

    @classmethod
    def from_config(
        cls, model: Mapping[str, Any], *, vocab_size: int, default_max_len: int
    ) -> ModelConfig:
        """The ModelConfig of a config's ``model`` block: the one conversion from configs.

        The block's keys are this dataclass's fields (``vocab_size`` comes from the task).
        ``None`` means unset; configs saved before that wrote 0 for the unset sizes
        (``UNSET_AS_ZERO``), which still load, as do the per-scheme attention options of
        older configs (:func:`upgrade_attention_options`). An unset ``max_len`` is
        ``default_max_len`` (the task's training length). Unknown keys are refused by name.
        """
        fields = dict(model)
        attention, fields["position_options"] = upgrade_attention_options(fields)
        fields.pop("attention_kernel", None)
        fields.update(attention)
        for key in UNSET_AS_ZERO:
            if fields.get(key) == 0:
                fields[key] = None
        if fields.get("max_len") is None:
            fields["max_len"] = default_max_len
        allowed = sorted(
            f.name for f in dataclasses.fields(cls) if f.init and f.name != "vocab_size"
        )
        unknown = sorted(set(fields) - set(allowed))
        if unknown:
            raise ValueError(f"unknown model keys {unknown}; allowed: {allowed}")
        return cls(vocab_size=vocab_size, **fields)

    def resolved_pattern(self) -> tuple[str, ...]:
        """``layer_pattern``, or the preset ``layout``'s (``copejax.model.layouts``); () when
        the layers are uniform."""
        if self.layout is not None and self.layer_pattern:
            raise ValueError(
                f"set model.layout={self.layout!r} or model.layer_pattern, not both "
                "(a preset is a named layer_pattern)"
            )
        if self.layout is not None:
            return preset_pattern(self.layout, self.window)
        pattern = self.layer_pattern
        if isinstance(pattern, str) or not all(isinstance(kind, str) for kind in pattern):
            raise ValueError(
                "model.layer_pattern must be a list of kinds 'scheme[:key=value,...]', "
                f"got {pattern!r}"
            )
        return tuple(pattern)

    def for_layer(self, index: int) -> ModelConfig:
        """Layer ``index``'s own configuration: its pattern kind's scheme, options and
        per-layer fields (``layouts.PER_LAYER_FIELDS``); ``self`` when the layers are uniform."""
        pattern = self.resolved_pattern()
        if not pattern:
            return self
        scheme, fields, scheme_options = parse_kind(pattern[index % len(pattern)])
        options = dict(self.position_options) if scheme == self.position else {}
        options.update(scheme_options)
        layer_fields: dict[str, Any] = {"window": self.window if self.layout is None else None}
        layer_fields.update(fields)
        if layer_fields["window"] is None and "window_sink_tokens" not in dict(fields):
            layer_fields["window_sink_tokens"] = 0  # sinks belong to window layers
        return dataclasses.replace(
            self,
            position=scheme,
            position_options=options,
            layer_pattern=(),
            layout=None,
            **layer_fields,
        )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    @property
    def resolved_kv_heads(self) -> int:
        """K, the key/value heads (N unless ``num_kv_heads`` is set)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_mlp_dim(self) -> int:
        if self.mlp_dim is not None:
            return self.mlp_dim
        if self.block == "gpt2":
            return 4 * self.d_model
        return -(-8 * self.d_model // 3 // 8) * 8

    def dot_product_attention_allowed(self) -> bool:
        """Whether ``jax.nn.dot_product_attention`` can compute this scheme's attention: sites
        embed and qk only, plus a bias site whose bias reads positions only (ALiBi, T5,
        Kerple, FIRE; ``PositionScheme.position_only_bias``)."""
        scheme = self.scheme
        if self.attention_sink:  # the kernel's softmax has no sink
            return False
        extra = set(scheme.sites) - KERNEL_SITES
        return not extra or (extra == {"bias"} and scheme.position_only_bias)

    def attention_block_for(self, length_k: int) -> int:
        """The block length for ``length_k`` keys: ``attention_block``, or by length, at
        most the scheme's ``max_engine_block``."""
        if self.attention_block is not None:
            return self.attention_block
        block = LARGE_BLOCK if length_k >= LARGE_BLOCK_FROM else SMALL_BLOCK
        cap = self.scheme.max_engine_block
        return block if cap is None else min(block, cap)

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def dims(self) -> Dims:
        return Dims(
            d_model=self.d_model,
            num_heads=self.num_heads,
            head_dim=self.resolved_head_dim,
            num_layers=self.num_layers,
            max_len=self.max_len,
            num_kv_heads=self.num_kv_heads,
        )
