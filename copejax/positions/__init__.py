"""Position schemes: one module per scheme family, registered by name.

``registry.make_scheme(name, options)`` builds one; ``python -m copejax.positions`` lists them.
"""

from copejax.positions.base import (
    AttentionContext,
    AttentionSite,
    Dims,
    EmbedOutput,
    EmbedSite,
    PositionScheme,
)
from copejax.positions.registry import get, make_scheme, names, register

__all__ = [
    "AttentionContext",
    "AttentionSite",
    "Dims",
    "EmbedOutput",
    "EmbedSite",
    "PositionScheme",
    "get",
    "make_scheme",
    "names",
    "register",
]
