"""Sinusoidal absolute position encoding (Vaswani et al. 2017, arXiv 1706.03762; seed 001).

``PE(pos, 2i) = sin(pos / base^(2i/d))`` and ``PE(pos, 2i+1) = cos(pos / base^(2i/d))`` with
``base = 10000``. Two ways to combine it with the token embeddings (seed 001):

- ``add``: ``x + PE`` with d = D;
- ``concat``: ``[x_tok, PE]`` where the token embedding has width D - pos_dim and the encoding
  width d = pos_dim, so the model width stays D.

Token embeddings are multiplied by sqrt(D) as in Vaswani et al. only with
``model.scale_embeddings`` (default off: GPT-2 style inputs). Without it, at init_std 0.02 the
encoding is tens of times the token embedding, and small models can fail to read the tokens
(see ``experiments/results/length_generalization.md``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from copejax.positions.base import (
    Dims,
    EmbedOutput,
    EmbedSite,
    PositionScheme,
    check_choice,
    check_positive,
)
from copejax.positions.registry import register

MODES = ("add", "concat")


def sinusoidal_encoding(positions_BT: jax.Array, width: int, base: float = 10000.0) -> jax.Array:
    """The sinusoidal encoding of each position, float32.

    Args:
      positions_BT: positions (int or float).
      width: d, the (even) encoding width.
      base: the frequency base (10000 in Vaswani et al.).

    Returns:
      pe_BTd of shape (B, T, width): sin at even features 2i, cos at odd features 2i + 1.
    """
    inv_freq_F = base ** (-jnp.arange(0, width, 2, dtype=jnp.float32) / width)
    angle_BTF = positions_BT.astype(jnp.float32)[..., None] * inv_freq_F
    pe_BTF2 = jnp.stack([jnp.sin(angle_BTF), jnp.cos(angle_BTF)], axis=-1)
    return pe_BTF2.reshape(*positions_BT.shape, width)


@register
@dataclasses.dataclass(frozen=True)
class Sinusoidal(PositionScheme):
    """Fixed sinusoidal encoding, added to or concatenated with the token embeddings.

    Options:
      mode: "add" (x + PE, width D) or "concat" ([x_tok, PE], token width D - pos_dim).
      pos_dim: width of the concatenated encoding (concat only; even); None uses D // 2
        rounded down to an even number.
      base: the frequency base.
    """

    name = "sinusoidal"
    sites = ("embed",)
    paper = "Vaswani et al. 2017, arXiv 1706.03762"

    mode: str = "add"
    pos_dim: int | None = None
    base: float = 10000.0

    def encoding_dim(self, d_model: int) -> int:
        """Width of the sinusoidal encoding: D (add) or pos_dim (concat)."""
        if self.mode == "add":
            return d_model
        return self.pos_dim if self.pos_dim is not None else d_model // 2 // 2 * 2

    def token_dim(self, d_model: int) -> int:
        return d_model - self.encoding_dim(d_model) if self.mode == "concat" else d_model

    def validate(self, dims: Dims) -> None:
        check_choice(self.name, "mode", self.mode, MODES)
        check_positive(self.name, base=self.base)
        if self.mode == "add" and self.pos_dim is not None:
            raise ValueError(
                f"{self.name}: pos_dim={self.pos_dim!r} applies only to mode='concat'; "
                "allowed with mode='add': None"
            )
        width = self.encoding_dim(dims.d_model)
        if self.mode == "concat" and not (
            isinstance(width, int) and 0 < width < dims.d_model and width % 2 == 0
        ):
            raise ValueError(
                f"{self.name}: pos_dim must be an even integer in (0, d_model={dims.d_model}), "
                f"got {width!r}"
            )
        if self.mode == "add" and dims.d_model % 2:
            raise ValueError(
                f"{self.name}: d_model must be even for sin/cos pairs, got {dims.d_model}"
            )

    def embed_module(self, dims: Dims) -> EmbedSite:
        return SinusoidalEmbed(dims=dims, scheme=self, name=self.name)


class SinusoidalEmbed(EmbedSite):
    """Adds (or concatenates) the sinusoidal encoding of ``positions_BT``; no parameters."""

    scheme: Sinusoidal = Sinusoidal()

    def __call__(
        self, x_BTD: jax.Array, positions_BT: jax.Array, deterministic: bool = True
    ) -> EmbedOutput:
        width = self.scheme.encoding_dim(self.dims.d_model)
        pe_BTd = sinusoidal_encoding(positions_BT, width, self.scheme.base).astype(x_BTD.dtype)
        if self.scheme.mode == "concat":
            expected = self.dims.d_model - width
            if x_BTD.shape[-1] != expected:
                raise ValueError(
                    f"{self.scheme.name}: concat expects token embeddings of width "
                    f"{expected} (D - pos_dim), got {x_BTD.shape[-1]}"
                )
            x_BTD = jnp.concatenate([x_BTD, pe_BTd], axis=-1)
        else:
            x_BTD = x_BTD + pe_BTd
        return EmbedOutput(x_BTD=x_BTD, positions_BT=positions_BT)
