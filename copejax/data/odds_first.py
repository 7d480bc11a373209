"""Odds first (Ruoss et al. 2023, arXiv 2305.16843; task of Deletang et al. 2023, arXiv
2207.02098): a uniform binary string x_0 ... x_{n-1} (0-based), output the symbols at odd
indices, then those at even ones: x_1 x_3 ... x_0 x_2 ... (n outputs).

This is what their generator computes (``concatenate([s[:, 1::2], s[:, ::2]])``); its
docstring's example counts from 1 (s_1 s_3 ... first, i.e. the 0-based even indices first).
The two orders are the same task up to which half comes first; copejax follows the code.

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
class OddsFirst(LengthTask):
    """s -> s[1::2] s[::2], binary."""

    name: ClassVar[str] = "odds_first"
    symbols: ClassVar[tuple[str, ...]] = ("0", "1")

    def sample(self, rng: np.random.Generator, length: int) -> tuple[list[int], list[int]]:
        string = random_symbols(rng, length, 2)
        return string, string[1::2] + string[::2]

    def output_length(self, length: int) -> int:
        return length
