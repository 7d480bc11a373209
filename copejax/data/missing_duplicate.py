"""Missing duplicate (Ruoss et al. 2023, arXiv 2305.16843, their ``missing_duplicate_string``):
a uniform binary string w of n // 2 symbols written twice, ``w w``, with one of its n // 2 * 2
symbols (uniform) replaced by the placeholder ``_``; for odd n the empty symbol ``#`` is
appended, so the input has n symbols. Output: one symbol, the one the placeholder hides.

n = 1 admits no duplicated string; as their generator does, the input is then ``1`` and the
output ``1``.

Framing, splits and metrics: :mod:`copejax.data._length_suite`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from copejax.data._length_suite import LengthTask, random_symbols
from copejax.data.base import register_task

# Indices into MissingDuplicate.symbols
PLACEHOLDER = 2
EMPTY = 3


@register_task
@dataclasses.dataclass(frozen=True)
class MissingDuplicate(LengthTask):
    """w w with one symbol hidden (plus ``#`` for odd n) -> the hidden symbol."""

    name: ClassVar[str] = "missing_duplicate"
    symbols: ClassVar[tuple[str, ...]] = ("0", "1", "_", "#")

    def sample(self, rng: np.random.Generator, length: int) -> tuple[list[int], list[int]]:
        if length == 1:
            return [1], [1]
        half = random_symbols(rng, length // 2, 2)
        doubled = half + half
        hidden = int(rng.integers(0, len(doubled)))
        answer = doubled[hidden]
        doubled[hidden] = PLACEHOLDER
        return doubled + [EMPTY] * (length % 2), [answer]

    def output_length(self, length: int) -> int:
        return 1
