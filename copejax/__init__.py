"""copejax: position encoding in transformers, in JAX/Flax.

For your own model: ``copejax.functional`` (a scheme on plain arrays: ``init``,
``attention``, ``init_cache``, ``decode``), ``copejax.linen.PositionAttention`` (the same as
a Linen module) and ``copejax.terms`` (the O(T) engine's block terms). They load on first
use, so ``import copejax`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["functional", "linen", "terms"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"copejax.{name}")
    raise AttributeError(f"module 'copejax' has no attribute {name!r}")
