"""Duplicate string (Ruoss et al. 2023, arXiv 2305.16843; task of Deletang et al. 2023, arXiv
2207.02098): a uniform binary string s_1 ... s_n, output s_1 ... s_n s_1 ... s_n (2n outputs).

Framing, splits and metrics: :mod:`copejax.data._length_suite`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from copejax.data._length_suite import LengthTask, random_symbols
from copejax.data.base import register_task


@register_task
@dataclasses.dataclass(frozen=True)
class DuplicateString(LengthTask):
    """s -> s s, binary."""

    name: ClassVar[str] = "duplicate_string"
    symbols: ClassVar[tuple[str, ...]] = ("0", "1")

    def sample(self, rng: np.random.Generator, length: int) -> tuple[list[int], list[int]]:
        string = random_symbols(rng, length, 2)
        return string, string + string

    def output_length(self, length: int) -> int:
        return 2 * length
