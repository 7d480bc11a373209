"""The model's frozen configuration and its validation."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from copejax.logit_scaling import (
    LLAMA4_ATTN_SCALE,
    LLAMA4_FLOOR_SCALE,
    LOGIT_SCALINGS,
    SSMAX_SCALE_INIT,
)
from copejax.positions.base import Dims, PositionScheme

BLOCKS = ("llama", "gpt2")
DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("auto", "naive", "blockwise", "dot_product_attention")
ATTENTION_BACKWARDS = ("auto", "flash", "remat")
SCAN_IMPLS = ("auto", "associative_scan", "cumsum")
# The blockwise engine's block length when model.attention_block is None: 128 below 4096 keys,
# 256 from there (side-by-side probes on a 2-core CPU: at T = 1024 blocks of 128 were faster
# for nope and CoPE, at T = 4096 blocks of 256 for nope and FoX; experiments/results/bench.md).
SMALL_BLOCK, LARGE_BLOCK, LARGE_BLOCK_FROM = 128, 256, 4096
# Sizes configs saved before ModelConfig.from_config wrote as 0 for "unset" (now None); the
# same keys as copejax.workdir.UNSET_AS_ZERO, which lets such a run resume.
UNSET_AS_ZERO = ("head_dim", "mlp_dim", "max_len", "window", "num_kv_heads")
# Sites a scheme may use with attention_impl="dot_product_attention": the kernel takes the
# queries, keys and values the qk site returns, an additive bias, and computes the masked
# softmax itself; a bias site is allowed when its bias reads positions only.
KERNEL_SITES = frozenset({"embed", "qk"})
# ModelConfig fields a layer kind of ``layer_pattern`` may set for its layers
# (``"rope:window=512"``); extend this tuple to make another attention field per-layer.
PER_LAYER_FIELDS = (
    "window",
    "window_sink_tokens",
    "attention_sink",
    "logit_scaling",
    "ssmax_scale",
    "ssmax_learned",
    "llama4_floor_scale",
    "llama4_attn_scale",
)


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
      dropout: residual and embedding dropout rate.
      dtype: compute dtype, "float32" or "bfloat16" (parameters are always float32).
      position: registered scheme name, e.g. "rope" or "cope+rope".
      position_options: options of the scheme (a mapping; stored as sorted pairs).
      max_len: training context length T (learned tables, FIRE's L, YaRN's original length).
      init_std: standard deviation of the weight initialisers.
      attention_impl: the attention path of every layer. "naive": float32 (B, N, T, S)
        logits, the scheme's bias and normalizer sites; the reference, and the only path that
        sows attention maps. "blockwise": the engine of ``copejax.ops.engine``, every scheme in
        O(T) memory. "dot_product_attention": ``jax.nn.dot_product_attention`` (XLA's fused
        form on CPU/TPU, cuDNN where JAX picks it on GPU), for schemes whose only sites are
        embed and qk (nope, learned, sinusoidal, randomized, rope, xpos). "auto" (default):
        naive for short sequences and while sowing, blockwise beyond
        (``copejax.attention_paths.choose_impl``).
      attention_block: the blockwise engine's block length (None: by length, see
        :meth:`attention_block_for`).
      attention_backward: the blockwise engine's backward pass: "flash" (custom VJP from the
        log-sum-exp, for softmax schemes without a walk carry), "remat" (rematerialised walk)
        or "auto" (flash where it applies over more than 8 key blocks, where it is faster).
      scan_impl: the cumulative sums of CoPE, FoX and stick-breaking ("auto",
        "associative_scan", "cumsum"; ``copejax.ops.scan``).
      window: sliding-window (local) attention: query i sees the last W keys of its segment,
        itself included (keys ``i - W < j <= i``; the convention of Mistral's and Gemma's
        ``sliding_window``). None (default): full causal attention. The blockwise engine
        walks only the key blocks in the window (O(T W)); decoding keeps a ring buffer of W
        slots (``copejax.kv_cache.RingCache``). With CoPE the counts cover the visible keys
        only, with stick-breaking the stick breaks over them only: valid variants.
      window_sink_tokens: with a window, the first n tokens of each segment stay visible to
        every query (StreamingLLM's attention sinks, arXiv 2309.17453) and the ring buffer
        keeps them in n extra slots. Positions are not reassigned: keys keep the positions
        they had when written (see README).
      layer_pattern: per-layer kinds ``"scheme[:key=value,...]"`` repeating over the layers
        (``copejax.layouts``); () (default): every layer uses ``position``.
      layout: a named preset of ``copejax.layouts.PRESETS`` that sets ``layer_pattern``
        (e.g. "gemma3", "irope", "swan", "rnope"); None: none.
      num_kv_heads: K key/value heads, grouped-query attention (Ainslie et al. 2023, arXiv
        2305.13245); must divide num_heads; None: K = N; 1: multi-query attention. Query head n
        reads key/value head n // (N / K). The key and value projections and the decode cache
        hold K heads (logical axis ``kv_heads``); the sites after qk see them repeated to N.
      attention_sink: a learned logit per head (init 0) that joins every query's softmax
        denominator and mixes no value, as in GPT-OSS (OpenAI 2025, model card arXiv
        2508.10925). Softmax schemes only (stick-breaking has no denominator); not with
        attention_impl="dot_product_attention" (the kernel has no sink).
      logit_scaling: "none", "ssmax" (Scalable-Softmax, arXiv 2501.19399: q times s log n, n
        the keys the query sees in its segment) or "llama4" (Llama 4's attention temperature
        tuning: q times log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1); see
        ``copejax.logit_scaling``. Softmax schemes only.
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
    dropout: float = 0.0
    dtype: str = "float32"
    position: str = "rope"
    position_options: Any = ()
    max_len: int = 512
    init_std: float = 0.02
    attention_impl: str = "auto"
    attention_block: int | None = None
    attention_backward: str = "auto"
    scan_impl: str = "auto"
    window: int | None = None
    window_sink_tokens: int = 0
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
        """``layer_pattern``, or the preset ``layout``'s; () when the layers are uniform."""
        from copejax import layouts

        return layouts.pattern_of(self)

    def for_layer(self, index: int) -> ModelConfig:
        """Layer ``index``'s own configuration: its pattern kind's scheme, options and
        per-layer fields (``PER_LAYER_FIELDS``); ``self`` when the layers are uniform."""
        from copejax import layouts

        return layouts.layer_config(self, index)

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
        """The block length for ``length_k`` keys: ``attention_block``, or by length."""
        if self.attention_block is not None:
            return self.attention_block
        return LARGE_BLOCK if length_k >= LARGE_BLOCK_FROM else SMALL_BLOCK

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

    def validate(self) -> ModelConfig:
        """Raises ValueError naming the first bad value and what is allowed; returns self."""
        for key in ("vocab_size", "d_model", "num_heads", "num_layers", "max_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model.{key} must be a positive integer, got {value!r}")
        for key in ("head_dim", "mlp_dim"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"model.{key} must be a positive integer or None, got {value!r}")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads="
                f"{self.num_heads}; choose sizes that divide or set model.head_dim"
            )
        if self.block not in BLOCKS:
            raise ValueError(f"model.block must be one of {BLOCKS}, got {self.block!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout!r}")
        for key, allowed in (
            ("attention_impl", ATTENTION_IMPLS),
            ("attention_backward", ATTENTION_BACKWARDS),
            ("scan_impl", SCAN_IMPLS),
        ):
            if getattr(self, key) not in allowed:
                raise ValueError(
                    f"model.{key} must be one of {allowed}, got {getattr(self, key)!r}"
                )
        block = self.attention_block
        if block is not None and (
            isinstance(block, bool) or not isinstance(block, int) or block <= 0
        ):
            raise ValueError(
                f"model.attention_block must be a positive integer or None, got {block!r}"
            )
        window = self.window
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, int) or window < 1
        ):
            raise ValueError(f"model.window must be a positive integer or None, got {window!r}")
        sinks = self.window_sink_tokens
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise ValueError(f"model.window_sink_tokens must be an integer >= 0, got {sinks!r}")
        if sinks and not self.scheme.window_sinks:
            raise ValueError(
                f"model.window_sink_tokens={sinks}: {self.scheme.name!r} cannot keep sink tokens "
                "beside a window (its logit for a sink key multiplies the transforms of every "
                "key in between, which the banded engine walk skips); use window_sink_tokens=0"
            )
        if sinks and window is None and not self.resolved_pattern():
            raise ValueError(
                f"model.window_sink_tokens={sinks} keeps tokens visible beside a sliding "
                "window; set model.window too (or window_sink_tokens=0)"
            )
        if self.resolved_pattern():
            from copejax import layouts

            layouts.validate_pattern(self)
        self._validate_attention_layout()
        scheme = self.scheme
        scheme.validate(self.dims)
        extra_sites = sorted(set(scheme.sites) - KERNEL_SITES)
        if self.attention_impl == "dot_product_attention" and self.attention_sink:
            raise ValueError(
                "model.attention_sink adds a learned logit to every softmax denominator, which "
                "jax.nn.dot_product_attention cannot take; use attention_impl='auto', 'naive' "
                "or 'blockwise'"
            )
        if (
            self.attention_impl == "dot_product_attention"
            and not self.dot_product_attention_allowed()
        ):
            raise ValueError(
                f"model.attention_impl='dot_product_attention' computes softmax(q.k / sqrt(H) "
                f"+ bias) and allows schemes whose only sites are {sorted(KERNEL_SITES)}, or "
                f"a bias that reads positions only (alibi, t5, kerple, fire); "
                f"{scheme.name!r} also uses {extra_sites}: use attention_impl='auto', 'naive' "
                "or 'blockwise'"
            )
        token_dim = scheme.token_dim(self.d_model)
        if not 0 < token_dim <= self.d_model:
            raise ValueError(
                f"{scheme.name}: token embedding width {token_dim} must be in (0, {self.d_model}]"
            )
        return self

    def _validate_attention_layout(self) -> None:
        """num_kv_heads, attention_sink, logit_scaling and its parameters."""
        kv = self.num_kv_heads
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0):
            raise ValueError(f"model.num_kv_heads must be a positive integer or None, got {kv!r}")
        if kv is not None and self.num_heads % kv:
            raise ValueError(
                f"model.num_kv_heads={kv} must divide model.num_heads={self.num_heads} (each "
                "key/value head serves an equal group of query heads); allowed: a divisor of "
                "num_heads (1: multi-query attention) or None"
            )
        if kv is not None and kv != self.num_heads and not self.scheme.grouped_kv:
            raise ValueError(
                f"model.num_kv_heads={kv}: {self.scheme.name!r} does not support grouped "
                "key/value heads (PaTH's transforms w, beta are per query head and rewrite the "
                "cached keys of each head; per-KV-head transforms are not implemented); use "
                "num_kv_heads=None"
            )
        for key in ("attention_sink", "ssmax_learned"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"model.{key} must be True or False, got {getattr(self, key)!r}")
        if self.logit_scaling not in LOGIT_SCALINGS:
            raise ValueError(
                f"model.logit_scaling must be one of {LOGIT_SCALINGS}, got {self.logit_scaling!r}"
            )
        for key in ("ssmax_scale", "llama4_attn_scale"):
            value = getattr(self, key)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise ValueError(f"model.{key} must be a finite number, got {value!r}")
        floor = self.llama4_floor_scale
        if isinstance(floor, bool) or not isinstance(floor, int | float) or not floor > 0:
            raise ValueError(f"model.llama4_floor_scale must be a number > 0, got {floor!r}")
        if "normalizer" in self.scheme.sites:
            name = self.scheme.name
            if self.attention_sink:
                raise ValueError(
                    f"model.attention_sink joins a softmax denominator; {name!r} replaces the "
                    "softmax (stick-breaking weights are sigmoids times the remaining stick, "
                    "with no denominator to join; its own remainder plays the sink's part): "
                    "use attention_sink=False"
                )
            if self.logit_scaling != "none":
                raise ValueError(
                    f"model.logit_scaling={self.logit_scaling!r} counters the softmax "
                    f"denominator's growth with the number of keys; {name!r} replaces the "
                    "softmax (stick-breaking has no denominator, each weight is a sigmoid of "
                    "its own logit times the remaining stick), so the scaling's derivation "
                    "does not apply: use logit_scaling='none'"
                )


# Keys that cope, fox and stickbreaking declared before the engine moved them to model level.
LEGACY_SCHEME_ATTENTION_KEYS = ("attention_impl", "block_size", "blockwise_min_len", "scan_impl")


def upgrade_attention_options(model: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Attention options of a config saved before they moved to model level.

    Returns (model-level ``attention_impl`` / ``attention_block`` / ``scan_impl`` entries,
    position options without the per-scheme keys). ``attention_kernel="dot_product_attention"``
    becomes ``attention_impl``; a scheme's ``attention_impl`` other than "auto",
    ``block_size`` and ``scan_impl`` become the model's; ``blockwise_min_len`` is dropped
    ("auto" chooses by length at model level; values are the same on every path). A config
    that already has the model-level keys keeps them.
    """
    options = dict(model.get("position_options", {}) or {})
    legacy = {key: options.pop(key) for key in LEGACY_SCHEME_ATTENTION_KEYS if key in options}
    upgraded: dict[str, Any] = {}
    if model.get("attention_kernel") == "dot_product_attention":
        upgraded["attention_impl"] = "dot_product_attention"
    if legacy.get("attention_impl", "auto") != "auto":
        upgraded["attention_impl"] = legacy["attention_impl"]
    if "block_size" in legacy:
        upgraded["attention_block"] = legacy["block_size"]
    if "scan_impl" in legacy:
        upgraded["scan_impl"] = legacy["scan_impl"]
    for key in ("attention_impl", "attention_block", "attention_backward", "scan_impl"):
        if model.get(key) is not None:
            upgraded[key] = model[key]
    return upgraded, options
