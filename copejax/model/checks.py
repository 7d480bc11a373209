"""A ModelConfig's checks: :func:`validate` runs them all, one per concern.

Each takes the config and raises ValueError naming the first bad value and what is allowed:
sizes, the block / dtype / attention-path choices, the sliding window and its sink tokens, the
per-layer pattern (``copejax.model.layouts``), the attention layout (grouped KV heads, the
attention sink, logit scaling) and what the position scheme allows.
"""

from __future__ import annotations

import math

from copejax.model.config import (
    ATTENTION_BACKWARDS,
    ATTENTION_IMPLS,
    BLOCKS,
    DTYPES,
    KERNEL_SITES,
    SCAN_IMPLS,
    ModelConfig,
)
from copejax.model.dense_init import DENSE_INITS
from copejax.model.kernel_terms import kernel_refusal
from copejax.model.layouts import parse_kind
from copejax.model.logit_scaling import LOGIT_SCALINGS


def validate(cfg: ModelConfig) -> ModelConfig:
    """Raises ValueError naming the first bad value of ``cfg`` and what is allowed; returns
    ``cfg``."""
    check_sizes(cfg)
    check_choices(cfg)
    check_window(cfg)
    if cfg.resolved_pattern():
        check_pattern(cfg)
    check_attention_layout(cfg)
    check_scheme(cfg)
    return cfg


def check_sizes(cfg: ModelConfig) -> None:
    """Positive model sizes; d_model divisible by num_heads unless head_dim is set."""
    for key in ("vocab_size", "d_model", "num_heads", "num_layers", "max_len"):
        value = getattr(cfg, key)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"model.{key} must be a positive integer, got {value!r}")
    for key in ("head_dim", "mlp_dim"):
        value = getattr(cfg, key)
        if value is not None and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"model.{key} must be a positive integer or None, got {value!r}")
    if cfg.head_dim is None and cfg.d_model % cfg.num_heads:
        raise ValueError(
            f"model.d_model={cfg.d_model} is not divisible by model.num_heads="
            f"{cfg.num_heads}; choose sizes that divide or set model.head_dim"
        )


def check_choices(cfg: ModelConfig) -> None:
    """block, dtype, dropout, dense_init, the attention path options and the engine's block
    length."""
    if cfg.block not in BLOCKS:
        raise ValueError(f"model.block must be one of {BLOCKS}, got {cfg.block!r}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {DTYPES}, got {cfg.dtype!r}")
    if (
        isinstance(cfg.norm_eps, bool)
        or not isinstance(cfg.norm_eps, int | float)
        or not (0 < cfg.norm_eps < 1)
    ):
        raise ValueError(f"model.norm_eps must be a number in (0, 1), got {cfg.norm_eps!r}")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"model.dropout must be in [0, 1), got {cfg.dropout!r}")
    for key, allowed in (
        ("dense_init", DENSE_INITS),
        ("attention_impl", ATTENTION_IMPLS),
        ("attention_backward", ATTENTION_BACKWARDS),
        ("scan_impl", SCAN_IMPLS),
    ):
        if getattr(cfg, key) not in allowed:
            raise ValueError(f"model.{key} must be one of {allowed}, got {getattr(cfg, key)!r}")
    block = cfg.attention_block
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block <= 0):
        raise ValueError(f"model.attention_block must be a positive integer or None, got {block!r}")


def check_window(cfg: ModelConfig) -> None:
    """The sliding window and the sink tokens kept beside it."""
    window = cfg.window
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"model.window must be a positive integer or None, got {window!r}")
    if cfg.window_decode_cache not in ("ring", "full"):
        raise ValueError(
            "model.window_decode_cache must be one of ('ring', 'full'), got "
            f"{cfg.window_decode_cache!r}"
        )
    sinks = cfg.window_sink_tokens
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"model.window_sink_tokens must be an integer >= 0, got {sinks!r}")
    if sinks and not cfg.scheme.window_sinks:
        raise ValueError(
            f"model.window_sink_tokens={sinks}: {cfg.scheme.name!r} cannot keep sink tokens "
            "beside a window (its logit for a sink key multiplies the transforms of every "
            "key in between, which the banded engine walk skips); use window_sink_tokens=0"
        )
    if sinks and window is None and not cfg.resolved_pattern():
        raise ValueError(
            f"model.window_sink_tokens={sinks} keeps tokens visible beside a sliding "
            "window; set model.window too (or window_sink_tokens=0)"
        )


def check_scheme(cfg: ModelConfig) -> None:
    """The scheme's own checks and the paths and embedding width it allows."""
    scheme = cfg.scheme
    scheme.validate(cfg.dims)
    extra_sites = sorted(set(scheme.sites) - KERNEL_SITES)
    if cfg.attention_impl == "dot_product_attention" and cfg.attention_sink:
        raise ValueError(
            "model.attention_sink adds a learned logit to every softmax denominator, which "
            "jax.nn.dot_product_attention cannot take; use attention_impl='auto', 'naive' "
            "or 'blockwise'"
        )
    if cfg.attention_impl == "dot_product_attention" and not cfg.dot_product_attention_allowed():
        raise ValueError(
            f"model.attention_impl='dot_product_attention' computes softmax(q.k / sqrt(H) "
            f"+ bias) and allows schemes whose only sites are {sorted(KERNEL_SITES)}, or "
            f"a bias that reads positions only (alibi, t5, kerple, fire); "
            f"{scheme.name!r} also uses {extra_sites}: use attention_impl='auto', 'naive' "
            "or 'blockwise'"
        )
    if cfg.attention_impl == "kernel":
        check_kernel(cfg)
    token_dim = scheme.token_dim(cfg.d_model)
    if not 0 < token_dim <= cfg.d_model:
        raise ValueError(
            f"{scheme.name}: token embedding width {token_dim} must be in (0, {cfg.d_model}]"
        )


def check_kernel(cfg: ModelConfig) -> None:
    """``attention_impl="kernel"``: a scheme the fused kernels cover, in tiles they take."""
    reason = kernel_config_refusal(cfg)
    if reason is not None:
        raise ValueError(reason)


def kernel_config_refusal(cfg: ModelConfig) -> str | None:
    """Why the fused kernels cannot run ``cfg``'s layers (the scheme, the block), or None;
    ``check_kernel`` raises it, ``auto`` reads it before following a measurement. The
    attention sink runs on every softmax kernel (``copejax.ops.kernels.sink``); with
    stick-breaking :func:`check_attention_layout` refuses it on every path."""
    refusal = kernel_refusal(cfg.scheme, cfg.dims)
    if refusal is not None:
        return refusal
    block = cfg.attention_block
    if block is not None and (block < 16 or block & (block - 1)):
        return (
            f"model.attention_block={block}: the fused kernels' tiles are powers of two of at "
            "least 16 (attention_impl='kernel'); use one, or None for their default"
        )
    return None


def check_attention_layout(cfg: ModelConfig) -> None:
    """num_kv_heads, attention_sink, logit_scaling and its parameters."""
    kv = cfg.num_kv_heads
    if kv is not None and (isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0):
        raise ValueError(f"model.num_kv_heads must be a positive integer or None, got {kv!r}")
    if kv is not None and cfg.num_heads % kv:
        raise ValueError(
            f"model.num_kv_heads={kv} must divide model.num_heads={cfg.num_heads} (each "
            "key/value head serves an equal group of query heads); allowed: a divisor of "
            "num_heads (1: multi-query attention) or None"
        )
    if kv is not None and kv != cfg.num_heads and not cfg.scheme.grouped_kv:
        raise ValueError(
            f"model.num_kv_heads={kv}: {cfg.scheme.name!r} does not support grouped "
            "key/value heads (PositionScheme.grouped_kv); use num_kv_heads=None"
        )
    for key in ("attention_sink", "ssmax_learned"):
        if not isinstance(getattr(cfg, key), bool):
            raise ValueError(f"model.{key} must be True or False, got {getattr(cfg, key)!r}")
    if cfg.logit_scaling not in LOGIT_SCALINGS:
        raise ValueError(
            f"model.logit_scaling must be one of {LOGIT_SCALINGS}, got {cfg.logit_scaling!r}"
        )
    for key in ("ssmax_scale", "llama4_attn_scale"):
        value = getattr(cfg, key)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ValueError(f"model.{key} must be a finite number, got {value!r}")
    floor = cfg.llama4_floor_scale
    if isinstance(floor, bool) or not isinstance(floor, int | float) or not floor > 0:
        raise ValueError(f"model.llama4_floor_scale must be a number > 0, got {floor!r}")
    if "normalizer" in cfg.scheme.sites:
        name = cfg.scheme.name
        if cfg.attention_sink:
            raise ValueError(
                f"model.attention_sink joins a softmax denominator; {name!r} replaces the "
                "softmax (stick-breaking weights are sigmoids times the remaining stick, "
                "with no denominator to join; its own remainder plays the sink's part): "
                "use attention_sink=False"
            )
        if cfg.logit_scaling != "none":
            raise ValueError(
                f"model.logit_scaling={cfg.logit_scaling!r} counters the softmax "
                f"denominator's growth with the number of keys; {name!r} replaces the "
                "softmax (stick-breaking has no denominator, each weight is a sigmoid of "
                "its own logit times the remaining stick), so the scaling's derivation "
                "does not apply: use logit_scaling='none'"
            )


def check_pattern(cfg: ModelConfig) -> None:
    """The per-layer pattern: its length divides the layers, and each kind is a valid layer of
    an attention-site scheme that keeps no modules shared across layers."""
    pattern = cfg.resolved_pattern()
    if cfg.num_layers % len(pattern):
        raise ValueError(
            f"model.layer_pattern has {len(pattern)} kinds {list(pattern)}, which does not "
            f"divide model.num_layers={cfg.num_layers}; allowed: a pattern whose length "
            "divides the layer count"
        )
    model_scheme = cfg.scheme
    if "carry" in model_scheme.sites:
        raise ValueError(
            f"model.position={cfg.position!r} has a carry site, which the layers of a "
            "layer_pattern would not update; use a scheme without one as model.position"
        )
    for kind in dict.fromkeys(pattern):
        scheme_name = parse_kind(kind)[0]
        layer = cfg.for_layer(pattern.index(kind))
        try:
            validate(layer)
        except ValueError as error:
            raise ValueError(f"model.layer_pattern kind {kind!r}: {error}") from None
        scheme = layer.scheme
        for site in ("embed", "carry"):
            if site in scheme.sites:
                raise ValueError(
                    f"model.layer_pattern kind {kind!r}: {scheme_name!r} uses the {site} site, "
                    "which acts once per model, not per layer; set model.position to it "
                    "(its embed site is applied once at the input) and use attention-site "
                    "schemes in the pattern"
                )
        if scheme.shared_attention_module(layer.dims) is not None:
            raise ValueError(
                f"model.layer_pattern kind {kind!r}: {scheme_name!r} shares its modules "
                "across layers, which a per-layer pattern cannot; use a per-layer variant "
                "(e.g. CoPE without share_layers)"
            )
