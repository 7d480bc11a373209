"""Parity check (Ruoss et al. 2023, arXiv 2305.16843; task of Deletang et al. 2023, arXiv
2207.02098): a uniform binary string, output one symbol, the number of 1s modulo 2.

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
class ParityCheck(LengthTask):
    """s -> sum(s) mod 2, binary."""

    name: ClassVar[str] = "parity_check"
    symbols: ClassVar[tuple[str, ...]] = ("0", "1")

    def sample(self, rng: np.random.Generator, length: int) -> tuple[list[int], list[int]]:
        string = random_symbols(rng, length, 2)
        return string, [sum(string) % 2]

    def output_length(self, length: int) -> int:
        return 1
