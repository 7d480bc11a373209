"""Per-layer attention layouts: a repeating pattern of layer kinds, and named presets.

``model.layer_pattern`` is a tuple of *kinds* that repeats over the layers (its length must
divide ``model.num_layers``). A kind is ``scheme[:key=value,...]``:

- ``scheme``: a registered position scheme (``"rope"``, ``"nope"``, ``"alibi+rope"``);
- ``key=value``: a per-layer ModelConfig field (:data:`PER_LAYER_FIELDS`: ``window``,
  ``window_sink_tokens``...) or an option of the scheme (``rope:base=1000000``).

Values are read as integers, floats, ``true`` / ``false`` or ``none`` where they parse as
such, strings otherwise. A layer's scheme options start from ``model.position_options`` when
its scheme is ``model.position`` and from the scheme's defaults otherwise; its per-layer
fields start from the model's (``window=none`` clears a model-wide window).

Embed-site schemes (learned, sinusoidal, randomized absolute positions) act once at the model
input, not per layer: ``model.position`` still supplies that embed site, and a pattern kind
may not have one (nor a carry site, nor modules shared across layers, which are built once
per model). ``ModelConfig.for_layer`` builds a layer's config from its kind, and
:func:`copejax.model.checks.validate` checks everything before any compute.

Presets (``model.layout``; ``model.window`` replaces the preset's local window):

- ``irope``: Llama 4's interleaved RoPE: three RoPE layers, then one NoPE layer (Meta,
  "The Llama 4 herd", 2025). Llama 4's RoPE layers use chunked attention (chunks of 8192);
  copejax approximates it with a sliding window of 8192 (a query sees the previous 8191
  tokens, where a chunk would cut at the chunk boundary).
- ``gemma3``: five local layers (RoPE base 10k, window 1024) per global layer (RoPE base
  1M) (Gemma 3 technical report, arXiv 2503.19786).
- ``swan``: SWAN-GPT (arXiv 2504.08719, section 2): "beginning with a global NoPE layer
  followed by three consecutive sliding-window layers, repeating this pattern", the
  sliding-window RoPE layers with "a fixed window size of 512 tokens" (the 1:3 global:local
  ratio of its 1B models, section 3). Its inference-time log scaling of the NoPE layers'
  logits is not part of the preset (``logit_scaling`` per layer does that).
- ``rnope``: Cohere's RNoPE (arXiv 2501.18795): three RoPE sliding-window layers (window
  4096) per full-attention NoPE layer.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from copejax.positions import registry

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
_KIND = re.compile(r"^([A-Za-z0-9_+]+)(?::(.*))?$")


def _local_global(
    local: str, global_: str, locals_per_global: int, global_first: bool = False
) -> Any:
    def pattern(window: int) -> tuple[str, ...]:
        locals_ = (local.format(window=window),) * locals_per_global
        return (global_, *locals_) if global_first else (*locals_, global_)

    return pattern


# name -> (default local window, window -> pattern)
PRESETS: dict[str, tuple[int, Any]] = {
    "irope": (8192, _local_global("rope:window={window}", "nope:window=none", 3)),
    "gemma3": (
        1024,
        _local_global("rope:window={window},base=10000", "rope:window=none,base=1000000", 5),
    ),
    "swan": (512, _local_global("rope:window={window}", "nope:window=none", 3, True)),
    "rnope": (4096, _local_global("rope:window={window}", "nope:window=none", 3)),
}


def preset_pattern(name: str, window: int | None = None) -> tuple[str, ...]:
    """The pattern of preset ``name`` with local window ``window`` (None: the paper's)."""
    if name not in PRESETS:
        raise ValueError(f"model.layout must be one of {sorted(PRESETS)} or None, got {name!r}")
    default, pattern = PRESETS[name]
    return pattern(default if window is None else window)


def _value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


@functools.cache
def parse_kind(kind: str) -> tuple[str, tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]:
    """``"scheme:key=value,..."`` -> (scheme, per-layer fields, scheme options).

    Raises ValueError naming the kind, the bad part and what is allowed.
    """
    match = _KIND.match(kind.strip())
    if not match:
        raise ValueError(
            f"model.layer_pattern kind {kind!r} is not 'scheme[:key=value,...]' "
            "(e.g. 'rope:window=512' or 'nope')"
        )
    scheme, rest = match.group(1), match.group(2)
    try:
        cls_parts = [registry.get(part) for part in scheme.split("+")]
    except ValueError as error:
        raise ValueError(f"model.layer_pattern kind {kind!r}: {error}") from None
    options = [name for cls in cls_parts for name in registry.option_names(cls)]
    fields: dict[str, Any] = {}
    scheme_options: dict[str, Any] = {}
    for item in (rest or "").split(",") if rest else ():
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"model.layer_pattern kind {kind!r}: {item!r} is not key=value")
        if key in fields or key in scheme_options:
            raise ValueError(f"model.layer_pattern kind {kind!r}: {key!r} is given twice")
        if key in PER_LAYER_FIELDS:
            fields[key] = _value(text)
        elif key in options:
            scheme_options[key] = _value(text)
        else:
            raise ValueError(
                f"model.layer_pattern kind {kind!r}: unknown key {key!r}; allowed: the "
                f"per-layer fields {list(PER_LAYER_FIELDS)} or the options of {scheme!r} "
                f"{options}"
            )
    return scheme, tuple(sorted(fields.items())), tuple(sorted(scheme_options.items()))
