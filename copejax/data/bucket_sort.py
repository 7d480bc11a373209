"""Bucket sort (Ruoss et al. 2023, arXiv 2305.16843; task of Deletang et al. 2023, arXiv
2207.02098): n symbols drawn uniformly from an alphabet of 5 (their ``vocab_size=5``), output
the same symbols in increasing order (n outputs).

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
class BucketSort(LengthTask):
    """s -> sorted(s), alphabet {0, ..., 4}."""

    name: ClassVar[str] = "bucket_sort"
    symbols: ClassVar[tuple[str, ...]] = ("0", "1", "2", "3", "4")

    def sample(self, rng: np.random.Generator, length: int) -> tuple[list[int], list[int]]:
        string = random_symbols(rng, length, len(self.symbols))
        return string, sorted(string)

    def output_length(self, length: int) -> int:
        return length
