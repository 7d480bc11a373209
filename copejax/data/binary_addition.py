"""Binary addition (Ruoss et al. 2023, arXiv 2305.16843; task of Deletang et al. 2023, arXiv
2207.02098): ``a + b`` in little-endian binary, output a + b in little-endian binary without
trailing (most significant) zeros, then the end symbol ``$``.

As their generator draws it, for input length n >= 3: len(a) uniform in [1, n - 2], len(b) =
n - 1 - len(a), a uniform in [1, 2^len(a) - 1] and b likewise, each written with exactly its
length (zero-padded at the most significant end). For n <= 2 the input is one number in
[0, 2^n - 2] written with n bits and no ``+``, and the output is that number. Their target is
padded with zeros after the end symbol and their accuracy mask stops at it; here the output is
the sum and ``$`` only, all scored (the same tokens).

Framing, splits and metrics: :mod:`copejax.data._length_suite`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from copejax.data._length_suite import LengthTask
from copejax.data.base import register_task

# Indices into BinaryAddition.symbols
PLUS = 2
END = 3


def little_endian_bits(value: int, width: int = 0) -> list[int]:
    """Bits of ``value`` >= 0, least significant first, at least ``width`` of them."""
    return [int(ch) for ch in reversed(format(value, "b").zfill(width))]


def nonzero_bits(rng: np.random.Generator, width: int) -> int:
    """A uniform integer in [1, 2^width - 1] (rejection on the all-zero draw)."""
    while True:
        value = int("".join(map(str, rng.integers(0, 2, size=width))), 2)
        if value:
            return value


@register_task
@dataclasses.dataclass(frozen=True)
class BinaryAddition(LengthTask):
    """a + b (little-endian binary) -> a + b then ``$``."""

    name: ClassVar[str] = "binary_addition"
    symbols: ClassVar[tuple[str, ...]] = ("0", "1", "+", "$")

    def sample(self, rng: np.random.Generator, length: int) -> tuple[list[int], list[int]]:
        if length <= 2:
            value = int(rng.integers(0, 2**length - 1))
            return little_endian_bits(value, length), [*little_endian_bits(value), END]
        len_a = int(rng.integers(1, length - 1))
        len_b = length - 1 - len_a
        a, b = nonzero_bits(rng, len_a), nonzero_bits(rng, len_b)
        question = [*little_endian_bits(a, len_a), PLUS, *little_endian_bits(b, len_b)]
        return question, [*little_endian_bits(a + b), END]

    def output_length(self, length: int) -> int:
        """n + 1 bounds every case: the sum has at most n - 1 bits for n >= 3 and at most 2
        for n <= 2, plus the end symbol."""
        return length + 1
