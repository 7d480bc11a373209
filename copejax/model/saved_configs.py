"""Model configs saved by earlier versions of copejax, upgraded on load.

:meth:`copejax.model.config.ModelConfig.from_config` reads every saved ``config.json``
through here, so that runs from before the engine moved the attention options to model level
still load and resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
