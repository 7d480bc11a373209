"""No position encoding: causal attention alone (Haviv et al. 2022, arXiv 2203.16634)."""

from __future__ import annotations

import dataclasses

from copejax.positions.base import PositionScheme
from copejax.positions.registry import register


@register
@dataclasses.dataclass(frozen=True)
class NoPE(PositionScheme):
    """NoPE: no site at all; order comes only from the causal mask."""

    name = "nope"
    sites = ()
    paper = "Haviv et al. 2022, arXiv 2203.16634"
