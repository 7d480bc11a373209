"""How the block's dense kernels start: ``model.dense_init``.

- ``"normal"`` (default): N(0, std²) with std = ``model.init_std`` (0.02, GPT-2's; the output
  projections of attention and MLP at init_std / sqrt(2 L)).
- ``"fan_in"``: a normal truncated at ±2 standard deviations, std 1 / sqrt(fan_in) before the
  truncation, i.e. haiku's ``hk.Linear`` default (``TruncatedNormal(1 / sqrt(input_size))``),
  which the models of Ruoss et al. 2023 (arXiv 2305.16843, google-deepmind/
  randomized_positional_encodings, ``models/transformer.py``) use for every linear layer.
  fan_in is the number of input features a kernel contracts (D for the query, key, value and
  MLP input kernels and an untied output layer; N H for the attention output; the MLP width
  for its output). Token embeddings keep N(0, init_std²) in both (theirs: truncated normal,
  std 0.02, times sqrt(D): ``model.scale_embeddings``). Parameters a position scheme owns
  keep that scheme's own initialisers.
"""

from __future__ import annotations

import math

import flax.linen as nn

DENSE_INITS = ("normal", "fan_in")


def kernel_init(dense_init: str, std: float, fan_in: int) -> nn.initializers.Initializer:
    """The initialiser of one dense kernel: N(0, ``std``²) for ``"normal"``, haiku's
    truncated normal with std 1 / sqrt(``fan_in``) for ``"fan_in"``."""
    if dense_init == "normal":
        return nn.initializers.normal(std)
    if dense_init == "fan_in":
        return nn.initializers.truncated_normal(1.0 / math.sqrt(fan_in))
    raise ValueError(f"model.dense_init must be one of {DENSE_INITS}, got {dense_init!r}")


def contracted_size(equation: str, kernel_shape: tuple[int, ...]) -> int:
    """The fan_in of an einsum kernel: the product of the kernel axes that the equation's
    input (its first operand) also has, e.g. D for "BTD,DNH->BTNH", N H for "BTNH,NHD->BTD"."""
    inputs, kernel = equation.split("->", maxsplit=1)[0].split(",")
    sizes = zip(kernel, kernel_shape, strict=True)
    return math.prod(size for axis, size in sizes if axis in inputs)
